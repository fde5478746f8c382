"""A real ``sglang.launch_server`` on this host, serving a tiny random-weight Qwen3-Next.

The model is generated on the spot (``write_tiny_qwen3_next``) and the server runs in its
own process group (``SGLangServer``) so that every process it forks (scheduler,
detokenizer) dies with it. The launch flags are the ones a CPU-only host needs
(docs: /work/shared/notes/sglang-cpu-server-probe.md); the CPU fallbacks themselves load in
every SGLang process through our plugin, not from here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

import pytest
import requests
import torch

from sglang_hybrid.engine.tiny_model_dirs import write_tiny_qwen3_next
from sglang_hybrid.harness.server_process import ServerProcess, free_local_port
from sglang_hybrid.replay.shared_data import REPO_ROOT

# The marks of a test that starts these servers: slow, and only on a host without CUDA,
# whose code paths (TRITON_INTERPRET, the torch fallbacks) it exercises.
SERVER_ON_CPU_HOST = (
    pytest.mark.slow,
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="exercises the CPU-host path (TRITON_INTERPRET, torch fallbacks)",
    ),
)

__all__ = ["write_tiny_qwen3_next"]


# Checkpoint slots of the semantic server of the ``tiny_server_pair`` fixture (conftest.py).
PAIR_CHECKPOINT_SLOTS = 64

# Start-up on two cores takes ~35 s (most of it allocating the KV and state pools).
STARTUP_TIMEOUT_S = 240.0


CPU_LAUNCH_FLAGS = [
    "--device", "cpu",
    "--dtype", "bfloat16",
    "--skip-tokenizer-init",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
    "--page-size", "1",
    "--mamba-radix-cache-strategy", "no_buffer",
    "--sampling-backend", "pytorch",
    "--grammar-backend", "none",
    "--max-total-tokens", "4096",
    "--chunked-prefill-size", "512",
    "--max-running-requests", "4",
    # The live state pool would otherwise be sized from free memory, which dominates start-up.
    "--max-mamba-cache-size", "16",
    # An idle scheduler busy-polls its sockets otherwise, which on two cores starves
    # whichever server is working.
    "--sleep-on-idle",
]  # fmt: skip


class SGLangServer(ServerProcess):
    """One ``python -m sglang.launch_server`` subprocess with the CPU host's flags."""

    def __init__(
        self,
        model_dir: Path,
        extra_args: list[str],
        env: Optional[dict[str, str]] = None,
        log_path: Optional[Path] = None,
        launch_flags: Sequence[str] = CPU_LAUNCH_FLAGS,
    ):
        port = free_local_port()
        command = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(model_dir),
            "--host", "127.0.0.1",
            "--port", str(port),
            *launch_flags,
            *extra_args,
        ]  # fmt: skip
        # The interpreter runs the Triton kernels that have no torch fallback (there is
        # no Triton driver without a GPU).
        super().__init__(command, f"http://127.0.0.1:{port}", {"TRITON_INTERPRET": "1", **(env or {})}, log_path)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
        return super().wait_ready(timeout_s)

    def generate(self, input_ids: list[int], max_new_tokens: int, **extra) -> dict:
        payload = {
            "input_ids": input_ids,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": max_new_tokens,
                "ignore_eos": True,
            },
            **extra,
        }
        response = requests.post(f"{self.base_url}/generate", json=payload, timeout=300)
        response.raise_for_status()
        return response.json()

    def num_running_requests(self) -> int:
        loads = requests.get(f"{self.base_url}/v1/loads", timeout=30).json()["loads"]
        return sum(load["num_running_reqs"] for load in loads)


DOCUMENTED_CPU_SECTION = "## On a machine without a GPU"


def documented_cpu_commands() -> list[str]:
    """The indented command lines of docs/serving.md's section for a machine without a GPU:
    the launch, then the queries."""
    text = (REPO_ROOT / "docs" / "serving.md").read_text()
    section = text[text.index(DOCUMENTED_CPU_SECTION) + len(DOCUMENTED_CPU_SECTION) :]
    section = section[: section.index("\n## ")]
    return [line[4:] for line in section.splitlines() if line.startswith("    ") and line.strip()]
