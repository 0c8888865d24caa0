"""An OpenAI-compatible server as the generation engine (``--engine server``).

Generation runs in another process, on other GPUs or on another machine than training:
``vllm serve`` (tested, vLLM 0.32), or any server whose ``/v1/completions`` takes a
token-id prompt and returns the sampled token ids (vLLM's ``return_token_ids``) and their
log-probs. Start vLLM for it like this (``--max-lora-rank`` at least the run's
``lora_r``)::

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve MODEL_DIR --enable-lora \\
        --max-lora-rank 16 --logprobs-mode processed_logprobs

:class:`ServerPolicy` is a :class:`~agentenv.lm.backend.PolicyBackend`:

* **token ids in and out**: each turn is one request whose prompt is the episode's ids so
  far; the reply's ``token_ids`` and ``logprobs`` (of the sampled token) are the turn. No
  text is re-tokenized, so the episode holds exactly the tokens sampled.
* **per-row seeds**: the request's ``seed`` (the same prompt and seed give the same turn
  in any batch, up to the server's batched float rounding).
* **stop strings** end a turn, the text completing one kept
  (``include_stop_str_in_output``), as the other engines do.
* **weights: LoRA only.** When the trained adapter changed (after every optimizer step,
  and before the first turn so a warm start samples its own adapter), it is saved to a new
  folder under ``adapter_dir`` and loaded under a new name (``/v1/load_lora_adapter``:
  a fresh adapter id, so the server's prefix cache never mixes versions); the previous
  one is unloaded and its folder removed. The server reads that folder itself: run it on
  this machine or give it a shared filesystem. Full fine-tuning would need the whole model
  sent into the server's memory (TRL's ``vllm-serve`` does it over NCCL): not built, and
  ``train`` refuses it before any model loads.
* **log-probs** are those of the distribution sampled from only when the server runs with
  ``--logprobs-mode processed_logprobs`` (vLLM's default is the raw model's, which agrees
  only at temperature 1 without top-k or top-p). The trainer recomputes its own either
  way; the gap is logged as ``sampler/logprob_abs_diff_mean``.
* **continuous batching**: :meth:`ServerPolicy.decoder` keeps one request in flight per
  episode, so with ``rollout.batching=continuous`` every episode's next turn is sent the
  moment its env has answered, and the server batches them as they come.

A server that stops answering raises :class:`~agentenv.errors.EngineError` naming it; a
training run's checkpoints are untouched: restart the server and continue with
``--resume``.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import shutil
import tempfile
import urllib.error
import urllib.request
import uuid
import weakref
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
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
from agentenv.lm.weights import is_peft, trainable_version

_MAX_REQUESTS = 256  # requests in flight at once (the server queues what it cannot batch)


def base_url(url: str) -> str:
    """``url`` as an OpenAI base URL: no trailing slash, ending in ``/v1``."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise InvalidOptionError(
            f"server_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {url!r}"
        )
    return url if url.endswith("/v1") else url + "/v1"


