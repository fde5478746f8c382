"""What the planner knows: the purposes of checkpoints, a request's context, the plan, and the
records of held checkpoints, sessions, followers and the stream's counters."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple, Optional, Sequence

import numpy as np

from sglang_hybrid.anchors.detector import Anchors
from sglang_hybrid.anchors.hints import ValidatedHint
from sglang_hybrid.cache.planning import CheckpointId
from sglang_hybrid.planning.addresses import AnchorIndex, Prefill
from sglang_hybrid.planning.edit_model import EditModel

# How many of a session's own requests the stream-wide statistics (edit rate, edit rule) weigh
# as, before the session has shown its own.
PRIOR_EDITS = 2
# A session's latest requests whose prefills an edit's credit looks back on: the request
# that computed a point its edits restore from is rarely older (a condensing agent's view
# fills in a handful of requests).
PREFILLS_KEPT = 8
# How many of a session's gaps between requests the stream's mean gap weighs as.
PRIOR_GAPS = 2
# What taking a checkpoint costs, in prefill tokens of the default cost profile (Qwen3-Next-80B
# on an H200, replay/cost_model.py, at 8k-128k tokens of context): copying the recurrent state
# (1.7-0.4 tokens) and the scheduler-thread work the checkpoint brings, its valuation, the
# node split that attaches it and its eviction (bench/planner_cost.py: ~120-150 us a
# checkpoint, 6.7-1.9 tokens on this project's 2-core machine). 4 is about the cost at 32k
# tokens (4.9 here; a server's CPU does the work faster). A GPU that prefills slower per
# token makes the same work fewer tokens: ~2.3-0.7 for Qwen3.5-35B on an RTX 4090.
CAPTURE_COST_TOKENS = 4.0
# Prompt prefixes (at message starts) whose first producer the planner remembers, to tell which
# session a request follows; the oldest are forgotten first.
MAX_REMEMBERED_PREFIXES = 1 << 16
# A session that holds no checkpoint is forgotten -- its counters, edit model and latest
# sequence (8 bytes a token: a server meeting thousands of 30k-token sessions a day would
# otherwise grow by gigabytes) -- once its client ended it or it has been silent for
# FORGET_AFTER_GAPS of its mean gaps (``alive`` is then below 1/1000). The planner looks
# every FORGET_SWEEP_REQUESTS requests; a session that comes back starts from the stream's priors.
FORGET_AFTER_GAPS = 64
FORGET_SWEEP_REQUESTS = 256
# A session ends once and is never seen to: for the stream's end rates, a session silent for
# ENDED_AFTER_GAPS of its mean gaps counts as ended, until it comes back. The rates are kept
# per closing (an output's last CLOSING_TOKENS tokens, and its last token alone), each drawn
# toward the next shorter one's (the shortest toward the stream's overall rate) as PRIOR_ENDS
# sessions; the MAX_REMEMBERED_CLOSINGS least recently counted are forgotten first.
ENDED_AFTER_GAPS = 4
CLOSING_TOKENS = 2
PRIOR_ENDS = 2
MAX_REMEMBERED_CLOSINGS = 1 << 16


class Purpose(IntEnum):
    """Why a checkpoint was taken; it decides how its value is estimated."""

    CONTINUATION = 0  # the generation-end state a request leaves on finish
    PROMPT_TAIL = 1  # len(prompt) - 1: identical repeats
    PREDICTED_EDIT = 2  # where the session's next edit is predicted
    BRANCH = 3  # where requests leave a path shared with other requests
    HINT = 4  # a client-requested position
    SHARED_PATH = 5  # a message start of new content other sessions may follow and leave later


# Checkpoints taken for other sessions' requests rather than the owner's next one.
SHARED_PURPOSES = (Purpose.BRANCH, Purpose.SHARED_PATH)


@dataclass(frozen=True)
class RequestContext:
    """What the planner needs to know about one request at admission.

    ``anchors`` come from ``AnchorDetector.detect(prompt_ids)``. The request's output does
    not exist yet when it is planned (a server plans its prefill); what it leaves in the tree
    is told to the planner with ``request_finished``.
    ``tree_lcp`` is how many prompt tokens the tree's KV already holds; ``held_depths`` the
    depths of checkpoints on that path; ``restored_depth``/``restored`` what the cache's
    match restored (0/None for none); ``free_slots`` how many checkpoint slots are unused,
    ``pool_slots`` how many there are.
    """

    session: str
    prompt_ids: np.ndarray
    anchors: Anchors
    tree_lcp: int
    held_depths: Sequence[int]
    restored_depth: int
    restored: Optional[CheckpointId]
    free_slots: int
    pool_slots: int
    hint: Optional[ValidatedHint] = None
    namespace: Optional[tuple[Optional[str], Optional[str]]] = None  # RequestToPlan.namespace


@dataclass(frozen=True)
class PlannedCheckpoint:
    depth: int
    purpose: Purpose
    value: float  # expected recomputed tokens saved, the admission criterion


class PromptDigests(NamedTuple):
    """A prompt's prefix digests at its message boundaries (``following.prefix_digests``)."""

    boundaries: np.ndarray  # int64, ascending: the ends of the prefixes
    sums: np.ndarray  # uint64: the digest of each prefix
    messages: np.ndarray  # uint64: the digest of the message ending at each boundary
    length: int  # of the prompt

    def message_ends(self) -> dict[int, int]:
        """Depth -> digest of the message ending there, but at the prompt's end (the prompt's
        last message is not complete)."""
        complete = int(np.searchsorted(self.boundaries, self.length))
        return dict(zip(self.boundaries[:complete].tolist(), self.messages[:complete].tolist()))


