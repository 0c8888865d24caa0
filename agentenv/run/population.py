"""A training step of a population, its evolution, and its lineage
(``agentenv train --population N``; :mod:`algorithms.population` holds the members).

Every step, each member in turn collects the step's tasks (the same tasks for all
members, so their rewards compare) at its own temperature and learns from them with its
own optimizer and hyper-parameters: a step of N members is N plain steps. A member's
sampling draws are its lineage's (:func:`member_sample_seed`): a copy made by an evolution
draws other episodes than its parent from its first step, even when no mutation set it
apart (it would otherwise repeat its parent step for step, and the population shrink).

**Fitness** is measured every ``evolve_every`` steps (and after the last, to pick the best
member) on the **validation slice of the train split**: ``validation_tasks`` tasks chosen
by a stable hash of their index (:func:`validation_slice`), which training never draws
while ``population > 1`` (:class:`TaskSplit` maps each step's task seeds onto the other
tasks). A member's fitness is its mean reward over one episode per slice task, sampled
at the run's temperature (every member at the same one) from fixed seeds: every member
and every evolution sees the same tasks and seeds, and a measurement can be repeated
exactly. Why sampled, and 64 tasks rather than the 16 greedy ones of before: a greedy
episode is right or wrong per task whatever the probability behind it, so greedy fitness
moves in steps of ``1 / validation_tasks`` and ties (ties go to the lower index); 16
greedy tasks saturated near 0.85 on word problems and could not tell members apart. A
sampled episode follows the probability of a right answer, which moves before the greedy
answer flips: over the word-problems recipe the sampled training reward rose by
0.26-0.28 where greedy test accuracy rose by 0.185, more signal per episode at a similar
binomial spread; and 64 tasks halve the spread of 16. Not the training reward, though it
is free: it is sampled at each member's own temperature (a colder mutation would win by
sampling colder), on the tasks being trained on, by the policies before their updates.

:func:`evolve` then runs :func:`algorithms.evolution.next_generation`, whose draws are
seeded by ``(seed, step)``, so a resumed run evolves as an uninterrupted one did.

The run directory gets, besides a plain run's files: ``metrics.jsonl`` rows with each
member's metrics under ``member<i>/`` (and ``rewards/mean``, ``kl``, ``loss``: the means
over members), ``lineage.jsonl`` (one line per evolution: each slot's parent, mutation
and fitness), ``plots/fitness.png`` and checkpoints holding every member
(``checkpoints/step_N/member_<i>/``, plain checkpoints, and ``population.json`` with the
lineage ids). ``agentenv eval --adapter`` and ``agentenv export`` given such a checkpoint
use its fittest member.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
import os
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agentenv.errors import InvalidOptionError
from agentenv.run.config import EvalConfig, TrainConfig
from algorithms.config import HYPERPARAMETERS

LINEAGE_FILE = "lineage.jsonl"
FITNESS_BATCH = 32  # slice tasks collected together when fitness is measured


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


def member_sample_seed(sample_seed: int, lineage_id: int) -> int:
    """The sampling seed of the member of lineage ``lineage_id`` at a step whose plain
    sampling seed is ``sample_seed``: lineage 0 (a plain run's one member, a population's
    first until an evolution overwrites it) draws the plain run's, every other its own."""
    if lineage_id == 0:
        return sample_seed
    return random.Random(f"{sample_seed}-lineage-{lineage_id}").getrandbits(63)


def validation_slice(num_tasks: int, size: int) -> tuple[int, ...]:
    """The validation slice of a train split of ``num_tasks`` tasks: the ``size`` task
    indices whose stable hash (BLAKE2b of ``"validation-<index>"``) is lowest, in order:
    a fixed sample of the split, the same for every run, seed and member.

    Raises:
        InvalidOptionError: ``size`` leaves no task to train on.
    """
    if size >= num_tasks:
        raise InvalidOptionError(
            f"validation_tasks={size} would hold out the whole train split ({num_tasks} tasks) "
            f"for fitness; set validation_tasks below {num_tasks} (e.g. {max(1, num_tasks // 8)})"
        )

    def key(index: int) -> bytes:
        return hashlib.blake2b(f"validation-{index}".encode(), digest_size=8).digest()

    return tuple(sorted(heapq.nsmallest(size, range(num_tasks), key=key)))


