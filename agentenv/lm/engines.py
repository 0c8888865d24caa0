"""Build the generation engine an :class:`~agentenv.lm.backend.EngineConfig` names."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from agentenv.errors import InvalidOptionError
from agentenv.lm.backend import EngineConfig, PolicyBackend

logger = logging.getLogger(__name__)


def check_engine(config: EngineConfig) -> None:
    """Fail before any model loads if the engine cannot run here: vllm not installed, or
    no server answering at ``server_url`` (or not serving ``server_model``)."""
    if config.engine == "server":
        from agentenv.lm.server_engine import served_models

        assert config.server_url is not None  # EngineConfig checks it
        names = served_models(config.server_url, api_key=server_api_key(config))
        if config.server_model is not None and config.server_model not in names:
            raise InvalidOptionError(
                f"engine server: {config.server_url} serves {names}, not "
                f"{config.server_model!r}; set server_model to one of those"
            )
    if config.engine == "vllm":
        from agentenv.lm.vllm_engine import vllm_missing

        reason = vllm_missing()
        if reason is not None:
            raise InvalidOptionError(f"engine vllm: {reason}")
        if config.vllm_sleep_mode:
            from vllm.platforms import current_platform

            if not current_platform.is_sleep_mode_available():
                raise InvalidOptionError(
                    f"vllm_sleep_mode: vLLM has no sleep mode on this platform "
                    f"({current_platform.device_type}); it needs a GPU. Leave it false here."
                )


# The major releases the fast sampler is built on and tested with (its cache layers,
# attention registry and Llama step follow their internals); another one decodes with
# the reference path until the suite has passed on it and this line says so.
FAST_SAMPLER_RELEASES = {"torch": 2, "transformers": 5}


def fast_sampler_missing(model: torch.nn.Module | None = None) -> str | None:
    """Why the bundled fast sampler (:mod:`agentenv.lm.sampler`) cannot decode ``model``
    here, or None; :func:`make_policy` then decodes with the reference path instead.

    It builds on torch's and transformers' internals (cache layers, the attention
    registry, Llama's modules, oneDNN's ops): a major release other than
    :data:`FAST_SAMPLER_RELEASES` is not trusted, and a release that moved one fails its
    import. And it packs plain weight matrices, which a 4-bit (bitsandbytes) base does
    not have."""
    for name, major in FAST_SAMPLER_RELEASES.items():
        version = _version(name)
        if not version.startswith(f"{major}."):
            return f"is built on {name} {major}.x, and this is {name} {version}"
    try:
        import agentenv.lm.sampler  # noqa: F401
    except ImportError as exc:
        return f"cannot be imported with this transformers ({exc})"
    if model is not None:
        from agentenv.lm.quantize import quantization_of

        quantized = quantization_of(model)
        if quantized is not None:
            return f"packs plain weights, and this base is in 4 bits ({quantized})"
    return None


def _version(name: str) -> str:
    """The installed version of the (already imported) library ``name``."""
    import importlib

    return str(importlib.import_module(name).__version__)


def server_api_key(config: EngineConfig) -> str | None:
    """The server's API key, read from the variable ``server_api_key_env`` names."""
    name = config.server_api_key_env
    return os.environ.get(name) if name else None


def make_policy(
    config: EngineConfig,
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    model_name: str,
    dtype: str | torch.dtype,
    record_hidden: bool = False,
) -> PolicyBackend:
    """The policy backend that samples from ``model`` (the one being trained or evaluated).

    Args:
        config: Which engine, and its settings.
        model: The trained (or evaluated) model; its weights are what the engine samples.
        tokenizer: Its tokenizer.
        model_name: The model's alias, Hugging Face id or local folder: vLLM builds its
            own copy of the architecture from it (then takes ``model``'s weights).
        dtype: Compute dtype of sampling.
        record_hidden: The local engines record each turn's hidden state
            (``Generation.hidden``, :mod:`agentenv.lm.hidden`); vLLM and a server never do.
    """
    from agentenv.lm.precision import resolve_dtype

    param = next(model.parameters())
    compute = resolve_dtype(dtype, param.device)
    engine = config.engine
    if engine == "agentenv":
        problem = fast_sampler_missing(model)
        if problem is not None:
            logger.warning("decoding with the reference path: the fast sampler %s", problem)
            engine = "reference"
    if engine == "reference":
        from agentenv.lm.reference import ReferencePolicy

        return ReferencePolicy(model, tokenizer, dtype=compute, record_hidden=record_hidden)
    if engine == "agentenv":
        from agentenv.lm.sampler import TransformersPolicy

        off = dict.fromkeys(config.fast_paths_off, False)
        return TransformersPolicy(
            model,
            tokenizer,
            dtype=compute,
            draft_tokens=config.draft_tokens,
            record_hidden=record_hidden,
            **off,
        )
    if config.engine == "server":
        from agentenv.lm.server_engine import ServerPolicy

        assert config.server_url is not None  # EngineConfig checks it
        return ServerPolicy(
            model,
            tokenizer,
            url=config.server_url,
            served_model=config.server_model,
            adapter_dir=config.server_adapter_dir,
            timeout_s=config.server_timeout_s,
            api_key=server_api_key(config),
        )
    from agentenv.lm.models import resolve
    from agentenv.lm.vllm_engine import VLLMPolicy

    return VLLMPolicy(
        model,
        tokenizer,
        model_path=resolve(model_name),
        dtype=str(compute).removeprefix("torch."),
        kv_cache_gb=config.vllm_kv_cache_gb,
        max_model_len=config.vllm_max_model_len,
        enforce_eager=config.vllm_enforce_eager,
        sleep_mode=config.vllm_sleep_mode,
    )
