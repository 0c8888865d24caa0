"""Episodes as tokens: the exact-token record of a multi-turn trajectory.

An :class:`Episode` holds one trajectory as the policy saw it: ``input_ids`` (the
prompt, every policy turn, every environment turn), ``action_mask`` (1 exactly on
the tokens the policy sampled) and the ``sampler_logprobs`` of those tokens (the one name
of the sampler's log-probs from generation to the loss).

Rules (docs/design.md §3):

* Policy tokens are appended exactly as sampled, never decoded and re-tokenized.
* Environment messages are appended as the chat-template *delta*: the template is
  rendered with and without the new messages and the suffix is tokenized. The
  closing scaffolding the template puts after an assistant message
  (``<|im_end|>\\n`` for ChatML) is environment text too, minus whatever of it the
  policy sampled itself (normally its end-of-turn token).
* Templates that re-render history (Qwen3's thinking templates drop the ``<think>``
  part of earlier assistant turns; others change a turn once it is no longer the last)
  are not prefix-stable, so the delta is rendered against a fixed base conversation
  instead (``[system, user] + new``, minus ``[system, user]``), the way SkyRL and verl
  append observations: earlier turns stay exactly as the policy saw and sampled them,
  and the episode is the model's token-in/token-out history, not the template's
  re-render of it.
* A template without a ``tool`` role still works: :class:`ChatFormat` detects that
  and sends tool results as ``user`` turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentenv.env.spaces import Message
from agentenv.errors import AgentEnvError

_SENTINEL = "\u2063AGENTENV_SENTINEL\u2063"
OVERFLOW_MARKER = "\n[... truncated to fit the context window ...]"
FAILED_STOP_REASONS = ("env_error", "timeout")  # an episode cut short by a failure


class ChatTemplateError(AgentEnvError):
    """A chat template cannot render environment messages as an appendable delta."""


# Fixed conversations the environment delta is rendered after when the real history
# re-renders (tried in order; one ending in an assistant turn for templates that require
# a tool result to follow one).
_BASES: tuple[list[Message], ...] = (
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
    [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ],
)


class ChatFormat:
    """Renders chats to token ids with a tokenizer's chat template, turn by turn.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template.
        chat_template: Optional template string overriding the tokenizer's.
        tool_role: Role used for tool results; ``None`` detects it (``"tool"`` if
            the template renders that role, else ``"user"``).
    """

    def __init__(
        self, tokenizer: Any, *, chat_template: str | None = None, tool_role: str | None = None
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        self.tool_role = tool_role or self._detect_tool_role(probe)
        rendered = self.render([*probe, {"role": "assistant", "content": _SENTINEL}])
        self.assistant_close = rendered.split(_SENTINEL, 1)[1]
        self._special_ids = set(tokenizer.all_special_ids)

    def _detect_tool_role(self, probe: list[Message]) -> str:
        chat = [
            *probe,
            {"role": "assistant", "content": "a"},
            {"role": "tool", "content": _SENTINEL},
        ]
        try:
            return "tool" if _SENTINEL in self.render(chat) else "user"
        except Exception:  # jinja raises for roles the template does not know
            return "user"

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``."""
        return self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (special tokens in the text are recognised)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def map_roles(self, messages: Sequence[Message]) -> list[Message]:
        """Messages with ``tool`` turns renamed to :attr:`tool_role`."""
        return [
            {"role": self.tool_role if m["role"] == "tool" else m["role"], "content": m["content"]}
            for m in messages
        ]

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """Ids of the opening messages plus the assistant generation prompt."""
        return self.encode(self.render(self.map_roles(messages), add_generation_prompt=True))

    def env_ids(
        self, history: Sequence[Message], new: Sequence[Message], policy_ids: Sequence[int]
    ) -> list[int]:
        """Ids to append after the policy's last turn for the environment's ``new`` messages.

        Args:
            history: The chat so far, ending with the policy's assistant message.
            new: The environment's new messages.
            policy_ids: The policy's last turn exactly as sampled.
        """
        history = self.map_roles(history)
        new = self.map_roles(new)
        before = self.render(history)
        after = self.render([*history, *new], add_generation_prompt=True)
        delta = after[len(before) :] if after.startswith(before) else self._base_delta(new)
        close = self.assistant_close
        if policy_ids and policy_ids[-1] in self._special_ids:  # the policy ended its own turn
            end = self.tokenizer.decode([policy_ids[-1]], skip_special_tokens=False)
            close = close.removeprefix(end)
        return self.encode(close + delta)

    def _base_delta(self, new: list[Message]) -> str:
        """``new`` and the generation prompt, rendered after a fixed base conversation."""
        for base in _BASES:
            try:
                before = self.render(base)
                after = self.render([*base, *new], add_generation_prompt=True)
            except Exception:  # jinja raises on an order the template refuses
                continue
            if after.startswith(before):
                return after[len(before) :]
        raise ChatTemplateError(
            "the chat template renders earlier turns differently once new messages are "
            "added, even after a fixed [system, user] or [system, user, assistant] "
            f"conversation, so {[m['role'] for m in new]} messages cannot be appended as "
            "tokens; pass a prefix-stable template with chat_template=..."
        )


