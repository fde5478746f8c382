"""AnchorPlanning: the semantic cache's ``CheckpointPlanning``, from anchors and a mode.

Built by the backend factory from the config (``plugin.py``) and given to the cache at
construction; the cache makes every call (``cache/planning.py``). Per request it detects the
prompt's anchors and picks depths by ``mode``:

* ``adaptive``: the ``CheckpointPlanner`` weighs the client's hint with its own candidates
  (learned edit points, branch points, shared paths), values held checkpoints for eviction
  when ``evict_by_value``, and learns from what each finished request left in the tree;
* ``messages``: every message start past the restored prefix, as slots allow;
* ``none``: nothing but what the client's hint asks for.

A request belongs to the session its client named, else to the session whose checkpoint it
restored (an agent's next call continues from its previous call's state), else to itself.
Of depths closer than ``MIN_CAPTURE_SPACING`` to each other only one is planned, the one the
planner values most (else the shallower, which an edit past it can still use): the other
would save fewer tokens than the spacing, and the prefill's capture bounds how many share a
chunk.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Optional, Sequence

import numpy as np

from sglang_hybrid.anchors.detector import AnchorDetector, AnchorKind, Anchors
from sglang_hybrid.anchors.hints import HintMode
from sglang_hybrid.planning.planner import CheckpointPlanner
from sglang_hybrid.planning.ends import closing_of
from sglang_hybrid.planning.state import PromptDigests, Purpose, RequestContext
from sglang_hybrid.cache.planning import CheckpointId, RequestToPlan
from sglang_hybrid.kernels import MIN_CAPTURE_SPACING


class AnchorPlanning:
    def __init__(
        self,
        detector: AnchorDetector,
        mode: str,
        planner: Optional[CheckpointPlanner] = None,
        evict_by_value: bool = True,
    ):
        if (mode == "adaptive") != (planner is not None):
            raise ValueError("the adaptive mode, and only it, plans with a CheckpointPlanner")
        self.detector = detector
        self.mode = mode
        self.planner = planner
        self.evicts_by_value = planner is not None and evict_by_value
        # rid -> session, depth -> purpose of what was planned for it, and (adaptive) its
        # prompt's anchors and digests, until it leaves.
        self._sessions: dict[str, str] = {}
        self._purposes: dict[str, dict[int, Purpose]] = {}
        self._prompt_anchors: dict[str, Anchors] = {}
        self._prompt_digests: dict[str, PromptDigests] = {}

    def plan(self, request: RequestToPlan) -> list[int]:
        session = request.session or self._session_of(request.restored) or request.rid
        self._sessions[request.rid] = session
        wanted = _spaced(self._wanted(session, request))
        self._purposes[request.rid] = {depth: purpose for depth, purpose, _ in wanted}
        return [depth for depth, _, _ in wanted]

    def _wanted(self, session: str, request: RequestToPlan) -> list[tuple[int, Purpose, float]]:
        """(depth, purpose, value): the planner's expected saving, 0 for the other modes."""
        hint = request.hint
        prompt_len = int(request.prompt.shape[0])
        if self.planner is not None:
            # The adaptive planner weighs a client's hint together with its own candidates.
            anchors = self._prompt_anchors[request.rid] = self.detector.detect(request.prompt)
            plan = self.planner.plan(RequestContext(
                session=session,
                prompt_ids=request.prompt,
                anchors=anchors,
                tree_lcp=request.tree_lcp,
                held_depths=request.held_depths,
                restored_depth=request.restored_depth,
                restored=request.restored,
                free_slots=request.free_slots,
                pool_slots=request.pool_slots,
                hint=hint,
                namespace=request.namespace,
            ))  # fmt: skip
            self._prompt_digests[request.rid] = plan.prompt_digests
            return [(c.depth, c.purpose, c.value) for c in plan.checkpoints]
        mode = hint.mode if hint is not None else None
        if mode is HintMode.NONE or (mode is None and self.mode == "none"):
            return []
        if mode is HintMode.EXPLICIT:
            depths = hint.positions.tolist()
        elif mode is HintMode.MESSAGES or self.mode == "messages":
            depths = np.unique(self.detector.detect(request.prompt).of_kind(AnchorKind.MESSAGE_START)).tolist()
        else:
            return []
        return [(int(d), Purpose.HINT, 0.0) for d in depths if request.restored_depth < d <= prompt_len]

    def _session_of(self, restored: Optional[CheckpointId]) -> Optional[str]:
        if self.planner is None or restored is None:
            return None
        record = self.planner.records.get(restored)
        return record.session if record is not None else None

    def staged(self, rid: str, depth: int, checkpoint: CheckpointId) -> None:
        session = self._sessions[rid]
        # A session forgotten while its request ran (``FORGET_AFTER_GAPS``) has no record to
        # add to: the checkpoint stays unvalued, the first to go.
        if self.planner is not None and session in self.planner.sessions:
            self.planner.record_checkpoint(checkpoint, session, depth, self._purposes[rid][depth])

    def value(self, checkpoint: CheckpointId, depth: int) -> float:
        return self.planner.value(checkpoint, depth)

    def device_values(self, num_slots: int) -> np.ndarray:
        return self.planner.device_values(num_slots)

    def moved(self, old: CheckpointId, new: CheckpointId) -> None:
        if self.planner is not None:
            self.planner.move_record(old, new)

    def evicted(self, checkpoint: CheckpointId) -> None:
        if self.planner is not None:
            self.planner.forget([checkpoint])

    def finished(
        self,
        rid: str,
        cached: np.ndarray,
        prompt_len: int,
        end: Optional[CheckpointId],
        free: Sequence[CheckpointId],
    ) -> None:
        if self.planner is None:
            return
        session = self._sessions.get(rid)
        # A session forgotten while its request ran learns nothing from it (``staged``).
        if session is not None and session in self.planner.sessions:
            output = cached[prompt_len:]
            planned = self._prompt_anchors.get(rid)
            if planned is not None and cached.shape[0] >= prompt_len:
                anchors = self.detector.detect_continuation(planned, cached[:prompt_len], output)
            else:
                anchors = self.detector.detect(cached[:prompt_len], output)
            self.planner.request_finished(session, cached, anchors, self.detector.output_ending(output),
                                          closing_of(output), self._prompt_digests.get(rid))
            if end is not None:
                self.planner.record_checkpoint(end, session, len(cached), Purpose.CONTINUATION)
        self.planner.forget(free)

    def session_ended(self, session: str) -> None:
        if self.planner is not None:
            self.planner.end_session(session)

    def released(self, rid: str) -> None:
        self._sessions.pop(rid, None)
        self._purposes.pop(rid, None)
        self._prompt_anchors.pop(rid, None)
        self._prompt_digests.pop(rid, None)


def _spaced(wanted: list[tuple[int, Purpose, float]]) -> list[tuple[int, Purpose, float]]:
    """``wanted`` by depth, without a depth within ``MIN_CAPTURE_SPACING`` of one worth more
    (of equal worth: of a shallower one)."""
    kept: list[tuple[int, Purpose, float]] = []
    kept_depths: list[int] = []  # ascending
    for candidate in sorted(wanted, key=lambda item: (-item[2], item[0])):
        depth = candidate[0]
        at = bisect_left(kept_depths, depth)
        near = kept_depths[max(at - 1, 0): at + 1]
        if all(abs(depth - other) >= MIN_CAPTURE_SPACING for other in near):
            kept.append(candidate)
            kept_depths.insert(at, depth)
    return sorted(kept, key=lambda item: item[0])
