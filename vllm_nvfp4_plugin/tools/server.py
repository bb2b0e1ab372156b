"""Start and stop a local `vllm serve` process (shared by the demo and the serving tests).

The server runs as `python -m vllm.entrypoints.cli.main serve ...`, which is exactly the `vllm`
console script but pinned to the current interpreter. It listens on 127.0.0.1 only, on a free port,
with Hugging Face offline switches set, and writes its log to a file so a failed start can be
reported with the log's tail.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class VllmServer:
    """`vllm serve MODEL ARGS` on 127.0.0.1; use as a context manager or call start()/stop().

    `env` adds to (and overrides) the current environment; `log_path` receives stdout and stderr.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike = "vllm_serve.log",
        startup_timeout_s: float = 600.0,
    ):
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        self.model = str(model)
        self.args = [str(a) for a in args]
        self.env = {**os.environ, **OFFLINE_ENV, **(env or {})}
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
            "--host", HOST, "--port", str(self.port), *self.args,
        ]  # fmt: skip

    def start(self) -> "VllmServer":
        """Launch the server and block until GET /health answers 200."""
        if self.process is not None:
            raise RuntimeError("this VllmServer was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # A new session makes the server the leader of a process group that also holds the
            # engine-core and worker processes it spawns, so stop() can reap all of them.
            self.process = subprocess.Popen(
                self.command(), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with code {self.process.returncode} before it was ready; "
                    f"log tail:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(
            f"vllm serve not ready after {self.startup_timeout_s:.0f} s; log tail:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server (it shuts its engine down), then SIGKILL its process group; returns once
        no process of the group is left."""
        if self.process is None:
            return
        group = self.process.pid
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(group, signal.SIGKILL)  # engine/worker children left behind, if any
        except ProcessLookupError:
            pass
        self.process.wait()
        # Orphaned children are reaped by init, not by us: wait until the group is really empty.
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        raise RuntimeError(f"processes of vllm serve's group {group} remain {grace_s:.0f} s after SIGKILL")

    def log_tail(self, num_chars: int = 6000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-num_chars:]

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
