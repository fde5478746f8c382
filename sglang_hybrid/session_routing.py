"""Data-parallel replicas (``--dp-size N``): a session's requests go to the replica holding
its checkpoints.

Each DP replica has its own tree and checkpoint pool, so a session's cache is on the replica
that served its previous turn. None of SGLang's ``--load-balance-method`` values keeps a
session on one replica (``round_robin`` sends consecutive turns to different ones), but every
one of them first honours a rank the request names itself (``routed_dp_rank`` on
``/generate``, the ``X-Data-Parallel-Rank`` header on the OpenAI routes), in
``DataParallelController.maybe_external_dp_rank_routing``. Around that method a request that
names a ``checkpoint_session`` in its ``custom_params`` and no rank is given the session's
rank: the active replica that ranks highest for the session by rendezvous hashing (blake2b of
session and rank). The choice depends on nothing but the session and the set of active
replicas, so it is the same for every turn, in every controller process and after a restart;
when a replica leaves, only its own sessions move. A rank the request names wins. With
``--load-balance-method follow_bootstrap_room`` (prefill-decode disaggregation, where the
rank must follow the bootstrap room) sessions are not routed.

In front of several single-replica servers ``sglang-router`` does the same with
``--policy manual`` and the ``X-SMG-Routing-Key`` header (docs/serving.md).
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

from sglang_hybrid.anchors.hints import SESSION_PARAM

DP_DISPATCH_TARGET = (
    "sglang.srt.managers.data_parallel_controller.DataParallelController.maybe_external_dp_rank_routing"
)


def session_dp_rank(session: str, active_ranks: Sequence[int]) -> int:
    """The replica of ``session`` among ``active_ranks`` (rendezvous hashing)."""
    if not active_ranks:
        raise ValueError("no active data-parallel rank to route a session to")
    return max(active_ranks, key=lambda rank: _weight(session, rank))


def _weight(session: str, rank: int) -> bytes:
    return hashlib.blake2b(f"{session}\0{rank}".encode(), digest_size=8).digest()


def request_session(req: Any) -> Optional[str]:
    """The ``checkpoint_session`` a tokenized request carries, if it is a usable one."""
    custom_params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if not isinstance(custom_params, dict):
        return None
    session = custom_params.get(SESSION_PARAM)
    return session if isinstance(session, str) and session else None


def _route_session_to_its_replica(original, controller, req):
    from sglang.srt.managers.data_parallel_controller import LoadBalanceMethod

    if (
        getattr(req, "routed_dp_rank", None) is None
        and controller.load_balance_method != LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM
        and controller._active_workers
    ):
        session = request_session(req)
        if session is not None:
            req.routed_dp_rank = session_dp_rank(session, controller._active_workers)
    return original(controller, req)


def install_session_routing_hook() -> None:
    """Register, in this process, session routing on SGLang's DP dispatch; effective once
    SGLang's ``load_plugins`` applies hooks (the DP controller process calls it)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(DP_DISPATCH_TARGET, _route_session_to_its_replica, HookType.AROUND)
