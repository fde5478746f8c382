"""Which checkpoints a request's prefill captures, and which forward captures them.

``plan_around_prepare`` wraps the step before a prefill forward, for the server (SGLang's
``prepare_for_extend``, ``runtime/hooks.py``) and for a request served outside one
(``harness/lifecycle.py``) alike. It reads, before the step forgets it, the checkpoint each
restored request continues from; after the step (``prepare_forward``), a request in its first
prefill forward gets its checkpoints
planned and staged by the cache (``SemanticStateCache.plan_checkpoints``, with the hint and
session its request carries), and every request of the forward gets, as capture queries,
its staged depths that fall inside the tokens this forward computes (chunked prefill spreads
one request over several forwards). The cache attaches a staged slot to the tree once the
request's KV reaches its depth, or frees it if the request ends before.

In a server, the model's recurrent layers then write the states at those positions into the
staged slots during that same forward (``runtime/hooks.py``), reading the queries with
``queries_for_forward``: indexed once for all the forward's layers (``CaptureIndex``). The
queries belong to the checkpoint pool the forward writes into, so caches in one process
(tests, the replay's budgets) never see each other's.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence, TypeVar

from sglang_hybrid.anchors.hints import RequestHints
from sglang_hybrid.cache.semantic_cache import SemanticStateCache
from sglang_hybrid.kernels import CaptureIndex

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from sglang_hybrid.cache.checkpoint_pool import StateCheckpointPool
    from sglang_hybrid.cache.planning import CheckpointId


T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureQueries:
    """States one forward must write, indexed for its kernels."""

    index: CaptureIndex
    # Per sequence of the batch, to check the forward is the one these were planned for.
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.index)


@dataclass
class _NextForward:
    queries: Optional[CaptureQueries] = None
    layers_captured: set[int] = field(default_factory=set)


# Checkpoint pool -> the captures of the next prefill forward writing into it.
_next_forward: "weakref.WeakKeyDictionary[StateCheckpointPool, _NextForward]" = weakref.WeakKeyDictionary()


def plan_around_prepare(
    tree_cache, reqs: Sequence["Req"], prepare: Callable[[], T]
) -> tuple[T, Optional[CaptureQueries]]:
    """Run ``prepare``, the step before the prefill forward of ``reqs`` (it queues or runs the
    copy of each restored checkpoint into its request's live slot), with the checkpoint
    planning around it; return its result and the forward's captures. A tree cache that plans
    no checkpoints only runs ``prepare``."""
    if not isinstance(tree_cache, SemanticStateCache) or tree_cache.planning is None:
        return prepare(), None
    restored = [tree_cache.restore_source(req) for req in reqs]
    result = prepare()
    return result, prepare_forward(tree_cache, reqs, restored)


def prepare_forward(
    cache: "SemanticStateCache", reqs: Sequence["Req"], restored: Sequence[Optional["CheckpointId"]]
) -> Optional[CaptureQueries]:
    """Plan the requests of ``reqs`` seen for the first time (``restored``: what each one's
    admission restored, ``SemanticStateCache.restore_source``), and set the captures of the
    next prefill forward, which computes tokens [req.prefix_len, req.extend_end) of every
    request in ``reqs`` (the order of the forward's sequences). Returns those captures."""
    seq, pos, slots = [], [], []
    for index, (req, source) in enumerate(zip(reqs, restored)):
        if not cache.has_planned(req):
            _plan(cache, req, source)
        start, length = int(req.prefix_len), int(req.extend_len)
        # Planned depths lie past the restored prefix and forwards advance monotonically, so
        # a staged depth at or before this forward's start was captured by an earlier one.
        for depth, checkpoint in cache.staged_checkpoints(req):
            if start < depth <= start + length:
                seq.append(index)
                pos.append(depth - start)
                slots.append(checkpoint.slot)
    pool = cache.checkpoint_pool
    queries = None
    if seq:
        prefix_lens = tuple(int(r.prefix_len) for r in reqs)
        extend_lens = tuple(int(r.extend_len) for r in reqs)
        index = CaptureIndex.build(
            extend_lens, [n > 0 for n in prefix_lens], seq, pos, slots, device=pool.device
        )
        queries = CaptureQueries(index, prefix_lens, extend_lens)
    _next_forward[pool] = _NextForward(queries)
    return queries


def _plan(cache: "SemanticStateCache", req: "Req", restored: Optional["CheckpointId"]) -> None:
    """Plan and stage ``req``'s checkpoints. This runs in SGLang's scheduler, where an
    exception stops the server: a request our planning fails on is served without
    in-prefill checkpoints instead, and the failure logged."""
    try:
        hints = RequestHints.of(req.sampling_params.custom_params, len(req.origin_input_ids))
        cache.plan_checkpoints(req, restored=restored, hint=hints.hint, session=hints.session)
    except Exception:
        logger.exception(
            "semantic state cache: planning the checkpoints of request %s failed; it is "
            "served without in-prefill checkpoints",
            req.rid,
        )
        cache.abandon_checkpoints(req)


def queries_for_forward(
    pool: "StateCheckpointPool", prefix_lens: Sequence[int], extend_lens: Sequence[int]
) -> Optional[CaptureQueries]:
    """The captures of the prefill forward now running into ``pool`` (None: nothing to
    capture)."""
    forward = _next_forward.get(pool)
    queries = forward.queries if forward is not None else None
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


def layer_captured(pool: "StateCheckpointPool", layer_index: int) -> None:
    """Recurrent layer ``layer_index`` wrote the current forward's captures into ``pool``;
    once every layer has, the queries are spent and no later forward can write them again."""
    forward = _next_forward[pool]
    forward.layers_captured.add(layer_index)
    if len(forward.layers_captured) == pool.layout.num_layers:
        forward.queries = None
