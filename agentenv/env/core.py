"""The environment base classes.

:class:`TextEnv` is the contract every agentenv environment follows (a
``gymnasium.Env`` whose observations are lists of new chat messages and whose
actions are strings). :class:`ToolEnv` adds the generic tool-use loop so an
environment author only supplies tasks, tools and a scoring function.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsFloat

import gymnasium as gym
from gymnasium.error import ResetNeeded

from agentenv.env.executor import ToolExecutor
from agentenv.env.parsers import ActionParser, HermesParser
from agentenv.env.spaces import FreeText, Message, Messages
from agentenv.env.tools import Tool
from agentenv.errors import InvalidOptionError

SPLITS: tuple[str, ...] = ("train", "test")
PROMPT_STYLES: tuple[str, ...] = ("full", "compact")


@dataclass(frozen=True)
class Task:
    """One task of an environment's split.

    Attributes:
        id: Stable identifier (unique within the env, e.g. ``"basic_arithmetic-17"``).
        prompt: The text the agent is given.
        answer: The gold answer the env scores against.
        metadata: Anything else the env or its scorer needs.
    """

    id: str
    prompt: str
    answer: Any
    metadata: dict[str, Any] = field(default_factory=dict)


class TextEnv(gym.Env[list[Message], str]):
    """A multi-turn text environment.

    Contract (see docs/design.md §1):

    * ``reset(seed=None, options=None) -> (observation, info)``: ``observation`` is
      the list of opening messages (system prompt with tool descriptions, then
      the task). The same ``seed`` always gives the same task and behaviour;
      ``options={"task_id": i}`` picks task ``i`` of the split.
    * ``step(action: str) -> (observation, reward, terminated, truncated, info)``:
      ``observation`` is the list of *new* messages (tool results, feedback).
    * ``num_tasks`` and ``split`` tell which tasks the instance draws from;
      ``train`` and ``test`` never overlap.
    * The instance owns its mutable state and RNG (``self.np_random``); it never
      touches Python's or numpy's global generators. ``close()`` releases it.

    Subclasses must set ``self.observation_space`` / ``self.action_space`` (done
    here) and implement :attr:`num_tasks`, :meth:`reset` and :meth:`step`.

    Args:
        split: ``"train"`` or ``"test"``.
        render_mode: ``None`` or ``"ansi"`` (``render()`` returns the transcript).
    """

    # render_fps only silences gymnasium's checker; text envs render on demand.
    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 1}
    #: Strings after which nothing more of a policy turn matters to this env (e.g.
    #: ``</tool_call>``): samplers may end the turn there. Empty: only end-of-turn tokens.
    stop_strings: tuple[str, ...] = ()

    def __init__(self, *, split: str = "train", render_mode: str | None = None):
        if split not in SPLITS:
            raise InvalidOptionError(f"split must be one of {SPLITS}, got {split!r}")
        if render_mode not in (None, "ansi"):
            raise InvalidOptionError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.split = split
        self.render_mode = render_mode
        self.observation_space = Messages()
        self.action_space = FreeText()

    @property
    @abstractmethod
    def num_tasks(self) -> int:
        """How many tasks this instance's split holds."""

    def _pick_task(self, seed: int | None, options: dict[str, Any] | None) -> int:
        """Seed ``np_random`` and choose a task index (``options["task_id"]`` or random)."""
        super().reset(seed=seed)
        options = options or {}
        unknown = set(options) - {"task_id"}
        if unknown:
            raise InvalidOptionError(f"unknown reset option(s) {sorted(unknown)}; known: task_id")
        n = self.num_tasks
        if "task_id" not in options:
            return int(self.np_random.integers(n))
        task_id = options["task_id"]
        if isinstance(task_id, bool) or not isinstance(task_id, int) or not 0 <= task_id < n:
            raise InvalidOptionError(
                f"options['task_id'] must be an int in [0, {n}) for the {self.split!r} split, "
                f"got {task_id!r}"
            )
        return task_id


