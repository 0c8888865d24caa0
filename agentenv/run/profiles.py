"""``--profile``: documented bundles of GRPO settings for ``agentenv train``.

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
