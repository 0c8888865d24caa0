"""agentenv environments in TRL's ``GRPOTrainer`` through its ``environment_factory``.

TRL (>= 1.16) runs the tool-calling loop itself: it renders the tools into the prompt with
the tokenizer's chat template, parses the model's tool calls, calls the environment's
public methods and appends their results as ``tool`` messages, until the model answers
without a tool call. This module gives it what it needs from an agentenv env::

    from trl import GRPOConfig, GRPOTrainer
    from agentenv.integrations.trl import (
        dataset, environment_factory, reward_func, tool_chat_template,
    )

    trainer = GRPOTrainer(
        model=model,
        processing_class=tool_chat_template(tokenizer),
        train_dataset=dataset("Calculator-v0", num_tasks=256),
        environment_factory=environment_factory("Calculator-v0"),
        reward_funcs=reward_func,
        args=GRPOConfig(output_dir="out", max_tool_calling_iterations=4, ...),
    )
    trainer.train()

* :func:`environment_factory` returns a class whose instances each own one env. Its tool
  methods are the env's tools, with the same names, typed signatures and docstrings, so
  TRL's schema (``transformers.utils.get_json_schema``) is the env's own; a call runs
  through the env's :class:`~agentenv.env.executor.ToolExecutor` (argument checks, time limit,
  output truncation, errors as text), exactly as in agentenv's own loop.
  ``reset(task_id=..., **row)`` re-creates the row's task (a Workspace's files, RAG's
  search budget).
* :func:`reward_func` scores the last assistant message's ``<answer>`` with the env's own
  parser and ``score`` (a Workspace answer is checked against the files the tools wrote),
  through TRL's ``environments`` argument. An episode without an answer scores 0.
* :func:`dataset` is :func:`~agentenv.integrations.task_rows` as a ``datasets.Dataset``,
  with the system prompt reduced to the task instructions, since TRL's template lists the
  tools itself.
* :func:`tool_chat_template` keeps a tokenizer whose template TRL accepts for tool calling;
  otherwise it installs TRL's ChatML ``qwen2_5.jinja``. SmolLM2's own template is ChatML
  without tool support, so the bundled default model gets that template.

Several envs in one run (:mod:`agentenv.env.mixture`): :func:`mixture_factory` gives TRL's
dict ``environment_factory`` (``{name: class}``) and :func:`mixture_dataset` the rows,
each with an ``environment`` column naming its env and as many per env as the weights
say; TRL exposes each row's env's tools only::

    envs = ["calc=Calculator-v0@2", {"env_id": "Workspace-v0", "name": "files"}]
    GRPOTrainer(..., train_dataset=mixture_dataset(envs, num_tasks=300),
                environment_factory=mixture_factory(envs), reward_funcs=reward_func)

What differs from agentenv's own loop: TRL, not the env, decides the turn structure (a
turn is one assistant message; ``max_tool_calling_iterations`` plays the part of the
env's ``max_turns``), and TRL's template, not the env's parser, formats tool calls and
results.
"""

from __future__ import annotations

import inspect
import typing
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentenv.env.conversation import ConversationEnv
from agentenv.env.core import ToolEnv
from agentenv.env.parsers import ToolCall
from agentenv.env.registration import make
from agentenv.env.tools import Tool
from agentenv.errors import InvalidOptionError
from agentenv.integrations.rows import task_rows

__all__ = [
    "AgentEnvironment",
    "dataset",
    "environment_factory",
    "mixture_dataset",
    "mixture_factory",
    "reward_func",
    "tool_chat_template",
]


