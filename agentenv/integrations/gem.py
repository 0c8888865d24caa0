"""agentenv envs in GEM's registry (``pip install --no-deps gem-llm``: its pin of
reasoning-gym==0.1.23 would replace agentenv's newer one).

GEM (used by ROLL, Oat, OpenRLHF and RL2) has text observations: ``reset(seed) -> (str,
info)`` and ``step(action: str) -> (str, reward, terminated, truncated, info)``. Importing
this module registers every agentenv env id (bundled and registered before the import)
as ``agentenv:<id>``; call :func:`register` again after registering more::

    import gem
    import agentenv.integrations.gem  # noqa: F401 - registers the ids

    env = gem.make("agentenv:Calculator-v0", split="test")
    vec = gem.make_vec(["agentenv:Calculator-v0"] * 8, async_mode=True, seed=0)

Observations as GEM expects them: the first is the env's system prompt and task as one
text (GEM has no system message); later ones are the tool results or feedback, joined,
with ``info["use_tool"]`` set when they are tool results (GEM's ``ObservationWrapper``
then renders them as ``tool`` messages). ``info["messages"]`` keeps agentenv's own chat
messages for a trainer that applies a chat template itself.
"""

from __future__ import annotations

from typing import Any, SupportsFloat

from agentenv.env.registration import full_id, make, registry
from agentenv.errors import InvalidOptionError

try:
    import gem
    from gem.envs.registration import ENV_REGISTRY
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        f"agentenv.integrations.gem needs GEM ({exc}); install it with "
        "`pip install --no-deps gem-llm` (its pins would replace agentenv's reasoning-gym)"
    ) from exc

__all__ = ["PREFIX", "GemEnv", "register"]

PREFIX = "agentenv:"
"""GEM ids are ``PREFIX + <agentenv id>``, e.g. ``agentenv:Calculator-v0``."""


class GemEnv(gem.Env):
    """One agentenv env with GEM's text interface.

    Args:
        env_id: A registered agentenv id.
        seed: Seeds the first ``reset()`` that has no seed (GEM's ``make_vec`` passes
            ``seed + i`` to env ``i``); later unseeded resets continue the env's RNG.
        **env_kwargs: Passed to :func:`agentenv.make`.
    """

    def __init__(self, env_id: str, seed: int | None = None, **env_kwargs: Any) -> None:
        super().__init__()
        self.env = make(env_id, **env_kwargs)
        self._first_seed = seed

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        if seed is None:  # only the first reset: later ones continue the env's RNG
            seed = self._first_seed
        self._first_seed = None
        messages, info = self.env.reset(seed=seed)
        text = "\n\n".join(m["content"] for m in messages)
        return text, {**info, "messages": messages}

    def step(self, action: str) -> tuple[str, SupportsFloat, bool, bool, dict[str, Any]]:
        messages, reward, terminated, truncated, info = self.env.step(action)
        text = "\n\n".join(m["content"] for m in messages)
        use_tool = bool(messages) and all(m["role"] == "tool" for m in messages)
        info = {**info, "messages": messages, "use_tool": use_tool}
        return text, float(reward), bool(terminated), bool(truncated), info

    def close(self) -> None:
        self.env.close()


def _entry_point(env_id: str) -> Any:
    def make_env(**kwargs: Any) -> GemEnv:
        return GemEnv(env_id, **kwargs)

    make_env.__name__ = f"GemEnv[{env_id}]"
    return make_env


def register(env_ids: list[str] | None = None) -> list[str]:
    """Register agentenv ids in GEM's registry as ``agentenv:<id>``; returns the GEM ids.

    Args:
        env_ids: agentenv ids (default: every registered one not yet in GEM's registry).
    """
    if env_ids is None:
        env_ids = [i.split("/", 1)[-1] for i in registry()]
    known = {full_id(i) for i in registry()}
    added = []
    for env_id in env_ids:
        if full_id(env_id) not in known:
            raise InvalidOptionError(
                f"{env_id!r} is not a registered agentenv id; agentenv.register it first"
            )
        gem_id = PREFIX + env_id.split("/", 1)[-1]
        if gem_id not in ENV_REGISTRY:
            gem.register(gem_id, entry_point=_entry_point(env_id))
            added.append(gem_id)
    return added


register()
