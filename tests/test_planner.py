"""CheckpointPlanner on sequences of edited agent requests.

Requests are ChatML token sequences built with the Qwen3 special-token ids, so the real
AnchorDetector finds their anchors. ``PrefixStore`` below plays the tree for the planner: the
KV prefix every earlier request left, and the checkpoints taken at planned depths (no budget,
no eviction: the budget tests drive the planner's valuation directly).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Optional

import numpy as np
import pytest
from sglang_hybrid.anchors.detector import AnchorDetector, AnchorKind, Anchors, Role
from sglang_hybrid.anchors.hints import validate_hints
from sglang_hybrid.planning.addresses import (
    ANY_ROLE, FROM_END, IN_MESSAGE_FROM_END, PROMPT_TAIL, AnchorIndex, Prefill,
)
from sglang_hybrid.planning.admission import SharedCandidates, admit
from sglang_hybrid.planning.edit_model import EditModel
from sglang_hybrid.planning.ends import closing_of
from sglang_hybrid.planning.anchor_planning import AnchorPlanning
from sglang_hybrid.planning.following import prefix_digests
from sglang_hybrid.planning.planner import CheckpointPlanner
from sglang_hybrid.planning import planner as planner_module
from sglang_hybrid.planning.state import (
    CAPTURE_COST_TOKENS, FORGET_AFTER_GAPS, SHARED_PURPOSES, ClosingCounts, Purpose, RequestContext,
)
from sglang_hybrid.planning.session_rates import (
    alive, append_probability, mean_gap, next_gap, patience, return_probability, stream_mean_gap,
)
from sglang_hybrid.planning.valuation import checkpoint_value, followed_value, pool_share
from sglang_hybrid.anchors.special_tokens import QWEN3_NEWLINE_ID, QWEN3_ROLE_IDS, QWEN3_SPECIAL_IDS
from sglang_hybrid.cache.planning import CheckpointId, RequestToPlan

IM_START = QWEN3_SPECIAL_IDS["<|im_start|>"]
IM_END = QWEN3_SPECIAL_IDS["<|im_end|>"]
THINK, END_THINK = QWEN3_SPECIAL_IDS["<think>"], QWEN3_SPECIAL_IDS["</think>"]
TOOL_RESPONSE, END_TOOL_RESPONSE = QWEN3_SPECIAL_IDS["<tool_response>"], QWEN3_SPECIAL_IDS["</tool_response>"]
TOOL_CALL, END_TOOL_CALL = QWEN3_SPECIAL_IDS["<tool_call>"], QWEN3_SPECIAL_IDS["</tool_call>"]
NL = QWEN3_NEWLINE_ID
DETECTOR = AnchorDetector.for_family("chatml")
MASKED = [5, 5, 5]


def text(tag: int, length: int) -> list[int]:
    """Content tokens unique to ``tag`` (ordinary BPE ids, far from the special ids)."""
    return [1000 + (tag * 7919 + i * 104729) % 140000 for i in range(length)]


def message(role: str, content: list[int]) -> list[int]:
    if role == "tool":  # Qwen3 renders tool results as user messages wrapping <tool_response>
        return [IM_START, QWEN3_ROLE_IDS["user"], NL, TOOL_RESPONSE, NL, *content, NL, END_TOOL_RESPONSE, IM_END, NL]
    return [IM_START, QWEN3_ROLE_IDS[role], NL, *content, IM_END, NL]


GENERATION_PROMPT = [IM_START, QWEN3_ROLE_IDS["assistant"], NL]


def request(messages: list[list[int]], answer: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, output): the output is the assistant content plus the <|im_end|> stop token."""
    prompt = [token for m in messages for token in m] + GENERATION_PROMPT
    return np.asarray(prompt, dtype=np.int32), np.asarray([*answer, IM_END], dtype=np.int32)


