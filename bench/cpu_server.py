"""The documented CPU server (`sglang-hybrid launch --tiny-model qwen3-next`), for the benchmarks
that measure the real server on this machine: started in its own process group, stopped with
every process it forked, its resident memory read from /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, Sequence

import requests

STARTUP_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def tiny_cpu_server(log_path: Path, extra_args: Sequence[str] = ()) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base url, launcher process) of a ready `sglang-hybrid launch --tiny-model qwen3-next`."""
    port = free_port()
    command = ["sglang-hybrid", "launch", "--tiny-model", "qwen3-next", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, base_url, log_path)
        yield base_url, process
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(process.pid, sig)
                process.wait(timeout=20)


def _wait_ready(process: subprocess.Popen, base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {log_path.read_text()[-3000:]}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{base_url}/health_generate", timeout=30).ok:
                return
        time.sleep(1.0)
    raise TimeoutError(f"server not ready after {STARTUP_TIMEOUT_S} s: {log_path.read_text()[-3000:]}")


def process_group_rss_mib(process: subprocess.Popen) -> float:
    """Resident memory of every process in ``process``'s group (launcher, scheduler,
    detokenizer), in MiB."""
    total_kib = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            if os.getpgid(int(entry.name)) != process.pid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
    return total_kib / 1024