@dataclass(frozen=True)
class CheckpointPlan:
    """Checkpoints to capture during the request's prefill, sorted by depth, all in
    (restored depth, len(prompt)]; and the prompt's digests, which the request's finish hands
    back (``CheckpointPlanner.request_finished``)."""

    checkpoints: tuple[PlannedCheckpoint, ...]
    prompt_digests: PromptDigests

    @property
    def depths(self) -> list[int]:
        return [c.depth for c in self.checkpoints]


@dataclass
class Record:
    session: str
    depth: int
    purpose: Purpose
    created: int
    uses: int = 0
    # BRANCH, SHARED_PATH: tokens a restore from it saves over the shared checkpoint before it
    # (for a message start, the one of the message before).
    span: int = 0
    # SHARED_PATH: digest of the message that ends at the checkpoint.
    message: int = 0
    # SHARED_PATH: whether another session has restored from it.
    followed: bool = False


@dataclass
class Follow:
    """A session whose latest prompt repeats another's: trials of one task, run one after
    another, replay the same conversation until their outputs differ."""

    leader: str
    lead_clock: int  # the leader's request whose prompt it repeated (wholly or in part)
    whole: bool  # the whole prompt, or up to a message start
    # Digest of the last message the two share: the leader's later prompts hold it too (a
    # sliding window moves it, not away), and the follower's next prompt leaves the leader's
    # at its end if their next messages differ.
    message: int


@dataclass
class Session:
    last_clock: int
    sequence: Optional[np.ndarray] = None  # prompt + output of the latest request
    # The digests of the prompt ``sequence`` starts with (None: not known), which the next
    # prompt's digests start from.
    digests: Optional[PromptDigests] = None
    index: Optional[AnchorIndex] = None
    transitions: int = 0  # requests that followed an earlier request of the session
    edits: int = 0  # of those, requests that diverged before the earlier request's end
    # How the latest output ended (``AnchorDetector.output_ending``), once its request
    # finished; None while it runs. Transitions and edits after each ending:
    ending: Optional[int] = None
    # The latest output's last CLOSING_TOKENS tokens (None while its request runs or if it has
    # none): how often sessions came back after such an output (``StreamStats.closings``).
    closing: Optional[tuple[int, ...]] = None
    # Silent for ENDED_AFTER_GAPS of its mean gaps since its latest request (or closed by its
    # client), it is counted as ended after its closing; counted out if it comes back.
    presumed_ended: bool = False
    transitions_after: Counter = field(default_factory=Counter)
    edits_after: Counter = field(default_factory=Counter)
    gap_total: int = 0  # requests of any session between consecutive requests of this one
    gaps_after: Counter = field(default_factory=Counter)  # gap_total by the ending before them
    base_depth: int = 0  # shared-prefix depth the session started from
    # Checkpoint -> depth of the session's checkpoints on its current path: those before its last
    # edit point. The others can only serve a request that undoes an edit.
    on_path: dict[CheckpointId, int] = field(default_factory=dict)
    # Depth -> P(the next request's edit restores from a checkpoint at that depth): as planned,
    # over any request; once the request finished, raised to that given how its output ended
    # (``EditPoints.after_output``).
    predictions: dict[int, float] = field(default_factory=dict)
    model: Optional[EditModel] = None
    # The edit model of the edits after each ending of the output before them.
    models_after: dict[int, EditModel] = field(default_factory=dict)
    # What its latest requests computed (``EditModel.observe``), the newest last.
    prefills: deque[Prefill] = field(default_factory=lambda: deque(maxlen=PREFILLS_KEPT))
    # Depth -> span of the SHARED_PATH checkpoints of the latest plan, until recorded.
    planned_spans: dict[int, int] = field(default_factory=dict)
    # Depth -> digest of the message ending there, for the latest plan's message starts.
    planned_messages: dict[int, int] = field(default_factory=dict)
    following: Optional[Follow] = None
    followers: dict[str, Follow] = field(default_factory=dict)
    # Its client said it sends no more requests (``CheckpointPlanner.end_session``); a request
    # it sends after all opens it again.
    ended: bool = False


