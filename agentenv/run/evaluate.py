"""Evaluate a policy on an environment's split: accuracy, pass@k, format and tool use.

Task ``i`` of the split is always evaluated as ``reset(seed=seed + i,
options={"task_id": i})``, so two evaluations with the same settings see the same
tasks and can be compared pairwise (:func:`compare`). Sampled evaluations
(``temperature > 0``) draw each episode's tokens from seeds of ``(seed, task, sample,
turn)`` (:func:`agentenv.rollout.collect.trajectory_seed`), not from a global generator:
the same command gives the same episodes, and in float32 so does another
``tasks_per_batch``. In bfloat16 another batch shape rounds the logits otherwise, so a
sampled episode may part from its counterpart at a near tie (greedy ones too, rarely).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import gymnasium as gym
from tqdm.auto import tqdm

from agentenv.errors import InvalidOptionError
from agentenv.lm.backend import PolicyBackend, SamplingConfig
from agentenv.rollout.collect import collect
from agentenv.rollout.config import RolloutConfig
from agentenv.rollout.episode import ChatFormat, Episode
from agentenv.rollout.stats import retrieval_stats, tool_call_stats
from agentenv.run.config import EvalConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al., 2021): ``1 - C(n-c, k) / C(n, k)``.

    Args:
        n: Samples drawn for the task.
        c: Correct samples among them.
        k: The k of pass@k (``k <= n``).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def turn_fractions(groups: Sequence[Sequence[Episode]]) -> list[float]:
    """Per task, the share of its user turns answered correctly (a conversation env's
    ``info["turns_correct"] / info["user_turns"]``), averaged over its episodes; an episode
    that reports none (a failed one) counts 0. Empty where no episode reports user turns."""
    if not any(e.info.get("user_turns") for g in groups for e in g):
        return []

    def share(e: Episode) -> float:
        turns = e.info.get("user_turns")
        return e.info.get("turns_correct", 0) / turns if turns else 0.0

    return [sum(share(e) for e in g) / len(g) for g in groups]


def summarize(groups: Sequence[Sequence[Episode]]) -> dict[str, float]:
    """Aggregate metrics over groups of episodes (one group per task)."""
    episodes = [e for g in groups for e in g]
    n_ep, n_tasks = len(episodes), len(groups)
    correct = [[bool(e.info.get("correct", False)) for e in g] for g in groups]
    per_task = [sum(c) / len(c) for c in correct]
    accuracy = sum(per_task) / n_tasks
    calls = sum(e.info.get("num_tool_calls", 0) for e in episodes)
    errors = sum(e.info.get("num_tool_errors", 0) for e in episodes)
    out = {
        "accuracy": accuracy,
        "accuracy_stderr": math.sqrt(accuracy * (1 - accuracy) / n_tasks),
        "mean_reward": sum(e.reward for e in episodes) / n_ep,
        "answer_rate": sum("answer" in e.info for e in episodes) / n_ep,
        "tool_call_rate": sum(e.info.get("num_tool_calls", 0) > 0 for e in episodes) / n_ep,
        "tool_error_rate": errors / calls if calls else 0.0,
        "mean_turns": sum(e.num_turns for e in episodes) / n_ep,
        "mean_tokens": sum(e.num_policy_tokens for e in episodes) / n_ep,
        "failed_rate": sum(e.failed for e in episodes) / n_ep,  # counted as incorrect
        "env_error_rate": sum(e.stop_reason == "env_error" for e in episodes) / n_ep,
        "timeout_rate": sum(e.stop_reason == "timeout" for e in episodes) / n_ep,
        "num_tasks": float(n_tasks),
        "samples": float(len(groups[0])),
        **tool_call_stats(episodes),
        **retrieval_stats(episodes),
    }
    turns = turn_fractions(groups)
    if turns:  # a conversation env: the share of user turns answered correctly
        out["turn_accuracy"] = sum(turns) / n_tasks
    k = 1
    while k <= len(groups[0]):
        out[f"pass@{k}"] = sum(pass_at_k(len(c), sum(c), k) for c in correct) / n_tasks
        k *= 2
    return out


@dataclass
class EvalReport:
    """Metrics plus per-task correctness (for paired comparisons).

    A report over several envs (:func:`evaluate_mixture`) holds each env's own report in
    ``by_env`` (name -> its fields) and, in ``metrics`` and ``per_task``, the pooled ones:
    every env's tasks in order, metrics averaged over them (``num_tasks`` and
    ``judge_failures`` summed) beside each env's main ones as ``<metric>/<env>``."""

    metrics: dict[str, float]
    per_task: list[float]
    config: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    by_env: dict[str, dict[str, Any]] = field(default_factory=dict)
    per_task_turns: list[float] = field(default_factory=list)  # conversations: turn_fractions

    def part(self, name: str) -> EvalReport:
        """Env ``name``'s own report (of a report over several envs)."""
        if name not in self.by_env:
            raise InvalidOptionError(
                f"report {self.label!r} has no env {name!r}; it has "
                f"{', '.join(self.by_env) or 'one env only'}"
            )
        return EvalReport(**self.by_env[name])

    def save(self, path: str | Path) -> None:
        """Write the report as JSON."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> EvalReport:
        """Read a report written by :meth:`save`."""
        return cls(**json.loads(Path(path).read_text()))


def evaluate(
    make_env: Callable[[], gym.Env],
    policy: PolicyBackend,
    fmt: ChatFormat,
    config: EvalConfig | None = None,
    *,
    label: str = "",
    show_progress: bool = True,
    judge: Any = None,
    about: dict[str, Any] | None = None,
    task_ids: Sequence[int] | None = None,
) -> EvalReport:
    """Run the policy on the first ``num_tasks`` tasks of the split (or on ``task_ids``).

    Args:
        make_env: Builds one env instance of the split to evaluate.
        policy: The policy backend.
        fmt: Chat format of the policy's tokenizer.
        config: What to evaluate.
        label: Name shown in tables (e.g. the model or checkpoint).
        show_progress: Progress bar over batches of tasks.
        judge: An :class:`~agentenv.run.judge.LLMJudge`: each final answer is also graded
            against the task's reference (``judge_score``: mean over episodes, 0 for an
            episode without an answer; ``judge_failures``: grades that fell back).
        about: What else the report's config records: ``env_id``, ``env_kwargs``,
            ``model``, ``adapter`` (:func:`format_table` heads the table with them).
        task_ids: The split's tasks to evaluate, by index, instead of its first
            ``num_tasks`` (a population's validation slice); ``per_task`` follows their order.
    """
    config = config or EvalConfig()
    if task_ids is None:
        probe = make_env()
        n = probe.num_tasks
        probe.close()
        task_ids = range(n if config.num_tasks is None else min(config.num_tasks, n))
    total = len(task_ids)
    rollout = RolloutConfig(
        group_size=config.samples,
        max_turns=config.max_turns,
        max_episode_tokens=config.max_episode_tokens,
        show_progress=False,
        sampling=SamplingConfig(config.max_new_tokens, temperature=config.temperature),
    )
    groups: list[list[Episode]] = []
    bar = tqdm(total=total, desc=f"eval {label}".strip(), disable=not show_progress)
    for start in range(0, total, config.tasks_per_batch):
        ids = task_ids[start : start + config.tasks_per_batch]
        batch, _ = collect(
            make_env,
            [config.seed + i for i in ids],
            policy,
            fmt,
            rollout,
            options=[{"task_id": i} for i in ids],
            sample_seed=config.seed,  # each episode's draws: its own, whatever shares its batch
        )
        groups.extend(batch)
        bar.update(len(ids))
    bar.close()
    per_task = [sum(bool(e.info.get("correct")) for e in g) / len(g) for g in groups]
    metrics = summarize(groups)
    if judge is not None:
        metrics.update(_judge(make_env, task_ids, groups, judge))
    about = {**(about or {}), **asdict(config)}
    return EvalReport(metrics, per_task, about, label, per_task_turns=turn_fractions(groups))


#: The metrics of each env that a report over several envs shows beside the pooled ones.
ENV_METRICS = (
    "accuracy", "accuracy_stderr", "mean_reward", "tool_call_rate", "mean_turns",
    "mean_tokens", "failed_rate",
)  # fmt: skip


def evaluate_mixture(
    mixture: Any,
    split: str,
    policy: PolicyBackend,
    fmt: ChatFormat,
    config: EvalConfig | None = None,
    *,
    label: str = "",
    show_progress: bool = False,
    judge: Any = None,
    about: dict[str, Any] | None = None,
) -> EvalReport:
    """:func:`evaluate` on ``split`` of each env of ``mixture``
    (:class:`~agentenv.env.mixture.Mixture`), its first ``num_tasks`` tasks each, with the
    env's own turn and token limits where it sets them; one env: that env's report, as
    :func:`evaluate` gives it. Several: their reports pooled (see :class:`EvalReport`)."""
    config = config or EvalConfig()
    parts = {}
    for spec in mixture.specs:
        cfg = replace(config, **spec.limits())
        own = {**(about or {}), "env_id": spec.env_id, "env_kwargs": spec.env_kwargs}
        own.pop("envs", None)
        parts[spec.name] = evaluate(
            functools.partial(spec.make, split), policy, fmt, cfg, label=label,
            show_progress=show_progress, judge=judge, about=own,
        )  # fmt: skip
    if len(parts) == 1:
        return next(iter(parts.values()))
    envs = [asdict(spec) for spec in mixture.specs]
    return pool_reports(parts, label, {**(about or {}), "envs": envs, **asdict(config)})


def pool_reports(parts: dict[str, EvalReport], label: str, config: dict[str, Any]) -> EvalReport:
    """One report of several envs' (``parts``: name -> report), see :class:`EvalReport`."""
    per_task = [x for part in parts.values() for x in part.per_task]
    sizes = [len(part.per_task) for part in parts.values()]
    keys = [
        k for k in next(iter(parts.values())).metrics if all(k in p.metrics for p in parts.values())
    ]
    metrics = {}
    for k in keys:
        values = [p.metrics[k] for p in parts.values()]
        if k in ("num_tasks", "judge_failures"):
            metrics[k] = sum(values)
        else:
            metrics[k] = sum(v * n for v, n in zip(values, sizes, strict=True)) / sum(sizes)
    accuracy = sum(per_task) / len(per_task)
    metrics["accuracy"] = accuracy
    metrics["accuracy_stderr"] = math.sqrt(accuracy * (1 - accuracy) / len(per_task))
    for name, part in parts.items():
        metrics.update({f"{k}/{name}": part.metrics[k] for k in ENV_METRICS if k in part.metrics})
    by_env = {name: asdict(part) for name, part in parts.items()}
    every = all(part.per_task_turns for part in parts.values())  # all conversations
    turns = [x for part in parts.values() for x in part.per_task_turns] if every else []
    return EvalReport(metrics, per_task, config, label, by_env, per_task_turns=turns)


def _judge(
    make_env: Callable[[], gym.Env],
    task_ids: Sequence[int],
    groups: list[list[Episode]],
    judge: Any,
) -> dict:
    """Grade every answered episode (one batched judge call); store each grade in its info."""
    env = make_env()
    try:
        items, answered = [], []
        for task_id, group in zip(task_ids, groups, strict=True):
            task = env.unwrapped.get_task(task_id)
            gold = task.answer[0] if isinstance(task.answer, list | tuple) else task.answer
            for episode in group:
                if "answer" in episode.info:
                    items.append((task.prompt, str(episode.info["answer"]), str(gold)))
                    answered.append(episode)
    finally:
        env.close()
    verdicts = judge.score_batch(items) if items else []
    for episode, verdict in zip(answered, verdicts, strict=True):
        episode.info["judge_score"] = verdict.reward
    n = sum(len(g) for g in groups)
    return {
        "judge_score": sum(v.reward for v in verdicts) / n,
        "judge_failures": float(sum(v.error is not None for v in verdicts)),
    }


def compare(a: EvalReport, b: EvalReport) -> dict[str, float]:
    """Paired difference ``b - a`` in accuracy over the same tasks, with its standard error;
    for reports over the same several envs, each env's too (``accuracy_diff/<env>``)."""
    out = {}
    if a.by_env and set(a.by_env) == set(b.by_env):
        for name in a.by_env:
            d = compare(a.part(name), b.part(name))
            out |= {f"{k}/{name}": v for k, v in d.items()}
    if len(a.per_task) != len(b.per_task):
        raise InvalidOptionError(
            f"reports cover different task counts ({len(a.per_task)} vs {len(b.per_task)}); "
            "evaluate both with the same split, num_tasks and seed"
        )
    out |= _paired("accuracy", a.per_task, b.per_task)
    if a.per_task_turns and len(a.per_task_turns) == len(b.per_task_turns):
        out |= _paired("turn_accuracy", a.per_task_turns, b.per_task_turns)
    return out


def _paired(name: str, a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """``{name}_diff``: the mean per-task difference ``b - a``; ``{name}_diff_stderr``: its
    standard error."""
    diffs = [y - x for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    return {f"{name}_diff": mean, f"{name}_diff_stderr": math.sqrt(var / n)}


def _what(report: EvalReport) -> dict[str, str]:
    """What a report evaluated, as the table's heading shows it (keys its config has)."""
    config, out = report.config, {}
    if config.get("envs"):
        out["env"] = ", ".join(f"{e['name']} ({e['env_id']})" for e in config["envs"])
    elif config.get("env_id"):
        kwargs = config.get("env_kwargs") or {}
        out["env"] = config["env_id"] + (f" {json.dumps(kwargs)}" if kwargs else "")
    if "split" in config:
        tasks = int(report.metrics.get("num_tasks", len(report.per_task)))
        out["split"] = f"{config['split']} ({tasks} tasks, seed {config.get('seed', 0)})"
    if config.get("model"):
        out["model"] = config["model"]
    if "adapter" in config:
        out["adapter"] = config["adapter"] or "none"
    return out


def format_table(reports: Sequence[EvalReport]) -> str:
    """A plain-text table of the reports' metrics, side by side, headed by what they
    evaluated (env, env kwargs, split, model, adapter); with two reports, the paired
    accuracy difference of the second over the first, labelled with their names."""
    keys = [k for k in reports[0].metrics if all(k in r.metrics for r in reports)]
    names = [r.label or f"run {i}" for i, r in enumerate(reports)]
    width = max(12, *(len(n) for n in names))
    lines = []
    heads = [_what(r) for r in reports]
    for what in ("env", "split", "model", "adapter"):
        values = [h.get(what, "?") for h in heads]
        if all(v == "?" for v in values):
            continue
        shown = (
            values[0]
            if len(set(values)) == 1
            else "; ".join(f"{n}: {v}" for n, v in zip(names, values, strict=True))
        )
        lines.append(f"{what + ':':9s}{shown}")
    lines.append(f"{'metric':22s}" + "".join(f"{n:>{width + 2}s}" for n in names))
    for k in keys:
        lines.append(f"{k:22s}" + "".join(f"{r.metrics[k]:>{width + 2}.4f}" for r in reports))
    if len(reports) == 2:
        d = compare(reports[0], reports[1])
        lines.append(
            f"accuracy diff ({names[1]} - {names[0]}): {d['accuracy_diff']:+.4f} "
            f"± {d['accuracy_diff_stderr']:.4f} (paired stderr)"
        )
        if "turn_accuracy_diff" in d:
            lines.append(
                f"turn accuracy diff: {d['turn_accuracy_diff']:+.4f} "
                f"± {d['turn_accuracy_diff_stderr']:.4f} (paired stderr)"
            )
        for name in reports[0].by_env:  # reports over several envs: each env's too
            if f"accuracy_diff/{name}" in d:
                diff, se = d[f"accuracy_diff/{name}"], d[f"accuracy_diff_stderr/{name}"]
                lines.append(f"  {name}: {diff:+.4f} ± {se:.4f}")
    return "\n".join(lines)
