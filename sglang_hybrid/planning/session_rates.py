"""How a session behaves in time: how often its requests edit or append, how many requests of
any session come between two of its own, whether it comes back at all (docs/architecture.md,
"Planning quantities"). Every function here reads the planner's state and returns a number;
none writes any; those marked ``register_jitable`` are also compiled into the loops over every
session at once (``SessionQuantities``) and give the same floats there.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from numba.extending import register_jitable

from sglang_hybrid.planning.state import PRIOR_EDITS, PRIOR_ENDS, PRIOR_GAPS, Session, StreamStats


def edit_probability(session: Session, stream: StreamStats) -> float:
    """P(the session's next request edits its history), the stream's rate as a prior."""
    return edit_rate(session.edits, session.transitions, stream.edits, stream.transitions)


def append_probability(session: Session, stream: StreamStats) -> float:
    """P(the session's next request only appends to its latest sequence).

    Once the session's latest output is known, given how it ended: an agent's request after
    a tool call appends the tool's result, one after an answer may see the turn re-rendered
    (Qwen3's template drops the reasoning of a finished turn). The rate after each ending is
    learned like the edit rate, the session's with the stream's as its prior; a template whose
    outputs all end alike (or no template) gives ``1 - edit_probability``. The predicted edit
    points keep the session's overall edit rate: after a tool call the next request appends,
    but the one closing the chain may restore where the chain began."""
    ending = session.ending
    if ending is None:
        return 1.0 - edit_probability(session, stream)
    return 1.0 - edit_rate(session.edits_after[ending], session.transitions_after[ending],
                            stream.edits_after[ending], stream.transitions_after[ending])


@register_jitable
def edit_rate(edits, transitions, stream_edits, stream_transitions):
    """A session's edits per transition, the stream's (Laplace-smoothed) weighing as
    ``PRIOR_EDITS`` of them."""
    return toward(edits, transitions, (stream_edits + 1) / (stream_transitions + 2), PRIOR_EDITS)


def mean_gap(session: Session, stream: StreamStats) -> float:
    """Requests of any session between two of this session's, the stream's mean as a prior."""
    return toward(session.gap_total, session.transitions, stream_mean_gap(stream), PRIOR_GAPS)


def stream_mean_gap(stream: StreamStats) -> float:
    return (stream.gap_total + 1) / (stream.transitions + 1)


def next_gap(session: Session, stream: StreamStats) -> float:
    """Requests of any session expected before the session's next one: once its latest output
    is known, the mean gap after outputs that ended the same way (the session's, with the
    stream's as a prior, and the stream's drawn alike toward its mean gap over all endings),
    else its mean gap."""
    ending = session.ending
    if ending is None:
        return mean_gap(session, stream)
    prior = toward(stream.gaps_after[ending], stream.transitions_after[ending], stream_mean_gap(stream), PRIOR_GAPS)
    return toward(session.gaps_after[ending], session.transitions_after[ending], prior, PRIOR_GAPS)


@register_jitable
def toward(total, count, prior, weight):
    """The mean of ``count`` observations summing to ``total``, with ``weight`` more at
    ``prior``: the prior rules until observations outnumber its weight."""
    return (total + weight * prior) / (count + weight)


def alive(session: Session, limit: float, stream: StreamStats) -> float:
    """P(the session sends another request): none once its client said it ended, else the
    rate at which sessions came back after an output closing like its latest
    (``return_probability``), and from how long it has been silent: as likely as that within
    ``limit`` requests (``patience``), then falling off as a session that ended would."""
    if session.ended:
        return 0.0
    idle = stream.clock - session.last_clock
    return return_probability(session, stream) * (1.0 if idle <= limit else (limit / idle) ** 2)


def return_probability(session: Session, stream: StreamStats) -> float:
    """P(the session comes back at all after its latest output): ``closing_return_rate`` of
    the tokens it closed with, 1 while its request runs."""
    return closing_return_rate(session.closing, stream)


def closing_return_rate(closing: Optional[tuple[int, ...]], stream: StreamStats) -> float:
    """The share of the stream's sessions that came back after an output closing with
    ``closing`` (of those that came back and those presumed ended, ``ENDED_AFTER_GAPS``):
    after its last token, drawn toward the stream's overall share (Laplace-smoothed) as
    ``PRIOR_ENDS`` sessions, then after its last two, drawn toward that. An agent's closing
    words end with their own tokens ("Have a great day!") where a question to its user or a
    step of its work does not (tau-bench tuning traces: 42% of the answers ending with "!"
    end their session, 22% of those ending with " ask!", 100% of " travels!", none of those
    ending with "." or "?"). 1 for None."""
    if closing is None:
        return 1.0
    rate = overall_return_rate(stream)
    for start in range(len(closing) - 1, -1, -1):
        rate = return_rate_after(rate, *stream.closings.of(closing[start:]))
    return rate


def overall_return_rate(stream: StreamStats) -> float:
    """The share of the stream's sessions that came back after any output (Laplace-smoothed)."""
    return (stream.transitions + 1) / (stream.transitions + stream.closings.ends + 2)


@register_jitable
def return_rate_after(rate, returns, ends):
    """The return rate after a closing suffix seen ``returns`` and ``ends`` times, drawn toward
    ``rate`` (the next shorter suffix's) as ``PRIOR_ENDS`` sessions."""
    return toward(returns, returns + ends, rate, PRIOR_ENDS)


@register_jitable
def patience(gap, next_gap):
    """The requests of any session a session may stay silent before it looks ended: twice
    the sooner of its mean ``gap`` and its ``next_gap``, the gap expected after its latest
    output's ending. A tool's result is sent back within a few requests, so a session silent
    much longer after a tool call has stopped (a quarter of the tuning traces' sessions end
    right after one). After an answer a user may take longer than the mean gap, but about
    one answer in eight ends its session, and waiting longer for them holds the slots of
    those that ended."""
    return 2.0 * np.minimum(gap, next_gap)
