"""A population of LoRA adapters on one base model, trained by one :class:`GRPO` trainer.

Each member is an adapter (its own copy of the trainer's trainable parameters), an AdamW
with its own state, its own LR schedule, critic and loss scale (where the trainer has
them) and its own hyper-parameters (:data:`~algorithms.config.HYPERPARAMETERS`). One set of
adapter weights is live in the model at a time: :meth:`Population.activate` stores the
live weights into the member that had them, copies the next member's in (in place, so
the sampler sees the change like an optimizer step's) and points the trainer at that
member's optimizer, schedule, critic, scaler, config and sampling settings. So the
memory of N members is one model plus N adapters and N optimizer states.

Why copies into one adapter rather than peft's named adapters switched with
``set_adapter``: the trainable parameters stay the same tensors, so everything built on
them keeps working unchanged: accelerate's DDP (which fixes the set of trainable
parameters when it wraps the model), the sampler's LoRA layers (built for the active
adapter), GRPO's frozen reference adapter, and the checkpoints (a member saves as a
plain checkpoint). Under ``accelerate launch`` every process holds every member and
trains each on its share of the tasks, the gradients reduced as in a plain run.

:meth:`Population.copy` makes one member a copy of another (weights, optimizer state,
schedule, critic and scaler, all deep copies: no tensor is shared afterwards) with new
hyper-parameters and a fresh **lineage id**. Each member has one: its slot index at the
start, then the next unused id for every copy. A member's sampling draws are seeded by its
lineage id (:func:`agentenv.run.population.member_sample_seed`), so a copy, even one
without a mutation, draws other episodes than its parent from its first step: without
that, an unmutated copy would have its parent's weights, settings and draws and repeat
it step for step. :meth:`Population.save` / :meth:`Population.load` write and restore the
whole population atomically (one plain checkpoint per member plus ``population.json``,
which holds the lineage ids, so a resumed run draws as an uninterrupted one).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentenv.errors import InvalidOptionError
from algorithms.checkpoint import (
    MARKER,
    checkpoint_step,
    load_checkpoint,
    publish,
    save_checkpoint,
)
from algorithms.config import HYPERPARAMETERS

POPULATION_FILE = "population.json"
# what a member owns of the trainer's state besides its weights (None where absent)
_OWN = ("optimizer", "scheduler", "critic", "scaler")


def member_dir(index: int) -> str:
    """A member's folder in a population checkpoint: a plain checkpoint."""
    return f"member_{index}"


def set_peak_lr(scheduler: Any, learning_rate: float) -> None:
    """Make ``learning_rate`` the peak LR of ``scheduler`` (a ``LambdaLR``, as every
    schedule here is) and of its optimizer, at the schedule's current point."""
    scheduler.base_lrs = [learning_rate] * len(scheduler.base_lrs)
    groups = scheduler.optimizer.param_groups
    for group, factor in zip(groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]


@dataclass
class Member:
    """One member: its adapter weights (the trainer's trainable parameters, in order; stale
    while it is the active one), what it owns of the trainer's state, its hyper-parameters,
    its lineage id (what seeds its draws; a copy gets a fresh one) and the fitness measured
    at each evolution."""

    hyperparameters: dict[str, float]
    weights: list[torch.Tensor]
    own: dict[str, Any]
    lineage_id: int
    fitness: list[float] = field(default_factory=list)


