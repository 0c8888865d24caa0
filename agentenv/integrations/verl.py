"""agentenv episodes as a verl agent loop (verl >= 0.9, ``verl.experimental.agent_loop``).

verl's ``AgentLoopWorker`` plays one dataset row per ``AgentLoopBase.run`` call, talking to
its inference servers token-in, token-out through ``server_manager.generate``. The loop here,
registered as ``"agentenv"``, plays one agentenv episode that way::

    from agentenv.integrations import verl as agentenv_verl

    agentenv_verl.write_dataset("Calculator-v0", "train.parquet", num_tasks=512)
    agentenv_verl.write_agent_loop_config("agentenv_agent.yaml")
    # then verl's trainer with
    #   data.train_files=train.parquet
    #   actor_rollout_ref.rollout.agent.agent_loop_config_path=agentenv_agent.yaml

* Each row's ``agent_name`` is ``"agentenv"``; its ``extra_info`` names the episode:
  ``env_id``, ``env_kwargs`` (a JSON object, as text: parquet cannot store an empty or
  ragged struct), ``split``, ``task_id`` and optionally ``seed`` and ``max_turns``
  (:func:`dataset_rows` writes them; :class:`EpisodeSpec` reads them). An env of your own
  is named ``"my_pkg.envs:My-v0"``: verl's worker processes import ``my_pkg.envs`` (its
  ``agentenv.register`` call) before making the env.
* Tokens are agentenv's own (:class:`~agentenv.rollout.episode.EpisodeBuilder`, the code
  ``collect`` uses): the env's opening messages through the tokenizer's chat template, each
  policy turn exactly as the server sampled it (``response_mask`` 1, the server's
  log-probs), each env reply as the template's delta after it (``response_mask`` 0,
  log-prob 0). verl's own ``rollout.multi_turn`` tokenizer is not used. A greedy episode
  equals the one ``agentenv.rollout.collect`` produces with the same model.
* Every turn of an episode is one ``server_manager.generate`` call under one request id,
  so verl's load balancer keeps the episode on one server (its prefix cache). A turn asks
  for at most the tokens left of ``rollout.response_length`` (and of ``max_new_tokens``
  when the loop is configured with it), and stops on the env's stop strings
  (``</tool_call>``, ``</answer>``; ``stop`` and ``include_stop_str_in_output`` in vLLM's
  sampling parameters).
* ``rollout.response_length`` bounds the policy and env tokens together: an env reply
  that would not fit is shortened with agentenv's marker, and when no room is left the
  episode ends with ``extra_fields["stop_reason"] == "max_tokens"`` and
  ``extra_fields["truncated"] = True``.
* ``reward_score`` is the sum of the env's step rewards (verl writes it as ``rm_scores`` on
  the last response token, and its reward function is not consulted). Per-step rewards go to
  ``extra_fields["turn_scores"]``, the env's per-turn rewards (``info["turn_reward"]``, e.g.
  a conversation's score of each user turn; 0 where a step gives none) to
  ``extra_fields["turn_rewards"]``, one per policy turn as in agentenv's ``Episode``.
  ``env.step`` runs in a thread (``asyncio.to_thread``), never on verl's event loop.
* An env whose ``step`` raises ends its episode (``stop_reason`` ``"env_error"``, the error
  in ``extra_fields["env_error"]``) with ``response_mask`` all 0: as in agentenv's GRPO, a
  failed episode teaches nothing. A bad row (unknown env id, no task) raises.
* Turn limit: ``extra_info["max_turns"]``, else ``rollout.multi_turn.max_assistant_turns``,
  else the env's own ``max_turns``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

from agentenv.env.registration import make, spec
from agentenv.errors import InvalidOptionError
from agentenv.integrations.rows import task_rows
from agentenv.rollout.episode import ChatFormat, EpisodeBuilder

try:
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopMetrics,
        AgentLoopOutput,
        register,
    )
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        f"agentenv.integrations.verl needs verl's agent loop ({exc}); install it as "
        "install.sh does: pip install --no-deps verl==0.9.1 ray codetiming tensordict==0.8.3 "
        "hydra-core==1.4.0rc1"
    ) from exc

__all__ = [
    "AGENT_NAME",
    "AgentEnvAgentLoop",
    "EpisodeSpec",
    "dataset_rows",
    "write_agent_loop_config",
    "write_dataset",
]

AGENT_NAME = "agentenv"
"""The ``agent_name`` of the rows :func:`dataset_rows` writes."""


@dataclass
class EpisodeSpec:
    """Which episode a row plays: read from the row's ``extra_info``.

    Attributes:
        env_id: A registered agentenv id, or ``"module:Id"`` to import ``module`` first.
        env_kwargs: Passed to :func:`agentenv.make` (with ``split``).
        split: ``"train"`` or ``"test"``.
        task_id: The task of the split (``reset(options={"task_id": ...})``); None: the
            env picks one from ``seed``.
        seed: The reset seed.
        max_turns: Policy turns at most; None: verl's ``max_assistant_turns`` or the env's.
    """

    env_id: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    split: str = "train"
    task_id: int | None = None
    seed: int | None = None
    max_turns: int | None = None

    @classmethod
    def from_row(cls, extra_info: Any) -> EpisodeSpec:
        """The spec of a row's ``extra_info``; raises :class:`InvalidOptionError` naming the
        missing or bad field and how to write a good row."""
        fix = "write the rows with agentenv.integrations.verl.dataset_rows"
        if not isinstance(extra_info, Mapping) or not extra_info.get("env_id"):
            keys = sorted(extra_info) if isinstance(extra_info, Mapping) else extra_info
            raise InvalidOptionError(
                f"the row's extra_info has no agentenv env_id (got {keys!r}); {fix}"
            )
        kwargs = extra_info.get("env_kwargs") or {}
        if isinstance(kwargs, str):
            try:
                kwargs = json.loads(kwargs)
            except json.JSONDecodeError as exc:
                raise InvalidOptionError(
                    f"extra_info['env_kwargs'] must be a JSON object, got {kwargs!r} ({exc}); {fix}"
                ) from exc
        if not isinstance(kwargs, Mapping):
            raise InvalidOptionError(
                f"extra_info['env_kwargs'] must be a JSON object, got {kwargs!r}; {fix}"
            )
        task_id, seed = extra_info.get("task_id"), extra_info.get("seed")
        if task_id is None and seed is None:
            raise InvalidOptionError(f"the row's extra_info has neither task_id nor seed; {fix}")
        max_turns = extra_info.get("max_turns")
        return cls(
            env_id=str(extra_info["env_id"]),
            env_kwargs=dict(kwargs),
            split=str(extra_info.get("split") or "train"),
            task_id=None if task_id is None else int(task_id),
            seed=None if seed is None else int(seed),
            max_turns=None if max_turns is None else int(max_turns),
        )

    def make(self) -> Any:
        """A fresh env for this episode; an unknown id raises naming the registered ones."""
        try:
            spec(self.env_id)
        except KeyError as exc:  # UnknownEnvError: its message lists the registered ids
            raise InvalidOptionError(
                f"the row's env_id {self.env_id!r} is not an agentenv env in verl's worker: "
                f"{exc}. Fix the row, or name an env of your own as 'my_pkg.envs:My-v0' so "
                "the worker imports the module that registers it"
            ) from exc
        return make(self.env_id, split=self.split, **self.env_kwargs)

    @property
    def options(self) -> dict[str, Any] | None:
        return None if self.task_id is None else {"task_id": self.task_id}


@register(AGENT_NAME)
class AgentEnvAgentLoop(AgentLoopBase):
    """One agentenv episode per verl dataset row (see the module docstring).

    Args:
        *args: verl's ``AgentLoopBase`` arguments (``trainer_config``, ``server_manager``,
            ``tokenizer``, ...), as its worker passes them.
        max_new_tokens: Most tokens per policy turn (None: whatever is left of
            ``rollout.response_length``). Set it in the agent loop YAML next to
            ``_target_``.
        **kwargs: Passed on to ``AgentLoopBase`` (the YAML's ``name``, verl's ``tools``).
    """

    def __init__(self, *args: Any, max_new_tokens: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if max_new_tokens is not None and max_new_tokens < 1:
            raise InvalidOptionError(f"max_new_tokens must be >= 1 or None, got {max_new_tokens}")
        self.max_new_tokens = max_new_tokens
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)
        multi_turn = self.rollout_config.get("multi_turn") or {}
        self.max_assistant_turns = multi_turn.get("max_assistant_turns")

    async def run(
        self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any
    ) -> AgentLoopOutput:
        """Play the episode of ``kwargs["extra_info"]``; returns verl's output for it."""
        episode = EpisodeSpec.from_row(kwargs.get("extra_info"))
        env = await asyncio.to_thread(episode.make)
        try:
            return await self._play(env, episode, sampling_params, int(priority))
        finally:
            await asyncio.to_thread(env.close)

    async def _play(
        self, env: Any, episode: EpisodeSpec, sampling_params: dict[str, Any], priority: int
    ) -> AgentLoopOutput:
        obs, _ = await asyncio.to_thread(env.reset, seed=episode.seed, options=episode.options)
        builder = EpisodeBuilder(ChatFormat(self.tokenizer), obs, max_tokens=0)
        prompt_len = len(builder.input_ids)
        if prompt_len > self.prompt_length:
            raise InvalidOptionError(
                f"{episode.env_id} task {episode.task_id} opens with {prompt_len} prompt tokens, "
                f"more than rollout.prompt_length={self.prompt_length}; raise "
                "data.max_prompt_length (or drop such rows with data.filter_overlong_prompts)"
            )
        builder.max_tokens = prompt_len + self.response_length  # the response budget
        inner = env.unwrapped
        max_turns = episode.max_turns or self.max_assistant_turns or getattr(inner, "max_turns", 0)
        stops = list(getattr(inner, "stop_strings", None) or [])
        params = dict(sampling_params)
        if stops:  # vLLM's names; the turn keeps the text that completed the stop string
            params.update(stop=stops, include_stop_str_in_output=True)
        deterministic = bool(self.rollout_config.get("full_determinism", False))
        progress = _Progress(request_id=f"det-{priority}" if deterministic else uuid4().hex)
        while not progress.stop_reason:
            if builder.room < 1:
                progress.stop_reason = "max_tokens"
                break
            text = await self._policy_turn(builder, progress, params, priority)
            t0 = time.perf_counter()
            try:
                new, reward, terminated, truncated, info = await asyncio.to_thread(env.step, text)
            except Exception as exc:  # noqa: BLE001 - a failing env ends only its episode
                progress.extra["env_error"] = f"{type(exc).__name__}: {exc}"
                progress.stop_reason = "env_error"
                break
            finally:
                progress.metrics["tool_calls"] += time.perf_counter() - t0
            progress.scores.append(float(reward))
            progress.turn_rewards.append(float(info.get("turn_reward", 0.0)))
            if terminated or truncated:
                progress.stop_reason = "terminated" if terminated else "truncated"
            elif max_turns and builder.num_turns >= max_turns:
                progress.stop_reason = "max_turns"
            elif builder.add_env(new):  # False: no room left for it, even shortened
                progress.env_turns += 1
            else:
                progress.stop_reason = "max_tokens"
        return self._output(builder, prompt_len, progress)

    async def _policy_turn(
        self, builder: EpisodeBuilder, progress: _Progress, params: dict[str, Any], priority: int
    ) -> str:
        """One ``server_manager.generate`` call appended to ``builder``; returns its text."""
        room = builder.room
        t0 = time.perf_counter()
        out = await self.server_manager.generate(
            request_id=progress.request_id,
            prompt_ids=list(builder.input_ids),
            sampling_params={**params, "max_tokens": min(room, self.max_new_tokens or room)},
            priority=priority,
        )
        progress.metrics["generate_sequences"] += time.perf_counter() - t0
        progress.merge_server_fields(out)
        ids = list(out.token_ids)[:room]  # a server past max_tokens is cut to the budget
        logps = [float(x) for x in out.log_probs[: len(ids)]] if out.log_probs else None
        progress.logprobs = progress.logprobs or logps is not None
        text = self.tokenizer.decode(ids, skip_special_tokens=True)  # as agentenv's engines do
        builder.add_policy(ids, logps or [0.0] * len(ids), text)
        return text

    def _output(
        self, builder: EpisodeBuilder, prompt_len: int, progress: _Progress
    ) -> AgentLoopOutput:
        """verl's output of a finished episode: its tokens split at the prompt's end, at
        most ``response_length`` response tokens."""
        n = self.response_length
        mask = builder.action_mask[prompt_len:][:n]
        logprobs = builder.sampler_logprobs[prompt_len:][:n] if progress.logprobs else None
        if progress.stop_reason == "env_error":
            mask = [0] * len(mask)  # a failed episode gives no gradient
        progress.extra.update(
            turn_scores=progress.scores,
            turn_rewards=progress.turn_rewards,
            tool_rewards=[],
            stop_reason=progress.stop_reason,
            truncated=progress.stop_reason == "max_tokens",
            policy_turns=builder.num_turns,
        )
        return AgentLoopOutput(
            prompt_ids=builder.input_ids[:prompt_len],
            response_ids=builder.input_ids[prompt_len:][:n],
            response_mask=mask,
            response_logprobs=logprobs,
            reward_score=sum(progress.scores),
            num_turns=1 + builder.num_turns + progress.env_turns,  # verl's count: prompt, turns
            metrics=AgentLoopMetrics(**progress.metrics),
            extra_fields=progress.extra,
        )


