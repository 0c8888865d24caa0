"""``agentenv/BFCL-v0``: the Berkeley Function Calling Leaderboard's multi-turn tasks.

A task is a conversation with one user over several turns ("move the report into temp",
then "grep it for the budget", ...) against stateful APIs: a file system, a Twitter
clone, a trading bot, a travel API... Each episode gets fresh instances of the task's
classes in its initial state (``episode_tools``); the agent calls their methods as
tools, answers each user turn with ``<answer>...</answer>`` and gets the next one.

After each user turn the env scores it as BFCL's ``multi_turn_checker`` does, with
BFCL's own ``state_checker`` and ``response_checker``: the ground truth's calls of that
turn run on a ground-truth copy of the instances; the turn is correct when every
instance's public state equals the copy's and every ground-truth result is among the
agent's call results so far. A turn whose ground truth is empty (the request cannot be
done) is not checked, as in BFCL. The episode is correct when every turn is (BFCL's task
accuracy); its reward is the share of correct turns.

What differs from the leaderboard's harness: tool calls are agentenv's
``<tool_call>{json}</tool_call>`` (or the parser given), not a model's native format; a
turn ends at ``<answer>``, not at a message without calls; ``max_turns`` bounds the
agent's actions over the whole conversation. As in BFCL, arguments reach the method as
given, unchecked against the schema (BFCL's ground truth itself passes a string where one
doc says integer); the method's own error is the observation (``Error: ...``) and the
recorded result (``Error during execution: ...``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any

from agentenv.env.conversation import ConversationEnv
from agentenv.env.core import Task
from agentenv.env.executor import ToolExecutor
from agentenv.env.splits import hashed_split
from agentenv.env.tools import Tool
from agentenv.errors import InvalidOptionError
from envs.bfcl import data

TEST_FRACTION = 0.25


def _tool_line(tool: Tool) -> str:
    """``name(arg, optional?): what it does``: a tool in the compact prompt."""
    params = tool.parameters.get("properties", {})
    required = set(tool.parameters.get("required", []))
    args = ", ".join(p if p in required else f"{p}?" for p in params)
    about = tool.description.split("Tool description:")[-1].strip().split(". ")[0]
    return f"{tool.name}({args}): {about.rstrip('.')}"


def call_actions(turns: list[list[dict[str, Any]]]) -> list[str]:
    """The actions that play ``turns`` (each user turn's tool calls): the calls in one
    message, then ``<answer>Done.</answer>``; a turn without calls is answered at once."""
    actions = []
    for calls in turns:
        if calls:
            actions.append("".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls))
            actions.append("<answer>Done.</answer>")
        else:
            actions.append("<answer>I cannot do that with the tools I have.</answer>")
    return actions


def state_digest(instances: dict[str, Any]) -> str:
    """A hash of every instance's public state (what BFCL's state check compares)."""
    state = {
        name: sorted((k, repr(v)) for k, v in vars(obj).items() if not k.startswith("_"))
        for name, obj in sorted(instances.items())
    }
    return hashlib.blake2b(repr(state).encode(), digest_size=16).hexdigest()


class BFCLTool(Tool):
    """A BFCL method as a tool: its doc's schema is shown, its arguments are not checked
    against it (BFCL's executor runs a call as written)."""

    def validate(self, arguments: Any) -> dict[str, Any]:
        if not isinstance(arguments, dict):
            return Tool.validate(self, arguments)  # the "must be a JSON object" error
        return dict(arguments)


class BFCLEnv(ConversationEnv):
    """BFCL v4 multi-turn tasks as a :class:`~agentenv.ConversationEnv`.

    Args:
        split: ``"train"`` or ``"test"`` (a stable hash of the task id; 1/4 test).
        category: ``"base"`` (default), ``"miss_func"`` (a tool withheld until a later
            turn, which announces it as BFCL's harness does), ``"miss_param"`` or
            ``"long_context"``.
        num_tasks: The split's first N tasks (default: all).
        prompt_style: ``"compact"`` (default: one line per tool) or ``"full"`` (every
            tool's JSON schema).
        max_turns: Agent actions over the whole conversation (default 24).
        **kwargs: :class:`~agentenv.ToolEnv`'s (``parser``, ``tool_timeout_s``, ...).
    """

    def __init__(
        self,
        split: str = "train",
        *,
        category: str = "base",
        num_tasks: int | None = None,
        prompt_style: str = "compact",
        max_turns: int = 24,
        **kwargs: Any,
    ):
        super().__init__(split=split, prompt_style=prompt_style, max_turns=max_turns, **kwargs)
        entries = [
            e for e in data.load_category(category) if hashed_split(e["id"], TEST_FRACTION) == split
        ]
        if num_tasks is not None:
            if not 1 <= num_tasks <= len(entries):
                raise InvalidOptionError(
                    f"num_tasks={num_tasks} is outside 1..{len(entries)}, the {split} tasks of "
                    f"BFCL's {category} category"
                )
            entries = entries[:num_tasks]
        self.category = category
        self.long_context = category == "long_context"
        self._entries = entries
        self.instances: dict[str, Any] = {}
        self.truth: dict[str, Any] = {}  # the ground truth's copies, a turn behind the agent's
        self.turn_calls: list[list[list[str]]] = []  # per user turn, per action: call strings
        self.results: list[str] = []  # every executed call's result, BFCL's text
        self._held: dict[int, list[Tool]] = {}

    @property
    def num_tasks(self) -> int:
        return len(self._entries)

    def get_task(self, index: int) -> Task:
        entry = self._entries[index]
        turns = ["\n".join(m["content"] for m in turn) for turn in entry["question"]]
        held = {int(t) for t in entry.get("missed_function") or {}}
        empty = [t for t, text in enumerate(turns) if not text and t not in held]
        if empty:
            raise InvalidOptionError(
                f"BFCL task {entry['id']}: question[{empty[0]}] has no user message and no "
                "missed_function arrives then"
            )
        return Task(
            id=entry["id"],
            prompt=turns[0],
            answer=entry["ground_truth"],
            metadata={"user_turns": turns[1:], "entry": entry},
        )

    # ---- tools: the task's classes, fresh for each episode --------------------------------
    def episode_tools(self, task: Task) -> list[Tool]:
        entry = task.metadata["entry"]
        classes, config = entry["involved_classes"], entry["initial_config"]
        self.instances, self.truth = {}, {}
        for name in classes:
            try:
                self.instances[name] = data.new_instance(name, config, self.long_context)
                self.truth[name] = data.new_instance(name, config, self.long_context)
            except Exception as exc:  # noqa: BLE001 - named, with the task and the field
                raise InvalidOptionError(
                    f"BFCL task {entry['id']}: initial_config[{name!r}] does not load into "
                    f"{name}: {type(exc).__name__}: {exc}"
                ) from exc
        self.turn_calls = [[] for _ in entry["question"]]
        self.results = []
        held = {n for names in (entry.get("missed_function") or {}).values() for n in names}
        excluded = set(entry.get("excluded_function") or ()) - held
        self._held: dict[int, list[Tool]] = {}  # miss_func: the tools a later turn adds
        tools: dict[str, Tool] = {}  # a name two classes share: the later class's (as BFCL)
        for name in classes:
            for doc in data.func_docs(name):
                if doc["name"] in excluded:
                    continue
                method = getattr(self.instances[name], doc["name"])
                schema = data.json_schema(doc["parameters"])
                schema.setdefault("properties", {})
                schema.setdefault("required", [])
                fn = self._recorded(doc["name"], method)
                tool = BFCLTool(doc["name"], doc["description"], schema, fn)
                if doc["name"] in held:
                    turn = next(
                        int(t)
                        for t, names in entry["missed_function"].items()
                        if doc["name"] in names
                    )
                    self._held.setdefault(turn, []).append(tool)
                else:
                    tools[doc["name"]] = tool
        return list(tools.values())

    def next_user_message(self, task: Task, turn: int) -> str | None:
        """The task's next user turn; at a ``miss_func`` turn, the tools it adds (now
        callable) and BFCL's "I have updated some more functions you can choose from"."""
        if turn not in self._held:
            return super().next_user_message(task, turn)
        from bfcl_eval.constants.default_prompts import (
            DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC as MORE,
        )

        new = self._held.pop(turn)
        self.tools = [*self.tools, *new]
        self.executor = ToolExecutor(self.tools, **self._tool_limits, in_order=True)
        return "\n".join(_tool_line(t) for t in new) + "\n" + MORE

    def _recorded(self, name: str, method: Any) -> Any:
        """``method`` that records its call (as BFCL's decoder writes it) and its result (as
        BFCL's executor does), and returns that result text."""

        def call(**arguments: Any) -> str:
            self._action_calls.append(data.call_string(name, arguments))
            try:
                value = method(**arguments)
            except Exception as exc:
                self.results.append(f"Error during execution: {exc}")
                raise
            text = data.result_text(value)
            self.results.append(text)
            return text

        return call

    def step(self, action: str) -> tuple[Any, ...]:
        self._action_calls: list[str] = []
        turn = self.user_turn
        obs, reward, terminated, truncated, info = super().step(action)
        if self._action_calls:
            self.turn_calls[turn].append(self._action_calls)
        if terminated or truncated:  # the tools' final state, comparable across runs
            info = {**info, "state_digest": state_digest(self.instances)}
        return obs, reward, terminated, truncated, info

    # ---- scoring: BFCL's checks after each user turn --------------------------------------
    def score_turn(self, answer: str, task: Task, turn: int) -> tuple[float, dict[str, Any]]:
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
            response_checker,
            state_checker,
        )

        truth_calls = task.answer[turn]
        truth_results = [self._run_truth(call) for call in truth_calls]
        if not truth_calls:  # nothing can be done: BFCL checks nothing here
            return 1.0, {"correct": True}
        if not self.turn_calls[turn]:
            return 0.0, {"correct": False, "bfcl_error": "multi_turn:empty_turn_model_response"}
        for check in (
            state_checker(self.instances, self.truth),
            response_checker(self.results, truth_results, turn),
        ):
            if not check["valid"]:
                return 0.0, {"correct": False, "bfcl_error": check["error_type"]}
        return 1.0, {"correct": True}

    def _owner(self, name: str) -> str:
        """The class whose method ``name`` is: the last involved class that has it."""
        owners = [c for c, obj in self.truth.items() if callable(getattr(obj, name, None))]
        if not owners or name.startswith("_"):
            raise InvalidOptionError(f"no involved class has a method {name!r}")
        return owners[-1]

    def _run_truth(self, text: str) -> str:
        name, args, kwargs = data.parse_call(text)
        try:
            value = getattr(self.truth[self._owner(name)], name)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - recorded as BFCL records it
            return f"Error during execution: {exc}"
        return data.result_text(value)

    # ---- prompts and demonstrations ----------------------------------------------------
    def instructions(self) -> str:
        return (
            "You carry out a user's requests with the tools below. When a request is done, "
            "reply to the user inside <answer> tags; the user may then ask for more."
        )

    def compact_prompt(self) -> str:
        lines = [_tool_line(t) for t in self.tools]
        example = json.dumps({"name": self.tools[0].name, "arguments": {}}) if self.tools else "{}"
        return (
            f"{self.instructions()} Call a tool with <tool_call>{example}</tool_call> (fill "
            "in its arguments; several calls in one message run in order).\nTools:\n"
            + "\n".join(lines)
        )

    def demonstration(self, task: Task) -> list[str]:
        """Per user turn, the ground truth's calls in one message, then a short answer
        (:func:`call_actions` of :meth:`truth_calls`)."""
        return call_actions(self.truth_calls(task))

    def truth_calls(self, task: Task | None = None) -> list[list[dict[str, Any]]]:
        """The ground truth's calls of each user turn as tool calls (``{"name",
        "arguments"}``, positional arguments named) of the current episode's task."""
        task = task or self.task
        assert task is not None, "reset() first"
        return [[self._keyword_call(text) for text in turn] for turn in task.answer]

    def _keyword_call(self, text: str) -> dict[str, Any]:
        """A ground-truth call string as a tool call: positional arguments named."""
        name, args, kwargs = data.parse_call(text)
        method = getattr(type(self.truth[self._owner(name)]), name)
        bound = inspect.signature(method).bind(None, *args, **kwargs)
        arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
        return {"name": name, "arguments": arguments}
