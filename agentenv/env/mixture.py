"""Several environments in one run: each env's share of a step's groups, by weight.

A run's ``envs`` list (:class:`EnvSpec`: an id, its kwargs, a name, a weight or a
schedule of weights, optionally its own turn and token limits) is a :class:`Mixture`; a run with
one ``env_id`` is the mixture of that one env, and draws exactly the tasks it drew
before mixtures existed. Each step's ``batch_size`` groups are split over the envs by
their weights at that step (:meth:`Mixture.quotas`)::

    need_e  = batch_size x w_e / sum(w)  +  debt_e        (debt_e: 0 at step 0)
    seats   one at a time to the env with the most need left (ties: the earlier env)
    debt_e  = need_e - seats_e                            (0 while w_e is 0)

so quotas are whole numbers, deterministic, and an env's groups over the run stay within
two groups of its weighted share (``sum of batch_size x w_e / sum(w)`` over the steps so
far), however small its weight: an env is never starved, it gets its first group by the
step where its share reaches 2 and keeps its rate after. Weights that do not divide
``batch_size`` alternate (1:1:1 and 4 groups: 2,1,1 then 1,2,1 then 1,1,2).
A weight of 0 drops the env for
those steps and clears its debt. Quotas are a pure function of the step (replayed from
step 0), so a resumed run gets the quotas an uninterrupted one did.

A step's tasks are the training loop's task seeds (``agentenv.run.train.task_seeds``)
in order, the first ``quota_0`` of them env 0's, and so on; each env's tasks, logs and
metrics carry its name, and its episodes draw their tokens from a sampling seed of their
own (:meth:`Mixture.sample_seed`), so no two envs' tasks collide.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from agentenv.config import option
from agentenv.env.registration import env_name
from agentenv.errors import InvalidOptionError


@dataclass
class EnvSpec:
    """One env of a mixture (an item of a config's ``envs`` list)."""

    env_id: str = option("", "Registered environment id (or module:Name-v0).")
    env_kwargs: dict[str, Any] = option({}, "Constructor arguments of the env (both splits).")
    name: str | None = option(
        None, "Its name in metrics (<metric>/<name>), logs and reports (default: the id's name)."
    )
    weight: float = option(1.0, "Its share of each step's groups, relative to the others'.")
    schedule: list[list[float]] = option(
        [],
        "[[step, weight], ...]: the weight at those steps, linear in between, the first "
        "before and the last after them; replaces weight.",
    )
    max_new_tokens: int | None = option(
        None, "Tokens per policy turn of this env (default: the run's)."
    )
    max_episode_tokens: int | None = option(
        None, "Token budget per episode of this env (default: the run's)."
    )
    max_turns: int | None = option(
        None, "Policy turns per episode of this env (default: the run's)."
    )

    def __post_init__(self) -> None:
        if not isinstance(self.env_id, str) or not self.env_id:
            raise InvalidOptionError(f"each env of envs needs an env_id, got {self.env_id!r}")
        self.name = self.name or env_name(self.env_id)
        if "/" in self.name or not self.name.strip():
            raise InvalidOptionError(
                f"env name {self.name!r} is a metric suffix (<metric>/<name>): give a name "
                "without '/'"
            )
        if self.weight < 0:
            raise InvalidOptionError(f"env {self.name!r}: weight must be >= 0, got {self.weight}")
        points = [list(p) for p in self.schedule]
        if any(len(p) != 2 or p[0] < 0 or p[1] < 0 for p in points) or any(
            a[0] >= b[0] for a, b in zip(points, points[1:], strict=False)
        ):
            raise InvalidOptionError(
                f"env {self.name!r}: schedule must be [[step, weight], ...] with steps "
                f"increasing and steps and weights >= 0, got {self.schedule!r}"
            )
        self.schedule = points
        for key, value in self.limits().items():
            if value < 1:
                raise InvalidOptionError(
                    f"env {self.name!r}: {key} must be >= 1 (or none), got {value}"
                )

    def limits(self) -> dict[str, int]:
        """The turn and token limits this env sets for itself (``max_turns``,
        ``max_new_tokens``, ``max_episode_tokens``), by the names the rollout and
        evaluation configs give them; the others are the run's."""
        names = ("max_turns", "max_new_tokens", "max_episode_tokens")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    @classmethod
    def coerce(cls, item: Any, where: str = "config") -> EnvSpec:
        """An item of ``envs``: an :class:`EnvSpec`, a dict of its fields (strict keys) or
        a command-line string (:meth:`parse`)."""
        from agentenv import config as config_lib

        if isinstance(item, EnvSpec):
            return item
        if isinstance(item, str):
            item = cls.parse(item)
        return config_lib.from_dict(cls, item, where, "an item of envs (EnvSpec)")

    @classmethod
    def parse(cls, text: str) -> dict[str, Any]:
        """A command-line item: a JSON object of the fields, or ``[NAME=]ENV_ID[@WEIGHT]``
        (``bridge=RAG-v0@2``)."""
        import json

        if text.lstrip().startswith("{"):
            value = json.loads(text)
            if not isinstance(value, dict):
                raise InvalidOptionError(f"an env must be a JSON object, got {text!r}")
            return value
        name, _, rest = text.rpartition("=")
        env_id, _, weight = rest.partition("@")
        out: dict[str, Any] = {"env_id": env_id}
        if name:
            out["name"] = name
        if weight:
            try:
                out["weight"] = float(weight)
            except ValueError:
                raise InvalidOptionError(
                    f"env {text!r}: the weight after @ must be a number, e.g. RAG-v0@2"
                ) from None
        return out

    def weight_at(self, step: int) -> float:
        """The env's weight at ``step``: ``weight``, or the schedule's (linear between
        its points, held before the first and after the last)."""
        points = self.schedule
        if not points:
            return float(self.weight)
        if step <= points[0][0]:
            return float(points[0][1])
        for (s0, w0), (s1, w1) in zip(points, points[1:], strict=False):
            if step <= s1:
                return float(w0 + (w1 - w0) * (step - s0) / (s1 - s0))
        return float(points[-1][1])

    def make(self, split: str) -> Any:
        """A fresh instance of the env's ``split``."""
        from agentenv.env.registration import make

        return make(self.env_id, split=split, **self.env_kwargs)


class Mixture:
    """The envs of a run and each one's share of every step (see the module docstring)."""

    def __init__(self, specs: list[EnvSpec]):
        if not specs:
            raise InvalidOptionError("a mixture needs at least one env")
        names = [s.name for s in specs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise InvalidOptionError(
                f"two envs of envs are named {twice[0]!r}: give each a distinct name "
                '(e.g. {"env_id": "RAG-v0", "name": "bridge", ...})'
            )
        self.specs = specs
        self._quotas: dict[int, list[list[int]]] = {}  # batch size -> quotas of steps 0..
        self._debts: dict[int, list[float]] = {}

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def names(self) -> list[str]:
        return [str(s.name) for s in self.specs]

    def weights(self, step: int) -> list[float]:
        """Each env's weight at ``step``."""
        return [s.weight_at(step) for s in self.specs]

    def check(self, steps: int) -> None:
        """Raise unless every step of ``0 .. steps-1`` has an env with weight > 0."""
        for step in range(steps):
            if sum(self.weights(step)) <= 0:
                raise InvalidOptionError(
                    f"every env of envs has weight 0 at step {step}: give one of "
                    f"{', '.join(self.names)} a weight > 0 there (weights or schedules)"
                )

    def quotas(self, step: int, n: int) -> list[int]:
        """Groups of each env at ``step`` when a step has ``n`` (they add up to ``n``)."""
        if len(self.specs) == 1:
            return [n]
        done = self._quotas.setdefault(n, [])
        debt = self._debts.setdefault(n, [0.0] * len(self.specs))
        while len(done) <= step:
            weights = self.weights(len(done))
            total = sum(weights)
            if total <= 0:
                raise InvalidOptionError(f"every env of envs has weight 0 at step {len(done)}")
            need = [n * w / total + d if w > 0 else 0.0 for w, d in zip(weights, debt, strict=True)]
            seats = [0] * len(need)
            for _ in range(n):
                live = [i for i, w in enumerate(weights) if w > 0]
                best = max(live, key=lambda i: (need[i] - seats[i], -i))
                seats[best] += 1
            debt[:] = [
                nd - s if w > 0 else 0.0 for nd, s, w in zip(need, seats, weights, strict=True)
            ]
            done.append(seats)
        return list(done[step])

    def step_tasks(self, seeds: list[int], step: int) -> list[int]:
        """The env of each of a step's tasks (``seeds``: the step's task seeds, in order)."""
        quotas = self.quotas(step, len(seeds))
        return [e for e, q in enumerate(quotas) for _ in range(q)]

    def sample_seed(self, sample_seed: int, env: int) -> int:
        """Env ``env``'s sampling seed of a step: the step's own for a single env."""
        if len(self.specs) == 1:
            return sample_seed
        return random.Random(f"{sample_seed}-{self.specs[env].name}").getrandbits(63)

    def largest_remainder(self, n: int, step: int = 0) -> list[int]:
        """``n`` items split by the weights at ``step`` with no carry (a one-off split,
        e.g. of ``agentenv sft``'s demonstrations): the floors, then one more to the largest
        remainders (ties: the earlier env)."""
        weights = self.weights(step)
        total = sum(weights)
        exact = [n * w / total for w in weights]
        out = [int(x) for x in exact]
        order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - out[i]), i))
        for i in order[: n - sum(out)]:
            out[i] += 1
        return out
