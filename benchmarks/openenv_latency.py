"""Step latency of an env served by ``agentenv serve`` (OpenEnv) vs the same env in-process.

    python benchmarks/openenv_latency.py                 # Calculator-v0 and Workspace-v0,
                                                         # 300 steps each, 1 and 16 sessions
    python benchmarks/openenv_latency.py --steps 100 --sessions 1 4

For each env the script starts ``agentenv serve ENV --port <free>`` on 127.0.0.1, then
times the same actions (a Calculator tool call; a Workspace ``write_file`` then
``read_file``) three ways: ``env.step(text)`` in this process; the same text sent by
OpenEnv's own client (``GenericEnvClient``, one WebSocket session); and with N sessions at
once (N clients in N threads, one episode each, all against one server). An episode is
reset when it ends; resets are not timed. Printed per env: p50 / p95 / max step latency in
milliseconds for each way, and steps per second with N sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CALL = '<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
ACTIONS = {
    "Calculator-v0": [CALL.format(name="calculator", args='{"expression": "(17 * 23) / 4"}')],
    "Workspace-v0": [
        CALL.format(name="write_file", args='{"path": "notes.txt", "content": "a\\nb\\n"}'),
        CALL.format(name="read_file", args='{"path": "notes.txt"}'),
    ],
}
ENV_KWARGS = {
    "Calculator-v0": {"source": "word_problems", "max_turns": 50},
    "Workspace-v0": {"sandbox": "auto", "num_tasks": 8, "max_turns": 50},
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(env_id: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "agentenv.cli", "serve", env_id, "--port", str(port)]
    command += ["--env-kwargs", json.dumps(ENV_KWARGS[env_id])]
    out = open(log, "w")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
            return process, url
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                sys.exit(f"the server did not start; see {log}")
            time.sleep(0.1)


def play(step, reset, actions: list[str], steps: int) -> list[float]:
    """``steps`` timed steps cycling through ``actions``; untimed resets when an episode ends."""
    latencies = []
    reset()
    for i in range(steps):
        started = time.perf_counter()
        done = step(actions[i % len(actions)])
        latencies.append(time.perf_counter() - started)
        if done:
            reset()
    return latencies


def local_steps(env_id: str, steps: int) -> list[float]:
    import agentenv

    env = agentenv.make(env_id, **ENV_KWARGS[env_id])
    try:
        return play(
            lambda a: any(env.step(a)[2:4]), lambda: env.reset(seed=0), ACTIONS[env_id], steps
        )
    finally:
        env.close()


def served_steps(url: str, env_id: str, steps: int, sessions: int) -> tuple[list[float], float]:
    from openenv.core import GenericEnvClient

    results: list[list[float]] = [[] for _ in range(sessions)]
    errors: list[str] = []

    def worker(k: int) -> None:
        try:
            with GenericEnvClient(base_url=url).sync() as env:
                results[k] = play(
                    lambda a: env.step({"text": a}).done,
                    lambda: env.reset(seed=k),
                    ACTIONS[env_id],
                    steps,
                )
        except Exception as exc:  # noqa: BLE001 - reported
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(sessions)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        sys.exit(f"{len(errors)} sessions failed: {errors[:3]}")
    return [x for r in results for x in r], sessions * steps / wall


def summary(latencies: list[float]) -> str:
    ms = np.array(latencies) * 1000
    p50, p95 = np.percentile(ms, [50, 95])
    return f"p50 {p50:7.2f}  p95 {p95:7.2f}  max {ms.max():8.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=list(ACTIONS), choices=list(ACTIONS))
    parser.add_argument("--steps", type=int, default=300, help="timed steps per session")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"{os.cpu_count()} CPUs; {args.steps} steps per session")
    for env_id in args.envs:
        print(f"\n{env_id} ({ENV_KWARGS[env_id]})")
        print(f"  in-process          {summary(local_steps(env_id, args.steps))}")
        process, url = start_server(env_id, Path(f"/tmp/openenv_latency_{env_id}.log"))
        try:
            for n in args.sessions:
                latencies, rate = served_steps(url, env_id, args.steps, n)
                label = f"served, {n} session" + ("s" if n > 1 else "")
                print(f"  {label:19s} {summary(latencies)}  ({rate:,.0f} steps/s)")
        finally:
            process.terminate()
            process.wait(timeout=30)


if __name__ == "__main__":
    main()
