"""Conversations: a user who comes back after each answer.

A :class:`ConversationEnv` is a :class:`~agentenv.env.core.ToolEnv` whose task holds
several user turns. The agent works on the first one with its tools and answers it; the
env scores that answer (:meth:`ConversationEnv.score_turn`, the step's
``info["turn_reward"]``, which ``credit=turn|gae`` read, beside ``info["answered_turn"]``)
and sends the next user message as the observation; the episode ends after the last user
turn is answered, with the reward of :meth:`ConversationEnv.score_conversation`
(default: the mean of the turns' rewards; correct when every turn was). A user turn comes
from the task (``task.metadata["user_turns"]``: the messages after ``task.prompt``) or
from a callable ``user(task, messages)`` that sees the conversation so far and returns
the next message (or None to end it): a scripted or simulated user.

``info["user_turn"]`` is the user turn the next action works on (0: ``task.prompt``);
``info["turns_correct"]`` counts the turns answered correctly so far and
``info["user_turns"]`` the task's user turns (``agentenv eval``'s ``turn_accuracy``).
``max_turns`` counts the agent's actions over the whole conversation; past it the episode
is truncated with reward 0 (the turns already answered keep their ``turn_reward``). The
user's messages are environment tokens, masked out of the loss like tool output.

With :meth:`~agentenv.env.core.ToolEnv.episode_tools` the tools can hold state across
the user turns (a file system the second request reads what the first wrote).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, SupportsFloat

from agentenv.env.core import Task, ToolEnv
from agentenv.env.spaces import Message
from agentenv.env.tools import Tool
from agentenv.errors import InvalidOptionError

#: A simulated user: ``user(task, messages) -> next message, or None to end``.
User = Callable[[Task, list[dict[str, str]]], str | None]


class ConversationEnv(ToolEnv):
    """A :class:`ToolEnv` whose tasks are conversations of several user turns.

    Subclasses implement :attr:`num_tasks`, :meth:`get_task` and :meth:`score_turn` (and
    may override :meth:`score_conversation` and :meth:`next_user_message`).

    Args:
        tools: Tools on offer (or :meth:`episode_tools` per episode).
        user: A simulated user (see :data:`User`); default: the task's
            ``metadata["user_turns"]`` in order.
        **kwargs: :class:`ToolEnv`'s (``split``, ``parser``, ``max_turns`` over the whole
            conversation, ...).
    """

    def __init__(self, tools: Sequence[Tool] = (), *, user: User | None = None, **kwargs: Any):
        super().__init__(tools, **kwargs)
        if user is not None and not callable(user):
            raise InvalidOptionError(
                f"user must be a callable user(task, messages) -> str | None, got {user!r}"
            )
        self.user = user
        self.user_turn = 0  # the user turn being worked on (0: task.prompt)
        self.turn_results: list[tuple[float, dict[str, Any]]] = []

    # ---- hooks ---------------------------------------------------------------------------
    def score_turn(self, answer: str, task: Task, turn: int) -> tuple[float, dict[str, Any]]:
        """Reward and info of the agent's answer to user turn ``turn`` (0: the first);
        the info must include ``"correct"``."""
        raise NotImplementedError(f"{type(self).__name__} must implement score_turn()")

    def score_conversation(
        self, task: Task, results: list[tuple[float, dict[str, Any]]]
    ) -> tuple[float, dict[str, Any]]:
        """The episode's reward and info from every user turn's ``(reward, info)``:
        by default the mean reward, correct when every turn was."""
        rewards = [r for r, _ in results]
        correct = [bool(i.get("correct")) for _, i in results]
        return sum(rewards) / len(rewards), {
            "correct": all(correct),
            "turns_correct": sum(correct),
            "user_turns": len(results),
        }

    def next_user_message(self, task: Task, turn: int) -> str | None:
        """User turn ``turn``'s message (``turn >= 1``), or None when the conversation is
        over: the simulated ``user``'s, else ``task.metadata["user_turns"][turn - 1]``."""
        if self.user is not None:
            return self.user(task, list(self.messages))
        turns = task.metadata.get("user_turns") or []
        return turns[turn - 1] if turn - 1 < len(turns) else None

    def score(self, answer: str, task: Task) -> tuple[float, dict[str, Any]]:
        """The answer to the current user turn, scored (:meth:`score_turn`)."""
        return self.score_turn(answer, task, self.user_turn)

    def _progress(self) -> dict[str, int]:
        """``turns_correct``: the user turns answered correctly so far; ``user_turns``: the
        task's number of user turns, where the task lists them (not a simulated user's).
        In every step's info, so an episode cut short still says how far it got."""
        out = {"turns_correct": sum(bool(i.get("correct")) for _, i in self.turn_results)}
        if self.user is None and self.task is not None:
            out["user_turns"] = 1 + len(self.task.metadata.get("user_turns") or [])
        return out

    # ---- the loop ------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        self.user_turn, self.turn_results = 0, []
        obs, info = super().reset(seed=seed, options=options)
        return obs, {**info, "user_turn": 0}

    def step(self, action: str) -> tuple[list[Message], SupportsFloat, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        if not terminated:  # a tool call or a reminder: the turn goes on
            info = {**info, **self._progress(), "user_turn": self.user_turn}
            return obs, reward, terminated, truncated, info
        assert self.task is not None
        turn_info = {k: v for k, v in info.items() if k not in self._stats}
        self.turn_results.append((float(reward), turn_info))
        info = {**info, "turn_reward": float(reward), "answered_turn": self.user_turn}
        info.update(self._progress())
        message = self.next_user_message(self.task, self.user_turn + 1)
        if message is None:  # the last user turn: the conversation's reward
            final, extra = self.score_conversation(self.task, self.turn_results)
            return [], float(final), True, False, {**info, **extra}
        self.user_turn += 1
        new = [{"role": "user", "content": message}]
        self.messages.extend(new)
        out_of_turns = self._stats["turn"] >= self.max_turns
        self._done = out_of_turns
        info = {**info, "user_turn": self.user_turn}
        if out_of_turns:  # answered, but no action left for the next user turn
            info["correct"] = False
        return new, 0.0, False, out_of_turns, info