class ToolEnv(TextEnv):
    """A :class:`TextEnv` with the standard tool-use loop built in.

    Each step parses the action with ``parser``. A final answer ends the episode
    (``terminated``) and is scored by :meth:`score`; otherwise every tool call is
    run by a :class:`~agentenv.env.executor.ToolExecutor` (timeouts, truncation,
    errors as observations) and the results come back as ``tool`` messages. An
    action with neither gets a short ``user`` reminder of the format. After
    ``max_turns`` actions without an answer the episode is ``truncated`` with
    reward 0.

    Subclasses implement :attr:`num_tasks`, :meth:`get_task` and :meth:`score`,
    and may override :meth:`instructions` (the task-family part of the system
    prompt), :meth:`on_reset` (per-episode setup) and :meth:`episode_tools` (tools that
    hold state, built fresh for each episode).

    Args:
        tools: Tools on offer.
        split: ``"train"`` or ``"test"``.
        parser: How actions are parsed (default :class:`~agentenv.env.parsers.HermesParser`).
        max_turns: Most actions per episode before ``truncated``.
        tool_timeout_s: Wall-clock limit per tool call.
        max_output_chars: Longest tool output shown to the model.
        system_prompt: Replaces the whole generated system prompt (instructions plus
            tool descriptions) with this text, e.g. a compact one for small models.
        prompt_style: ``"full"`` (instructions plus every tool's JSON schema) or
            ``"compact"`` (the env's :meth:`compact_prompt`: a few lines with one example
            call, for small models and CPU training, where every prompt token is paid for
            G times per task in sampling and again in the learner).
        render_mode: ``None`` or ``"ansi"``.
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        split: str = "train",
        parser: ActionParser | None = None,
        max_turns: int = 5,
        tool_timeout_s: float = 10.0,
        max_output_chars: int = 2000,
        system_prompt: str | None = None,
        prompt_style: str = "full",
        render_mode: str | None = None,
    ):
        super().__init__(split=split, render_mode=render_mode)
        if prompt_style not in PROMPT_STYLES:
            raise InvalidOptionError(
                f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}"
            )
        if prompt_style == "compact" and type(self).compact_prompt is ToolEnv.compact_prompt:
            raise InvalidOptionError(
                f"{type(self).__name__} has no compact prompt; use prompt_style='full', or "
                "pass your own text as system_prompt="
            )
        self._system_prompt = system_prompt
        self.prompt_style = prompt_style
        if max_turns < 1:
            raise InvalidOptionError(f"max_turns must be >= 1, got {max_turns}")
        self.tools = list(tools)
        self.parser: ActionParser = parser or HermesParser()
        self.max_turns = int(max_turns)
        self._tool_limits = {"timeout_s": tool_timeout_s, "max_output_chars": max_output_chars}
        self.executor = ToolExecutor(self.tools, **self._tool_limits)
        self.task: Task | None = None
        self.messages: list[dict[str, str]] = []
        self._done = True
        self._stats: dict[str, Any] = {}

    @property
    def stop_strings(self) -> tuple[str, ...]:  # type: ignore[override]
        """The parser's turn-ending strings (Hermes: ``</tool_call>``, ``</answer>``)."""
        return tuple(getattr(self.parser, "stop_strings", ()))

    # ---- hooks for subclasses ---------------------------------------------------------
    @abstractmethod
    def get_task(self, index: int) -> Task:
        """Task ``index`` (``0 <= index < num_tasks``) of this instance's split."""

    @abstractmethod
    def score(self, answer: str, task: Task) -> tuple[float, dict[str, Any]]:
        """Reward for a final ``answer`` and extra ``info`` (must include ``"correct"``)."""

    def instructions(self) -> str:
        """The task-family part of the system prompt (before the tool instructions)."""
        return "You are a helpful assistant that solves tasks step by step using tools."

    def on_reset(self, task: Task) -> None:
        """Per-episode setup after the task is chosen (default: nothing)."""

    def episode_tools(self, task: Task) -> Sequence[Tool] | None:
        """The tools of an episode of ``task``, built at each reset; None (the default):
        the constructor's ``tools``.

        For tools that hold state: return ``agentenv.toolset(MyApi(task...))``, a fresh
        object per episode, so no two episodes (or concurrent envs) share it. The episode's
        calls run in order, one after another (they may depend on each other), and the
        system prompt lists these tools."""
        return None

    def demonstration(self, task: Task) -> list[str] | None:
        """Expert actions that solve ``task`` (one string per turn), or ``None``.

        Used to build supervised warm-start data (``agentenv sft``): the actions are
        replayed through the env, so demonstrations get the same tokenization and
        masks as sampled episodes. Override in envs that can solve their tasks.
        """
        return None

    def compact_prompt(self) -> str | None:
        """The system prompt of ``prompt_style="compact"``; ``None``: the env has none.

        Override with a few lines that show one complete tool call and the answer format.
        """
        return None

    # ---- gymnasium API ----------------------------------------------------------------
    def system_prompt(self) -> str:
        """The system prompt: ``system_prompt=`` if given; else :meth:`compact_prompt` for
        ``prompt_style="compact"``; else :meth:`instructions` plus the parser's tool
        instructions."""
        if self._system_prompt is not None:
            return self._system_prompt
        if self.prompt_style == "compact":
            return self.compact_prompt() or ""
        return f"{self.instructions()}\n\n{self.parser.format_instructions(self.tools)}"

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        index = self._pick_task(seed, options)
        self.task = self.get_task(index)
        tools = self.episode_tools(self.task)
        if tools is not None:  # a stateful toolset: this episode's own objects
            self.tools = list(tools)
            self.executor = ToolExecutor(self.tools, **self._tool_limits, in_order=True)
        self.on_reset(self.task)
        self._done = False
        self._stats = {"turn": 0, "num_tool_calls": 0, "num_tool_errors": 0, "tool_errors": {}}
        obs = [
            {"role": "system", "content": self.system_prompt()},
            {"role": "user", "content": self.task.prompt},
        ]
        self.messages = list(obs)
        return obs, {"task_id": index, "task": self.task.id, **self._info_stats()}

    def step(self, action: str) -> tuple[list[Message], SupportsFloat, bool, bool, dict[str, Any]]:
        if self.task is None or self._done:
            raise ResetNeeded("call reset() before step(): the episode has not started or ended")
        if not isinstance(action, str):
            raise InvalidOptionError(f"action must be a str, got {type(action).__name__}")
        self._stats["turn"] += 1
        self.messages.append({"role": "assistant", "content": action})
        parsed = self.parser.parse(action)
        if parsed.answer is not None:
            reward, extra = self.score(parsed.answer, self.task)
            self._done = True
            info = {**self._info_stats(), "answer": parsed.answer, **extra}
            return [], float(reward), True, False, info
        if parsed.tool_calls:
            results = self.executor.run(parsed.tool_calls)
            self._stats["num_tool_calls"] += len(results)
            for r in results:
                if r.error:
                    self._stats["num_tool_errors"] += 1
                    errs = self._stats["tool_errors"]
                    errs[r.error] = errs.get(r.error, 0) + 1
            obs = [{"role": "tool", "content": r.content} for r in results]
        else:
            obs = [{"role": "user", "content": self.format_reminder()}]
        self.messages.extend(obs)
        truncated = self._stats["turn"] >= self.max_turns
        self._done = truncated
        info = {**self._info_stats(), "correct": False} if truncated else self._info_stats()
        return obs, 0.0, False, truncated, info

    def format_reminder(self) -> str:
        """Feedback for an action with neither a tool call nor an answer. It shows the tags
        without a placeholder answer between them: a model that echoes it answers nothing,
        rather than ``"..."``."""
        if not isinstance(self.parser, HermesParser):
            return "No tool call or final answer found. " + self.parser.format_instructions([])
        return (
            "No tool call or final answer found. Call a tool with "
            '<tool_call>{"name": ..., "arguments": {...}}</tool_call> or give the final '
            f"answer alone inside <{self.parser.answer_tag}> tags."
        )

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in self.messages)

    def _info_stats(self) -> dict[str, Any]:
        return {**self._stats, "tool_errors": dict(self._stats.get("tool_errors", {}))}
