"""Which checkpoints a request's prefill captures, and which forward captures them.

``AnchorCapture`` is the one place where the planner meets the cache, for the server and the
replay alike: at a request's first prefill forward it detects the prompt's anchors, asks the
configured planner for depths, takes a checkpoint slot per depth from the cache (which may
evict one) and stages it there (``SemanticStateCache.stage_checkpoint``): the cache attaches
a staged slot to the tree once the request's KV reaches its depth, or frees it if the request
ends before. When the request finishes, the planner learns which slot holds its
generation-end state.

In a server, every prefill forward then asks ``queries_for_forward`` which of the staged
depths fall inside the tokens it computes (chunked prefill spreads one request over several
forwards); the model's recurrent layers write the states at those positions into the staged
slots during that same forward (``runtime/gdn_hooks.py``). The replay has no forward: it
only checks where checkpoints land.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from sglang_hybrid.anchors.detector import AnchorDetector, AnchorKind
from sglang_hybrid.anchors.hints import HintMode, ValidatedHint
from sglang_hybrid.anchors.planner import CheckpointPlanner, Purpose, RequestContext

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from sglang_hybrid.cache.semantic_cache import SemanticStateCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureQueries:
    """States one forward must write: sequence ``seq[i]`` of the batch, after ``pos[i]`` of
    the tokens it computes in this forward, into checkpoint slot ``slots[i]``."""

    seq: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    # Per sequence of the batch, to check the forward is the one these were planned for.
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.seq.shape[0])


class AnchorCapture:
    """Plans in-prefill checkpoints with ``mode`` ("adaptive", "messages" or "none") and
    stages them in ``cache``.

    ``planner`` is required for "adaptive"; with ``evict_by_value`` it is also installed as
    the cache's ``eviction_scorer`` (expected saving instead of recency). The other modes
    take no learning. The planner keeps its records by checkpoint slot, so it follows the
    checkpoints the cache moves between tiers.
    """

    def __init__(
        self,
        cache: "SemanticStateCache",
        detector: AnchorDetector,
        mode: str,
        planner: Optional[CheckpointPlanner] = None,
        evict_by_value: bool = True,
    ):
        if mode == "adaptive" and planner is None:
            raise ValueError("the adaptive checkpoint planner needs a CheckpointPlanner")
        self.cache = cache
        self.detector = detector
        self.mode = mode
        self.planner = planner
        if planner is not None:
            cache.on_checkpoint_moved = planner.move_record
            if evict_by_value:
                cache.eviction_scorer = planner.eviction_score
        # rid -> (depth, slot) staged for it and not yet captured by a forward; a request
        # is in the dict from its first prefill forward until it leaves (``release``).
        self._uncaptured: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._sessions: dict[str, str] = {}  # rid -> planner session
        self._pending_queries: Optional[CaptureQueries] = None
        self._layers_captured: set[int] = set()

    # ---- planning ----

    def plan_request(
        self,
        req: "Req",
        *,
        session: str,
        prompt: np.ndarray,
        restored_slot: Optional[int],
        hint: Optional[ValidatedHint],
    ) -> list[tuple[int, torch.Tensor]]:
        """Stage the checkpoints ``req`` gets; return their (depth, slot), by depth.

        Planned from what a server knows at a request's first prefill forward: its prompt and
        the tree, not its output. Slots run out quietly: a request is never failed for want
        of a checkpoint.
        """
        restored = int(req.prefix_len)
        wanted = self._wanted_depths(session, prompt, restored, restored_slot, hint)
        staged: list[tuple[int, torch.Tensor]] = []
        for depth, purpose in wanted:
            slot = self.cache.alloc_checkpoint_slot()
            if slot is None:
                break
            self.cache.stage_checkpoint(req, depth, slot)
            if self.planner is not None:
                self.planner.record_checkpoint(int(slot), session, depth, purpose)
            staged.append((depth, slot.view(-1)))
        return staged

    def _wanted_depths(self, session, prompt, restored, restored_slot, hint):
        prompt_len = int(prompt.shape[0])
        if self.planner is not None:
            # The adaptive planner weighs a client's hint together with its own candidates.
            lcp, held = self.cache.checkpoints_on_path(prompt)
            plan = self.planner.plan(RequestContext(
                session=session,
                prompt_ids=prompt,
                anchors=self.detector.detect(prompt),
                tree_lcp=lcp,
                held_depths=[depth for depth, _ in held],
                restored_depth=restored,
                restored_slot=restored_slot,
                free_slots=self.cache.checkpoint_pool.available_size(),
                hint=hint,
            ))  # fmt: skip
            return [(c.depth, c.purpose) for c in plan.checkpoints]
        mode = hint.mode if hint is not None else None
        if mode is HintMode.NONE or (mode is None and self.mode == "none"):
            return []
        if mode is HintMode.EXPLICIT:
            depths = hint.positions.tolist()
        elif mode is HintMode.MESSAGES or self.mode == "messages":
            anchors = self.detector.detect(prompt)
            depths = np.unique(anchors.of_kind(AnchorKind.MESSAGE_START)).tolist()
        else:
            return []
        return [(int(d), Purpose.HINT) for d in depths if restored < d <= prompt_len]

    def session_of_restore(self, restored_slot: Optional[int]) -> Optional[str]:
        """The session whose checkpoint a request restored: a server's requests carry no
        session id, and an agent's next call continues from its previous call's state."""
        if self.planner is None or restored_slot is None:
            return None
        record = self.planner.records.get(int(restored_slot))
        return record.session if record is not None else None

    def request_finished(self, session: str, cached_tokens: Sequence[int], prompt_len: int) -> None:
        """Tell the planner what the request left in the tree (``cached_tokens``: its prompt of
        ``prompt_len`` tokens and the output its final state covers), which slot holds the
        state after it, and which slots the pool no longer holds."""
        if self.planner is None or session not in self.planner.sessions:
            return
        tokens = np.asarray(cached_tokens, dtype=np.int64)
        anchors = self.detector.detect(tokens[:prompt_len], tokens[prompt_len:])
        self.planner.request_finished(session, tokens, anchors)
        slot = self.cache.checkpoint_slot_at(tokens)
        if slot is not None:
            self.planner.record_checkpoint(slot, session, len(tokens), Purpose.CONTINUATION)
        self.planner.forget_slots(self.cache.free_checkpoint_keys())

    # ---- per forward (server) ----

    def prepare_forward(
        self,
        reqs: Sequence["Req"],
        restored_slots: Sequence[Optional[int]],
        hints: Sequence[Optional[ValidatedHint]],
        sessions: Sequence[Optional[str]],
    ) -> None:
        """Plan requests seen for the first time, and set the queries of the next prefill
        forward, which computes tokens [req.prefix_len, req.extend_end) of every request in
        ``reqs`` (the order of the forward's sequences). A request's session is the one its
        client named, else the one whose checkpoint it restored, else its own."""
        seq, pos, slots = [], [], []
        for index, (req, restored_slot, hint, session) in enumerate(
            zip(reqs, restored_slots, hints, sessions)
        ):
            if req.rid not in self._uncaptured:
                session = session or self.session_of_restore(restored_slot) or req.rid
                prompt = np.asarray(req.origin_input_ids, dtype=np.int64)
                self._uncaptured[req.rid] = self.plan_request(
                    req, session=session, prompt=prompt, restored_slot=restored_slot, hint=hint,
                )
                self._sessions[req.rid] = session
            start, length = int(req.prefix_len), int(req.extend_len)
            remaining = []
            for depth, slot in self._uncaptured[req.rid]:
                if start < depth <= start + length:
                    seq.append(index)
                    pos.append(depth - start)
                    slots.append(slot)
                elif depth > start + length:
                    remaining.append((depth, slot))
                else:
                    # Planned depths lie past the restored prefix, and forwards advance
                    # monotonically, so a depth at or before this forward's start was missed.
                    raise RuntimeError(
                        f"request {req.rid}: checkpoint at depth {depth} planned but its "
                        f"forward (from {start}) has passed it"
                    )
            self._uncaptured[req.rid] = remaining
        self._layers_captured.clear()
        if not seq:
            self._pending_queries = None
            return
        device = slots[0].device
        self._pending_queries = CaptureQueries(
            seq=torch.tensor(seq, dtype=torch.int32, device=device),
            pos=torch.tensor(pos, dtype=torch.int32, device=device),
            slots=torch.cat(slots).to(torch.int32),
            prefix_lens=tuple(int(r.prefix_len) for r in reqs),
            extend_lens=tuple(int(r.extend_len) for r in reqs),
        )

    def queries_for_forward(self, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> Optional[CaptureQueries]:
        """The captures of the prefill forward now running (None: nothing to capture)."""
        queries = self._pending_queries
        if queries is None:
            return None
        num_seqs = len(queries.prefix_lens)
        if (
            tuple(int(p) for p in prefix_lens[:num_seqs]) != queries.prefix_lens
            or tuple(int(n) for n in extend_lens[:num_seqs]) != queries.extend_lens
        ):
            raise RuntimeError(
                "the prefill forward does not match the batch its checkpoints were planned "
                f"for: prefix lengths {list(prefix_lens)} vs {list(queries.prefix_lens)}"
            )
        return queries

    def layer_captured(self, layer_index: int) -> None:
        """Recurrent layer ``layer_index`` wrote the current forward's captures; once every
        layer has, the queries are spent and no later forward can write them again."""
        self._layers_captured.add(layer_index)
        if len(self._layers_captured) == self.cache.checkpoint_pool.layout.num_layers:
            self._pending_queries = None

    def release(self, req: "Req") -> Optional[str]:
        """Forget ``req`` (its staged slots are the cache's to free); return its session."""
        self._uncaptured.pop(req.rid, None)
        return self._sessions.pop(req.rid, None)
