"""Fuzz every env's ``step`` at volume: hostile actions, the invariants of tests/envs/test_fuzz.py.

    python benchmarks/fuzz.py                                  # 10,000 actions per env
    python benchmarks/fuzz.py --actions 200 --envs Calculator-v0 RAG-v0
    python benchmarks/fuzz.py --envs Workspace-v0 --sandbox rlimit --seed 3

Actions are drawn by Hypothesis from the strategies of ``tests/helpers/fuzz_actions.py``
(tool calls with hostile arguments, broken JSON, unclosed tags, too many calls, junk
answers, empty and 1 MB turns), one action per example, without shrinking. Each env
plays them back to back: an episode goes on until it ends, then ``reset``. After every
fuzzed action a valid probe step must work (or, when the episode ended, a reset), and
for Workspace-v0 nothing outside the workspace root may change; after ``close`` its
folder, processes and scratch files must be gone.

Envs: ``Calculator-v0`` (defaults), ``RAG-v0`` (the small generated corpus of
tests/envs/rag, BM25 only, so no embedding work), ``Workspace-v0`` (1 s sandbox limit).
Printed per env: actions run, exceptions escaped from ``step``, invariant violations by
kind (with the first action that broke each), steps over the time limit, p50 / p95 / max
step time, tool calls and their error kinds, and wall time. Exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "helpers")]

import fuzz_actions as fa  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import agentenv  # noqa: E402
from envs.rag import generate  # noqa: E402

ENVS = ("Calculator-v0", "RAG-v0", "Workspace-v0")
CHUNK = 500  # examples per Hypothesis run


def make_env(env_id: str, sandbox: str, cache_dir: str) -> Any:
    """The env with the light settings of tests/envs/test_fuzz.py."""
    if env_id == "RAG-v0":
        docs, qa = generate(num_per_type=6, seed=7)
        kwargs = {"corpus": docs, "qa": qa, "retriever": "bm25", "chroma": "memory"}
        return agentenv.make(env_id, **kwargs, cache_dir=cache_dir)
    if env_id == "Workspace-v0":
        return agentenv.make(env_id, sandbox=sandbox, limits=fa.WORKSPACE_LIMITS, num_tasks=16)
    return agentenv.make(env_id)


def fuzz_env(env_id: str, n: int, sandbox: str, rng_seed: int, cache_dir: str) -> dict[str, Any]:
    """Run ``n`` fuzzed actions on one env; return the counts and timings."""
    guard = fa.OutsideGuard() if env_id == "Workspace-v0" else None
    children = fa.live_children()
    if guard is not None:
        guard.__enter__()
    env = make_env(env_id, sandbox, cache_dir)
    stepper = fa.Stepper(env)
    strategy: dict[str, Any] = {}
    if guard is not None:
        strategy["by_name"] = fa.argument_strings(outside=[guard.canary, guard.parent])
        strategy["cheap_tools"] = [t for t in env.tools if t.name in ("list_files", "read_file")]
    violations: Counter[str] = Counter()
    first: dict[str, str] = {}
    times: list[float] = []
    calls: Counter[str] = Counter()  # tool calls: "ok" and error kinds

    def record(kinds: list[str], action: str) -> None:
        for v in kinds:
            kind = v.split(":", 1)[0]
            violations[kind] += 1
            first.setdefault(kind, f"{v[:300]} [action {fa.short(action)}]")

    def one_action(reset_seed: int, action: str) -> None:
        if stepper.done:
            record(stepper.reset(reset_seed), "(reset)")
        errors, num_calls = stepper.errors.copy(), stepper.num_calls
        report = stepper.step(action)
        times.append(report.elapsed_s)
        new_errors = stepper.errors - errors
        calls.update(new_errors)
        calls["ok"] += stepper.num_calls - num_calls - sum(new_errors.values())
        record(report.violations, action)
        record(stepper.probe(), action)
        if guard is not None:
            record(guard.check(env.workspace), action)

    actions = fa.actions(env.tools, env.parser, **strategy)
    start = time.perf_counter()
    try:
        # in chunks, each a fresh Hypothesis run: one run of 10,000 examples keeps every
        # example's choices (megabytes for the huge ones) and grew past 8 GB
        for chunk, done in enumerate(range(0, n, CHUNK)):
            run = settings(
                max_examples=min(CHUNK, n - done),
                database=None,
                deadline=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )(given(st.integers(0, 2**16), actions)(one_action))
            seed(rng_seed * 1_000_003 + chunk)(run)()
    finally:
        if guard is not None:
            record(fa.close_and_check(env, stepper, guard, children), "(close)")
            guard.__exit__(None, None, None)
        else:
            env.close()
    return {
        "env": env_id,
        "actions": len(times),
        "episodes": stepper.episodes,
        "violations": violations,
        "first": first,
        "times": times,
        "tool_errors": calls,
        "time_limit_s": stepper.time_limit_s,
        "wall_s": time.perf_counter() - start,
    }


def _ms(times: list[float], q: float) -> float:
    ordered = sorted(times)
    return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if times else 0.0


def report(r: dict[str, Any]) -> bool:
    """Print one env's results; True when it kept every invariant."""
    v: Counter[str] = r["violations"]
    escaped = v.get("exception", 0) + v.get("probe_exception", 0)
    over = v.get("over_time_limit", 0) + v.get("probe_over_time_limit", 0)
    print(f"\n{r['env']}: {r['actions']} actions ({r['episodes']} episodes) in {r['wall_s']:.1f} s")
    print(f"  exceptions escaped step:    {escaped}")
    print(f"  invariant violations:       {sum(v.values()) - escaped - over}")
    print(f"  steps over the time limit:  {over} (limit {r['time_limit_s']:.1f} s)")
    times = r["times"]
    print(
        f"  step time p50 / p95 / max:  {_ms(times, 0.5):.1f} / {_ms(times, 0.95):.1f} / "
        f"{1000 * max(times, default=0):.1f} ms (mean {1000 * statistics.fmean(times or [0]):.1f})"
    )
    outcomes = ", ".join(f"{k} {n}" for k, n in r["tool_errors"].most_common())
    print(f"  tool calls by outcome:      {outcomes or '-'}")
    for kind, n in v.most_common():
        print(f"  VIOLATION {kind} x{n}: {r['first'][kind]}")
    return not v


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actions", type=int, default=10_000, help="fuzzed actions per env")
    parser.add_argument("--envs", nargs="+", default=list(ENVS), choices=ENVS)
    parser.add_argument("--sandbox", default="auto", choices=["auto", "bwrap", "rlimit"])
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis's random seed")
    args = parser.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory(prefix="agentenv-fuzz-rag-") as cache_dir:
        for env_id in args.envs:
            ok &= report(fuzz_env(env_id, args.actions, args.sandbox, args.seed, cache_dir))
    print("\nall invariants held" if ok else "\nINVARIANTS BROKEN (see VIOLATION lines)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
