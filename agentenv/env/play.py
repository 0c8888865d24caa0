"""Play one episode with any policy: the smallest possible agent loop.

A *policy* here is any callable ``messages -> str`` (the chat so far in, the next
assistant message out). :class:`ChatModelPolicy` wraps a Hugging Face causal LM.
Batched, token-exact collection for training lives in ``agentenv.rollout.collect``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from agentenv.env.spaces import Message

Policy = Callable[[list[Message]], str]


@dataclass
class EpisodeResult:
    """Transcript and outcome of one played episode."""

    messages: list[Message]
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)


def play_episode(
    env: gym.Env,
    policy: Policy,
    *,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    max_steps: int = 100,
) -> EpisodeResult:
    """Reset ``env`` and step it with ``policy`` until the episode ends.

    Args:
        env: A text environment (observations are message lists).
        policy: ``messages -> action``.
        seed: Reset seed (same seed, same task).
        options: Reset options, e.g. ``{"task_id": 3}``.
        max_steps: Safety cap for environments without their own turn limit.
    """
    obs, info = env.reset(seed=seed, options=options)
    messages = list(obs)
    reward, terminated, truncated = 0.0, False, False
    for _ in range(max_steps):
        action = policy(messages)
        messages.append({"role": "assistant", "content": action})
        obs, r, terminated, truncated, info = env.step(action)
        messages.extend(obs)
        reward += float(r)
        if terminated or truncated:
            break
    return EpisodeResult(messages, reward, terminated, truncated, info)


class ChatModelPolicy:
    """A policy that samples the next assistant message from a chat model.

    Args:
        model: A ``transformers`` causal LM.
        tokenizer: Its tokenizer (with a chat template).
        max_new_tokens: Tokens generated per turn.
        temperature: 0 for greedy decoding.
    """

    def __init__(
        self, model: Any, tokenizer: Any, *, max_new_tokens: int = 256, temperature: float = 0.0
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature

    def __call__(self, messages: list[Message]) -> str:
        import torch

        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"].to(self.model.device)
        sampling = (
            {"do_sample": True, "temperature": self.temperature}
            if self.temperature > 0
            else {"do_sample": False}
        )
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=self.max_new_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
                **sampling,
            )
        return self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
