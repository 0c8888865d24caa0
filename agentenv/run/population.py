"""A training step of a population, its evolution, and its lineage
(``agentenv train --population N``; :mod:`algorithms.population` holds the members).

Every step, each member in turn collects the step's tasks (the same tasks and seeds for
all members, so their rewards compare) at its own temperature and learns from them with
its own optimizer and hyper-parameters: a step of N members is N plain steps. Every
``evolve_every`` steps each member's fitness is measured (mean reward, greedy, on the
train split's first ``validation_tasks`` tasks) and :func:`algorithms.evolution.next_generation`
decides which members become mutated copies of which; the decision's random draws are
seeded by ``(seed, step)``, so a resumed run evolves as an uninterrupted one did.

The run directory gets, besides a plain run's files: ``metrics.jsonl`` rows with each
member's metrics under ``member<i>/`` (and ``rewards/mean``, ``kl``, ``loss``: the means
over members), ``lineage.jsonl`` (one line per evolution: each slot's parent, mutation
and fitness), ``plots/fitness.png`` and checkpoints holding every member
(``checkpoints/step_N/member_<i>/``, plain checkpoints, and ``population.json``).
``agentenv eval --adapter`` and ``agentenv export`` given such a checkpoint use its
fittest member.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentenv.errors import InvalidOptionError
from agentenv.run.config import EvalConfig, TrainConfig
from algorithms.config import HYPERPARAMETERS

LINEAGE_FILE = "lineage.jsonl"


def run_values(config: TrainConfig) -> dict[str, float]:
    """The run's own value of each hyper-parameter a member may have of its own."""
    grpo, sampling = config.grpo, config.rollout.sampling
    return {
        "learning_rate": float(grpo.learning_rate),
        "beta": float(grpo.beta),
        "entropy_coef": float(grpo.entropy_coef),
        "temperature": float(sampling.temperature),
    }


def start_hyperparameters(config: TrainConfig) -> list[dict[str, float]]:
    """Each member's starting hyper-parameters: the run's, with ``member_start``'s values.

    Raises:
        InvalidOptionError: a member would start with beta > 0 while ``grpo.beta`` is 0 (the
            KL reference is built only for a run with beta > 0).
    """
    evo = config.evolution
    assert set(run_values(config)) == set(HYPERPARAMETERS)
    members = []
    for index in range(evo.population):
        hp = run_values(config)
        hp.update({name: float(values[index]) for name, values in evo.member_start.items()})
        members.append(hp)
    if config.grpo.beta == 0 and any(hp["beta"] > 0 for hp in members):
        raise InvalidOptionError(
            "member_start gives a member beta > 0 but grpo.beta is 0, so no KL reference is "
            "built; set grpo.beta > 0 (e.g. the smallest member's), or leave beta out of "
            "member_start"
        )
    return members


def check_population(config: TrainConfig) -> None:
    """Refuse, before any model loads, a population the trainer cannot run."""
    if config.evolution.population == 1:
        return
    if not config.grpo.use_lora:
        raise InvalidOptionError(
            f"population={config.evolution.population} trains LoRA adapters on one base "
            "model; set grpo.use_lora true (full fine-tuning would hold a model per member)"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise InvalidOptionError(
            "a population swaps whole adapters in and out of the model, which FSDP2 shards; "
            "run it without FSDP (DDP: plain accelerate launch)"
        )
    start_hyperparameters(config)  # raises on a beta without a reference


def fitness_config(config: TrainConfig) -> EvalConfig:
    """How fitness is measured: greedy, the train split's first ``validation_tasks``."""
    rollout = config.rollout
    return EvalConfig(
        split="train",
        num_tasks=config.evolution.validation_tasks,
        max_turns=rollout.max_turns,
        max_new_tokens=rollout.sampling.max_new_tokens,
        max_episode_tokens=rollout.max_episode_tokens,
    )


def measure_fitness(
    population: Any,
    train_env: Callable[[], Any],
    policy: Any,
    fmt: Any,
    config: TrainConfig,
    main: bool,
) -> list[float]:
    """Each member's mean reward on the validation slice (the main process measures, the
    others receive the values)."""
    from accelerate.utils import broadcast_object_list

    from agentenv.run.evaluate import evaluate

    cfg = fitness_config(config)
    fitness: list[Any] = [None] * len(population)
    for index in range(len(population)):
        population.activate(index)
        policy.refresh()
        if main:
            report = evaluate(
                train_env, policy, fmt, cfg, label=f"member {index}", show_progress=False
            )
            fitness[index] = float(report.metrics["mean_reward"])
    if population.trainer.accelerator.num_processes > 1:
        fitness = broadcast_object_list(fitness)
    for member, value in zip(population.members, fitness, strict=True):
        member.fitness.append(float(value))
    return [float(v) for v in fitness]


def evolve(population: Any, fitness: list[float], config: TrainConfig, step: int) -> dict:
    """One evolution after step ``step``: the next generation carried out on ``population``;
    returns its lineage record ``{"step", "fitness", "children": [...]}``."""
    from algorithms.evolution import next_generation

    rng = random.Random(f"{config.seed}-{step}-evolve")
    children = next_generation(fitness, population.hyperparameters, rng, config.evolution)
    for child in children:  # losers' slots get copies; a loser is never a parent
        population.copy(child.parent, child.slot, child.hyperparameters)
    return {
        "step": step,
        "fitness": fitness,
        "children": [
            {
                "slot": c.slot,
                "parent": c.parent,
                "elite": c.elite,
                "mutation": {k: list(v) for k, v in c.mutation.items()},
                "hyperparameters": c.hyperparameters,
            }
            for c in children
        ],
    }


def member_metrics(index: int, metrics: dict[str, float]) -> dict[str, float]:
    """A member's step metrics under ``member<index>/``."""
    return {f"member{index}/{key}": value for key, value in metrics.items()}


def mean_metrics(per_member: list[dict[str, float]]) -> dict[str, float]:
    """The members' mean of every metric they all have (what the progress bar and the plain
    plots read)."""
    keys = set.intersection(*(set(m) for m in per_member))
    return {k: sum(m[k] for m in per_member) / len(per_member) for k in sorted(keys)}


def write_lineage(run_dir: Path, lineage: list[dict]) -> None:
    """``lineage.jsonl``: one line per evolution (rewritten whole, atomically)."""
    path = run_dir / LINEAGE_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(record) + "\n" for record in lineage))
    os.replace(tmp, path)


def read_lineage(run_dir: str | Path) -> list[dict]:
    """The records of ``lineage.jsonl`` (empty if there is none)."""
    path = Path(run_dir) / LINEAGE_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_fitness(run_dir: str | Path) -> Path | None:
    """``plots/fitness.png``: each slot's fitness and learning rate at every evolution."""
    lineage = read_lineage(run_dir)
    if not lineage:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in lineage]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5.5), sharex=True)
    for slot in range(len(lineage[0]["fitness"])):
        top.plot(steps, [r["fitness"][slot] for r in lineage], marker="o", label=f"member {slot}")
        lrs = [r["children"][slot]["hyperparameters"]["learning_rate"] for r in lineage]
        bottom.plot(steps, lrs, marker="o", label=f"member {slot}")
    top.set_ylabel("fitness (before the evolution)")
    bottom.set_ylabel("learning rate (after)")
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(fontsize=8)
    fig.tight_layout()
    out = Path(run_dir) / "plots" / "fitness.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
