"""PNG plots of a run's metrics (reward, eval accuracy, KL, loss, tokens/s, tool calls per
episode and the rate of a second call, the share of episodes with 0, 1, 2, 3+ calls, the
critic's value loss and explained variance, vs step). A run of several envs draws each
env's reward, eval accuracy, correct rate and no-signal fraction beside the pooled ones."""

from __future__ import annotations

import json
from pathlib import Path

from agentenv.rollout.stats import HISTOGRAM_TOP
from agentenv.run.tracking import read_metrics

PLOTS: dict[str, tuple[str, ...]] = {
    "reward": ("rewards/mean",),
    "eval_accuracy": ("eval/accuracy",),
    "kl": ("kl",),
    "loss": ("loss",),
    "tokens_per_second": ("tokens_per_second",),
    "tool_calls": (
        "rollout/tool_calls_mean",
        "rollout/second_call_rate",
        "rollout/requery_after_miss_rate",
        "rollout/second_hop_recall",
        "rollout/prices_found_rate",
    ),
    "tool_calls_histogram": (
        *(f"rollout/tool_calls/{k}" for k in range(HISTOGRAM_TOP)),
        f"rollout/tool_calls/{HISTOGRAM_TOP}+",
    ),
    "critic": ("critic/value_loss", "critic/explained_variance"),
}

#: Plots a run of several envs draws once per metric, a line per env (``<metric>/<env>``).
PER_ENV: dict[str, str] = {
    "reward": "rewards/mean",
    "eval_accuracy": "eval/accuracy",
    "correct_rate_per_env": "episodes/correct_rate",
    "no_signal_per_env": "frac_no_signal",
}


def _env_names(run_dir: Path) -> list[str]:
    """The env names of a run of several envs (its config.json's ``envs``), else []."""
    try:
        envs = json.loads((run_dir / "config.json").read_text()).get("envs") or []
    except (OSError, ValueError):
        return []
    return [e["name"] for e in envs if len(envs) > 1]


def plot_run(run_dir: str | Path) -> list[Path]:
    """Draw ``run_dir/plots/<name>.png`` for each metric that was logged; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    plots = dict(PLOTS)
    for name, metric in PER_ENV.items():
        own = tuple(f"{metric}/{env}" for env in _env_names(Path(run_dir)))
        if own:
            plots[name] = (*plots.get(name, ()), *own)
    for name, keys in plots.items():
        series = {k: [(r["step"], r[k]) for r in rows if k in r] for k in keys}
        if not any(series.values()):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k, points in series.items():
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=k)
        ax.set_xlabel("step")
        ax.set_title(name.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
