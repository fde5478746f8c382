"""What several SGLang ranks (``--dp-size``, ``--tp-size``, ``--pp-size``) need on a host
without CUDA, set by ``sglang-hybrid launch`` where the user has not.

* ``SGLANG_CPU_OMP_THREADS_BIND``: on a CPU device SGLang binds each rank to a NUMA node and
  asserts there are as many nodes as ranks unless this names each rank's cores
  (``"0|1"``: rank 0 on core 0, rank 1 on core 1). The host's usable cores are split
  evenly; with fewer cores than ranks, ranks share them.
* ``SGLANG_NCCL_SO_PATH``: the CUDA build of torch makes SGLang load NCCL for its groups,
  which then fail with "Expected a cuda device". A path to no library makes that load fail
  (SGLang logs it as expected off NVIDIA GPUs) and the groups run over gloo.

A host with CUDA, one rank, or a variable already set: nothing is changed.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
NCCL_LIBRARY_ENV = "SGLANG_NCCL_SO_PATH"
# No such library exists: loading it fails and SGLang's groups fall back to gloo.
NO_NCCL_LIBRARY = "sglang-hybrid-no-nccl-on-a-cpu-host.so"


def threads_bind(num_ranks: int, cpus: Sequence[int]) -> str:
    """Each rank's cores, ``|``-separated in rank order: ``cpus`` split evenly."""
    if num_ranks < 1 or not cpus:
        raise ValueError(f"need at least one rank and one core, got {num_ranks} ranks and cores {list(cpus)}")
    cpus = sorted(cpus)
    if len(cpus) < num_ranks:
        groups = [[cpus[rank % len(cpus)]] for rank in range(num_ranks)]
    else:
        per_rank, extra = divmod(len(cpus), num_ranks)
        groups, start = [], 0
        for rank in range(num_ranks):
            end = start + per_rank + (rank < extra)
            groups.append(cpus[start:end])
            start = end
    return "|".join(",".join(map(str, group)) for group in groups)


def cpu_parallel_env(
    num_ranks: int, environ: Mapping[str, str], *, cuda_available: bool, cpus: Sequence[int]
) -> dict[str, str]:
    """The variables to add to ``environ`` so that ``num_ranks`` SGLang ranks start here."""
    if cuda_available or num_ranks <= 1:
        return {}
    added = {}
    if not environ.get(THREADS_BIND_ENV):
        added[THREADS_BIND_ENV] = threads_bind(num_ranks, cpus)
    if not environ.get(NCCL_LIBRARY_ENV):
        added[NCCL_LIBRARY_ENV] = NO_NCCL_LIBRARY
    return added


def server_ranks(server_args) -> int:
    """SGLang's count of rank processes: replicas x tensor x pipeline ranks."""
    return server_args.dp_size * server_args.tp_size * server_args.pp_size


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))