@dataclass
class _Progress:
    """What an episode accumulates besides its tokens."""

    request_id: str  # one per episode: verl's load balancer keeps it on one server
    stop_reason: str = ""
    scores: list[float] = field(default_factory=list)  # the env's reward of each step
    turn_rewards: list[float] = field(default_factory=list)  # info["turn_reward"] of each
    env_turns: int = 0
    logprobs: bool = False  # the server returned log-probs
    extra: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(
        default_factory=lambda: {"generate_sequences": 0.0, "tool_calls": 0.0, "num_preempted": -1}
    )

    def merge_server_fields(self, out: Any) -> None:
        """Keep the server's extra fields of the first turn and the newest weights version,
        and add up preemptions, as verl's ``ToolAgentLoop`` does."""
        if not self.extra:
            self.extra.update(out.extra_fields)
        elif out.extra_fields.get("max_global_steps") is not None:
            self.extra["max_global_steps"] = out.extra_fields["max_global_steps"]
        if out.num_preempted is not None:
            self.metrics["num_preempted"] = (
                max(self.metrics["num_preempted"], 0) + out.num_preempted
            )


def dataset_rows(
    env_id: str,
    *,
    split: str = "train",
    num_tasks: int | None = None,
    max_turns: int | None = None,
    agent_name: str = AGENT_NAME,
    **env_kwargs: Any,
) -> list[dict[str, Any]]:
    """verl RL dataset rows, one per task of ``split``.

    Each row has ``data_source`` (the env id), ``prompt`` (the env's opening messages, which
    verl's dataset uses to filter and batch), ``agent_name``, a placeholder
    ``reward_model`` (the env scores the episode) and ``extra_info`` (``index``, ``env_id``,
    ``env_kwargs`` as JSON, ``split``, ``task_id`` and ``max_turns`` if given).

    Args:
        env_id: A registered env id, or ``"module:Id"`` for an env verl's workers must
            import first.
        split: ``"train"`` or ``"test"``.
        num_tasks: The first ``num_tasks`` tasks; default all of the split.
        max_turns: Policy turns per episode (default: verl's ``max_assistant_turns`` or the
            env's own).
        agent_name: The registered loop's name.
        **env_kwargs: Passed to :func:`agentenv.make` (JSON-serializable values).
    """
    try:
        encoded = json.dumps(env_kwargs, sort_keys=True)
    except TypeError as exc:
        raise InvalidOptionError(
            f"env_kwargs must be JSON-serializable to travel in a dataset row: {exc}"
        ) from exc
    full = spec(env_id).id
    rows = []
    for i, row in enumerate(task_rows(env_id, split=split, num_tasks=num_tasks, **env_kwargs)):
        extra = {"index": i, "env_id": env_id, "env_kwargs": encoded, "split": split}
        extra["task_id"] = row["task_id"]
        if max_turns is not None:
            extra["max_turns"] = max_turns
        rows.append(
            {
                "data_source": full,
                "prompt": row["prompt"],
                "agent_name": agent_name,
                "reward_model": {"style": "env", "ground_truth": ""},
                "extra_info": extra,
            }
        )
    return rows


def write_dataset(env_id: str, path: str | Path, **kwargs: Any) -> Path:
    """:func:`dataset_rows` as a parquet file (verl's ``data.train_files``); returns its path.

    Args:
        env_id: As for :func:`dataset_rows`.
        path: Where to write, e.g. ``"train.parquet"``.
        **kwargs: :func:`dataset_rows`'s options and the env's kwargs.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(dataset_rows(env_id, **kwargs)), path)
    return path


def write_agent_loop_config(path: str | Path, *, max_new_tokens: int | None = None) -> Path:
    """The YAML that ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` points at:
    it names :class:`AgentEnvAgentLoop` as ``"agentenv"`` in verl's worker processes.

    Args:
        path: Where to write, e.g. ``"agentenv_agent.yaml"``.
        max_new_tokens: Most tokens per policy turn (default: the rest of the response).
    """
    path = Path(path)
    lines = [f"- name: {AGENT_NAME}", f"  _target_: {__name__}.{AgentEnvAgentLoop.__qualname__}"]
    if max_new_tokens is not None:
        lines.append(f"  max_new_tokens: {int(max_new_tokens)}")
    path.write_text("\n".join(lines) + "\n")
    return path
