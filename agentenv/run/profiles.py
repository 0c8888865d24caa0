"""``--profile``: documented bundles of settings for ``agentenv train``.

A profile is a layer of settings between the defaults and ``--config FILE`` / flags, so
anything given explicitly still wins; the run's ``config.json`` records the values that
were used (and the profile's name). The bundles follow common practice for LoRA GRPO on
small models:

* ``conservative``: a low LR (2e-5), the symmetric clip 0.2, a KL leash to the starting
  policy (beta 0.04, k3 in the loss), and tighter gradient clipping (0.5):
  slow, stable updates that stay close to a warm start.
* ``balanced``: LR 5e-5, DAPO's clip-higher (0.2 / 0.28), no KL: the defaults with
  clip-higher, which keeps exploration alive on low-entropy policies.
* ``aggressive``: LR 1e-4, clip-higher (0.2 / 0.28), no KL, a small entropy bonus
  (0.001) against collapse, and two optimizer steps per batch (clipped): fast
  movement for short runs; watch ``clip_ratio/*`` and ``entropy``.
* ``multi-step``: the best setting measured for envs whose answer takes several dependent
  tool calls and that pay per-turn rewards (``info["turn_reward"]``; where it failed:
  docs/training.md#multi-step-envs): ``gae`` credit (a critic over turns, with
  the env's per-turn rewards at the default ``turn_weight`` 1) reading the sampler's
  hidden states (``critic_input: sampler``, no extra forward), and each step spread over
  8 tasks x 4 samples instead of 4 x 8 (the critic, not the group, is the baseline). It
  sets ``batch_size`` and ``rollout.group_size``, so a ``--config`` file that sets them
  overrides it there.
"""

from __future__ import annotations

from typing import Any

from agentenv.errors import InvalidOptionError

PROFILES: dict[str, dict[str, Any]] = {
    "conservative": {
        "grpo": {
            "learning_rate": 2e-5,
            "epsilon_low": 0.2,
            "epsilon_high": 0.2,
            "beta": 0.04,
            "kl_estimator": "k3",
            "kl_placement": "loss",
            "entropy_coef": 0.0,
            "num_iterations": 1,
            "max_grad_norm": 0.5,
        },
    },
    "balanced": {
        "grpo": {
            "learning_rate": 5e-5,
            "epsilon_low": 0.2,
            "epsilon_high": 0.28,
            "beta": 0.0,
            "entropy_coef": 0.0,
            "num_iterations": 1,
            "max_grad_norm": 1.0,
        },
    },
    "aggressive": {
        "grpo": {
            "learning_rate": 1e-4,
            "epsilon_low": 0.2,
            "epsilon_high": 0.28,
            "beta": 0.0,
            "entropy_coef": 0.001,
            "num_iterations": 2,
            "max_grad_norm": 1.0,
        },
    },
    "multi-step": {
        "batch_size": 8,
        "rollout": {"group_size": 4},
        "grpo": {"credit": "gae", "critic_input": "sampler"},
    },
}


def profile_settings(name: str | None) -> dict[str, Any]:
    """The settings of profile ``name`` as a nested dict (``{}`` for ``None``)."""
    if name is None:
        return {}
    if name not in PROFILES:
        raise InvalidOptionError(
            f"profile must be one of {sorted(PROFILES)}, got {name!r}; leave it out for the "
            "plain defaults"
        )
    return PROFILES[name]
