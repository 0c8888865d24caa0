"""A real Chroma server (``chroma run``, from the chromadb package) on 127.0.0.1.

Used by the outage test (tests/envs/rag/test_chroma_server.py) and the load script
(benchmarks/chroma_load.py): start it, kill it as a crash would (SIGKILL), pause it
(SIGSTOP, a server that accepts connections but never answers) and start it again on
the same port over the same folder, so the data it held comes back.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from scripts import console_script


def chroma_cli() -> tuple[str | None, str]:
    """``(path of the chroma CLI, "")``, or ``(None, why not)``."""
    exe = console_script("chroma")
    if exe is None:
        return None, "no chroma CLI beside python or on PATH; pip install chromadb"
    return exe, ""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChromaServer:
    """``chroma run --host 127.0.0.1 --port PORT --path PATH``, started and killed by its owner.

    The port is chosen once, so :meth:`start` after :meth:`kill` brings the server back at
    the same :attr:`url`, over the same (persistent) ``path``.

    Args:
        exe: The chroma CLI (see :func:`chroma_cli`).
        path: The server's database folder.
        log: File its output is appended to.
        port: Port to serve on (default: a free one).
    """

    def __init__(self, exe: str, path: str | Path, log: str | Path, port: int | None = None):
        self.exe, self.path, self.log = exe, Path(path), Path(log)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> ChromaServer:
        """Start the server and return once its heartbeat answers.

        Raises:
            RuntimeError: if it exits or does not answer within ``timeout_s`` (the end of
                its log is in the message).
        """
        command = [self.exe, "run", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--path", str(self.path)]
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while not self.alive():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"the Chroma server at {self.url} did not answer within {timeout_s:g} s; "
                    f"end of {self.log}:\n{tail}"
                )
            time.sleep(0.05)
        return self

    def alive(self, timeout_s: float = 1.0) -> bool:
        """Whether ``GET /api/v2/heartbeat`` answers within ``timeout_s``."""
        try:
            urllib.request.urlopen(f"{self.url}/api/v2/heartbeat", timeout=timeout_s).close()
            return True
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server's process group at once, as a crash would (no-op if stopped)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None

    def pause(self) -> None:
        """SIGSTOP the server: connections are still accepted, nothing is answered."""
        if self.process is None:
            raise RuntimeError(f"the Chroma server at {self.url} is not running; start() it")
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGCONT)

    def __enter__(self) -> ChromaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