@dataclass(frozen=True)
class TaskSplit:
    """The train split of a population run: its validation slice (fitness) and the rest
    (training).

    Attributes:
        num_tasks: Tasks in the train split.
        validation: The validation slice's task indices, ascending.
    """

    num_tasks: int
    validation: tuple[int, ...]

    @property
    def num_training(self) -> int:
        return self.num_tasks - len(self.validation)

    def training_task(self, task_seed: int) -> int:
        """The training task of a step's task seed: the ``task_seed % num_training``-th
        index outside the validation slice (uniform over them; a pure function of the
        seed, so every member and every process maps a seed to the same task)."""
        index = task_seed % self.num_training
        for held_out in self.validation:  # ascending: skip each one at or below it
            if held_out > index:
                break
            index += 1
        return index

    def training_options(self, task_seeds: list[int]) -> list[dict[str, int]]:
        """The reset options (``{"task_id": i}``) of a step's tasks: never a slice task."""
        return [{"task_id": self.training_task(seed)} for seed in task_seeds]


def task_splits(config: TrainConfig, say: bool = False) -> dict[int, TaskSplit]:
    """The train split of each env of a population run (``{env index: split}``, one env
    unless ``envs`` lists several) with ``config.evolution.validation_tasks`` tasks carved
    out of each for fitness (none for a plain run: it trains on the whole split); with
    ``say``, print what was held out (stderr)."""
    if config.evolution.population == 1:
        return {}
    splits = {}
    for index, spec in enumerate(config.mixture().specs):
        env = spec.make("train")
        try:
            num_tasks = int(env.unwrapped.num_tasks)
        finally:
            env.close()
        size = config.evolution.validation_tasks
        splits[index] = TaskSplit(num_tasks, validation_slice(num_tasks, size))
        if say:
            print(
                f"population: fitness on the validation slice of {spec.name}'s train split, "
                f"{size} of its {num_tasks} tasks (never drawn for training)",
                file=sys.stderr,
            )
    return splits


def measure_fitness(
    population: Any,
    mixture: Any,
    policy: Any,
    fmt: Any,
    config: TrainConfig,
    main: bool,
    splits: dict[int, TaskSplit],
) -> list[float]:
    """Each member's mean reward on the validation slices (of every env of the run's
    ``mixture``, pooled over their tasks): one episode per task, sampled at the run's
    temperature, task ``i`` reset with seed ``config.seed + i`` and its tokens drawn from
    seeds of ``config.seed`` (:func:`agentenv.run.evaluate.evaluate`). The main process
    measures, the others receive the values."""
    from accelerate.utils import broadcast_object_list

    from agentenv.run.evaluate import evaluate

    rollout = config.rollout
    cfg = EvalConfig(
        split="train",
        temperature=rollout.sampling.temperature,
        max_turns=rollout.max_turns,
        max_new_tokens=rollout.sampling.max_new_tokens,
        max_episode_tokens=rollout.max_episode_tokens,
        tasks_per_batch=FITNESS_BATCH,
        seed=config.seed,
    )
    fitness: list[Any] = [None] * len(population)
    for index in range(len(population)):
        population.activate(index)
        policy.refresh()
        if not main:
            continue
        rewards = []  # (mean reward, tasks) per env
        for env, split in splits.items():
            spec = mixture.specs[env]
            own = replace(cfg, **spec.limits())
            report = evaluate(
                functools.partial(spec.make, "train"), policy, fmt, own,
                show_progress=False, task_ids=split.validation,
            )  # fmt: skip
            rewards.append((float(report.metrics["mean_reward"]), len(split.validation)))
        fitness[index] = (
            rewards[0][0]
            if len(rewards) == 1
            else sum(r * n for r, n in rewards) / sum(n for _, n in rewards)
        )
    if population.trainer.accelerator.num_processes > 1:
        fitness = broadcast_object_list(fitness)
    for member, value in zip(population.members, fitness, strict=True):
        member.fitness.append(float(value))
    return [float(v) for v in fitness]


def evolve(population: Any, fitness: list[float], config: TrainConfig, step: int) -> dict:
    """One evolution after step ``step``: the next generation carried out on ``population``;
    returns its lineage record ``{"step", "fitness", "children": [...]}`` (each child's
    ``lineage_id``: its parent's if it stayed itself, a fresh one if it is a copy)."""
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
                "lineage_id": population.members[c.slot].lineage_id,
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
