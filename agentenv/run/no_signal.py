"""Saying, once per run, that ``agentenv train`` is learning nothing.

GRPO learns from the reward differences between the G episodes of a task's group: a
step in which every group's rewards are equal (``frac_no_signal == 1.0`` in the metrics
``GRPO.learn`` returns; with ``credit="turn"`` or ``"gae"`` its per-turn returns too)
gives no reward gradient, whatever the loss settings.
Most often every reward is 0: the model never writes a tool call or an answer the env's
parser reads. After :data:`NO_SIGNAL_STEPS` such steps in a row, the run prints one
message with the likely fixes, written for the env and flags of the run.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentenv.env.registration import env_name
from agentenv.run.config import TrainConfig

#: Consecutive steps in which every group's rewards were equal before the run says so
#: (once). 3: one step of B groups all alike is common early on; three in a row at the
#: default B=4, G=8 is 96 episodes in which no two of a task's episodes differed.
NO_SIGNAL_STEPS = 3


def has_signal(metrics: Mapping[str, float]) -> bool:
    """Whether a step's GRPO metrics show a learning signal: some group whose episodes'
    rewards (or, under turn-level credit, per-turn returns) differ (``frac_no_signal <
    1``; metrics without it: ``frac_reward_zero_std < 1``)."""
    return metrics.get("frac_no_signal", metrics["frac_reward_zero_std"]) < 1.0


@dataclass
class SignalWatch:
    """Counts consecutive steps without a learning signal and decides when to say so.

    Attributes:
        patience: Steps without a signal in a row before :meth:`update` returns True.
        streak: Steps without a signal in a row so far.
        rewards: ``rewards/mean`` of each step of the current streak.
        warned: Whether :meth:`update` has returned True (it does so at most once).
    """

    patience: int = NO_SIGNAL_STEPS
    streak: int = 0
    rewards: list[float] = field(default_factory=list)
    warned: bool = False

    def update(self, metrics: Mapping[str, float]) -> bool:
        """Record one step's metrics; True exactly once: at the first step that ends
        ``patience`` consecutive steps without a learning signal."""
        if has_signal(metrics):
            self.streak, self.rewards = 0, []
            return False
        self.streak += 1
        self.rewards.append(float(metrics["rewards/mean"]))
        if self.warned or self.streak < self.patience:
            return False
        self.warned = True
        return True


@dataclass(frozen=True)
class EnvOffers:
    """What an env offers that a stuck run could use.

    Attributes:
        demonstrations: ``demonstration(task)`` solves its train tasks (``agentenv sft``).
        compact_prompt: It has a ``prompt_style="compact"`` system prompt.
    """

    demonstrations: bool
    compact_prompt: bool


def env_offers(make_env: Callable[[], Any]) -> EnvOffers:
    """Ask a fresh env (from ``make_env``) whether it demonstrates its first task, as
    ``agentenv sft`` would (reset, then ``demonstration(task)``), and has a compact prompt."""
    env = make_env()
    try:
        inner = env.unwrapped
        env.reset(seed=0)
        demo = getattr(inner, "demonstration", lambda task: None)(getattr(inner, "task", None))
        compact = getattr(inner, "compact_prompt", lambda: None)()
        return EnvOffers(demonstrations=demo is not None, compact_prompt=compact is not None)
    finally:
        env.close()


def _command(name: str, config: TrainConfig, env_kwargs: dict[str, Any], *extra: str) -> str:
    args = ["agentenv", name, config.env_id]
    if env_kwargs:
        args += ["--env-kwargs", json.dumps(env_kwargs)]
    if config.model != TrainConfig().model:
        args += ["--model", config.model]
    return shlex.join([*args, *extra])


def no_signal_message(config: TrainConfig, rewards: list[float], offers: EnvOffers) -> str:
    """The message for a run whose last ``len(rewards)`` steps (their ``rewards/mean``) had
    no group with a learning signal: what happened and the fixes that apply to ``config``'s
    env (``offers``), as commands to type."""
    n, g = len(rewards), config.rollout.group_size
    temperature = config.rollout.sampling.temperature
    why = "so GRPO is learning nothing (it learns from reward differences within a group)"
    hotter = (
        f"a higher sampling temperature (now {temperature}) for more varied episodes: "
        f"--temperature {round(temperature + 0.2, 2)}"
    )
    if any(rewards):  # equal but not all 0: e.g. every task solved by every episode
        return (
            f"agentenv train: in the last {n} steps every group's {g} episodes got equal "
            f"rewards (mean {sum(rewards) / n:.2f}), {why}.\nLikely fixes: harder tasks, a "
            f"larger --group-size (now {g}), or {hotter}"
        )
    fixes = []
    if offers.demonstrations and not config.init_from:
        sft_dir = f"runs/sft-{env_name(config.env_id)}"
        sft = _command("sft", config, config.env_kwargs, "--output-dir", sft_dir)
        train = _command("train", config, config.env_kwargs, "--init-from", f"{sft_dir}/checkpoint")
        fixes.append(f"warm-start from the env's demonstrations:\n      $ {sft}\n      $ {train}")
    elif offers.demonstrations:
        fixes.append(
            f"a longer warm start than {config.init_from} (more --num-demos or --epochs "
            "in its sft run)"
        )
    if offers.compact_prompt and config.env_kwargs.get("prompt_style") != "compact":
        compact = {**config.env_kwargs, "prompt_style": "compact"}
        fixes.append(f"the env's compact prompt:\n      $ {_command('train', config, compact)}")
    fixes.append(hotter)
    return (
        f"agentenv train: every episode of the last {n} steps got reward 0, {why}; the model "
        "likely never writes a tool call or an answer in the env's format.\nLikely fixes "
        "(add your other flags to these commands):\n" + "\n".join(f"  - {fix}" for fix in fixes)
    )
