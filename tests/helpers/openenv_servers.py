"""OpenEnv servers for the tests, each in its own process on 127.0.0.1.

* :func:`serve` runs ``agentenv serve ENV_ID`` (the command users run).
* ``FaultyCalculator-v0``: an action with ``sleep`` sleeps ``SLOW_STEP_S`` before its
  step, one with ``raise`` raises; registered on import (``--import openenv_servers``).
* ``CoinCalculator-v0`` (``coin_env``: rewards a tiny random model earns) is registered too.
* ``EchoEnvironment``: an OpenEnv environment that is not agentenv's (its action is
  ``{"message": str}``), served by :func:`serve_foreign` with OpenEnv's own ``create_app``,
  to show an agentenv client on anyone's server.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import coin_env  # noqa: F401 - registers CoinCalculator-v0
from chroma_server import free_port

import agentenv
from envs.calculator import CalculatorEnv

HELPERS = Path(__file__).parent
SLOW_STEP_S = 3.0


class FaultyCalculator(CalculatorEnv):
    def step(self, action):
        if "sleep" in action:
            time.sleep(SLOW_STEP_S)
        if "raise" in action:
            raise RuntimeError("the tool's backend is down")
        return super().step(action)


agentenv.register("FaultyCalculator-v0", entry_point=FaultyCalculator, override=True)


def _wait(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(
                    f"the server at {url} did not start; end of {log}:\n"
                    + log.read_text(errors="replace")[-3000:]
                ) from None
            time.sleep(0.1)


@contextlib.contextmanager
def _process(command: list[str], log: Path, env: dict[str, str] | None) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    environ = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(HELPERS), str(HELPERS.parents[1]), environ.get("PYTHONPATH", "")]
    )
    with open(log, "a") as out:
        process = subprocess.Popen(
            [*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=environ
        )
    try:
        _wait(url, process, log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def serve(
    env_id: str,
    log: Path,
    *,
    env_kwargs: dict | None = None,
    flags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """``agentenv serve env_id`` on a free port; yields its ``http://`` address."""
    command = [sys.executable, "-m", "agentenv.cli", "serve", env_id, "--import", "openenv_servers"]
    command += ["--env-kwargs", json.dumps(env_kwargs or {}), *flags]
    with _process(command, log, env) as url:
        yield url


# ---- a server that is not agentenv's --------------------------------------------------------
def echo_app():
    from openenv.core.env_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class EchoAction(Action):
        message: str

    class EchoObservation(Observation):
        text: str = ""

    class EchoEnvironment(Environment):
        """Task ``seed``: say the number ``seed``; reward 1 if the message contains it."""

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State()
            self.target = 0

        def reset(self, seed=None, episode_id=None, **kwargs):
            self.target = int(seed or 0)
            self._state = State(episode_id=episode_id)
            return EchoObservation(text=f"Say the number {self.target}.")

        def step(self, action, timeout_s=None, **kwargs):
            self._state.step_count += 1
            hit = str(self.target) in action.message
            return EchoObservation(text=f"you said {action.message}", reward=float(hit), done=True)

        @property
        def state(self):
            return self._state

    return create_app(EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=8)


@contextlib.contextmanager
def serve_foreign(log: Path) -> Iterator[str]:
    """OpenEnv's ``create_app`` on :class:`EchoEnvironment`, under uvicorn."""
    command = [sys.executable, "-m", "openenv_servers"]
    with _process(command, log, None) as url:
        yield url


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(echo_app(), host="127.0.0.1", port=int(sys.argv[sys.argv.index("--port") + 1]))
