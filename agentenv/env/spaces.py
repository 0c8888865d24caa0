"""Spaces for text environments.

Gymnasium's built-in :class:`gymnasium.spaces.Text` only contains strings drawn
from a fixed charset (alphanumeric by default), so it rejects free-form LLM
output. The two spaces here contain what a text environment really exchanges:

* :class:`FreeText` -- any ``str`` up to ``max_length`` characters (actions).
* :class:`Messages` -- a list of chat messages ``{"role": ..., "content": ...}``
  (observations).

Both sample from their own seeded ``np_random`` so ``check_env`` can use them.
:class:`Messages` also works in gymnasium's ``AsyncVectorEnv`` with shared memory (its
default): each env's observation travels as JSON in a slot of its own.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import string
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import (
    create_shared_memory,
    read_from_shared_memory,
    write_to_shared_memory,
)

Message = dict[str, str]
"""A chat message: ``{"role": "system" | "user" | "tool" | "assistant", "content": str}``."""

ENV_ROLES: tuple[str, ...] = ("system", "user", "tool")
_SAMPLE_CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"


class FreeText(spaces.Text):
    """Any Python string of at most ``max_length`` characters.

    A subclass of :class:`gymnasium.spaces.Text`, so code that checks for a text
    action space keeps working, but ``contains`` accepts every character (LLMs
    write unicode, newlines and markup). ``sample`` draws printable ASCII.

    Args:
        max_length: Longest string contained. Longer actions are still accepted
            by the bundled environments (they are parsed, then answered with an
            error), but are not members of the space.
        min_length: Shortest string contained.
        seed: Seed for :meth:`sample`.
    """

    def __init__(
        self, max_length: int = 1_000_000, *, min_length: int = 0, seed: int | None = None
    ):
        super().__init__(max_length, min_length=min_length, charset=_SAMPLE_CHARS, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """Random printable text of 1 to 64 characters (``mask`` is not supported)."""
        if mask is not None or probability is not None:
            raise NotImplementedError("FreeText.sample does not support mask or probability")
        hi = max(self.min_length, min(64, self.max_length))
        length = int(self.np_random.integers(max(self.min_length, 1), hi + 1)) if hi else 0
        idx = self.np_random.integers(0, len(_SAMPLE_CHARS), size=length)
        return "".join(_SAMPLE_CHARS[i] for i in idx)

    def __repr__(self) -> str:
        return f"FreeText(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FreeText) and (self.min_length, self.max_length) == (
            other.min_length,
            other.max_length,
        )


class Messages(spaces.Space[list[Message]]):
    """Lists of chat messages, each exactly ``{"role": str, "content": str}``.

    This is the observation space of every :class:`~agentenv.TextEnv`: ``reset``
    returns the system prompt and task, ``step`` returns the new messages the
    environment says (tool results, feedback).

    Args:
        roles: Roles a message may have.
        max_messages: Most messages in one observation.
        max_content_length: Longest ``content`` string contained.
        seed: Seed for :meth:`sample`.
    """

    def __init__(
        self,
        roles: Sequence[str] = ENV_ROLES,
        *,
        max_messages: int = 64,
        max_content_length: int = 1_000_000,
        seed: int | None = None,
    ):
        if not roles:
            raise ValueError("Messages needs at least one role, got an empty sequence")
        self.roles = tuple(roles)
        self.max_messages = int(max_messages)
        self.max_content_length = int(max_content_length)
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        if not isinstance(x, list) or len(x) > self.max_messages:
            return False
        return all(
            isinstance(m, dict)
            and m.keys() == {"role", "content"}
            and m["role"] in self.roles
            and isinstance(m["content"], str)
            and len(m["content"]) <= self.max_content_length
            for m in x
        )

    def sample(self, mask: Any = None, probability: Any = None) -> list[Message]:
        """1 to 3 messages with random roles and printable content."""
        if mask is not None or probability is not None:
            raise NotImplementedError("Messages.sample does not support mask or probability")
        rng: np.random.Generator = self.np_random
        out: list[Message] = []
        for _ in range(int(rng.integers(1, min(3, self.max_messages) + 1))):
            n = int(rng.integers(0, min(64, self.max_content_length) + 1))
            content = "".join(_SAMPLE_CHARS[i] for i in rng.integers(0, len(_SAMPLE_CHARS), n))
            out.append({"role": self.roles[int(rng.integers(len(self.roles)))], "content": content})
        return out

    def __repr__(self) -> str:
        return f"Messages(roles={self.roles}, max_messages={self.max_messages})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Messages) and (
            self.roles,
            self.max_messages,
            self.max_content_length,
        ) == (other.roles, other.max_messages, other.max_content_length)


# ---- AsyncVectorEnv shared memory ---------------------------------------------------------
# gymnasium's AsyncVectorEnv (shared_memory=True, the default) has each worker write its
# observation into shared memory, and reads the batch through a view made once. A message
# list has no fixed shape, so each env gets a slot of SHARED_MEMORY_BYTES holding its
# observation as length-prefixed UTF-8 JSON, and the view decodes the slots when read.

SHARED_MEMORY_BYTES = 1 << 20
"""Bytes of shared memory per env for one :class:`Messages` observation (as JSON)."""


class SharedMessages(Sequence[list[Message]]):
    """The batch of :class:`Messages` observations in shared memory: a read-only sequence
    that decodes env ``i``'s slot when indexed. ``copy.deepcopy`` (what AsyncVectorEnv
    returns with its default ``copy=True``) gives a plain tuple of message lists."""

    def __init__(self, buffer: Any, n: int):
        self._buffer, self._n = buffer, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._n)))
        if not -self._n <= index < self._n:
            raise IndexError(f"env index {index} out of range for {self._n} envs")
        view = np.frombuffer(self._buffer.get_obj(), dtype=np.uint8)
        start = (index % self._n) * SHARED_MEMORY_BYTES
        size = int.from_bytes(view[start : start + 4].tobytes(), "little")
        return json.loads(view[start + 4 : start + 4 + size].tobytes()) if size else []

    def __deepcopy__(self, memo: dict[int, Any]) -> tuple[list[Message], ...]:
        return tuple(self)

    def __repr__(self) -> str:
        return f"SharedMessages({list(self)!r})"


@create_shared_memory.register(Messages)
def _create_messages_shared_memory(space: Messages, n: int = 1, ctx: Any = mp) -> Any:
    return ctx.Array("B", n * SHARED_MEMORY_BYTES)


@read_from_shared_memory.register(Messages)
def _read_messages_shared_memory(space: Messages, shared_memory: Any, n: int = 1) -> Any:
    return SharedMessages(shared_memory, n)


@write_to_shared_memory.register(Messages)
def _write_messages_shared_memory(
    space: Messages, index: int, value: list[Message], shared_memory: Any
) -> None:
    data = json.dumps(value).encode()
    if len(data) + 4 > SHARED_MEMORY_BYTES:
        raise ValueError(
            f"observation of {len(data)} bytes (as JSON) exceeds the {SHARED_MEMORY_BYTES}-byte "
            "shared-memory slot of AsyncVectorEnv; make it with "
            "vector_kwargs={'shared_memory': False}"
        )
    view = np.frombuffer(shared_memory.get_obj(), dtype=np.uint8)
    start = index * SHARED_MEMORY_BYTES
    view[start : start + 4] = np.frombuffer(len(data).to_bytes(4, "little"), dtype=np.uint8)
    view[start + 4 : start + 4 + len(data)] = np.frombuffer(data, dtype=np.uint8)
