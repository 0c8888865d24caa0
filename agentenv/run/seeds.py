"""Seeds as the unit of a result: run a recipe once per seed, evaluate each, report the set.

One RL run is one draw: the same recipe can land far apart by seed alone. ``agentenv
seeds`` runs ``agentenv train`` once per seed (one after another, or ``--jobs`` at a time,
each its own process) into ``OUT/seed_N``, evaluates each run's last checkpoint on the
test split into ``OUT/seed_N/eval.json`` and reports the arm::

    agentenv seeds --seeds 0 1 2 --eval-tasks 184 --baseline runs/sft_eval.json -- \\
        --config examples/rag_bridge_grpo.yaml --credit gae --output-dir runs/bridge_gae

A seed whose ``eval.json`` exists is done and skipped; one whose run stopped part way
resumes (``--resume``). :func:`format_arms` reports arms side by side: every seed's
held-out accuracy, their mean, standard deviation (n - 1) and minimum, each seed's paired
difference from the baseline with its standard error (the same tasks, :func:`~agentenv.
run.evaluate.compare`), and the tool-use metrics and costs each seed recorded (training
wall time and peak RSS; for a resumed seed, the sum of its step times and its last part's
peak RSS).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agentenv.errors import InvalidOptionError
from agentenv.run.evaluate import EvalReport, compare

#: Metrics of an eval report that the arm table shows (averaged over seeds) where present.
SHOWN_METRICS = ("tool_calls_mean", "second_hop_recall")


@dataclass
class Arm:
    """One recipe's seeds: each seed's eval report and, where the run recorded it, its cost.

    Attributes:
        label: The arm's name in the table (its folder's name by default).
        seeds: ``{seed: report}`` in seed order.
        costs: ``{seed: {"wall_s": ..., "peak_rss_gb": ...}}`` of the seeds' training runs.
    """

    label: str
    seeds: dict[int, EvalReport]
    costs: dict[int, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def load(cls, folder: str | Path, label: str | None = None, part: str | None = None) -> Arm:
        """The arm in ``folder`` (its ``seed_N/eval.json`` and ``seed_N/cost.json``); with
        ``part``, each report's part of that env (of runs on several envs, e.g. a schedule
        that ends on the env a one-env baseline was evaluated on)."""
        folder = Path(folder)
        seeds, costs = {}, {}
        for path in sorted(folder.glob("seed_*/eval.json")):
            seed = int(path.parent.name.removeprefix("seed_"))
            report = EvalReport.load(path)
            seeds[seed] = report.part(part) if part is not None else report
            cost = path.parent / "cost.json"
            if cost.exists():
                costs[seed] = json.loads(cost.read_text())
        if not seeds:
            raise InvalidOptionError(
                f"{folder} holds no seed_N/eval.json; run `agentenv seeds ... -- "
                f"--output-dir {folder}` first"
            )
        name = label or (f"{folder.name}/{part}" if part else folder.name)
        return cls(name, dict(sorted(seeds.items())), costs)

    def accuracies(self) -> list[float]:
        return [r.metrics["accuracy"] for r in self.seeds.values()]


def summary(values: Sequence[float]) -> dict[str, float]:
    """``mean``, ``sd`` (sample, n - 1; nan for one value) and ``min`` of ``values``."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
    return {"mean": mean, "sd": sd, "min": min(values)}


def paired(arm: Arm, baseline: EvalReport) -> dict[int, tuple[float, float]]:
    """Each seed's accuracy minus the baseline's on the same tasks: ``{seed: (diff, se)}``."""
    out = {}
    for seed, report in arm.seeds.items():
        d = compare(baseline, report)
        out[seed] = (d["accuracy_diff"], d["accuracy_diff_stderr"])
    return out


def format_arms(arms: Sequence[Arm], baseline: EvalReport | None = None) -> str:
    """The arms side by side, one line each (see the module docstring)."""
    lines = []
    if baseline is not None:
        name = baseline.label or "baseline"
        lines.append(f"baseline {name}: accuracy {baseline.metrics['accuracy']:.3f}")
    for arm in arms:
        acc = arm.accuracies()
        s = summary(acc)
        seeds = " / ".join(f"{a:.3f}" for a in acc)
        sd = "" if math.isnan(s["sd"]) else f" ± {s['sd']:.3f}"
        line = (
            f"{arm.label}: seeds {', '.join(map(str, arm.seeds))}: {seeds}; "
            f"mean {s['mean']:.3f}{sd}, min {s['min']:.3f}"
        )
        if baseline is not None:
            diffs = paired(arm, baseline)
            line += "; vs baseline " + " / ".join(
                f"{d:+.3f} ± {se:.3f}" for d, se in diffs.values()
            )
        for key in SHOWN_METRICS:
            values = [r.metrics[key] for r in arm.seeds.values() if key in r.metrics]
            if values:
                line += f"; {key} {' / '.join(f'{v:.3f}' for v in values)}"
        if arm.costs:
            line += "; train " + " / ".join(_format_cost(c) for c in arm.costs.values())
        lines.append(line)
    return "\n".join(lines)