class ClosingCounts:
    """Per closing suffix (an output's last token, its last two...): the sessions that came
    back after an output closing so, and those presumed ended after one
    (``Session.presumed_ended``). Any tokens may close an output: the least recently counted
    suffixes are forgotten first, beyond ``capacity``."""

    def __init__(self, capacity: int = MAX_REMEMBERED_CLOSINGS):
        self.capacity = capacity
        self._counts: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()  # -> [returns, ends]
        self.ends = 0  # sessions presumed ended, after any closing
        self._changed: set[tuple[int, ...]] = set()  # suffixes counted or forgotten since taken

    def of(self, suffix: tuple[int, ...]) -> tuple[int, int]:
        """(returns, ends) after outputs closing with ``suffix``."""
        counts = self._counts.get(suffix)
        return (0, 0) if counts is None else (counts[0], counts[1])

    def count(self, closing: tuple[int, ...], returned: int, ended: int) -> None:
        """Add ``returned`` returns and ``ended`` ends (-1: a session counted as ended came
        back) to every suffix of ``closing``."""
        for start in range(len(closing)):
            suffix = closing[start:]
            counts = self._counts.get(suffix)
            if counts is None:
                counts = self._counts[suffix] = [0, 0]
            else:
                self._counts.move_to_end(suffix)
            counts[0] += returned
            counts[1] = max(counts[1] + ended, 0)  # its end was forgotten with the suffix
            self._changed.add(suffix)
        self.ends += ended
        while len(self._counts) > self.capacity:
            self._changed.add(self._counts.popitem(last=False)[0])

    def take_changed(self) -> set[tuple[int, ...]]:
        """The suffixes whose counts changed (counted, or forgotten) since the last call: for
        the one reader that keeps the counts of its sessions' closings (``SessionQuantities``)."""
        changed, self._changed = self._changed, set()
        return changed


@dataclass
class StreamStats:
    """Stream-wide counters: the priors of sessions with little history of their own."""

    clock: int = 0  # requests planned
    transitions: int = 0  # requests that followed an earlier request of their session
    edits: int = 0  # of those, requests that diverged before the earlier request's end
    transitions_after: Counter = field(default_factory=Counter)  # by the ending before them
    edits_after: Counter = field(default_factory=Counter)
    gap_total: int = 0  # requests of any session between consecutive requests of one session
    gaps_after: Counter = field(default_factory=Counter)  # gap_total by the ending before them
    # Sessions that came back, and those presumed ended, after each closing.
    closings: ClosingCounts = field(default_factory=ClosingCounts)
    pool_slots: int = 0  # the device checkpoint pool's size, as the latest request was planned
    # Message starts of new content proposed as SHARED_PATH checkpoints, and the checkpoints
    # taken at them that another session restored from: how often the stream's sessions follow
    # each other's new content. Counted per proposal, so that how many the pool admits does not
    # move the estimate; and once per checkpoint: a system prompt every session restores from
    # is one popular checkpoint, its own uses tell its value, not that other message starts
    # will be followed.
    shared_proposed: int = 0
    shared_followed: int = 0
    # Whether a follower had repeated its leader's whole prompt -> its next requests seen,
    # and of those, the ones that left the same leader's prompt at a message start.
    follow_seen: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    follow_parted: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