def last_n_session(steps: int, keep: int = 2, tag: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """SWE-agent-style calls: tool outputs older than the last ``keep`` are masked."""
    system, task = message("system", text(tag + 1, 40)), message("user", text(tag + 2, 20))
    calls = []
    for step in range(steps):
        history = [system, task]
        for i in range(step):
            observation = text(tag + 100 + i, 30) if i >= step - keep else MASKED
            history += [message("assistant", text(tag + 50 + i, 8)), message("tool", observation)]
        calls.append(request(history, text(tag + 50 + step, 8)))
    return calls


def divergence(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def latest_continuation(planner: CheckpointPlanner, session: str) -> CheckpointId:
    """The generation-end checkpoint of ``session``'s latest finished request."""
    held = [(record.created, checkpoint) for checkpoint, record in planner.records.items()
            if record.session == session and record.purpose is Purpose.CONTINUATION]
    return max(held)[1]


class PrefixStore:
    """The tree as the planner sees it: KV of every earlier prompt + output[:-1], and the
    checkpoints taken (as the token prefixes they hold)."""

    def __init__(self, planner: CheckpointPlanner, budget: int = 1 << 20, evict: bool = False):
        self.planner = planner
        self.budget = budget
        self.evict = evict  # hold at most ``budget`` checkpoints, else only plan for it
        self._next_slot = 0
        self.sequences: list[np.ndarray] = []
        self.checkpoints: dict[CheckpointId, tuple[int, ...]] = {}  # -> tokens the state consumed

    def serve(self, session: str, prompt: np.ndarray, output: np.ndarray, hint=None):
        kept = output[:-1]
        lcp = max((divergence(prompt, s) for s in self.sequences), default=0)
        held = {checkpoint: len(p) for checkpoint, p in self.checkpoints.items()
                if len(p) <= lcp and tuple(prompt[: len(p)].tolist()) == p}
        usable = {checkpoint: d for checkpoint, d in held.items() if d <= min(lcp, len(prompt) - 1)}
        restored_checkpoint = max(usable, key=usable.get) if usable else None
        restored = usable[restored_checkpoint] if usable else 0
        plan = self.planner.plan(RequestContext(
            session=session, prompt_ids=prompt, anchors=DETECTOR.detect(prompt),
            tree_lcp=lcp, held_depths=sorted(held.values()), restored_depth=restored,
            restored=restored_checkpoint, free_slots=self.budget - len(self.checkpoints),
            pool_slots=self.budget, hint=hint,
        ))
        sequence = np.concatenate([prompt, kept])
        for checkpoint in plan.checkpoints:
            self._take(session, sequence, checkpoint.depth, checkpoint.purpose)
        self.planner.request_finished(session, sequence, DETECTOR.detect(prompt, kept), DETECTOR.output_ending(kept),
                                      closing_of(kept), plan.prompt_digests)
        self._take(session, sequence, len(sequence), Purpose.CONTINUATION)
        self.sequences.append(sequence)
        return plan, restored

    def _take(self, session, sequence, depth, purpose):
        tokens = tuple(sequence[:depth].tolist())
        if tokens in self.checkpoints.values():
            return
        if self.evict and len(self.checkpoints) >= self.budget:
            # As the cache does: the checkpoint the planner values least makes room.
            victim = min(self.checkpoints, key=lambda c: self.planner.value(c, len(self.checkpoints[c])))
            del self.checkpoints[victim]
            self.planner.forget([victim])
        checkpoint = CheckpointId.device(self._next_slot)
        self._next_slot += 1
        self.checkpoints[checkpoint] = tokens
        self.planner.record_checkpoint(checkpoint, session, depth, purpose)


# "<tool_response>\n": template text between a tool result's anchor and its content.
TOOL_RESULT_HEADER = 2


def test_last_n_masking_checkpoints_the_observation_the_next_step_masks():
    calls = last_n_session(10)
    planner = CheckpointPlanner()
    store = PrefixStore(planner)
    plans, restored = [], []
    for prompt, output in calls:
        plan, depth = store.serve("swe", prompt, output)
        plans.append(plan)
        restored.append(depth)
    for step in range(4, len(calls) - 1):
        previous = np.concatenate([calls[step][0], calls[step][1][:-1]])
        edit = divergence(calls[step + 1][0], previous)
        assert edit < len(calls[step][0]), "the emulated step must edit, not append"
        # The checkpoint sits on the anchor of the observation the next step masks.
        assert edit - TOOL_RESULT_HEADER in plans[step].depths, (step, edit, plans[step].depths)
        assert restored[step + 1] == edit - TOOL_RESULT_HEADER


def test_edit_inside_a_message_is_learned_as_a_position():
    """A memory block rewritten inside the system prompt: no anchor marks the edit point."""
    head, memory_at = text(1, 30), 3 + 30  # the block starts after the system header + head
    calls = []
    history: list[list[int]] = [message("user", text(2, 10))]
    for step in range(8):
        system = message("system", head + text(500 + step, 12))  # the block changes every call
        calls.append(request([system, *history], text(600 + step, 6)))
        history += [message("assistant", text(600 + step, 6)), message("user", text(700 + step, 10))]
    store = PrefixStore(CheckpointPlanner())
    restored = [store.serve("letta", p, o)[1] for p, o in calls]
    assert all(depth == memory_at for depth in restored[3:]), restored


def reasoning_session(turns: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Qwen3 thinking template: two calls per user turn (tool call, then answer); reasoning is
    kept for the assistant messages after the last user query only."""
    system = message("system", text(1, 30))
    calls = []
    for turn in range(turns):
        for call in range(2):
            history = [system]
            for t in range(turn + 1):
                history.append(message("user", text(10 + t, 12)))
                for c in range(2 if t < turn else call):
                    reasoning = [THINK, NL, *text(100 + 10 * t + c, 15), NL, END_THINK, NL, NL] if t == turn else []
                    history.append(message("assistant", reasoning + text(200 + 10 * t + c, 6)))
                    if c == 0:
                        history.append(message("tool", text(300 + 10 * t, 20)))
            answer = [THINK, NL, *text(100 + 10 * turn + call, 15), NL, END_THINK, NL, NL, *text(200 + 10 * turn + call, 6)]
            calls.append(request(history, answer))
    return calls


def aider_session(turns: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Aider's layout: system, the finished turns, the files block (the files as a user message
    and the assistant's acknowledgement), then the current turn. Each turn makes a tool call,
    which comes back re-rendered (its arguments re-serialized: one token differs) with its
    result, then answers. So after a tool call the next request leaves the previous one inside
    its output, and after an answer it leaves it where the files block began: the next user
    turn moves the block below the finished turn."""
    system = message("system", text(1, 30))
    files = [message("user", text(2, 40)), message("assistant", text(3, 2))]
    history: list[list[int]] = []
    calls = []
    for turn in range(turns):
        user = message("user", text(10 + turn, 12))
        call = [TOOL_CALL, NL, *text(100 + turn, 10), NL, END_TOOL_CALL]
        calls.append(request([system, *history, *files, user], call))
        rendered = [*call[:3], call[3] + 1, *call[4:]]
        exchange = [user, message("assistant", rendered), message("tool", text(200 + turn, 20))]
        answer = text(300 + turn, 6)
        calls.append(request([system, *history, *files, *exchange], answer))
        history += [*exchange, message("assistant", answer)]
    return calls


@pytest.mark.parametrize("ends_with_tool_call", [True, False])
def test_predicted_edit_points_follow_how_the_latest_output_ended(ends_with_tool_call):
    """Once a request finishes, its output's ending tells where the session's next request will
    leave it, as far as past edits after such endings do: after a tool call inside the output
    (a checkpoint at the prompt end restores it), after an answer where the files block began.
    The point that ending names is predicted as the session's edits after it have shown; the
    other keeps its probability over any request (the files block restores the user turn that
    ends a chain of tool calls)."""
    calls = aider_session(6)
    served = calls[:-1] if ends_with_tool_call else calls[:-2]
    planner = CheckpointPlanner()
    store = PrefixStore(planner)
    for prompt, output in served:
        store.serve("aider", prompt, output)
    sequence, prompt_end = store.sequences[-1], len(served[-1][0])
    leaves_at = divergence(sequence, calls[len(served)][0])
    files = np.asarray(message("user", text(2, 40)))
    windows = np.lib.stride_tricks.sliding_window_view(sequence, len(files))
    (files_start,) = np.flatnonzero((windows == files).all(axis=1)).tolist()
    assert leaves_at > prompt_end if ends_with_tool_call else files_start < leaves_at < files_start + len(files)
    predictions = planner.sessions["aider"].predictions
    restores_from = max(depth for depth in predictions if depth <= leaves_at)
    assert restores_from == (prompt_end if ends_with_tool_call else files_start)
    assert predictions[restores_from] == max(predictions.values())
    assert predictions.keys() >= {prompt_end, files_start}


def test_stripped_reasoning_keeps_the_first_prompt_end_of_the_turn():
    calls = reasoning_session(5)
    planner = CheckpointPlanner()
    store = PrefixStore(planner)
    restored = []
    for prompt, output in calls:
        restored.append(store.serve("qwen3", prompt, output)[1])
    # A new user turn diverges where the previous turn's first answer began: the prompt end of
    # that turn's first call. Once the session has shown that rule, a checkpoint at that prompt
    # end restores it exactly; before, the prompt tail restores it but for one token.
    assert restored[4] >= len(calls[2][0]) - 1
    for turn in range(3, 5):
        first_of_previous_turn = calls[2 * (turn - 1)][0]
        assert restored[2 * turn] == len(first_of_previous_turn)
    # The valuation agrees: within the current turn, the first call's prompt end is worth
    # keeping for the next turn; the prompt tails, which only a repeat restores from, are not.
    session = planner.sessions["qwen3"]
    held = {depth: slot for slot, depth in session.on_path.items()}
    first_end = len(calls[-2][0])
    assert planner.records[held[first_end]].purpose is Purpose.PREDICTED_EDIT
    assert planner.value(held[first_end], first_end) > 0.0
    for prompt, _ in calls[-2:]:
        assert planner.value(held[len(prompt) - 1], len(prompt) - 1) == 0.0


def test_a_repeated_prompt_is_predicted_at_its_tail_and_a_re_rendered_output_at_the_prompt_end():
    """A request repeating its session's prompt can restore at most from the prompt's last
    token: that is the point it teaches (``PROMPT_TAIL``), where a template dropping the
    reasoning of the latest answer teaches the prompt end, which the next, longer prompt
    leaves. Each session is predicted at its own point, and each repeat recomputes one token."""
    planner = CheckpointPlanner()
    store = PrefixStore(planner, budget=8, evict=True)
    system = message("system", text(1, 30))
    retried = request([system, message("user", text(2, 12))], [])[0]
    calls = reasoning_session(4)
    for step in range(6):
        _, restored = store.serve("retry", retried, np.array(text(50 + step, 5), dtype=np.int32))
        if step >= 3:  # once the first repeat taught its point
            assert restored == len(retried) - 1
        store.serve("qwen3", *calls[step])
    retry = planner.sessions["retry"].predictions
    # The prompt end keeps only what the stream's other session (its prior) puts there.
    assert retry[len(retried) - 1] > 10 * retry.get(len(retried), 0.0)
    prompt = calls[5][0]
    index = AnchorIndex(DETECTOR.detect(prompt), len(prompt))
    assert (PROMPT_TAIL,) in index.addresses_of(len(prompt) - 1)
    assert index.position_of((PROMPT_TAIL,)) == len(prompt) - 1
    assert (PROMPT_TAIL,) not in index.addresses_of(len(prompt))


def test_an_anchor_index_groups_positions_by_kind_and_role_in_order():
    """The index's groups, found with one sort, are each (kind, role) pair's positions in
    order, as a mask per pair selects them; its unique positions are numpy's."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        count = int(rng.integers(1, 60))
        positions = np.sort(rng.integers(0, 40, count)).astype(np.int64)
        kinds = rng.integers(0, len(AnchorKind), count).astype(np.int8)
        roles = rng.integers(0, len(Role), count).astype(np.int8)
        anchors = Anchors(positions, kinds, roles)
        index = AnchorIndex(anchors, 40)
        pairs = sorted(set(zip(kinds.tolist(), roles.tolist())))
        expected = {pair: positions[(kinds == pair[0]) & (roles == pair[1])] for pair in pairs}
        expected[(int(AnchorKind.MESSAGE_START), ANY_ROLE)] = anchors.of_kind(AnchorKind.MESSAGE_START)
        assert index.by_key.keys() == expected.keys()
        for pair, group in expected.items():
            np.testing.assert_array_equal(index.by_key[pair], group)
        np.testing.assert_array_equal(index.unique, np.unique(positions))


def test_an_address_names_a_position_exactly_where_it_lists_it():
    """``names`` (asked of one message) agrees with the points ``points_named`` lists,
    with no limit but the messages there are, for every address of every position, window
    addresses reaching past the sequence's messages included."""
    rng = np.random.default_rng(7)
    kinds = [int(AnchorKind.MESSAGE_START), int(AnchorKind.TOOL_RESULT_START), int(AnchorKind.PROMPT_END)]
    for _ in range(100):
        count = int(rng.integers(1, 30))
        positions = np.sort(rng.integers(0, 40, count)).astype(np.int64)
        anchors = Anchors(positions, rng.choice(kinds, count).astype(np.int8),
                          rng.integers(0, len(Role), count).astype(np.int8))
        index = AnchorIndex(anchors, 40)
        addresses = {address for position in range(41) for address in index.addresses_of(position)}
        addresses |= {(IN_MESSAGE_FROM_END, int(AnchorKind.TOOL_RESULT_START), role, n)
                      for role in range(len(Role)) for n in range(1, 2 * len(index.messages) + 4)}
        for address in sorted(addresses):
            listed = {depth for depth, _ in index.points_named(address, len(index.messages) + 1)}
            assert [index.names(address, position) for position in range(41)] == [
                position in listed for position in range(41)], address


def test_sessions_sharing_a_system_prompt_restore_at_the_message_start():
    system = message("system", text(1, 50))
    store = PrefixStore(CheckpointPlanner())
    # a's and b's user messages share their first tokens: enough that a checkpoint where they
    # part saves more than its capture costs.
    opening = list(range(4242, 4252))
    first = request([system, message("user", [*opening, *text(2, 10)])], text(3, 5))
    second = request([system, message("user", [*opening, *text(4, 10)])], text(5, 5))
    third = request([system, message("user", text(6, 10))], text(7, 5))
    plan, _ = store.serve("a", *first)
    # a computes its user message first: its start is a shared-path checkpoint, for sessions
    # that follow a's path and leave it inside that message.
    assert (len(system), Purpose.SHARED_PATH) in [(c.depth, c.purpose) for c in plan.checkpoints]
    # The generation prompt's start opens the message a generates, not one of the prompt: a
    # session sharing a's whole prompt restores from the prompt tail, two tokens deeper.
    assert len(first[0]) - len(GENERATION_PROMPT) not in plan.depths
    plan, restored = store.serve("b", *second)
    assert restored == len(system)
    # b shares the opening of its user message with a: it branches there, past the message
    # start (and its header, three tokens).
    assert (len(system) + 3 + len(opening), Purpose.BRANCH) in [(c.depth, c.purpose) for c in plan.checkpoints]
    _, restored = store.serve("c", *third)
    assert restored == len(system)


def window_masking_session(steps: int, window: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    """OpenHands-style masking: tool results outside the last ``window`` messages are masked,
    and assistant turns are sometimes followed by a user message instead of a tool result, so
    the n-th tool result from the end is not where the next mask lands; the n-th message is."""
    system, task = message("system", text(1, 40)), message("user", text(2, 20))
    follow_ups = [message("tool", text(100 + i, 30)) if i % 3 else message("user", text(100 + i, 6))
                  for i in range(steps)]
    calls = []
    for step in range(steps):
        history = [system, task]
        for i in range(step):
            history += [message("assistant", text(50 + i, 8)), follow_ups[i]]
        cutoff = len(history) - window
        history = [MASKED_TOOL if i < cutoff and h[3] == TOOL_RESPONSE else h for i, h in enumerate(history)]
        calls.append(request(history, text(50 + step, 8)))
    return calls


MASKED_TOOL = message("tool", MASKED)


def test_an_edit_rule_keeps_its_share_through_edits_of_sequences_it_names_no_point_of():
    """Masking starts once a session holds more observations than its window: until then the
    address of the observation it masks names no point of the sequence, and the edits there
    (re-rendered answers) are no evidence against it. Where it names a point again, it keeps
    the share it had earned."""
    def sequence(observations: int) -> AnchorIndex:
        history = [message("system", text(1, 40)), message("user", text(2, 20))]
        for i in range(observations):
            history += [message("assistant", text(50 + i, 8)), message("tool", text(100 + i, 30))]
        prompt, _ = request(history, [])
        return AnchorIndex(DETECTOR.detect(prompt), len(prompt))

    long, short = sequence(4), sequence(1)
    third_from_end = (FROM_END, int(AnchorKind.TOOL_RESULT_START), int(Role.TOOL), 3)
    masked = long.position_of(third_from_end)
    assert masked is not None and short.position_of(third_from_end) is None
    model = EditModel(capacity=16, learning_rate=0.3)
    for _ in range(2):  # seen once, then predicted once
        model.observe(long, masked, None)
    earned = model.shares[third_from_end]
    assert earned > 0.0
    for _ in range(5):  # edits at the answer of sequences with one observation
        model.observe(short, short.length - 1, None)
    assert model.shares[third_from_end] == earned
    assert model.predict(long, limit=6)[masked] >= earned


def test_an_edit_is_credited_to_the_addresses_naming_its_point_when_it_was_computed():
    """A condensing agent keeps its first messages and, once its view is full, replaces the
    rest by a new summary: each condensation restores from the summary's start, which only the
    request right after the previous one computed (the later ones restore past it). The n-th
    message from the end names the summary only when the view is full and names nothing at
    the re-rendered answers in between, so by its record it would take every condensation's
    credit; but a checkpoint there must be taken while the view is short, where the n-th
    anchor from the start names it. Once learned, the summary's start is predicted by the
    request that can checkpoint it."""
    head = [message("system", text(1, 40)), message("user", text(2, 20)),
            message("assistant", text(3, 8)), message("tool", text(4, 30))]

    def view(pairs: int) -> AnchorIndex:
        history = [*head, message("user", text(5, 25))]
        for i in range(pairs):
            history += [message("assistant", text(50 + i, 8)), message("user", text(100 + i, 12))]
        prompt, _ = request(history, [])
        return AnchorIndex(DETECTOR.detect(prompt), len(prompt))

    short, middle, full = view(1), view(3), view(6)
    summary_start = short.messages[len(head)]
    assert full.messages[len(head)] == summary_start
    message_from_end = (FROM_END, int(AnchorKind.MESSAGE_START), ANY_ROLE, len(full.messages) - len(head))
    assert full.position_of(message_from_end) == summary_start and short.position_of(message_from_end) is None
    after_condensing = [Prefill(restored=summary_start - 1, length=short.length, index=short)]
    last_answer = middle.messages[-3]  # the last one opens the generation prompt
    model = EditModel(capacity=32, learning_rate=0.3)
    for condensation in range(4):
        # Each summary first differs from the one before a little earlier into its text.
        model.observe(full, summary_start + 6 - condensation, None, after_condensing)
        model.observe(middle, last_answer + 3, None)  # a re-rendered answer
    assert model.shares.get(message_from_end, 0.0) < 0.05, model.shares
    assert model.predict(short, limit=6).get(summary_start, 0.0) > 0.3


def test_window_masking_is_predicted_by_message_count():
    """The edit lands on the message a fixed count from the end, whatever the roles before it:
    once learned, every masking step restores at the start of the message it masks."""
    calls = window_masking_session(16)
    store = PrefixStore(CheckpointPlanner())
    restored = [store.serve("oh", prompt, output)[1] for prompt, output in calls]
    misses = 0
    for step in range(8, len(calls)):
        previous = np.concatenate([calls[step - 1][0], calls[step - 1][1][:-1]])
        edit = divergence(calls[step][0], previous)
        if edit < len(calls[step - 1][0]):  # a masking step, not a re-rendered answer
            misses += restored[step] != edit - TOOL_RESULT_HEADER
    assert misses == 0, restored


def test_a_session_following_another_restores_at_the_message_it_leaves_in():
    """Two trials of one task: the second repeats the first's conversation until its third
    answer differs. Its request restores the first's shared-path checkpoint at the start of
    that answer, not the system prompt."""
    system, task = message("system", text(1, 40)), message("user", text(2, 20))
    shared = [message("assistant", text(10, 8)), message("tool", text(11, 30)),
              message("assistant", text(12, 8)), message("tool", text(13, 30))]
    leader = request([system, task, *shared, message("assistant", text(14, 8)), message("tool", text(15, 30))],
                     text(16, 8))
    follower = request([system, task, *shared, message("assistant", text(24, 8)), message("tool", text(25, 30))],
                       text(26, 8))
    store = PrefixStore(CheckpointPlanner())
    store.serve("trial-0", *leader)
    plan, restored = store.serve("trial-1", *follower)
    branch_message = sum(len(m) for m in [system, task, *shared])
    assert restored == branch_message
    assert all(c.depth > branch_message for c in plan.checkpoints)


def recent_window_session(
    steps: int, tag: int, keep: int = 4, parted_at: Optional[int] = None, parted_tag: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """OpenHands' recent-events window: the system prompt and the last ``keep`` messages. The
    system prompt is every session's; the rest is the session's own (``tag``). From step
    ``parted_at`` on, the answers and tool results are ``parted_tag``'s: a trial of ``tag``'s
    task whose answer there differs."""
    system = message("system", text(1, 40))
    history = [message("user", text(tag, 20))]
    calls = []
    for step in range(steps):
        own = parted_tag if parted_at is not None and step >= parted_at else tag
        answer = text(own + 50 + step, 8)
        calls.append(request([system, *history[-keep:]], answer))
        history += [message("assistant", answer), message("tool", text(own + 100 + step, 30))]
    return calls


def test_a_trial_parting_from_another_restores_where_their_windows_part():
    """Trials of one task under a recent-events window: the second repeats the first one
    step behind it until its answer at step 4 differs. Its next windows open with messages
    the two share, up to that answer: each restores the first trial's checkpoint at the end
    of the last shared message, in the first trial's window of the same step, though other
    sessions fill the pool and no request of the first trial's own needs it."""
    steps, keep, parted_at = 8, 6, 4
    leader_calls = recent_window_session(steps, tag=10_000, keep=keep)
    follower_calls = recent_window_session(steps, tag=10_000, keep=keep, parted_at=parted_at, parted_tag=30_000)
    # Nine slots: the system prompt's checkpoint, which every request restores from (the
    # windows part after it), holds one; the other sessions fill the rest.
    store = PrefixStore(CheckpointPlanner(), budget=9, evict=True)
    others = {f"other-{i}": recent_window_session(steps, tag=20_000 + 1000 * i, keep=keep) for i in range(3)}
    parted = []
    for step in range(steps):
        if step >= 1:
            prompt, output = follower_calls[step - 1]
            _, restored = store.serve("trial-1", prompt, output)
            shared = divergence(prompt, leader_calls[step - 1][0])
            starts = DETECTOR.detect(prompt).of_kind(1)  # AnchorKind.MESSAGE_START
            if parted_at < step - 1 and shared < len(prompt) - 1 and shared > starts[1]:
                parted.append(restored == int(starts[starts <= shared].max()))
        store.serve("trial-0", *leader_calls[step])
        for name, calls in others.items():
            store.serve(name, *calls[step])
    assert parted == [True, True], parted


def reasoning_agent_session(turns: int, tag: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Qwen3 with its reasoning kept while a turn's tool calls run: an output that calls a
    tool is followed by its result (an append); a final answer by the user's next message,
    and the template drops that answer's reasoning when it renders it again (an edit at the
    answer's start). Turns alternate: two tool calls, then an answer."""
    history = [message("system", text(1, 40)), message("user", text(tag, 20))]
    calls = []
    for turn in range(turns):
        thought = [THINK, *text(tag + 10 + turn, 12), END_THINK, NL]
        if turn % 3 < 2:
            answer = [*thought, TOOL_CALL, *text(tag + 30 + turn, 6), END_TOOL_CALL]
            calls.append(request(history, answer))
            history += [message("assistant", answer), message("tool", text(tag + 50 + turn, 20))]
        else:
            answer = [*thought, *text(tag + 70 + turn, 10)]
            calls.append(request(history, answer))
            history += [message("assistant", answer[len(thought):]), message("user", text(tag + 90 + turn, 10))]
    return calls


def agent_among_other_sessions(store: PrefixStore):
    """``reasoning_agent_session``'s turns among other sessions' requests (masking agents,
    one per session in turn): one after a tool call (its result is sent back at once), six
    after an answer (a user types the next turn). Yields (turn, prompt, how the output ended)
    once each of the agent's requests is served, before the others that follow it."""
    fillers = [last_n_session(10, tag=20_000 + 1000 * i) for i in range(8)]
    served = [0] * len(fillers)
    for turn, (prompt, output) in enumerate(reasoning_agent_session(18, tag=500)):
        store.serve("agent", prompt, output)
        ending = "tool call" if store.planner.sessions["agent"].ending == END_TOOL_CALL else "answer"
        yield turn, prompt, ending
        for i in range(1 if ending == "tool call" else 6):
            filler = i % len(fillers)
            store.serve(f"filler-{filler}", *fillers[filler][served[filler] % len(fillers[filler])])
            served[filler] += 1


def test_whether_the_next_request_appends_is_learned_from_how_the_output_ended():
    """After a tool call the session's next request appends; after an answer it edits. The
    planner learns the two rates apart (the unconditional one is two thirds), so the
    generation-end state is worth its output after a tool call and nothing after an answer,
    while the prompt end, where an answer's edit restores, keeps its value after both."""
    planner = CheckpointPlanner()
    store = PrefixStore(planner)
    appends, end_values, prompt_end_values = {}, {}, {}
    for turn, (prompt, output) in enumerate(reasoning_agent_session(18, tag=500)):
        store.serve("agent", prompt, output)
        if turn >= 9:
            session = planner.sessions["agent"]
            ending = "tool call" if session.ending == END_TOOL_CALL else "answer"
            appends.setdefault(ending, []).append(append_probability(session, planner.stream))
            end = latest_continuation(planner, "agent")
            prompt_end = next(checkpoint for checkpoint, record in planner.records.items()
                              if record.purpose is Purpose.PREDICTED_EDIT and record.depth == len(prompt))
            end_values.setdefault(ending, []).append(planner.value(end, planner.records[end].depth))
            prompt_end_values.setdefault(ending, []).append(planner.value(prompt_end, len(prompt)))
    assert min(appends["tool call"]) > 0.8 > 0.2 > max(appends["answer"]), appends
    assert max(end_values["answer"]) < 0.2 * min(end_values["tool call"]), end_values
    assert min(prompt_end_values["tool call"]) > 0 and min(prompt_end_values["answer"]) > 0, prompt_end_values


def test_an_append_that_comes_sooner_is_worth_more_per_request():
    """A tool's result is sent back at once; a user's next message comes after other
    sessions' requests. The planner learns the session's gap after each ending apart, and the
    generation-end state, which an append restores from at the session's next request, is
    worth its append share of what it saves scaled by how much sooner than the session's mean
    gap that request comes: more after a tool call, less after an answer."""
    planner = CheckpointPlanner()
    gaps, scaled = {}, {}
    for turn, prompt, ending in agent_among_other_sessions(PrefixStore(planner)):
        session = planner.sessions["agent"]
        if turn >= 9:
            gaps.setdefault(ending, []).append(next_gap(session, planner.stream))
            end = latest_continuation(planner, "agent")
            depth = planner.records[end].depth
            saved = depth - (len(prompt) - 1)  # over the prompt tail, the next shallower one
            unscaled = append_probability(session, planner.stream) * saved
            scaled.setdefault(ending, []).append(planner.value(end, depth) / unscaled)
            assert alive(session, patience(mean_gap(session, planner.stream), next_gap(session, planner.stream)),
                         planner.stream) == return_probability(session, planner.stream) > 0.9
    mean = mean_gap(planner.sessions["agent"], planner.stream)
    assert max(gaps["tool call"]) < mean < min(gaps["answer"]), (gaps, mean)
    assert min(scaled["tool call"]) > 1.5, scaled
    assert max(scaled["answer"]) < 0.9, scaled


def alive_after(silence, session, limit, stream):
    """``alive`` once the session has been silent ``silence`` requests more."""
    stream.clock += silence
    try:
        return alive(session, limit, stream)
    finally:
        stream.clock -= silence


def test_a_session_silent_long_after_a_tool_call_looks_ended_before_one_waiting_on_its_user():
    """A tool's result comes back within a few requests; a user's next turn later than the
    session's mean gap. Silent for three times the gap that follows its tool calls, and less
    than twice its mean gap, the session looks ended after a tool call: its own checkpoints
    lose value. After an answer the same silence leaves it alive, since the bound stays twice
    its mean gap, and only a silence beyond that makes it look ended."""
    planner = CheckpointPlanner()
    silences = {}
    for turn, _prompt, ending in agent_among_other_sessions(PrefixStore(planner)):
        if turn < 9:
            continue
        session, stream = planner.sessions["agent"], planner.stream
        gap, expected = mean_gap(session, stream), next_gap(session, stream)
        limit = patience(gap, expected)
        end = latest_continuation(planner, "agent")
        value_now = checkpoint_value(planner.records[end], end, planner.sessions, stream)
        if ending == "tool call":
            silence = silences["tool call"] = 3 * expected
            assert silence < 2 * gap and limit == 2 * expected, (silence, gap, expected)
            assert alive_after(silence, session, limit, stream) < 0.5
            stream.clock += silence
            assert checkpoint_value(planner.records[end], end, planner.sessions, stream) < 0.5 * value_now
            stream.clock -= silence
        else:
            assert expected > gap and limit == 2 * gap, (gap, expected)
            assert alive_after(silences["tool call"], session, limit, stream) == return_probability(session, stream)
            assert alive_after(2 * expected, session, limit, stream) < return_probability(session, stream)
            silences["answer"] = 2 * expected
    assert set(silences) == {"tool call", "answer"}


def sessions_saying_farewell(planner: CheckpointPlanner, asks: list[int], closes: list[int]):
    """Four sessions at a time, one request each in turn, four new ones as they leave: each
    asks three times (its output closing with ``asks``), says farewell (``closes``) and goes
    silent. Then "asking" asks and "leaving" says farewell. Returns a function serving one
    more request of a session."""
    store = PrefixStore(planner)
    history: dict[str, list[list[int]]] = {}

    def serve(name: str, step: int, closing: list[int]) -> None:
        history.setdefault(name, [message("user", text(10_000 + step, 12))])
        prompt, output = request(history[name], [*text(20_000 + step, 10), *closing])
        store.serve(name, prompt, output)
        history[name] += [message("assistant", list(output[:-1])), message("user", text(30_000 + step, 6))]

    turns = 4
    for step in range(64):
        serve(f"s{step % 4 + 4 * (step // (4 * turns))}", step, closes if step // 4 % turns == turns - 1 else asks)
    serve("asking", 64, asks)
    serve("leaving", 65, closes)
    return serve


def test_a_session_whose_output_closed_as_those_ending_sessions_did_looks_less_likely_to_come_back():
    """Sessions end after their closing words ("Have a great day!"), whose last token their
    other answers rarely end with. The stream counts a session silent for ENDED_AFTER_GAPS of
    its mean gaps as ended after its latest output's closing tokens, and counts it out if it
    comes back: a session whose output closed like those is less likely to come back than
    one whose output closed like those that went on, and its generation-end checkpoint is
    worth less."""
    planner = CheckpointPlanner()
    asks, closes = text(1, 1)[0], text(2, 1)[0]  # the last tokens of a question and of a farewell
    serve = sessions_saying_farewell(planner, [asks], [closes])
    stream = planner.stream
    assert stream.closings.of((closes,))[1] >= 8 and stream.closings.of((asks,))[1] == 0
    asking, leaving = planner.sessions["asking"], planner.sessions["leaving"]
    assert return_probability(leaving, stream) < 0.2 < 0.9 < return_probability(asking, stream)
    values = {}
    for name in ("asking", "leaving"):
        end = latest_continuation(planner, name)
        values[name] = planner.value(end, planner.records[end].depth)
    assert values["leaving"] < 0.2 * values["asking"], values

    # A session counted as ended that comes back is counted out.
    returned, ended = stream.closings.of((closes,))
    assert planner.sessions["s0"].presumed_ended
    serve("s0", 66, [asks])
    assert stream.closings.of((closes,)) == (returned + 1, ended - 1) and not planner.sessions["s0"].presumed_ended


def test_the_token_before_the_last_tells_closings_that_share_their_last_token_apart():
    """ "... feel free to ask!" goes on, "... safe travels!" ends: both close with "!", whose
    rate mixes them; the rate after the last two tokens, drawn toward the last token's,
    tells them apart."""
    planner = CheckpointPlanner()
    bang, ask, travels = text(3, 3)
    sessions_saying_farewell(planner, [ask, bang], [travels, bang])
    stream = planner.stream
    returned, ended = stream.closings.of((bang,))
    assert returned > 0 and ended > 0 and stream.closings.of((ask, bang))[1] == 0
    asking, leaving = (return_probability(planner.sessions[name], stream) for name in ("asking", "leaving"))
    assert leaving < 0.5 * asking, (leaving, asking)


def test_closing_counts_forget_the_least_recently_counted_and_never_go_negative():
    counts = ClosingCounts(capacity=3)
    counts.count((1, 2), 1, 0)
    counts.count((3, 2), 0, 1)  # (2,) counted again: (1, 2) is now the least recent
    counts.count((4,), 1, 0)
    assert counts.of((1, 2)) == (0, 0) and counts.of((2,)) == (1, 1) and counts.of((3, 2)) == (0, 1)
    counts.count((5, 6), 1, -1)  # a session counted as ended after a forgotten closing came back
    assert counts.of((5, 6)) == (1, 0) and counts.ends == 0


def test_the_pool_share_weighs_a_predicted_edit_by_how_soon_and_how_long():
    """The prompt end of a turn's first call is where the user's next turn, which re-renders
    the answer without its reasoning, restores. With a slot for every active session it is
    worth its edit share of what it saves. With a slot for every two sessions or fewer, that
    share per unit of time: times the stream's mean gap over the requests until its session's
    next one comes, more than all of it after a tool call (its result is sent back at once),
    less after an answer (a user types the next turn). With four slots for each, a
    checkpoint can wait through four of its session's requests: worth the chance that one of
    them restores there, more than the next one's and less than four times it."""
    planner = CheckpointPlanner()

    def value_with_share(checkpoint: CheckpointId, share: float) -> float:
        """Its value if the pool held ``share`` slots per active session."""
        stream = planner.stream
        kept, stream.pool_slots = stream.pool_slots, share * stream_mean_gap(stream)
        try:
            assert pool_share(stream) == share
            return checkpoint_value(planner.records[checkpoint], checkpoint, planner.sessions, stream)
        finally:
            stream.pool_slots = kept

    scarce, ample, soon = {}, {}, {}
    for turn, prompt, ending in agent_among_other_sessions(PrefixStore(planner)):
        session = planner.sessions["agent"]
        if turn >= 9:
            prompt_end = next(checkpoint for checkpoint, record in planner.records.items()
                              if record.session == "agent" and record.depth == len(prompt))
            one_each = value_with_share(prompt_end, 1.0)
            assert one_each > 0.0
            scarce.setdefault(ending, []).append(value_with_share(prompt_end, 0.5) / one_each)
            ample.setdefault(ending, []).append(value_with_share(prompt_end, 4.0) / one_each)
            soon.setdefault(ending, []).append(stream_mean_gap(planner.stream) / next_gap(session, planner.stream))
    assert min(scarce["tool call"]) > 2.0 and max(scarce["answer"]) < 0.9, scarce
    for ending in scarce:
        assert scarce[ending] == pytest.approx(soon[ending]), (scarce, soon)
    assert all(1.0 < ratio < 4.0 for ratios in ample.values() for ratio in ratios), ample


def test_hints():
    calls = last_n_session(3)
    prompt, output = calls[2]
    planner = CheckpointPlanner()
    store = PrefixStore(planner)
    plan, _ = store.serve("s", prompt, output, hint=validate_hints("none", len(prompt), 8))
    assert plan.checkpoints == ()
    other_prompt, other_output = last_n_session(3, tag=9000)[2]
    plan, _ = store.serve("t", other_prompt, other_output, hint=validate_hints([7, 20], len(other_prompt), 8))
    assert {(7, Purpose.HINT), (20, Purpose.HINT)} <= {(c.depth, c.purpose) for c in plan.checkpoints}
    third_prompt, third_output = last_n_session(3, tag=18000)[2]
    plan, _ = store.serve("u", third_prompt, third_output, hint=validate_hints("messages", len(third_prompt), 8))
    starts = DETECTOR.detect(third_prompt).of_kind(1).tolist()  # AnchorKind.MESSAGE_START
    assert set(d for d in starts if 0 < d < len(third_prompt)) <= set(plan.depths)


def test_an_ended_session_keeps_nothing_of_its_own_until_it_comes_back():
    """Once its client says a session ended, its own checkpoints are worth nothing, so a full
    pool evicts them first, and the other sessions' keep their values; a request it sends
    after all opens it again. A session never planned cannot be ended."""
    planner = CheckpointPlanner()
    store = PrefixStore(planner, budget=6, evict=True)
    calls = {"a": last_n_session(6, tag=0), "b": last_n_session(6, tag=5000)}
    for step in range(4):
        for name in calls:
            store.serve(name, *calls[name][step])

    def values(session: str, purposes=tuple(Purpose)) -> dict[CheckpointId, float]:
        return {checkpoint: planner.value(checkpoint, record.depth) for checkpoint, record in planner.records.items()
                if record.session == session and record.purpose in purposes}

    own = tuple(purpose for purpose in Purpose if purpose not in SHARED_PURPOSES)
    assert max(values("a", own).values()) > 0.0
    shared_by_a, others = values("a", SHARED_PURPOSES), values("b")
    planner.end_session("a")
    planner.end_session("never-planned")
    assert "never-planned" not in planner.sessions
    assert set(values("a", own).values()) == {0.0}
    assert values("a", SHARED_PURPOSES) == shared_by_a and values("b") == others
    held_by_a = set(values("a", own))
    store.serve("b", *calls["b"][4])
    assert held_by_a and not held_by_a & set(planner.records)
    store.serve("a", *calls["a"][4])
    assert not planner.sessions["a"].ended
    assert max(values("a", own).values()) > 0.0


def test_sessions_holding_nothing_are_forgotten_once_ended_or_long_silent(monkeypatch):
    """The planner's memory of a session (counters, edit model, its latest sequence) goes once
    the session holds no checkpoint and its client ended it or it fell silent for
    FORGET_AFTER_GAPS of its gaps: thousands of sessions do not pile up. One that comes back
    starts afresh, and a session that followed a forgotten one follows nothing."""
    monkeypatch.setattr(planner_module, "FORGET_SWEEP_REQUESTS", 16)
    planner = CheckpointPlanner()
    store = PrefixStore(planner, budget=8, evict=True)
    for i in range(200):
        for call in last_n_session(2, tag=1000 * i):  # two requests, then silence
            store.serve(f"s{i}", *call)
    assert len(planner.sessions) < 2 * FORGET_AFTER_GAPS
    assert {record.session for record in planner.records.values()} <= set(planner.sessions)
    assert "s0" not in planner.sessions
    store.serve("s0", *last_n_session(3, tag=0)[2])
    assert planner.sessions["s0"].transitions == 0

    lead = last_n_session(3, tag=777_001)  # a system prompt no other session has
    store.serve("lead", *lead[0])
    store.serve("trial", *lead[0])  # a second trial of the task: the same first prompt
    assert planner.sessions["trial"].following.leader == "lead"
    held_by_lead = [checkpoint for checkpoint, record in planner.records.items() if record.session == "lead"]
    planner.forget(held_by_lead)
    for checkpoint in held_by_lead:
        del store.checkpoints[checkpoint]
    planner.end_session("lead")
    while "lead" in planner.sessions:
        store.serve("other", *last_n_session(2, tag=888_001)[1])
    assert planner.sessions["trial"].following is None
    store.serve("trial", *lead[1])
    store.serve("third", *lead[0])
    assert planner.sessions["third"].following is None


def test_a_request_whose_session_is_forgotten_while_it_runs_finishes_unrecorded(monkeypatch):
    """The planner forgets a session while its request still runs (silent past
    FORGET_AFTER_GAPS, holding nothing): the request's staged checkpoints and its end state
    stay unrecorded (worth nothing, the first to go), and the free slots the cache reports
    with its finish are forgotten as with any other."""
    monkeypatch.setattr(planner_module, "FORGET_SWEEP_REQUESTS", 4)
    planning = AnchorPlanning(DETECTOR, "adaptive", CheckpointPlanner())
    planner = planning.planner

    def to_plan(rid: str, session: str, prompt: np.ndarray) -> RequestToPlan:
        return RequestToPlan(rid=rid, prompt=prompt.astype(np.int64), session=session, hint=None, restored_depth=0,
                             restored=None, tree_lcp=0, held_depths=(), free_slots=64, pool_slots=64)

    slow_prompt, slow_output = last_n_session(3, tag=1)[2]
    depths = planning.plan(to_plan("slow", "slow", slow_prompt))
    assert depths
    others = last_n_session(2, tag=5000)
    turn = 0
    while "slow" in planner.sessions:
        prompt, output = others[turn % 2]
        planning.plan(to_plan(f"other-{turn}", "other", prompt))
        planning.finished(f"other-{turn}", np.concatenate([prompt, output[:-1]]).astype(np.int64), len(prompt),
                          None, [])
        planning.released(f"other-{turn}")
        turn += 1
    planning.staged("slow", depths[0], CheckpointId.device(1))
    planner.record_checkpoint(CheckpointId.device(3), "other", 5, Purpose.PROMPT_TAIL)
    cached = np.concatenate([slow_prompt, slow_output[:-1]]).astype(np.int64)
    planning.finished("slow", cached, len(slow_prompt), CheckpointId.device(2), [CheckpointId.device(3)])
    planning.released("slow")
    assert not planner.records


def test_a_prompt_starts_its_digests_from_those_of_the_request_its_session_continues():
    """The digests a session's next prompt starts from are those of the prompt its sequence
    starts with, even when another request of the session was planned in between: here an
    edited retry with the same message boundaries, whose digests differ past the edit."""
    planning = AnchorPlanning(DETECTOR, "adaptive", CheckpointPlanner())
    session = planning.planner.sessions

    def plan(rid: str, prompt: np.ndarray) -> None:
        planning.plan(RequestToPlan(rid=rid, prompt=prompt.astype(np.int64), session="s", hint=None,
                                    restored_depth=0, restored=None, tree_lcp=0, held_depths=(), free_slots=64,
                                    pool_slots=64))
        starts = DETECTOR.detect(prompt).of_kind(AnchorKind.MESSAGE_START)
        alone = prefix_digests(prompt.astype(np.int64), [*starts[(starts > 0) & (starts < len(prompt))].tolist(),
                                                         len(prompt)])
        assert session["s"].digests.sums.tolist() == alone.sums.tolist()
        assert session["s"].digests.messages.tolist() == alone.messages.tolist()

    (first, output), _ = last_n_session(2, tag=0)
    plan("first", first)
    retry = first.copy()
    retry[5] += 1  # inside the system message: every boundary stays where it was
    plan("retry", retry)
    cached = np.concatenate([first, output[:-1]]).astype(np.int64)
    planning.finished("first", cached, len(first), None, [])
    plan("next", np.concatenate([cached, message("tool", text(9, 30)), [IM_START, QWEN3_ROLE_IDS["assistant"], NL]]))


def test_an_ended_session_sending_again_on_a_sweep_keeps_what_it_learned(monkeypatch):
    """A request from an ended session that holds nothing reopens it even when it arrives as
    the planner forgets idle sessions: it is not the one forgotten."""
    monkeypatch.setattr(planner_module, "FORGET_SWEEP_REQUESTS", 1)
    planner = CheckpointPlanner()
    store = PrefixStore(planner)
    calls = last_n_session(3, tag=0)
    store.serve("a", *calls[0])
    store.serve("a", *calls[1])
    held = [checkpoint for checkpoint, record in planner.records.items() if record.session == "a"]
    planner.forget(held)
    for checkpoint in held:
        del store.checkpoints[checkpoint]
    planner.end_session("a")
    store.serve("a", *calls[2])
    assert planner.sessions["a"].transitions == 2 and not planner.sessions["a"].ended


def test_ending_a_follower_lowers_what_its_leader_shares_with_it_at_once():
    """A leader's shared-path checkpoints are worth what a following trial would restore from
    them. Once the follower's client ends it they are worth that much less at once, before any
    other request: an eviction in between sees it."""
    leader = recent_window_session(8, tag=10_000, keep=6)
    follower = recent_window_session(8, tag=10_000, keep=6, parted_at=4, parted_tag=30_000)
    planner = CheckpointPlanner()
    store = PrefixStore(planner)
    followed = []
    for step in range(8):
        if step >= 1:
            store.serve("trial-1", *follower[step - 1])
        store.serve("trial-0", *leader[step])
        followed = [checkpoint for checkpoint, record in planner.records.items() if record.session == "trial-0"
                    and followed_value(planner.sessions["trial-0"], record, planner.sessions, planner.stream) > 0]
        if followed:
            break
    assert followed
    before = {checkpoint: planner.value(checkpoint, planner.records[checkpoint].depth) for checkpoint in followed}
    assert before == {checkpoint: checkpoint_value(planner.records[checkpoint], checkpoint, planner.sessions,
                                                   planner.stream) for checkpoint in followed}
    planner.end_session("trial-1")
    for checkpoint, record in planner.records.items():
        fresh = checkpoint_value(record, checkpoint, planner.sessions, planner.stream)
        assert planner.value(checkpoint, record.depth) == fresh
    assert all(planner.value(checkpoint, planner.records[checkpoint].depth) < value
               for checkpoint, value in before.items())


def test_full_pool_admits_only_checkpoints_worth_more_than_the_least_valuable_held():
    """With no free slot, a candidate (the prompt tail included) must be worth more than the
    least valuable held checkpoint: the continuation states of active sessions stay."""
    planner = CheckpointPlanner()
    store = PrefixStore(planner, budget=4)
    sessions = {f"s{i}": last_n_session(6, tag=1000 * i) for i in range(4)}
    for step in range(6):
        for name, calls in sessions.items():
            store.serve(name, *calls[step])
    held_values = [planner.value(slot, r.depth) for slot, r in planner.records.items()]
    continuation_values = [planner.value(c, planner.records[c].depth)
                           for c in (latest_continuation(planner, name) for name in planner.sessions)]
    assert min(continuation_values) > 0.0
    newcomer = last_n_session(2, tag=50_000)[1]
    store.budget = len(store.checkpoints)  # the pool is full
    plan, _ = store.serve("new", *newcomer)
    assert all(c.value > sorted(held_values)[0] for c in plan.checkpoints)
    # Free slots take the prompt tail even when nothing predicts an edit there.
    store.budget = len(store.checkpoints) + 8
    plan, _ = store.serve("newer", *last_n_session(2, tag=60_000)[1])
    assert Purpose.PROMPT_TAIL in {c.purpose for c in plan.checkpoints}


def test_a_checkpoint_is_admitted_only_if_it_saves_more_than_its_capture_costs():
    """Free slot or not, a candidate must save more than its capture costs: alone while slots
    are free (the prompt tail takes one unvalued), beyond the value it displaces once not."""
    cost = CAPTURE_COST_TOKENS
    shared = SharedCandidates([100, 200], [Purpose.SHARED_PATH, Purpose.SHARED_PATH], np.array([0.5 * cost, 3 * cost]))
    own_values = {50: 0.9 * cost, 150: 2.5 * cost, 299: 0.0}
    own = [(50, Purpose.PREDICTED_EDIT), (150, Purpose.PREDICTED_EDIT), (299, Purpose.PROMPT_TAIL)]

    def admitted(free_slots: int, lowest_held: float) -> list[int]:
        plan = admit(list(own), shared, lambda depth, purpose, planned: own_values[depth], free_slots,
                     lambda count: np.full(count, lowest_held))
        return [c.depth for c in plan]

    assert admitted(free_slots=8, lowest_held=0.0) == [150, 200, 299]
    # A full pool: worth the least valuable held checkpoint and a capture more, or nothing.
    assert admitted(free_slots=0, lowest_held=0.0) == [150, 200]
    assert admitted(free_slots=0, lowest_held=1.6 * cost) == [200]
    assert admitted(free_slots=0, lowest_held=2.5 * cost) == []


def test_a_checkpoint_is_worth_what_it_saves_over_the_next_shallower_one():
    """An append that loses the continuation state restores from the prompt tail: the
    continuation is worth at most the tokens between the two. Once it is gone the tail takes
    the append's share, worth at most what the tail saves over the session's checkpoint before
    it, and most of that: every request of this session appended."""
    planner = CheckpointPlanner()
    store = PrefixStore(planner)
    history = [message("system", text(1, 200)), message("user", text(2, 40))]
    for turn in range(3):
        prompt, output = request(history, text(10 + turn, 12))
        store.serve("appends", prompt, output)
        history += [message("assistant", text(10 + turn, 12)), message("user", text(20 + turn, 30))]
    continuation = latest_continuation(planner, "appends")
    end = planner.records[continuation].depth
    tail_depth = len(prompt) - 1
    [tail] = [c for c, r in planner.records.items() if r.purpose is Purpose.PROMPT_TAIL and r.depth == tail_depth]
    assert 0.0 < planner.value(continuation, end) <= end - tail_depth
    tail_before = planner.value(tail, tail_depth)
    planner.forget([continuation])
    below = max(depth for depth in planner.sessions["appends"].on_path.values() if depth < tail_depth)
    assert 0.5 * (tail_depth - below) < planner.value(tail, tail_depth) <= tail_depth - below
    assert planner.value(tail, tail_depth) > tail_before


def test_superseded_and_bypassed_checkpoints_are_worth_nothing():
    calls = last_n_session(8)
    planner = CheckpointPlanner()
    store = PrefixStore(planner)
    for prompt, output in calls[:-1]:
        store.serve("swe", prompt, output)
    current = latest_continuation(planner, "swe")
    old_continuations = [slot for slot, record in planner.records.items()
                         if record.purpose is Purpose.CONTINUATION and slot != current]
    assert old_continuations
    for slot in old_continuations:
        assert planner.value(slot, planner.records[slot].depth) == 0.0
    assert planner.value(current, planner.records[current].depth) > 0.0
    # A slot the planner does not know, or knows at another depth, is evicted first.
    assert planner.value(CheckpointId.device(10_000), 5) == 0.0
    assert planner.value(current, planner.records[current].depth + 1) == 0.0


DETERMINISM_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from test_planner import CheckpointPlanner, PrefixStore, last_n_session, reasoning_session
    planner = CheckpointPlanner()
    store = PrefixStore(planner, budget=8)
    streams = {{"swe-" + str(i): last_n_session(6, tag=1000 * i) for i in range(3)}}
    streams["qwen3"] = reasoning_session(3)
    out = []
    for step in range(6):
        for name, calls in streams.items():
            if step < len(calls):
                plan, restored = store.serve(name, *calls[step])
                out.append([name, restored, [(c.depth, int(c.purpose), round(c.value, 9)) for c in plan.checkpoints]])
        out.append(sorted((list(c), round(planner.value(c, r.depth), 9)) for c, r in planner.records.items()))
    print(json.dumps(out))
""")


def test_decisions_are_a_function_of_the_request_stream_only():
    """Two processes with different string-hash seeds (as two TP ranks) plan identically."""
    script = DETERMINISM_SCRIPT.format(tests=os.path.dirname(__file__))
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        outputs.append(json.loads(result.stdout))
    assert outputs[0] == outputs[1]
    assert any(entry[2] for entry in outputs[0] if isinstance(entry[0], str))


def test_the_uses_of_one_popular_shared_checkpoint_do_not_raise_the_worth_of_new_content():
    """A fresh shared-path message start is worth its span at the rate such checkpoints are
    followed by other sessions, counted once per checkpoint: that every session restores
    from one of them (the system prompt's end) is that checkpoint's own value, not a sign
    that sessions follow each other's new content."""
    system = message("system", text(1, 60))

    def own_messages(tag: int) -> list[list[int]]:
        # Long enough that a fresh message start is worth its capture.
        return [message("user" if i % 2 == 0 else "assistant", text(tag + i, 200)) for i in range(6)]

    def fresh_worth_per_token(followers: int) -> tuple[float, int]:
        planner = CheckpointPlanner()
        store = PrefixStore(planner)
        store.serve("leader", *request([system, *own_messages(100)], text(99, 5)))
        for follower in range(followers):
            # No checkpoints of their own (not even a branch): they restore the leader's.
            prompt, output = request([system, *own_messages(200 + 100 * follower)], text(98, 5))
            _, restored = store.serve(f"follower-{follower}", prompt, output,
                                      hint=validate_hints("none", len(prompt), 8))
            assert restored == len(system)
        prompt, output = request([system, *own_messages(5000)], text(97, 5))
        plan, _ = store.serve("new", prompt, output)
        starts = DETECTOR.detect(prompt).of_kind(AnchorKind.MESSAGE_START).tolist()
        spans = {depth: depth - previous for previous, depth in zip(starts, starts[1:])}
        worth = max(c.value / spans[c.depth] for c in plan.checkpoints
                    if c.purpose is Purpose.SHARED_PATH and c.depth > len(system))
        system_end = next(checkpoint for checkpoint, record in planner.records.items()
                          if record.depth == len(system) and record.session == "leader")
        return worth, planner.records[system_end].uses

    once, used_once = fresh_worth_per_token(1)
    often, used_often = fresh_worth_per_token(6)
    assert (used_once, used_often) == (2, 7)  # the followers and the new session
    assert once > 0.0 and often == pytest.approx(once)


def test_a_full_pool_does_not_trade_message_starts_for_fresher_ones_worth_less_than_a_capture():
    """Every request computing new content proposes its message starts for sessions that may
    follow it; unfollowed, each is worth a fraction of a token, fading as it ages. A fresh one
    is always worth a little more than an older one, but taking it costs a capture (a few
    prefill tokens): with the pool full of them, the next requests' message starts do not
    displace them, while an own checkpoint worth more than the least valuable held still does."""
    system = message("system", text(1, 40))
    planner = CheckpointPlanner()
    store = PrefixStore(planner, budget=24, evict=True)

    def fresh_prompt(tag: int) -> tuple[np.ndarray, np.ndarray]:
        return request([system, *(message("user" if i % 2 == 0 else "assistant", text(tag + i, 40))
                                  for i in range(12))], text(tag + 99, 5))

    for tag in range(0, 20_000, 1000):
        store.serve(f"s{tag}", *fresh_prompt(tag))
    assert len(store.checkpoints) == store.budget
    for tag in range(20_000, 24_000, 1000):
        plan, _ = store.serve(f"s{tag}", *fresh_prompt(tag))
        shared = [c for c in plan.checkpoints if c.purpose is Purpose.SHARED_PATH]
        assert shared == [], shared
        assert Purpose.PROMPT_TAIL in {c.purpose for c in plan.checkpoints}


def test_a_masking_window_not_yet_full_predicts_its_first_observation_ahead():
    """Sessions that mask all but their last ``keep`` observations taught the planner the
    rule (the n-th observation from the end); a new session holding fewer observations has
    no n-th one yet, but once its window fills the rule names its first observation. That
    point is predicted before then, its share divided by the requests until the edit."""
    keep, planner = 3, CheckpointPlanner()
    store = PrefixStore(planner)
    for tag in (0, 10_000, 20_000):
        for prompt, output in last_n_session(8, keep=keep, tag=tag):
            store.serve(f"trained-{tag}", prompt, output)
    calls = last_n_session(8, keep=keep, tag=30_000)
    masks_first = keep + 1  # the first request that masks an observation
    before = np.concatenate([calls[masks_first - 1][0], calls[masks_first - 1][1][:-1]])
    first_observation = divergence(calls[masks_first][0], before) - TOOL_RESULT_HEADER
    predicted = []
    for step, (prompt, output) in enumerate(calls[: masks_first + 1]):
        store.serve("young", prompt, output)
        if step < masks_first and first_observation < len(prompt):
            predicted.append(planner.sessions["young"].predictions.get(first_observation, 0.0))
    # Predicted from the first observation on, more as the window fills.
    assert len(predicted) == keep and 0.0 < predicted[0] < predicted[1] < predicted[2], predicted


def test_an_address_right_only_alongside_the_rule_loses_its_share():
    """Several addresses name an edit point; where they agree they share its credit, but once
    one has been right alone it takes the credit of the points they name together: an address
    that is right only when it coincides with the rule (the first answer counted from the
    start, when the edit re-renders the last answer) keeps no share, so where the two disagree
    the rule's point is predicted, not the other's."""
    def sequence(answers: int) -> tuple[AnchorIndex, int]:
        history = [message("system", text(1, 40))]
        for i in range(answers):
            history += [message("user", text(10 + i, 20)), message("assistant", text(50 + i, 8))]
        prompt, _ = request(history, [])
        anchors = DETECTOR.detect(prompt)
        last_answer = int(anchors.of_kind(AnchorKind.MESSAGE_START)[-2])  # the last: the generation prompt
        return AnchorIndex(anchors, len(prompt)), last_answer

    (one, first_answer), (two, last_answer) = sequence(1), sequence(2)
    assert first_answer < last_answer
    model = EditModel(capacity=32, learning_rate=0.3)
    for _ in range(2):
        model.observe(one, first_answer, None)  # every description of the point agrees
    model.observe(two, last_answer, None)  # the first answer's descriptions are wrong alone
    for _ in range(3):
        model.observe(one, first_answer, None)
    predicted = model.predict(two, limit=6)
    assert predicted.get(first_answer, 0.0) < 0.05, predicted
    assert predicted[last_answer] > 0.5, predicted


def test_a_message_window_is_addressed_by_message_rank_inside_the_message():
    """The tool result of the n-th message from the end: named where that message holds one,
    nowhere where it does not, whatever the roles of the messages after it."""
    history = [message("system", text(1, 40)), message("user", text(2, 20))]
    for i, role in enumerate(["tool", "user", "tool", "tool"]):
        history += [message("assistant", text(50 + i, 8)), message(role, text(100 + i, 30))]
    prompt, _ = request(history, [])
    anchors = DETECTOR.detect(prompt)
    index = AnchorIndex(anchors, len(prompt))
    starts = anchors.of_kind(AnchorKind.MESSAGE_START)  # the last one opens the generation prompt
    tool_results = anchors.of_kind(AnchorKind.TOOL_RESULT_START)
    kind, role = int(AnchorKind.TOOL_RESULT_START), int(Role.TOOL)
    for rank, message_start in enumerate(starts[::-1].tolist(), start=1):
        inside = [int(p) for p in tool_results if message_start <= p < message_start + 10]
        assert index.position_of((IN_MESSAGE_FROM_END, kind, role, rank)) == (inside[0] if inside else None)
    fourth = index.position_of((IN_MESSAGE_FROM_END, kind, role, 4))
    assert fourth is not None
    assert (IN_MESSAGE_FROM_END, kind, role, 4) in index.addresses_of(fourth + TOOL_RESULT_HEADER)


def test_a_message_window_predicts_the_observations_it_masks_in_later_requests():
    """A window of the last N messages masks an observation requests after the prefill that
    computed it, and only a checkpoint taken then can serve that edit: once the rule is
    learned, a request predicts the observations its window will mask in the next requests,
    the sooner the likelier."""
    steps, learned = 24, 16
    calls = window_masking_session(steps)
    store = PrefixStore(CheckpointPlanner())
    for prompt, output in calls[:learned]:
        store.serve("oh", prompt, output)
    predictions = store.planner.sessions["oh"].predictions
    prompt = calls[learned - 1][0].tolist()

    def tool_result_at(tokens: list[int], observation: int) -> Optional[int]:
        content = text(100 + observation, 30)
        for position in range(len(tokens) - len(content) + 1):
            if tokens[position: position + len(content)] == content:
                return position - TOOL_RESULT_HEADER
        return None

    # The observations the next requests mask, by where their tool results are now.
    masked_later = []
    for step in range(learned, learned + 4):
        for observation in range(step):
            before, after = (tool_result_at(calls[s][0].tolist(), observation) for s in (step - 1, step))
            if before is not None and after is None:
                masked_later.append(tool_result_at(prompt, observation))
    assert len(masked_later) >= 2 and None not in masked_later, masked_later
    soonest_first = [predictions.get(point, 0.0) for point in masked_later]
    assert all(p > 0.0 for p in soonest_first), (masked_later, predictions)
    assert soonest_first == sorted(soonest_first, reverse=True), soonest_first
