"""Chroma under load and through a crash: many RAG-v0 workers searching one server.

    HF_HUB_OFFLINE=1 python benchmarks/chroma_load.py            # 64 workers in 4 processes,
                                                                 # 10,000 searches, kill at 40 %
    python benchmarks/chroma_load.py --small --workers 8 --processes 2 --searches 500
    python benchmarks/chroma_load.py --outage-at 0               # load only, no outage

The script starts its own ``chroma run --host 127.0.0.1 --port <free> --path <tmp>``,
builds the RAG index on it once (the bundled corpus, or ``--small``: the tests' generated
24-article one; ``--retriever dense`` by default so every search goes to Chroma), then
starts ``--processes`` processes that each make their share of ``--workers`` RAG-v0
instances against that server and drive them from one thread each. A worker's actions
are ``search`` tool calls only (Hermes ``<tool_call>``), its query a question of the
split or, with probability ``--word-frac``, 1-4 words of the corpus (seeded per worker);
an episode is reset when it ends or its searches are used up. ``--searches`` calls are
made in all (a shared counter hands them out).

Outage: when ``--outage-at`` of the searches are made, the server is SIGKILLed, and
``--outage-s`` seconds later started again on the same port over the same (persistent)
folder. The workers are not restarted. A search that overlaps the window from the kill
to ``--grace-s`` after the new server's heartbeat answers counts as "in the outage".
A worker whose last search failed goes on past the budget until one succeeds (or
``--recover-timeout-s`` after the budget is spent), so recovery is always measured.

Printed: searches made, ok, error observations (in / outside the outage, by kind),
exceptions escaped from ``step``, hung steps (longer than the env's ``tool_timeout_s`` +
``--hang-slack-s``, or still running at the end), search latency p50 / p95 / max overall
and outside the outage, the server's restart time, the time from the restart until every
worker had a successful search again, and the wall time. The exit status is 1 if an
exception escaped, a step hung, an error came outside the outage (grace included), a
worker never recovered or a worker process failed.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "helpers")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from chroma_server import ChromaServer, chroma_cli  # noqa: E402

# One search step: (worker, start, end, outcome, kind, text). Times are time.monotonic()
# (CLOCK_MONOTONIC: one clock for every process on the machine); outcome is "ok",
# "error" (an Error: observation; kind = its info["tool_errors"] key) or "exception"
# (kind = the exception type); text is the start of an error's observation.
Step = tuple[int, float, float, str, str, str]


def env_kwargs(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """RAGEnv arguments for this run (the same in every process)."""
    from envs.rag import generate

    kwargs: dict[str, Any] = {"retriever": args.retriever, "chroma": url}
    kwargs.update(cache_dir=args.cache_dir, tool_timeout_s=args.tool_timeout_s)
    if args.small:
        docs, qa = generate(num_per_type=6, seed=7)
        kwargs.update(corpus=docs, qa=qa)
    return kwargs


def search_action(query: str) -> str:
    """A Hermes ``search`` tool call."""
    call = {"name": "search", "arguments": {"query": query}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def take(budget: Any, total: int) -> bool:
    """Take one search from the shared budget; False once ``total`` are taken."""
    with budget.get_lock():
        if budget.value >= total:
            return False
        budget.value += 1
        return True


def classify(obs: list[dict], info: dict, before: dict[str, int]) -> tuple[str, str, str]:
    """``(outcome, kind, text)`` of a search step from its observation and ``info``
    (``before``: ``info["tool_errors"]`` before the step)."""
    text = obs[0]["content"] if obs else ""
    new = [k for k, n in info["tool_errors"].items() if n > before.get(k, 0)]
    if not new and not text.startswith("Error:"):
        return "ok", "", ""
    kind = new[0] if new else "uncounted"
    raised = re.match(r"Error: tool '\w+' raised (\w+)", text)
    if kind == "exception" and raised:
        kind += f" ({raised.group(1)})"
    if not text.startswith("Error:"):
        kind += " (no 'Error:' text)"
    return "error", kind, text[:160]


def worker_loop(worker: int, env: Any, shared: dict[str, Any], steps: list[Step]) -> None:
    """Search with ``env`` until the budget is spent and the last search, started after
    the last kill, succeeded (or until ``stop``); every step is appended to ``steps``."""
    args, budget, kills = shared["args"], shared["budget"], shared["kills"]
    rng = random.Random(args.seed * 100_003 + worker)
    questions, words = shared["questions"], shared["words"]
    _, info = env.reset(seed=rng.randrange(2**31))
    ok_since = 0  # kills before the start of the last search, if it succeeded; else -1
    while not shared["stop"].is_set() and (take(budget, args.searches) or ok_since != kills.value):
        if rng.random() < args.word_frac:
            query = " ".join(rng.sample(words, rng.randint(1, 4)))
        else:
            query = rng.choice(questions)
        before, epoch, start = info["tool_errors"], kills.value, time.monotonic()
        shared["now"][worker] = start
        try:
            obs, _, terminated, truncated, info = env.step(search_action(query))
            outcome, kind, text = classify(obs, info, before)
        except Exception as exc:  # what this benchmark checks never happens
            outcome, kind, text = "exception", type(exc).__name__, str(exc)[:160]
            terminated = truncated = True
        steps.append((worker, start, time.monotonic(), outcome, kind, text))
        shared["now"][worker] = None
        ok_since = epoch if outcome == "ok" else -1
        if terminated or truncated or info["num_searches"] >= env.max_searches:
            _, info = env.reset(seed=rng.randrange(2**31))


def worker_process(index: int, args: argparse.Namespace, url: str, sync: dict[str, Any]) -> None:
    """One process: build its envs, wait for ``go``, run one thread per env, send results."""
    import torch

    from envs.rag import RAGEnv

    torch.set_num_threads(args.torch_threads)
    ids = list(range(index, args.workers, args.processes))
    envs = [RAGEnv(**env_kwargs(args, url)) for _ in ids]
    questions = [envs[0].get_task(i).prompt for i in range(envs[0].num_tasks)]
    words = sorted({w for c in envs[0].chunks for w in re.findall(r"[A-Za-z]{4,}", c.text)})
    in_flight: dict[int, float | None] = dict.fromkeys(ids)
    shared = dict(args=args, budget=sync["budget"], stop=sync["stop"], kills=sync["kills"])
    shared["now"] = in_flight
    shared.update(questions=questions, words=words)
    steps: list[Step] = []
    threads = [
        threading.Thread(target=worker_loop, args=(w, env, shared, steps), daemon=True)
        for w, env in zip(ids, envs, strict=True)
    ]
    sync["messages"].put(("ready", index, None))
    sync["go"].wait()
    for t in threads:
        t.start()
    deadline = math.inf
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        if sync["stop"].is_set() and deadline == math.inf:
            deadline = time.monotonic() + args.tool_timeout_s + args.hang_slack_s
        time.sleep(0.05)
    hung = [(w, s) for w, s in in_flight.items() if s is not None]
    sync["messages"].put(("done", index, (list(steps), hung)))
    sync["messages"].close()
    sync["messages"].join_thread()
    os._exit(0)  # at once: tool threads a timeout abandoned may still be inside torch


def wait_ready(procs: list, messages: Any, timeout_s: float = 900.0) -> None:
    """Return once every worker process has built its envs.

    Raises:
        RuntimeError: if one exits first, or they are not ready within ``timeout_s``.
    """
    ready, deadline = 0, time.monotonic() + timeout_s
    while ready < len(procs):
        try:
            messages.get(timeout=0.5)
            ready += 1
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"worker processes not ready: exited {dead}, or {timeout_s:g} s passed"
                ) from None


def outage(server: ChromaServer, outage_s: float, kills: Any) -> dict[str, float]:
    """Kill the server, wait ``outage_s``, start it again; the times, monotonic."""
    kill = time.monotonic()
    server.kill()
    with kills.get_lock():  # after the kill: a search started before it never counts as
        kills.value += 1  # a recovery in the workers (nor below: see summarize)
    time.sleep(outage_s)
    launch = time.monotonic()
    server.start()
    return {"kill": kill, "launch": launch, "ready": time.monotonic()}


def drive(
    args: argparse.Namespace, server: ChromaServer, procs: list, sync: dict[str, Any]
) -> tuple[list[Step], list, dict[str, float] | None, list[str]]:
    """Wait for the workers' results, killing and restarting the server on the way."""
    threshold = math.ceil(args.outage_at * args.searches) if 0 < args.outage_at < 1 else None
    times, problems, results = None, [], {}
    spent = stopped = None
    while len(results) < len(procs):
        try:
            _, index, payload = sync["messages"].get(timeout=0.1)
            results[index] = payload
            continue
        except queue.Empty:
            pass
        now, made = time.monotonic(), sync["budget"].value
        if threshold is not None and times is None and made >= threshold:
            try:
                times = outage(server, args.outage_s, sync["kills"])
            except RuntimeError as exc:
                problems.append(f"the server did not come back: {exc}")
                times, stopped = {"kill": now, "launch": now, "ready": now}, now
                sync["stop"].set()
        spent = spent or (now if made >= args.searches else None)
        if spent and now > max(spent, times["ready"] if times else 0) + args.recover_timeout_s:
            stopped = stopped or now
            sync["stop"].set()
        for i, p in enumerate(procs):
            if i not in results and p.exitcode not in (None, 0):
                problems.append(f"worker process {i} exited with {p.exitcode}")
                results[i] = ([], [])
        if stopped and now > stopped + args.tool_timeout_s + args.hang_slack_s + 30:
            problems.append(f"worker processes {sorted(set(range(len(procs))) - set(results))} "
                            "sent no results; terminated")  # fmt: skip
            break
    steps = [s for r in results.values() for s in r[0]]
    hung = [h for r in results.values() for h in r[1]]
    return steps, hung, times, problems


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``values`` (nearest rank), or nan if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(
    args: argparse.Namespace, steps: list[Step], hung: list, times: dict[str, float] | None
) -> dict[str, Any]:
    """The figures the script prints (see the module docstring)."""
    end = times["ready"] + args.grace_s if times else -math.inf
    in_window = [bool(times) and s[2] >= times["kill"] and s[1] <= end for s in steps]
    errors = [(s, w) for s, w in zip(steps, in_window, strict=True) if s[3] == "error"]
    limit = args.tool_timeout_s + args.hang_slack_s
    out: dict[str, Any] = {
        "made": len(steps),
        "ok": sum(s[3] == "ok" for s in steps),
        "errors_in": sum(w for _, w in errors),
        "errors_out": sum(not w for _, w in errors),
        "errors_grace": sum(w and s[2] > times["ready"] for s, w in errors) if times else 0,
        "kinds": Counter(s[4] for s, _ in errors),
        "samples": {s[4]: s[5] for s, _ in errors},
        "exceptions": Counter(s[4] for s in steps if s[3] == "exception"),
        "hung": sum(s[2] - s[1] > limit for s in steps) + len(hung),
        "lat_all": [s[2] - s[1] for s in steps],
        "lat_out": [s[2] - s[1] for s, w in zip(steps, in_window, strict=True) if not w],
    }
    if times:
        first_ok: dict[int, float] = {}
        for worker, start, stop, outcome, *_ in steps:
            if outcome == "ok" and start > times["launch"]:  # from the new server
                first_ok[worker] = min(first_ok.get(worker, math.inf), stop)
        out["unrecovered"] = sorted(set(range(args.workers)) - set(first_ok))
        gaps = [max(0.0, t - times["ready"]) for t in first_ok.values()]
        out["recovery_s"] = max(gaps) if gaps else math.nan
    return out