class Population:
    """N members on ``trainer``'s model (see the module docstring).

    Args:
        trainer: A LoRA :class:`~algorithms.grpo.GRPO` (its optimizer, schedule, critic and
            scaler become member 0's; the others start as fresh copies of them).
        hyperparameters: Each member's starting hyper-parameters (one dict per member,
            every name of :data:`~algorithms.config.HYPERPARAMETERS`).
        sampling: The run's sampling settings; a member's ``temperature`` replaces theirs.
    """

    def __init__(self, trainer: Any, hyperparameters: list[dict[str, float]], sampling: Any):
        if not trainer.config.use_lora:
            raise InvalidOptionError(
                "a population's members are LoRA adapters on one base model; set "
                "grpo.use_lora true (full fine-tuning would need a model per member)"
            )
        missing = [n for hp in hyperparameters for n in HYPERPARAMETERS if n not in hp]
        if missing:
            raise InvalidOptionError(
                f"every member needs every hyper-parameter of {list(HYPERPARAMETERS)}; "
                f"missing {sorted(set(missing))}"
            )
        self.trainer = trainer
        self.base_config = trainer.config
        self.base_sampling = sampling
        self.members: list[Member] = []
        for index, hp in enumerate(hyperparameters):
            if index == 0:
                own = {name: getattr(trainer, name, None) for name in _OWN}
            else:
                optimizer, scheduler = trainer.new_optimizer(hp["learning_rate"])
                own = {
                    "optimizer": optimizer,
                    "scheduler": scheduler,
                    "critic": copy.deepcopy(getattr(trainer, "critic", None)),
                    "scaler": copy.deepcopy(getattr(trainer, "scaler", None)),
                }
            set_peak_lr(own["scheduler"], hp["learning_rate"])
            weights = [p.detach().clone() for p in trainer._params]
            self.members.append(Member(dict(hp), weights, own, lineage_id=index))
        self.next_lineage_id = len(self.members)  # the id the next copy gets
        self.active: int | None = None
        self.activate(0)

    def __len__(self) -> int:
        return len(self.members)

    @property
    def hyperparameters(self) -> list[dict[str, float]]:
        return [dict(m.hyperparameters) for m in self.members]

    def best(self) -> int:
        """The fittest member by its last measured fitness (never measured: -inf; ties: the
        lower index)."""
        return _fittest([m.fitness for m in self.members])

    @torch.no_grad()
    def _store(self) -> None:
        """Copy the live weights into the active member (its copy is stale while active)."""
        if self.active is not None:
            for stored, live in zip(
                self.members[self.active].weights, self.trainer._params, strict=True
            ):
                stored.copy_(live)

    @torch.no_grad()
    def activate(self, index: int) -> Member:
        """Make member ``index`` the one the trainer trains and the sampler samples: its
        weights into the model (in place), its optimizer, schedule, critic, scaler, config
        and temperature into the trainer. Returns it."""
        member = self.members[index]
        if self.active != index:
            self._store()
            for live, stored in zip(self.trainer._params, member.weights, strict=True):
                live.copy_(stored)  # bumps the parameters' versions: the sampler re-syncs
            self.active = index
        hp = member.hyperparameters
        for name, value in member.own.items():
            if value is not None:
                setattr(self.trainer, name, value)
        self.trainer.config = dataclasses.replace(
            self.base_config,
            learning_rate=hp["learning_rate"],
            beta=hp["beta"],
            entropy_coef=hp["entropy_coef"],
        )
        self.trainer.sampling = self.sampling(index)
        return member

    def sampling(self, index: int) -> Any:
        """The sampling settings member ``index`` collects with (its temperature)."""
        temperature = self.members[index].hyperparameters["temperature"]
        return dataclasses.replace(self.base_sampling, temperature=temperature)

    @torch.no_grad()
    def copy(self, source: int, target: int, hyperparameters: dict[str, float]) -> None:
        """Make member ``target`` a copy of member ``source`` (weights, optimizer state,
        schedule, critic, scaler; deep copies) with ``hyperparameters`` and a fresh lineage
        id (``source == target``: only the new hyper-parameters, the same id)."""
        self._store()
        src, dst = self.members[source], self.members[target]
        if source != target:
            for to, from_ in zip(dst.weights, src.weights, strict=True):
                to.copy_(from_)
            for name in _OWN:
                if src.own[name] is not None:
                    dst.own[name].load_state_dict(copy.deepcopy(src.own[name].state_dict()))
            dst.fitness = list(src.fitness)
            dst.lineage_id = self.next_lineage_id  # its own draws from now on
            self.next_lineage_id += 1
            if self.active == target:  # its weights are live: put the copy in
                for live, stored in zip(self.trainer._params, dst.weights, strict=True):
                    live.copy_(stored)
        dst.hyperparameters = dict(hyperparameters)
        set_peak_lr(dst.own["scheduler"], hyperparameters["learning_rate"])
        if self.active == target:
            self.activate(target)  # its new config and temperature

    def state(self) -> dict[str, Any]:
        """What ``population.json`` holds besides the members' checkpoints."""
        return {
            "step": self.trainer.step,
            "next_lineage_id": self.next_lineage_id,
            "members": [
                {
                    "index": i,
                    "lineage_id": m.lineage_id,
                    "hyperparameters": m.hyperparameters,
                    "fitness": m.fitness,
                }
                for i, m in enumerate(self.members)
            ],
        }

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write the population to the folder ``path`` atomically: ``member_<i>/`` (a plain
        checkpoint each, with the member's config) and ``population.json`` (hyper-parameters,
        fitness, and ``extra``, e.g. the lineage), then the completion marker. Every process
        calls it (the checkpoints' collectives); the main process writes."""
        path = Path(path)
        acc = self.trainer.accelerator
        tmp = path.with_name(f"{path.name}.tmp-population")  # one name on every process
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        active = self.active
        for index in range(len(self)):
            self.activate(index)
            save_checkpoint(self.trainer, tmp / member_dir(index))
        if active is not None:
            self.activate(active)
        if acc.is_main_process:
            state = {**self.state(), **(extra or {})}
            (tmp / POPULATION_FILE).write_text(json.dumps(state, indent=2))
            publish(tmp, path, {"step": self.trainer.step})
        acc.wait_for_everyone()
        return path

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore every member (weights, optimizer, schedule, critic, scaler, step, RNG)
        and its hyper-parameters, lineage id and fitness from :meth:`save`'s folder; return
        ``population.json``'s contents."""
        path = Path(path)
        if checkpoint_step(path) is None or not (path / POPULATION_FILE).is_file():
            raise InvalidOptionError(
                f"{path} is not a complete population checkpoint (no {MARKER} or "
                f"{POPULATION_FILE}); pass a folder that Population.save wrote"
            )
        state = json.loads((path / POPULATION_FILE).read_text())
        if len(state["members"]) != len(self):
            raise InvalidOptionError(
                f"{path} holds {len(state['members'])} members, this population has "
                f"{len(self)}; resume with population={len(state['members'])}"
            )
        for saved, member in zip(state["members"], self.members, strict=True):
            member.hyperparameters = dict(saved["hyperparameters"])
            member.fitness = list(saved["fitness"])
            member.lineage_id = int(saved.get("lineage_id", saved["index"]))  # older: none
        self.next_lineage_id = int(
            state.get("next_lineage_id", max(m.lineage_id for m in self.members) + 1)
        )
        for index in reversed(range(len(self))):  # member 0 last: its RNG state wins
            self.activate(index)  # its config and optimizer, then its saved state
            load_checkpoint(self.trainer, path / member_dir(index))
            self._store()
        return state


def is_population_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder :meth:`Population.save` wrote."""
    return (Path(path) / POPULATION_FILE).is_file()


def best_member(path: str | Path) -> tuple[Path, int]:
    """The folder of the fittest member of a population checkpoint (by its last measured
    fitness; members never measured count as -inf, ties go to the lower index), and its
    index."""
    state = json.loads((Path(path) / POPULATION_FILE).read_text())
    best = _fittest([m["fitness"] for m in state["members"]])
    return Path(path) / member_dir(best), best


def _fittest(histories: list[list[float]]) -> int:
    """The index whose last fitness is highest (none yet: -inf; ties: the lower index)."""
    last = [h[-1] if h else float("-inf") for h in histories]
    return max(range(len(last)), key=lambda i: (last[i], -i))