@dataclass
class Episode:
    """One trajectory as tokens, with its outcome.

    Attributes:
        input_ids: Every token of the episode, in order.
        action_mask: 1 on tokens the policy sampled, 0 on prompt/environment/template tokens.
        sampler_logprobs: The sampler's log-prob of each policy token; 0.0 where the mask
            is 0.
        reward: The episode's scalar reward (a bandit: shared by all policy tokens).
        num_turns: Policy turns taken.
        stop_reason: ``"terminated"``, ``"truncated"``, ``"max_turns"`` or ``"max_tokens"``;
            a failure (:attr:`failed`): ``"env_error"`` (the env raised; the error in
            ``info["env_error"]``) or ``"timeout"`` (past the episode's wall-clock limit).
        info: The environment's last ``info``.
        messages: The chat for display (environment tool turns keep role ``tool``).
        group: Index of the GRPO group (task) within its batch.
        seed: The reset seed of the task.
        env: The name of its env in a run of several (:mod:`agentenv.env.mixture`); ""
            in a run of one.
        turn_spans: ``[start, end)`` of each policy turn's tokens in ``input_ids``, one per
            turn in order (exactly the positions where ``action_mask`` is 1).
        step_rewards: The env's ``step`` reward after each policy turn (0.0 for a turn
            whose step did not run or raised); they add up to ``reward``.
        turn_rewards: The env's optional per-turn reward, ``info["turn_reward"]`` of the
            step after each turn (0.0 where the env gives none), e.g. "this search
            retrieved a gold article". Not part of ``reward``: turn-level credit
            (``GRPOConfig.credit``) reads it, the bandit default ignores it.
        turn_hidden: The sampler's last hidden state before each policy turn (``(H,)``
            float32 each: the state the turn's first token was drawn from), where the
            engine records it (the local ones do: :mod:`agentenv.lm.hidden`); else None.
            ``credit="gae"`` with ``critic_input="sampler"`` feeds these to its critic
            instead of a forward of its own. Not written to the episode logs.
    """

    input_ids: list[int]
    action_mask: list[int]
    sampler_logprobs: list[float]
    reward: float = 0.0
    num_turns: int = 0
    stop_reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    group: int = 0
    seed: int | None = None
    env: str = ""
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_hidden: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.action_mask) != n or len(self.sampler_logprobs) != n:
            raise ValueError(
                f"input_ids, action_mask and sampler_logprobs must have equal lengths, got "
                f"{n}, {len(self.action_mask)}, {len(self.sampler_logprobs)}"
            )
        if not self.turn_spans:  # an episode built by hand: its turns from the mask
            self.turn_spans = self.policy_spans()
        turns = len(self.turn_spans)
        for name in ("step_rewards", "turn_rewards"):
            values = getattr(self, name)
            if not values:
                setattr(self, name, [0.0] * turns)
            elif len(values) != turns:
                raise ValueError(
                    f"{name} must have one value per policy turn ({turns}), got {len(values)}"
                )
        if self.turn_hidden is not None and len(self.turn_hidden) != turns:
            raise ValueError(
                f"turn_hidden must have one state per policy turn ({turns}) or be None, got "
                f"{len(self.turn_hidden)}"
            )

    @property
    def failed(self) -> bool:
        """Whether the episode ended by a failure rather than by the policy or the env's
        rules: no learning signal comes from it (:mod:`algorithms.grpo`)."""
        return self.stop_reason in FAILED_STOP_REASONS

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.action_mask)

    def policy_spans(self) -> list[tuple[int, int]]:
        """``[start, end)`` index ranges of consecutive policy tokens (one per turn)."""
        return mask_spans(self.action_mask)