class AgentEnvironment:
    """One agentenv env as a TRL environment; its tool methods are added per env id.

    TRL exposes every public function of the class as a tool, except ``reset`` and
    ``get_reward``; everything else here is private for that reason.
    """

    _env_id: str = ""
    _env_kwargs: dict[str, Any] = {}

    def __init__(self) -> None:  # TRL calls the factory with no arguments
        self._task_id: int | None = None
        self._tool_calls = 0
        self._tool_errors = 0
        self._open()

    def reset(self, task_id: int, **row: Any) -> None:
        """Start the row's task; the prompt is already in the row, so nothing is appended."""
        self._start(int(task_id))
        self._task_id = int(task_id)
        self._tool_calls = 0
        self._tool_errors = 0

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        if self._task_id is None:
            raise RuntimeError(f"{name} was called before reset(task_id=...)")
        content, failed = self._run(name, arguments)
        self._tool_calls += 1
        self._tool_errors += failed
        return content

    def _score(self, text: str) -> tuple[float, dict[str, Any]]:
        """Reward and info for the final assistant text: its answer, scored by the env."""
        if self._task_id is None:
            raise RuntimeError("the episode was scored before reset(task_id=...)")
        return self._reward(text)

    # ---- where the env lives: here, in-process (agentenv.integrations.openenv: a server)
    def _open(self) -> None:
        env = make(self._env_id, **self._env_kwargs)
        self._env = env
        self._inner: ToolEnv = env.unwrapped  # type: ignore[assignment]
        weakref.finalize(self, env.close)  # TRL never closes its environments

    def _start(self, task_id: int) -> None:
        self._env.reset(options={"task_id": task_id})

    def _run(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """One tool call: its result text, and whether it failed."""
        (result,) = self._inner.executor.run([ToolCall(name=name, arguments=arguments)])
        return result.content, result.error is not None

    def _reward(self, text: str) -> tuple[float, dict[str, Any]]:
        answer = self._inner.parser.parse(text).answer
        if answer is None:
            return 0.0, {"correct": False, "answer": None}
        assert self._inner.task is not None
        reward, info = self._inner.score(answer, self._inner.task)
        return float(reward), {**info, "answer": answer}


def _tool_method(tool: Tool) -> Callable[..., str]:
    """A method with ``tool``'s name, typed signature and Google docstring."""
    hints = typing.get_type_hints(tool.fn)
    params = [
        p.replace(annotation=hints[p.name], kind=inspect.Parameter.KEYWORD_ONLY)
        if p.kind == inspect.Parameter.KEYWORD_ONLY
        else p.replace(annotation=hints[p.name], kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for p in inspect.signature(tool.fn).parameters.values()
    ]
    return tool_method(tool.name, tool.description, tool.parameters, params)


def tool_method(
    name: str, description: str, parameters: dict[str, Any], params: list[inspect.Parameter]
) -> Callable[..., str]:
    """A method ``name(self, <params>) -> str`` that runs ``self._call(name, arguments)``,
    with a Google docstring from ``description`` and the JSON schema ``parameters``: what
    TRL (``transformers.utils.get_json_schema``) turns back into the tool's schema."""
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    signature = inspect.Signature([self_param, *params], return_annotation=str)

    def method(self: Any, **arguments: Any) -> str:
        # The env's executor checks the arguments against the schema (errors as text).
        return self._call(name, arguments)

    properties = parameters.get("properties", {})
    lines = [description, "", "Args:"]
    lines += [f"    {n}: {p.get('description', n)}" for n, p in properties.items()]
    method.__name__ = method.__qualname__ = name
    method.__doc__ = "\n".join(lines) if properties else description
    method.__signature__ = signature  # type: ignore[attr-defined]
    method.__annotations__ = {**{p.name: p.annotation for p in params}, "return": str}
    return method


def class_stem(env_id: str) -> str:
    """A class-name stem for an env id: ``"agentenv/Calculator-v0"`` -> ``"Calculator"``."""
    return "".join(c for c in env_id.split("/")[-1].split("-v")[0].title() if c.isalnum())


def environment_factory(env_id: str, **env_kwargs: Any) -> type[AgentEnvironment]:
    """A TRL ``environment_factory``: a class whose instances each own one ``env_id`` env.

    Args:
        env_id: A registered env id; user-registered envs work once registered.
        **env_kwargs: Passed to :func:`agentenv.make` for every instance (``split``,
            ``source``, ``families``, ...). Use the same ones for :func:`dataset`.

    Raises:
        InvalidOptionError: when the env is not a :class:`~agentenv.ToolEnv` (TRL needs
            its tools) or a tool name would clash with ``reset``/``get_reward``.
    """
    probe = make(env_id, **env_kwargs)
    try:
        inner = probe.unwrapped
        if not isinstance(inner, ToolEnv):
            raise InvalidOptionError(
                f"{env_id} is a {type(inner).__name__}, not a ToolEnv: TRL's "
                "environment_factory needs the env's tools; wrap a ToolEnv instead"
            )
        if isinstance(inner, ConversationEnv):
            raise InvalidOptionError(
                f"{env_id} is a ConversationEnv: after an answer its user asks a follow-up, "
                "and TRL ends a rollout at the first answer without a tool call, so the "
                "follow-up turns would never be played; train it with agentenv train, or "
                "through SkyRL, verifiers, verl or GEM, which pass each user message back"
            )
        if type(inner).episode_tools is not ToolEnv.episode_tools:
            raise InvalidOptionError(
                f"{env_id} builds its tools per episode (episode_tools): TRL reads the tools "
                "once, from a probe instance's methods; give the env fixed tools for TRL"
            )
        tools = list(inner.tools)
    finally:
        probe.close()
    reserved = {"reset", "get_reward"}
    for tool in tools:
        if tool.name in reserved or tool.name.startswith("_"):
            raise InvalidOptionError(
                f"{env_id}'s tool {tool.name!r} cannot be a TRL tool method: the names "
                f"{sorted(reserved)} and names starting with '_' are not exposed; rename it"
            )
    name = class_stem(env_id)
    namespace: dict[str, Any] = {t.name: _tool_method(t) for t in tools}
    namespace.update(
        _env_id=env_id,
        _env_kwargs=dict(env_kwargs),
        __doc__=f"The agentenv env {env_id} as a TRL environment (tools: "
        f"{', '.join(t.name for t in tools)}).",
        __module__=__name__,
    )
    return type(f"{name}Environment", (AgentEnvironment,), namespace)


def reward_func(
    completions: list[Any], environments: list[AgentEnvironment] | None = None, **kwargs: Any
) -> list[float]:
    """TRL reward: each episode's final ``<answer>`` scored by its own env.

    ``completions`` are TRL's conversational completions (lists of messages); the last
    assistant message holds the answer. Pass this function in ``reward_funcs``.
    """
    if environments is None:
        raise InvalidOptionError(
            "reward_func needs TRL's `environments` argument: pass "
            "environment_factory=agentenv.integrations.trl.environment_factory(env_id) "
            "to GRPOTrainer"
        )
    rewards = []
    for completion, env in zip(completions, environments, strict=True):
        if isinstance(completion, str):
            text = completion
        else:
            replies = [m for m in completion if m.get("role") == "assistant"]
            text = _text(replies[-1].get("content")) if replies else ""
        rewards.append(env._score(text)[0])
    return rewards


def _text(content: Any) -> str:
    """A message's text, whether a string or a list of ``{"type": "text"}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def dataset(
    env_id: str, *, split: str = "train", num_tasks: int | None = None, **env_kwargs: Any
) -> Any:
    """The tasks of ``split`` as a ``datasets.Dataset`` with ``prompt`` and ``task_id``.

    The system message holds the env's task instructions only: TRL's chat template lists
    the tools (from the environment's methods) and their call format itself.
    """
    from datasets import Dataset

    rows = task_rows(
        env_id, split=split, num_tasks=num_tasks, system_prompt="instructions", **env_kwargs
    )
    return Dataset.from_list(rows)


def _mixture(envs: Sequence[Any]) -> Any:
    """A :class:`~agentenv.env.mixture.Mixture` of ``envs``: EnvSpecs, dicts of their fields
    or ``NAME=ENV_ID@WEIGHT`` strings."""
    from agentenv.env.mixture import EnvSpec, Mixture

    return Mixture([EnvSpec.coerce(item, "the envs") for item in envs])


def mixture_factory(envs: Sequence[Any], *, split: str = "train") -> dict[str, type]:
    """TRL's dict ``environment_factory`` for several envs: ``{name: class}``, each class
    :func:`environment_factory`'s for that env's id and kwargs (``split`` for all)."""
    return {
        str(spec.name): environment_factory(spec.env_id, split=split, **spec.env_kwargs)
        for spec in _mixture(envs).specs
    }


def mixture_dataset(
    envs: Sequence[Any], *, split: str = "train", num_tasks: int | None = None
) -> Any:
    """The rows of several envs for TRL's dict ``environment_factory``: each env's first
    tasks (:func:`dataset`'s rows) with an ``environment`` column holding its name.

    ``num_tasks`` rows in all, split over the envs by their weights (largest remainder;
    a schedule's weights at step 0), so that TRL's shuffled sampling mixes them in those
    proportions; None: every task of every env (then the split sizes set the mix)."""
    from datasets import Dataset

    mixture = _mixture(envs)
    counts = [None] * len(mixture) if num_tasks is None else mixture.largest_remainder(num_tasks)
    rows = []
    for spec, count in zip(mixture.specs, counts, strict=True):
        if count == 0:
            continue
        own = task_rows(
            spec.env_id, split=split, num_tasks=count, system_prompt="instructions",
            **spec.env_kwargs,
        )  # fmt: skip
        rows += [{**row, "environment": spec.name} for row in own]
    keys = list(dict.fromkeys(k for row in rows for k in row))  # every env's columns
    return Dataset.from_list([{k: row.get(k) for k in keys} for row in rows])


def tool_chat_template(tokenizer: Any) -> Any:
    """``tokenizer`` with a chat template TRL can run tools with.

    Keeps the model's own template when TRL's ``supports_tool_calling`` accepts it;
    otherwise sets TRL's ChatML ``chat_templates/qwen2_5.jinja`` (tool calls as
    ``<tool_call>{json}</tool_call>``, results as ``<tool_response>`` in a user turn), the
    format agentenv's Hermes parser uses too. Mutates and returns ``tokenizer``.
    """
    import trl
    from trl.chat_template_utils import supports_tool_calling

    if tokenizer.chat_template and supports_tool_calling(tokenizer):
        return tokenizer
    path = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"
    tokenizer.chat_template = path.read_text()
    return tokenizer
