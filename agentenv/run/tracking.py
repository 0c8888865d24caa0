"""Run-directory logging: metrics.jsonl, TensorBoard, optional Weights & Biases, episodes.

Layout of a run directory::

    config.json            the resolved configuration
    metrics.jsonl          one JSON line per step (flushed as it is written)
    tb/                    TensorBoard events
    episodes/step_N.jsonl  sampled episodes: messages, tokens, mask, reward, advantage
    checkpoints/           see algorithms.checkpoint
    plots/*.png            drawn by agentenv.run.plots
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentenv.rollout.episode import Episode


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All rows of ``metrics.jsonl`` (a torn last line from a killed run is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


class RunLogger:
    """Writes metrics and sampled episodes of one run.

    Args:
        run_dir: The run directory (created).
        resume_step: When resuming, rows of ``metrics.jsonl`` after this step are
            dropped (they belong to work the checkpoint does not contain).
        tensorboard: Also write TensorBoard events under ``run_dir/tb``.
        wandb_project: Log to Weights & Biases under this project (needs ``wandb``).
        config: Logged to W&B as the run config.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        resume_step: int | None = None,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        config: dict[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        (self.run_dir / "episodes").mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_step is not None:
            kept = [r for r in read_metrics(self.run_dir) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=resume_step)
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise ImportError(
                    "wandb logging was requested but the package is missing: pip install wandb"
                ) from exc
            self._wandb = wandb.init(project=wandb_project, config=config, dir=str(self.run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one row (``step`` plus the metrics) and flush it to disk."""
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, float(v), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def log_episodes(
        self,
        step: int,
        episodes: Sequence[Episode],
        tokenizer: Any,
        advantages: Sequence[float] | None = None,
        turn_advantages: Sequence[Sequence[float]] | None = None,
    ) -> Path:
        """Write ``episodes/step_N.jsonl`` with per-token text for the viewer.

        ``advantages``: each episode's advantage; ``turn_advantages``: each episode's
        per-turn ones (``credit="turn"``; default: the episode's on every turn): what
        each turn's tokens trained with, logged beside its span and rewards."""
        path = self.run_dir / "episodes" / f"step_{step:06d}.jsonl"
        with path.open("w") as f:
            for i, e in enumerate(episodes):
                row = {
                    **({"env": e.env} if e.env else {}),
                    "group": e.group,
                    "seed": e.seed,
                    "reward": e.reward,
                    "stop_reason": e.stop_reason,
                    "num_turns": e.num_turns,
                    "messages": e.messages,
                    "input_ids": e.input_ids,
                    "action_mask": e.action_mask,
                    "tokens": [tokenizer.decode([t]) for t in e.input_ids],
                    "advantage": None if advantages is None else float(advantages[i]),
                    "turn_spans": [list(span) for span in e.turn_spans],
                    "step_rewards": e.step_rewards,
                    "turn_rewards": e.turn_rewards,
                    "turn_advantages": _turn_advantages(e, i, advantages, turn_advantages),
                    "info": _jsonable(e.info),
                }
                f.write(json.dumps(row) + "\n")
        return path

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def _turn_advantages(
    episode: Episode,
    i: int,
    advantages: Sequence[float] | None,
    turn_advantages: Sequence[Sequence[float]] | None,
) -> list[float] | None:
    """Episode ``i``'s per-turn advantages: given, else its one advantage on every turn."""
    if turn_advantages is not None:
        return [float(a) for a in turn_advantages[i]]
    if advantages is None:
        return None
    return [float(advantages[i])] * len(episode.turn_spans)
