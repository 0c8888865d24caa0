"""Workspace env speed: reset / step / close latency and episodes per second.

    python benchmarks/workspace.py                        # auto sandbox; 1, 8, 32 instances
    python benchmarks/workspace.py --sandbox rlimit --episodes 16 --json out.json

Each of ``C`` threads owns one ``Workspace-v0`` instance and plays episodes back to
back: ``reset`` -> the family's scripted solver (file tools and sandboxed code runs) ->
``<answer>`` (which runs the checker, itself often sandboxed) -> ``close``. Tasks cycle
through all families and levels. Reported per concurrency level: episodes per second
(wall clock), and p50 / p95 latency of ``reset``, file-tool steps (``list_files``,
``read_file``, ``write_file``), code steps (``run_python`` / ``run``), the answer step
(checker) and ``close``. Latencies under concurrency include waiting for a CPU: on a
2-core machine, 32 instances mostly measure queueing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import agentenv  # noqa: E402
from envs.workspace import SandboxLimits, as_actions, solve_task  # noqa: E402

FILE_TOOLS = ("list_files", "read_file", "write_file")


def _kind(action: str) -> str:
    if action.startswith("<answer>"):
        return "answer"
    name = json.loads(action[len("<tool_call>") : -len("</tool_call>")])["name"]
    return "file_step" if name in FILE_TOOLS else "code_step"


def _play(env: Any, task_id: int, timings: dict[str, list[float]]) -> float:
    t = time.perf_counter()
    env.reset(options={"task_id": task_id})
    timings["reset"].append(time.perf_counter() - t)
    reward = 0.0
    for action in as_actions(solve_task(env.task)):
        t = time.perf_counter()
        _, reward, terminated, truncated, _ = env.step(action)
        timings[_kind(action)].append(time.perf_counter() - t)
        if terminated or truncated:
            break
    t = time.perf_counter()
    env.close()
    timings["close"].append(time.perf_counter() - t)
    return float(reward)


def run_level(concurrency: int, episodes: int, sandbox: str) -> dict[str, Any]:
    """Play ``episodes`` episodes on ``concurrency`` instances; return the figures."""
    limits = SandboxLimits(timeout_s=10.0)
    envs = [
        agentenv.make("Workspace-v0", sandbox=sandbox, limits=limits, num_tasks=64)
        for _ in range(concurrency)
    ]
    timings: dict[str, list[float]] = defaultdict(list)
    lock = threading.Lock()
    counter = iter(range(episodes))
    rewards: list[float] = []

    def worker(env: Any) -> None:
        local: dict[str, list[float]] = defaultdict(list)
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                break
            rewards.append(_play(env, i % env.num_tasks, local))
        with lock:
            for key, values in local.items():
                timings[key].extend(values)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(worker, envs))
    wall = time.perf_counter() - start
    for env in envs:
        env.close()
    return {
        "concurrency": concurrency,
        "episodes": episodes,
        "wall_s": wall,
        "episodes_per_s": episodes / wall,
        "mean_reward": statistics.fmean(rewards),
        "sandbox": envs[0].sandbox_mode,
        "latency_ms": {key: _percentiles(values) for key, values in sorted(timings.items())},
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pick(q: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": pick(0.5), "p95": pick(0.95), "n": len(ordered)}


def _table(results: list[dict[str, Any]]) -> str:
    keys = ["reset", "file_step", "code_step", "answer", "close"]
    head = f"{'C':>3} {'ep/s':>6} " + " ".join(f"{k + ' p50/p95 ms':>22}" for k in keys)
    lines = [head, "-" * len(head)]
    for r in results:
        cells = []
        for k in keys:
            lat = r["latency_ms"].get(k)
            cells.append(f"{lat['p50']:>10.1f} / {lat['p95']:>8.1f}" if lat else f"{'-':>22}")
        lines.append(f"{r['concurrency']:>3} {r['episodes_per_s']:>6.2f} " + " ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sandbox", default="auto", choices=["auto", "bwrap", "rlimit"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--episodes", type=int, default=None, help="per level (default 4 × concurrency, >= 16)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    if "agentenv/Workspace-v0" not in agentenv.registry():  # until the registry ships it
        agentenv.register("Workspace-v0", "envs.workspace:WorkspaceEnv")
    results = []
    for c in args.concurrency:
        episodes = args.episodes or max(16, 4 * c)
        results.append(run_level(c, episodes, args.sandbox))
        r = results[-1]
        print(
            f"C={c:<3} {r['episodes']} episodes in {r['wall_s']:.1f} s "
            f"({r['episodes_per_s']:.2f} ep/s, mean reward {r['mean_reward']:.2f})",
            flush=True,
        )
    print(f"\nsandbox: {results[0]['sandbox']}, {os.cpu_count()} CPUs, load {os.getloadavg()}")
    print(_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