def ms(values: Sequence[float]) -> str:
    """p50 / p95 / max of ``values`` (seconds), in milliseconds."""
    return " / ".join(f"{1000 * pct(values, q):.1f}" for q in (0.5, 0.95, 1.0))


def report(args: argparse.Namespace, r: dict[str, Any], times: dict | None, wall: float) -> int:
    """Print the table; return the exit status (0: every check passed)."""
    extra = r["made"] - args.searches
    rows = [
        ("searches made", f"{r['made']:,}" + (f" ({extra} past the budget)" if extra > 0 else "")),
        ("ok", f"{r['ok']:,}"),
        ("error observations in the outage", f"{r['errors_in']:,}"),
        ("  of which after the restarted server answered", f"{r['errors_grace']:,}"),
        ("error observations outside it", f"{r['errors_out']:,}"),
        ("exceptions escaped from step", str(sum(r["exceptions"].values()))),
        (f"hung steps (> {args.tool_timeout_s + args.hang_slack_s:g} s)", str(r["hung"])),
        ("latency ms p50 / p95 / max, all", ms(r["lat_all"])),
        ("latency ms p50 / p95 / max, outside the outage", ms(r["lat_out"])),
    ]
    if times:
        rows += [
            ("server restart (launch -> heartbeat) s", f"{times['ready'] - times['launch']:.2f}"),
            ("every worker ok again, s after the heartbeat", f"{r['recovery_s']:.2f}"),
            ("workers never recovered", str(len(r["unrecovered"]))),
        ]
    rows.append(("wall time s", f"{wall:.1f} ({r['made'] / wall:.0f} searches/s)"))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    for kind, n in sorted(r["kinds"].items()):
        print(f"  error kind {kind}: {n}, e.g. {r['samples'][kind]!r}")
    for kind, n in sorted(r["exceptions"].items()):
        print(f"  EXCEPTION {kind}: {n}")
    failed = bool(r["exceptions"]) or r["hung"] > 0 or r["errors_out"] > 0
    return int(failed or bool(r.get("unrecovered")))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=64, help="env instances, one thread each")
    p.add_argument("--processes", type=int, default=4, help="worker processes")
    p.add_argument("--searches", type=int, default=10_000, help="search calls in all")
    p.add_argument("--small", action="store_true", help="the tests' 24-article corpus")
    p.add_argument("--retriever", default="dense", choices=["dense", "hybrid", "bm25"])
    p.add_argument("--outage-at", type=float, default=0.4, help="fraction made; 0: no outage")
    p.add_argument("--outage-s", type=float, default=3.0, help="seconds the server stays dead")
    p.add_argument("--grace-s", type=float, default=1.0, help="outage window after restart")
    p.add_argument("--tool-timeout-s", type=float, default=10.0, help="the env's tool timeout")
    p.add_argument("--hang-slack-s", type=float, default=2.0, help="a step past timeout+this hung")
    p.add_argument("--recover-timeout-s", type=float, default=30.0)
    p.add_argument("--word-frac", type=float, default=0.3, help="share of random-word queries")
    p.add_argument("--torch-threads", type=int, default=0, help="per process; 0: CPUs/processes")
    p.add_argument("--cache-dir", default=None, help="index cache (default agentenv's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 1 <= args.processes <= args.workers or args.searches < 1:
        p.error(f"need 1 <= --processes <= --workers and --searches >= 1, got {args.processes}, "
                f"{args.workers}, {args.searches}")  # fmt: skip
    if not 0 <= args.outage_at < 1:
        p.error(f"--outage-at is a fraction in [0, 1), got {args.outage_at}")
    args.torch_threads = args.torch_threads or max(1, (os.cpu_count() or 1) // args.processes)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); return the exit status."""
    args = parse_args(argv)
    exe, why = chroma_cli()
    if exe is None:
        sys.exit(why)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"{args.workers} workers in {args.processes} processes, {args.searches:,} searches, "
          f"retriever {args.retriever}, {'small' if args.small else 'bundled'} corpus")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="chroma_load_") as tmp:
        server = ChromaServer(exe, Path(tmp) / "db", Path(tmp) / "chroma.log").start()
        try:
            from envs.rag import RAGEnv

            start = time.perf_counter()
            RAGEnv(**env_kwargs(args, server.url))
            print(f"index built on {server.url} in {time.perf_counter() - start:.1f} s")
            ctx = mp.get_context("spawn")
            sync = dict(budget=ctx.Value("q", 0), kills=ctx.Value("i", 0))
            sync.update(go=ctx.Event(), stop=ctx.Event())
            sync["messages"] = ctx.Queue()
            procs = [
                ctx.Process(target=worker_process, args=(i, args, server.url, sync), daemon=True)
                for i in range(args.processes)
            ]
            for p in procs:
                p.start()
            wait_ready(procs, sync["messages"])
            start = time.monotonic()
            sync["go"].set()
            steps, hung, times, problems = drive(args, server, procs, sync)
            wall = time.monotonic() - start
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.terminate()
        finally:
            server.kill()
    if times:
        print(f"outage window: kill -> {args.grace_s:g} s after the restarted server answered")
    status = report(args, summarize(args, steps, hung, times), times, wall)
    for line in problems:
        print("PROBLEM:", line)
    return max(status, int(bool(problems)))


if __name__ == "__main__":
    sys.exit(main())