def served_models(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> list[str]:
    """The model names an OpenAI-compatible server at ``url`` lists (``GET /v1/models``);
    :class:`~agentenv.errors.EngineError` if nothing answers there."""
    reply = _request(f"{base_url(url)}/models", None, timeout_s, api_key)
    return [m["id"] for m in (reply or {}).get("data", [])]


class ServerPolicy:
    """An OpenAI-compatible server as the policy (see the module docstring).

    Args:
        model: The model being trained or evaluated, here; a peft ``PeftModel``'s adapter
            is sent to the server before the first turn and after every change. A plain
            model is not sent: the server samples from the model it serves.
        tokenizer: Its tokenizer (decodes the turns' text).
        url: The server's base URL (``http://HOST:PORT/v1``; ``/v1`` is added if missing).
        served_model: The name of the base model on the server (default: the first one
            ``/v1/models`` lists).
        adapter_dir: Where adapters are written for the server to load; it must be able to
            read this path. Default: a new temporary folder, removed by :meth:`close` or
            when the engine is garbage-collected (or the interpreter exits).
        stop_token_ids: Ids that end a turn (default: the tokenizer's and generation
            config's EOS ids, as the other engines').
        timeout_s: Seconds to wait for one reply.
        api_key: Sent as a bearer token (``vllm serve --api-key``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        url: str,
        served_model: str | None = None,
        adapter_dir: str | Path | None = None,
        stop_token_ids: Sequence[int] | None = None,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ):
        self.url = base_url(url)
        self.timeout_s = timeout_s
        self._api_key = api_key
        names = served_models(self.url, api_key=api_key)
        if served_model is None:
            if not names:
                raise EngineError(f"engine server: {self.url}/models lists no model")
            served_model = names[0]
        self.base_model = served_model
        self.model_name = served_model  # what requests ask for: the base or the adapter
        self.trained = model
        self.tokenizer = tokenizer
        if stop_token_ids is None:
            stop_token_ids = default_stop_ids(model, tokenizer)
        self.stop_token_ids = list(stop_token_ids)
        self.lora = is_peft(model)
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        # a plain model is the server's own: only a change after this point is unsendable
        self._version = None if self.lora else trainable_version(self._trainable)
        self._remove_dir: weakref.finalize | None = None  # a folder of our own goes with us
        if adapter_dir is None:  # removed by close(), else when collected or at exit
            self.adapter_dir = Path(tempfile.mkdtemp(prefix="agentenv-adapters-"))
            self._remove_dir = weakref.finalize(
                self, shutil.rmtree, self.adapter_dir, ignore_errors=True
            )
        else:
            self.adapter_dir = Path(adapter_dir)
        self._run = uuid.uuid4().hex[:8]  # adapter names of two runs on one server differ
        self._adapter: tuple[str, Path] | None = None  # the loaded adapter's name and folder
        self.syncs = 0  # adapters sent so far
        self._pool = ThreadPoolExecutor(_MAX_REQUESTS, thread_name_prefix="agentenv-server")

    # ---- weights -------------------------------------------------------------------

    def refresh(self) -> None:
        """Send the trained adapter to the server if it changed since the last one sent
        (or none was sent yet)."""
        version = trainable_version(self._trainable)
        if version == self._version:
            return
        if not self.lora:
            raise EngineError(
                "engine server: the trained model's weights changed, but only a LoRA adapter "
                "can be sent to a server; train with LoRA (grpo.use_lora true), or use "
                "engine vllm or agentenv for full fine-tuning"
            )
        self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Save the active adapter to a new folder, load it on the server under a new name
        and unload the previous one (see the module docstring)."""
        self._version = trainable_version(self._trainable)
        name = f"agentenv-{self._run}-{self.syncs}"
        folder = self.adapter_dir / name
        active = self.trained.active_adapter
        self.trained.save_pretrained(folder, selected_adapters=[active])
        if not (folder / "adapter_config.json").exists():  # peft nests a non-default name
            folder = folder / active
        self._post("load_lora_adapter", {"lora_name": name, "lora_path": str(folder.resolve())})
        old, self._adapter = self._adapter, (name, self.adapter_dir / name)
        self.model_name = name
        self.syncs += 1
        if old is not None:
            self._post("unload_lora_adapter", {"lora_name": old[0]})
            shutil.rmtree(old[1], ignore_errors=True)

    def close(self) -> None:
        """Unload this run's adapter from the server (if it still answers) and remove the
        temporary adapter folder."""
        if self._adapter is not None:
            try:
                self._post("unload_lora_adapter", {"lora_name": self._adapter[0]}, timeout_s=10)
            except EngineError:
                pass  # the server is gone: so is the adapter
            shutil.rmtree(self._adapter[1], ignore_errors=True)
            self._adapter = None
        if self._remove_dir is not None:  # the caller's folder stays
            self._remove_dir()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- decoding ------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """One continuation per prompt, in order: every prompt is a request in flight at
        once (the server batches them); with ``seeds``, row ``i`` draws from ``seeds[i]``."""
        check_batch(prompts, seeds)
        self.refresh()
        futures = [
            self._pool.submit(self.complete, p, sampling, None if seeds is None else seeds[i])
            for i, p in enumerate(prompts)
        ]
        return [f.result() for f in futures]

    def decoder(self, sampling: SamplingConfig) -> RunningBatch:
        """The rollout engine's running batch: one request in flight per row."""
        return Requests(self, sampling)

    def complete(
        self, prompt: Sequence[int], sampling: SamplingConfig, seed: int | None
    ) -> Generation:
        """One turn: one ``/v1/completions`` request (blocking; thread-safe)."""
        body = {
            "model": self.model_name,
            "prompt": [int(t) for t in prompt],
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "stop": list(sampling.stop_strings or []),
            "include_stop_str_in_output": True,
            "stop_token_ids": self.stop_token_ids,
            "logprobs": 0,  # the sampled token's own
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if seed is not None:
            body["seed"] = int(seed) % 2**63
        choice = self._post("completions", body)["choices"][0]
        ids = choice.get("token_ids")
        if ids is None:
            raise EngineError(
                f"engine server: {self.url} returned no token ids; it needs to support "
                "vLLM's `return_token_ids` (vllm >= 0.10.2)"
            )
        logps = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(logps) != len(ids) or any(v is None for v in logps):
            raise EngineError(
                f"engine server: {self.url} returned {len(ids)} token ids but "
                f"{len(logps)} log-probs; it must return the sampled tokens' log-probs"
            )
        if choice.get("finish_reason") == "length":
            reason = "length"
        elif isinstance(choice.get("stop_reason"), str):
            reason = "stop_string"
        else:
            reason = "stop"
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(list(ids), [float(v) for v in logps], text, reason)

    def _post(self, path: str, body: dict, timeout_s: float | None = None) -> Any:
        return _request(f"{self.url}/{path}", body, timeout_s or self.timeout_s, self._api_key)


class Requests:
    """Rows of a :class:`ServerPolicy` in flight, a
    :class:`~agentenv.lm.backend.RunningBatch`: :meth:`add` sends a row's request at once,
    :meth:`step` returns the rows whose reply came back."""

    POLL_S = 0.02  # step() waits at most this long, so the caller also sees its env steps

    def __init__(self, policy: ServerPolicy, sampling: SamplingConfig):
        self.policy, self.sampling = policy, sampling
        self.inflight: dict[Future, Any] = {}  # in the order the rows were added

    def __len__(self) -> int:
        return len(self.inflight)

    def add(
        self,
        key: Any,
        prompt: Sequence[int],
        *,
        seed: int | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        """Send a row's request; its :class:`Generation` comes back from :meth:`step`."""
        check_batch([prompt], None)
        self.policy.refresh()
        sampling = self.sampling
        if max_new_tokens is not None and max_new_tokens < sampling.max_new_tokens:
            sampling = dataclasses.replace(sampling, max_new_tokens=max_new_tokens)
        future = self.policy._pool.submit(self.policy.complete, prompt, sampling, seed)
        self.inflight[future] = key

    def step(self) -> list[tuple[Any, Generation]]:
        """Wait (at most ``POLL_S``) for a reply; return ``(key, Generation)`` of every row
        whose reply came, in the order they were added."""
        if self.inflight:
            wait(self.inflight, timeout=self.POLL_S, return_when=FIRST_COMPLETED)
        done = [f for f in self.inflight if f.done()]
        return [(self.inflight.pop(f), f.result()) for f in done]


def _request(url: str, body: dict | None, timeout_s: float, api_key: str | None = None) -> Any:
    """GET (``body`` None) or POST JSON to ``url``; the reply's JSON (None if it is not).

    Raises :class:`~agentenv.errors.EngineError` naming the URL when nothing answers or the
    server answers with an error."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as reply:
            text = reply.read().decode()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise EngineError(f"engine server: {url} answered {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise EngineError(
            f"engine server: no answer from {url} ({type(exc).__name__}: {reason}). Is the "
            "server running? Start (or restart) it; a training run continues from its last "
            "checkpoint with --resume"
        ) from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