def mask_spans(action_mask: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges of the runs of 1s in ``action_mask``."""
    spans, start = [], None
    for i, m in enumerate([*action_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


class EpisodeBuilder:
    """Accumulates one trajectory's tokens turn by turn.

    Args:
        fmt: The chat format.
        messages: The environment's opening messages (from ``reset``).
        max_tokens: Token budget of the whole episode.
    """

    def __init__(self, fmt: ChatFormat, messages: Sequence[Message], max_tokens: int):
        self.fmt = fmt
        self.max_tokens = max_tokens
        self.messages: list[Message] = list(messages)
        self.input_ids = fmt.prompt_ids(messages)
        self.action_mask = [0] * len(self.input_ids)
        self.sampler_logprobs = [0.0] * len(self.input_ids)
        self._last_policy: list[int] = []
        self.num_turns = 0
        self.turn_spans: list[tuple[int, int]] = []
        self.turn_hidden: list[torch.Tensor | None] = []

    @property
    def room(self) -> int:
        """Tokens left in the budget."""
        return self.max_tokens - len(self.input_ids)

    def add_policy(
        self,
        token_ids: Sequence[int],
        sampler_logprobs: Sequence[float],
        text: str,
        hidden: torch.Tensor | None = None,
    ) -> None:
        """Append a policy turn exactly as sampled (``text`` is for display only;
        ``hidden``: the state its first token was drawn from, if the engine recorded it)."""
        if len(token_ids) != len(sampler_logprobs):
            raise ValueError(f"{len(token_ids)} tokens but {len(sampler_logprobs)} log-probs")
        self.turn_hidden.append(hidden)
        self.turn_spans.append((len(self.input_ids), len(self.input_ids) + len(token_ids)))
        self.input_ids += list(token_ids)
        self.action_mask += [1] * len(token_ids)
        self.sampler_logprobs += [float(x) for x in sampler_logprobs]
        self._last_policy = list(token_ids)
        self.messages.append({"role": "assistant", "content": text})
        self.num_turns += 1

    def add_env(self, new: Sequence[Message], min_room: int = 16) -> bool:
        """Append environment messages; shrink them with a marker if they would overflow.

        Returns:
            False when even a shrunk observation leaves fewer than ``min_room`` tokens
            for the next policy turn (the episode must stop: ``"max_tokens"``).
        """
        new = [dict(m) for m in new]
        for _ in range(4):
            ids = self.fmt.env_ids(self.messages, new, self._last_policy)
            excess = len(ids) - (self.room - min_room)
            if excess <= 0:
                self.input_ids += ids
                self.action_mask += [0] * len(ids)
                self.sampler_logprobs += [0.0] * len(ids)
                self.messages.extend(new)
                return True
            total = sum(len(m["content"]) for m in new)
            if total == 0:
                break
            keep = max(0.0, 1 - (excess + 8 * len(new) + 16) / max(len(ids), 1))
            for m in new:
                if m["content"]:
                    m["content"] = m["content"][: int(len(m["content"]) * keep)] + OVERFLOW_MARKER
        return False

    def _all_hidden(self) -> list[torch.Tensor] | None:
        """Every turn's hidden state, or None if any turn has none."""
        states = [h for h in self.turn_hidden if h is not None]
        return states if len(states) == len(self.turn_hidden) else None

    def build(self, **kwargs: Any) -> Episode:
        """The finished :class:`Episode` (``kwargs``: reward, stop_reason, info, ...)."""
        return Episode(
            list(self.input_ids),
            list(self.action_mask),
            list(self.sampler_logprobs),
            num_turns=self.num_turns,
            messages=list(self.messages),
            turn_spans=list(self.turn_spans),
            turn_hidden=self._all_hidden(),
            **kwargs,
        )


def collate(
    episodes: Sequence[Any], advantages: Sequence[float], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Right-pad episodes into the tensors the algorithm consumes.

    Args:
        episodes: :class:`Episode` objects (anything with ``input_ids``, ``action_mask``,
            ``sampler_logprobs`` and ``reward``).
        advantages: One advantage per episode (computed by the algorithm).
        pad_token_id: Id used for padding.

    Returns:
        ``input_ids`` (N, T) long, ``attention_mask`` (N, T) long, ``action_mask`` (N, T)
        float, ``sampler_logprobs`` (N, T) float (sampler log-probs, 0 off-policy tokens),
        ``advantages`` (N,) float, ``rewards`` (N,) float.
    """
    if len(episodes) != len(advantages):
        raise ValueError(f"{len(episodes)} episodes but {len(advantages)} advantages")
    n, t = len(episodes), max(len(e.input_ids) for e in episodes)
    input_ids = torch.full((n, t), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, t), dtype=torch.long)
    action_mask = torch.zeros((n, t), dtype=torch.float32)
    sampler_logprobs = torch.zeros((n, t), dtype=torch.float32)
    for i, e in enumerate(episodes):
        k = len(e.input_ids)
        input_ids[i, :k] = torch.tensor(e.input_ids)
        attention_mask[i, :k] = 1
        action_mask[i, :k] = torch.tensor(e.action_mask, dtype=torch.float32)
        sampler_logprobs[i, :k] = torch.tensor(e.sampler_logprobs)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "action_mask": action_mask,
        "sampler_logprobs": sampler_logprobs,
        "advantages": torch.tensor(list(advantages), dtype=torch.float32),
        "rewards": torch.tensor([e.reward for e in episodes], dtype=torch.float32),
    }
