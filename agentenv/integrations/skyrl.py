"""agentenv environments as skyrl-gym ``BaseTextEnv``\\ s, for SkyRL's trainer.

SkyRL's generator creates one env per trajectory with ``skyrl_gym.make(env_class,
env_config=..., extras=row_extras)``, calls ``init(prompt)`` once and ``step(model_text)``
per turn, and appends the returned observations to the chat. agentenv's own ``step``
takes the model's text too, so the wrapper is thin::

    from agentenv.integrations import skyrl

    skyrl.register("Calculator-v0")  # skyrl-gym id "agentenv/Calculator-v0"
    rows = skyrl.dataset_rows("Calculator-v0", num_tasks=512)  # env_class, prompt, task_id
    datasets.Dataset.from_list(rows).to_parquet("train.parquet")
    # then train with SkyRL, e.g. `environment.env_class=agentenv/Calculator-v0`

* ``extras["task_id"]`` (a dataset column) picks the task; ``init`` resets the env to it, so
  per-task state (a Workspace's files) exists before the first turn. The prompt ``init``
  returns is the env's own opening (system prompt with the tool-call format, then the task),
  which is what the row's ``prompt`` holds.
* ``step`` returns the env's new messages (``tool`` results, format reminders) as
  ``observations`` and its reward; ``done`` folds ``terminated`` and ``truncated`` together,
  since skyrl-gym has one flag. ``extras["max_turns"]`` (SkyRL sets it from
  ``generator.max_turns``) ends the episode earlier than the env's own ``max_turns``.
* ``get_metrics`` reports the env's turn and tool counters and whether the answer was correct.

Ray workers import this module by name, so a string entry point works there too:
``skyrl_gym.register("my-id", "agentenv.integrations.skyrl:AgentEnvTextEnv")`` with
``env_config={"env_id": "Calculator-v0", "env_kwargs": {...}}`` in SkyRL's
``environment.skyrl_gym`` config.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from agentenv.env.registration import make, spec
from agentenv.errors import InvalidOptionError
from agentenv.integrations.rows import task_rows

__all__ = ["AgentEnvTextEnv", "dataset_rows", "register"]


def _plain(config: Any) -> dict[str, Any]:
    """An omegaconf ``DictConfig`` (what SkyRL passes), a mapping or ``None`` as a dict."""
    if config is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return dict(OmegaConf.to_container(config, resolve=True))  # type: ignore[arg-type]
    except ImportError:
        pass
    if not isinstance(config, Mapping):
        raise InvalidOptionError(
            f"env_config must be a mapping such as {{'env_id': 'Calculator-v0'}}, "
            f"got {type(config).__name__}"
        )
    return dict(config)


class AgentEnvTextEnv(BaseTextEnv):
    """One agentenv env behind skyrl-gym's ``init`` / ``step`` API.

    Args:
        env_config: ``{"env_id": ..., "env_kwargs": {...}}`` (a dict or SkyRL's
            ``DictConfig``); ignored for keys given directly as ``env_id``/``env_kwargs``.
        extras: The dataset row's extra columns: ``task_id`` (required) and optionally
            ``max_turns``.
        env_id: The agentenv env id (what :func:`register` binds).
        env_kwargs: Passed to :func:`agentenv.make`.
    """

    def __init__(
        self,
        env_config: Any = None,
        extras: Mapping[str, Any] | None = None,
        *,
        env_id: str | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        config = _plain(env_config)
        env_id = env_id or config.get("env_id")
        if not env_id:
            raise InvalidOptionError(
                "AgentEnvTextEnv needs an agentenv env id: register it with "
                "agentenv.integrations.skyrl.register('Calculator-v0'), or pass "
                "env_config={'env_id': 'Calculator-v0'}"
            )
        extras = dict(extras or {})
        if "task_id" not in extras:
            raise InvalidOptionError(
                f"extras has no 'task_id' (keys: {sorted(extras)}): build the dataset with "
                "agentenv.integrations.skyrl.dataset_rows, whose rows carry it"
            )
        spec(env_id)  # an unknown id fails here with the registered ids
        self.env = make(env_id, **{**config.get("env_kwargs", {}), **(env_kwargs or {})})
        self.task_id = int(extras["task_id"])
        env_max_turns = getattr(self.env.unwrapped, "max_turns", None)
        self.max_turns = int(extras.get("max_turns") or env_max_turns or 1)
        self.info: dict[str, Any] = {}

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Reset to ``task_id``; returns the env's opening messages and the task's info."""
        observation, info = self.env.reset(options={"task_id": self.task_id})
        self.turns = 0
        self.info = info
        return list(observation), {"task_id": self.task_id, "task": info.get("task")}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """One model turn through the agentenv env."""
        self.turns += 1
        observation, reward, terminated, truncated, info = self.env.step(action)
        self.info = info
        done = bool(terminated or truncated or self.turns >= self.max_turns)
        return BaseTextEnvStepOutput(
            observations=[] if done else list(observation),
            reward=float(reward),
            done=done,
            metadata=info,
        )

    def get_metrics(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "num_tool_calls": self.info.get("num_tool_calls", 0),
            "num_tool_errors": self.info.get("num_tool_errors", 0),
            "correct": float(bool(self.info.get("correct", False))),
        }

    def close(self) -> None:
        self.env.close()


def register(env_id: str, skyrl_id: str | None = None, **env_kwargs: Any) -> str:
    """Register ``env_id`` with skyrl-gym and return its skyrl-gym id.

    Args:
        env_id: A registered agentenv env id.
        skyrl_id: The skyrl-gym id (SkyRL's ``env_class``); default the full agentenv id,
            e.g. ``"agentenv/Calculator-v0"``. Registering the same id again replaces it.
        **env_kwargs: Passed to :func:`agentenv.make` for every env.
    """
    import skyrl_gym
    from skyrl_gym.envs.registration import deregister

    full_id = spec(env_id).id
    skyrl_id = skyrl_id or full_id
    if skyrl_id in skyrl_gym.registry:
        deregister(skyrl_id)
    entry = functools.partial(AgentEnvTextEnv, env_id=full_id, env_kwargs=env_kwargs)
    skyrl_gym.register(id=skyrl_id, entry_point=entry)
    return skyrl_id


def dataset_rows(
    env_id: str,
    *,
    split: str = "train",
    num_tasks: int | None = None,
    skyrl_id: str | None = None,
    **env_kwargs: Any,
) -> list[dict[str, Any]]:
    """SkyRL dataset rows: ``prompt``, ``env_class`` and ``task_id`` (which becomes an extra).

    ``env_class`` is ``skyrl_id`` (default the full agentenv id, as :func:`register` uses).
    """
    env_class = skyrl_id or spec(env_id).id
    rows = task_rows(env_id, split=split, num_tasks=num_tasks, **env_kwargs)
    return [{**row, "env_class": env_class, "data_source": "agentenv"} for row in rows]
