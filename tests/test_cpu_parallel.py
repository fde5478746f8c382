"""Several SGLang ranks on a host without CUDA: what ``sglang-hybrid launch`` sets for them."""

from __future__ import annotations

import os

import pytest

from sglang_hybrid import launch
from sglang_hybrid.cpu_parallel import (
    NCCL_LIBRARY_ENV,
    NO_NCCL_LIBRARY,
    THREADS_BIND_ENV,
    cpu_parallel_env,
    threads_bind,
)
from sglang_hybrid.launch import prepare_cpu_parallel, prepare_launch

MODEL = ["--model-path", "Qwen/Qwen3-Next-80B-A3B-Instruct"]


@pytest.mark.parametrize(
    "num_ranks, cpus, expected",
    [
        (2, [0, 1], "0|1"),
        (2, [0, 1, 2, 3, 4], "0,1,2|3,4"),
        (4, [0, 1], "0|1|0|1"),
        (1, [3, 1], "1,3"),
    ],
)
def test_cores_are_split_evenly_between_ranks(num_ranks, cpus, expected):
    assert threads_bind(num_ranks, cpus) == expected


def test_several_ranks_without_cuda_get_the_binding_and_gloo():
    assert cpu_parallel_env(2, {}, cuda_available=False, cpus=[0, 1]) == {
        THREADS_BIND_ENV: "0|1",
        NCCL_LIBRARY_ENV: NO_NCCL_LIBRARY,
    }


def test_what_the_user_set_is_kept_and_cuda_or_one_rank_needs_nothing():
    mine = {THREADS_BIND_ENV: "0-7|8-15", NCCL_LIBRARY_ENV: "/opt/nccl/libnccl.so.2"}
    assert cpu_parallel_env(2, mine, cuda_available=False, cpus=[0, 1]) == {}
    assert cpu_parallel_env(2, {}, cuda_available=True, cpus=[0, 1]) == {}
    assert cpu_parallel_env(1, {}, cuda_available=False, cpus=[0, 1]) == {}


def test_the_launcher_sets_them_for_dp_and_tp_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(launch, "usable_cpus", lambda: [0, 1])
    for name in (THREADS_BIND_ENV, NCCL_LIBRARY_ENV):
        monkeypatch.delenv(name, raising=False)
    server_args, _ = prepare_launch([*MODEL, "--dp-size", "2", "--tp-size", "2"], cuda_available=False)
    prepare_cpu_parallel(server_args, cuda_available=False)
    assert os.environ[THREADS_BIND_ENV] == "0|1|0|1"
    assert os.environ[NCCL_LIBRARY_ENV] == NO_NCCL_LIBRARY
    line = capsys.readouterr().err
    assert "4 ranks on a host without CUDA" in line and THREADS_BIND_ENV in line and NCCL_LIBRARY_ENV in line
