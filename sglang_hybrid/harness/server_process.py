"""An SGLang server as a subprocess: started in a process group of its own, waited for until
it serves, and stopped with every process it forked (scheduler, detokenizer). The server
tests and the CPU benchmarks start their servers through it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence, Union

import requests


def process_group_members(group: int) -> list[Path]:
    """The /proc entries of the live processes in process group ``group`` (a server started
    by ``ServerProcess``: its launcher, schedulers, detokenizer)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == group:
                    members.append(entry)
            except OSError:  # the process ended since the listing
                continue
    return members


def free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``command`` (an argv, or a shell line as a user types it) serving at ``base_url``."""

    def __init__(
        self,
        command: Union[Sequence[str], str],
        base_url: str,
        env: Optional[dict[str, str]] = None,
        log_path: Optional[Path] = None,
    ):
        self.base_url = base_url
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            command,
            shell=isinstance(command, str),
            env={**os.environ, **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.startup_s: Optional[float] = None

    def wait_ready(self, timeout_s: float) -> float:
        """Block until the server answers /health_generate; return the start-up time."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"sglang server exited with {self.process.returncode} during start-up; "
                    f"log: {self.log_tail()}"
                )
            try:
                if requests.get(f"{self.base_url}/health_generate", timeout=30).ok:
                    self.startup_s = time.monotonic() - started
                    return self.startup_s
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"sglang server not ready after {timeout_s} s; log: {self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        """Kill the whole process group: the launcher, scheduler and detokenizer."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=20)
            except ProcessLookupError:
                pass
        # Children re-parented after the launcher exited still carry its group id.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self._log is not subprocess.DEVNULL:
            self._log.close()