def _train_s(cost: dict[str, float]) -> float:
    """A seed's training time: the process's wall, or a resumed run's step times."""
    return cost["steps_s"] if cost.get("resumed") else cost["wall_s"]


def _format_cost(cost: dict[str, float]) -> str:
    if cost.get("resumed"):
        return (
            f"{_train_s(cost) / 60:.0f} min (resumed: its step times) "
            f"{cost['peak_rss_gb']:.1f} GB (its last part)"
        )
    return f"{_train_s(cost) / 60:.0f} min {cost['peak_rss_gb']:.1f} GB"


def train_cost(cost: dict[str, float], folder: Path, resumed: bool) -> dict[str, float]:
    """What ``cost.json`` records of a seed's training: the train process's wall time and
    peak RSS. A resumed run's process saw only its last part, so it also gets ``resumed``
    (1.0) and ``steps_s``, the sum of ``time/step_s`` over every part (``metrics.jsonl``
    keeps one row per step across resumes), which the report shows in place of the wall."""
    if not resumed:
        return cost
    from agentenv.run.tracking import read_metrics

    steps_s = sum(row.get("time/step_s", 0.0) for row in read_metrics(folder))
    return {**cost, "resumed": 1.0, "steps_s": steps_s}


def _run(cmd: list[str], log: Path, env: dict[str, str]) -> tuple[int, dict[str, float]]:
    """Run ``cmd`` with its output in ``log``; its exit code, wall time and peak RSS."""
    start = time.perf_counter()
    with log.open("a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
    proc.returncode = os.waitstatus_to_exitcode(status)
    cost = {"wall_s": time.perf_counter() - start, "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9}
    return proc.returncode, cost


@dataclass
class SeedJob:
    """One seed of an arm: where it runs and the commands that train and evaluate it."""

    seed: int
    folder: Path
    train: list[str]
    evaluate: list[str]


def seed_jobs(
    train_args: Sequence[str],
    seeds: Sequence[int],
    eval_tasks: int | None,
    out: Path,
    eval_args: Sequence[str] = (),
) -> list[SeedJob]:
    """The train and eval commands of each seed (``python -m agentenv.cli ...``);
    ``eval_args`` go to eval too (e.g. ``--import MODULE``)."""
    python = [sys.executable, "-m", "agentenv.cli"]
    jobs = []
    for seed in seeds:
        folder = out / f"seed_{seed}"
        train = [*python, "train", *train_args, "--seed", str(seed), "--output-dir", str(folder)]
        if (folder / "config.json").exists():
            train.append("--resume")
        evaluate = [*python, "eval", *eval_args]  # --adapter: the last checkpoint, at the end
        if eval_tasks is not None:
            evaluate += ["--num-tasks", str(eval_tasks)]
        evaluate += ["--label", f"{out.name}-seed_{seed}", "--output", str(folder / "eval.json")]
        jobs.append(SeedJob(seed, folder, train, evaluate))
    return jobs


def run_job(job: SeedJob, env: dict[str, str]) -> str:
    """Train and evaluate one seed; a line saying how it went."""
    from algorithms.checkpoint import latest_checkpoint

    job.folder.mkdir(parents=True, exist_ok=True)
    log = job.folder / "seeds.log"
    code, cost = _run(job.train, log, env)
    if code != 0:
        return f"seed {job.seed}: train failed (exit {code}); see {log}"
    cost = train_cost(cost, job.folder, resumed="--resume" in job.train)
    (job.folder / "cost.json").write_text(json.dumps(cost))
    last = latest_checkpoint(job.folder / "checkpoints")
    code, _ = _run([*job.evaluate, "--adapter", str(last)], log, env)
    if code != 0:
        return f"seed {job.seed}: eval failed (exit {code}); see {log}"
    accuracy = EvalReport.load(job.folder / "eval.json").metrics["accuracy"]
    return f"seed {job.seed}: accuracy {accuracy:.3f} ({_train_s(cost) / 60:.1f} min training)"


def run_seeds(
    train_args: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    eval_tasks: int | None = None,
    jobs: int = 1,
    say: bool = True,
    eval_args: Sequence[str] = (),
    part: str | None = None,
) -> Arm:
    """Run every seed not done yet (``jobs`` at a time, each a process), then load the arm
    (``part``: see :meth:`Arm.load`).

    With ``jobs > 1`` each process gets ``OMP_NUM_THREADS`` = CPU cores // ``jobs`` and,
    where ``CUDA_VISIBLE_DEVICES`` lists several GPUs, one of them in turn."""
    from concurrent.futures import ThreadPoolExecutor

    todo = seed_jobs(train_args, seeds, eval_tasks, out, eval_args)
    todo = [job for job in todo if not (job.folder / "eval.json").exists()]
    gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    envs = []
    for i, _ in enumerate(todo):
        env = dict(os.environ)
        if jobs > 1:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
            if len(gpus) > 1:
                env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        envs.append(env)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for line in pool.map(run_job, todo, envs):
            if say:
                print(line, flush=True)
    return Arm.load(out, part=part)
