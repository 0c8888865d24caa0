"""An LLM judge: a reward (or eval metric) for free-form answers, from a rubric prompt.

:class:`LLMJudge` asks a model to grade an answer to a question, against a reference when
there is one, and reads a 0-10 grade from ``<score>N</score>`` in its reply (a reward in
[0, 1]). The model is any :class:`JudgeBackend`:

* :class:`TransformersJudge`: a local HF model through agentenv's generation path (greedy),
  by default the bundled SmolLM2-135M-Instruct, offline. It is a weak judge: fine for a
  smoke test and for wiring, not for grading that matters.
* :class:`OpenAIJudge`: any OpenAI-compatible ``/v1/chat/completions`` endpoint by URL
  (vLLM, TGI, ``transformers serve``, a hosted API), with a per-request timeout.

Grades are batched (one backend call per :meth:`LLMJudge.score_batch`) and cached by a hash
of (question, answer, reference), so GRPO's repeated answers within a group cost one call.
A failure (an exception, a timeout, a reply without a grade) gives ``fallback`` and is
counted in :attr:`LLMJudge.stats`; it never raises into the training loop.
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.request
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Protocol

from agentenv.env.spaces import Message
from agentenv.errors import InvalidOptionError

DEFAULT_RUBRIC = (
    "You grade answers. Read the question, the reference answer (if given) and the "
    "candidate answer. Give a grade from 0 (wrong or unsupported) to 10 (fully correct and "
    "complete). Reply with the grade only, as <score>N</score>."
)
_SCORE = re.compile(r"<score>\s*(\d+(?:\.\d+)?)\s*</score>", re.I)


class JudgeBackend(Protocol):
    """Something that completes chats: one reply text per chat, in order."""

    def complete(self, chats: Sequence[list[Message]]) -> list[str]: ...


@dataclass
class Verdict:
    """One grade: ``reward`` in [0, 1] (``fallback`` on failure), the reply, any error."""

    reward: float
    reply: str = ""
    error: str | None = None


class LLMJudge:
    """Grades (question, answer[, reference]) triples with a model and a rubric.

    Args:
        backend: The model (a :class:`JudgeBackend`).
        rubric: The system prompt; it must ask for ``<score>N</score>`` with N in 0..10.
        fallback: The reward of a failed grade.
        timeout_s: Wall-clock limit of one batched backend call.
        cache_size: Most grades kept (least recently used dropped first).
    """

    def __init__(
        self,
        backend: JudgeBackend,
        *,
        rubric: str = DEFAULT_RUBRIC,
        fallback: float = 0.0,
        timeout_s: float = 60.0,
        cache_size: int = 10_000,
    ):
        if timeout_s <= 0 or cache_size < 0:
            raise InvalidOptionError(
                f"timeout_s must be > 0 and cache_size >= 0, got {timeout_s} and {cache_size}"
            )
        self.backend = backend
        self.rubric = rubric
        self.fallback = float(fallback)
        self.timeout_s = float(timeout_s)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Verdict] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-judge")
        self.stats = {"calls": 0, "graded": 0, "cached": 0, "failures": 0}

    def chat(self, question: str, answer: str, reference: str | None = None) -> list[Message]:
        """The chat the judge model sees for one triple."""
        parts = [f"Question:\n{question}"]
        if reference is not None:
            parts.append(f"Reference answer:\n{reference}")
        parts.append(f"Candidate answer:\n{answer}")
        return [
            {"role": "system", "content": self.rubric},
            {"role": "user", "content": "\n\n".join(parts)},
        ]

    def score(self, question: str, answer: str, reference: str | None = None) -> float:
        """The reward in [0, 1] of one answer."""
        return self.score_batch([(question, answer, reference)])[0].reward

    def score_batch(self, items: Sequence[tuple[str, str, str | None]]) -> list[Verdict]:
        """Grades of ``(question, answer, reference)`` triples: cached ones are reused, the
        rest go to the backend in one call (a triple repeated in the batch, once). Failed
        grades are not cached, so they are tried again next time."""
        keys = [_key(*item) for item in items]
        fresh: dict[str, tuple[str, str, str | None]] = {}
        for key, item in zip(keys, items, strict=True):
            if key not in self._cache:
                fresh.setdefault(key, item)
        graded = dict(zip(fresh, self._grade(list(fresh.values())), strict=True)) if fresh else {}
        self.stats["cached"] += len(keys) - len(fresh)
        for key, verdict in graded.items():
            if verdict.error is None and self.cache_size > 0:
                self._cache[key] = verdict
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)  # the least recently used
        out = []
        for key in keys:
            if key in graded:
                out.append(graded[key])
            else:
                self._cache.move_to_end(key)
                out.append(self._cache[key])
        return out

    def _grade(self, items: list[tuple[str, str, str | None]]) -> list[Verdict]:
        chats = [self.chat(*item) for item in items]
        self.stats["calls"] += 1
        try:
            future = self._pool.submit(self.backend.complete, chats)
            replies = future.result(timeout=self.timeout_s)
            if len(replies) != len(chats):
                raise ValueError(f"the backend returned {len(replies)} replies for {len(chats)}")
        except FutureTimeout:
            return self._failed(len(items), f"no reply within {self.timeout_s:g} s")
        except Exception as error:  # the judge must not stop training
            return self._failed(len(items), f"{type(error).__name__}: {error}")
        verdicts = [parse_verdict(reply, self.fallback) for reply in replies]
        self.stats["graded"] += sum(v.error is None for v in verdicts)
        self.stats["failures"] += sum(v.error is not None for v in verdicts)
        return verdicts

    def _failed(self, n: int, error: str) -> list[Verdict]:
        self.stats["failures"] += n
        return [Verdict(self.fallback, "", error) for _ in range(n)]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def parse_verdict(reply: str, fallback: float) -> Verdict:
    """The reward in ``<score>N</score>`` (N in 0..10, scaled to [0, 1])."""
    match = _SCORE.search(reply or "")
    if match is None:
        return Verdict(fallback, reply, "no <score>N</score> in the reply")
    grade = float(match.group(1))
    if not 0 <= grade <= 10:
        return Verdict(fallback, reply, f"grade {grade:g} is outside 0..10")
    return Verdict(grade / 10, reply)


def _key(question: str, answer: str, reference: str | None) -> str:
    payload = json.dumps([question, answer, reference], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


class OpenAIJudge:
    """A :class:`JudgeBackend` on any OpenAI-compatible ``/v1/chat/completions`` endpoint.

    Args:
        base_url: The API root, e.g. ``"http://127.0.0.1:8000/v1"``.
        model: The model name the server expects.
        api_key: Sent as a bearer token when given.
        max_tokens: Reply length limit.
        timeout_s: Per-request timeout (requests run one after another).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        max_tokens: int = 32,
        timeout_s: float = 30.0,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise InvalidOptionError(
                f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                f"got {base_url!r}"
            )
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key = model, api_key
        self.max_tokens, self.timeout_s = max_tokens, timeout_s

    def complete(self, chats: Sequence[list[Message]]) -> list[str]:
        replies = []
        for chat in chats:
            body = {
                "model": self.model,
                "messages": chat,
                "max_tokens": self.max_tokens,
                "temperature": 0.0,
            }
            request = urllib.request.Request(
                self.url,
                data=json.dumps(body).encode(),
                headers={
                    "Content-Type": "application/json",
                    **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}),
                },
            )
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = json.loads(response.read())
            replies.append(payload["choices"][0]["message"]["content"] or "")
        return replies


class TransformersJudge:
    """A :class:`JudgeBackend` on a local HF causal LM, greedy, batched.

    Args:
        model, tokenizer: The judge model (default :meth:`default` loads the bundled
            SmolLM2-135M-Instruct: offline, and weak as a judge).
        max_new_tokens: Reply length limit.
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_new_tokens: int = 16):
        from agentenv.lm.backend import SamplingConfig
        from agentenv.lm.sampler import TransformersPolicy
        from agentenv.rollout.episode import ChatFormat

        self.format = ChatFormat(tokenizer)
        self.policy = TransformersPolicy(model, tokenizer, reuse_cache=False)
        self.sampling = SamplingConfig(
            max_new_tokens=max_new_tokens, temperature=0.0, stop_strings=["</score>"]
        )

    @classmethod
    def default(cls, **kwargs: Any) -> TransformersJudge:
        """The bundled default model as a judge."""
        from agentenv.lm import models

        model, tokenizer = models.load(models.DEFAULT_MODEL)
        return cls(model, tokenizer, **kwargs)

    def complete(self, chats: Sequence[list[Message]]) -> list[str]:
        prompts = [self.format.prompt_ids(chat) for chat in chats]
        return [g.text for g in self.policy.generate(prompts, self.sampling)]
