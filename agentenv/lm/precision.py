"""Precision: the dtype names a user may give, what ``"auto"`` means, and autocast.

One list, :data:`DTYPES`, and one meaning of ``"auto"`` (:func:`resolve_dtype`: bfloat16
on a GPU that supports it and on a CPU where it is the faster choice, :func:`cpu_prefers_bf16`,
else float32; never float16, which a user asks for by name), used by the
command line, the configs, model loading and the sampler. This module imports torch only
inside its functions, so the command line can list the choices without loading torch.

The learn phase computes in the model's weights' dtype unless told otherwise: a LoRA run
whose base was loaded in bfloat16 computes in bfloat16 (its float32 adapters too); a float32
model computes in float32 unless given a compute dtype (float32 weights trained under bf16
autocast). Autocast is plain ``torch.autocast``, not accelerate's ``mixed_precision`` (fixed
once per process), so two trainers in one process may use different dtypes.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

from agentenv.errors import InvalidOptionError

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16")


BF16_CPU_FEATURES = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")
"""CPU features that compute bfloat16 natively: x86's AVX512-BF16 and AMX-BF16, ARM's
BF16 (NEON) and SVE-BF16, as :func:`torch.cpu.get_capabilities` names them."""


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU features this machine reports: the names :func:`torch.cpu.get_capabilities`
    marks True (any architecture) where this torch has it, else Linux's ``/proc/cpuinfo``
    x86 flags; empty where neither can be read (not Linux: Apple silicon and others)."""
    import torch

    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is not None:
        return frozenset(name for name, on in get_capabilities().items() if on is True)
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(flags.partition(":")[2].split())


def cpu_supports_bf16() -> bool:
    """True if this CPU computes bfloat16 natively (one of :data:`BF16_CPU_FEATURES` in
    :func:`cpu_features`). Without it PyTorch emulates bfloat16, slower than float32."""
    return not cpu_features().isdisjoint(BF16_CPU_FEATURES)


@functools.cache
def cpu_vendor() -> str:
    """This CPU's vendor as x86's CPUID names it (``"GenuineIntel"``, ``"AuthenticAMD"``),
    read from Linux's ``/proc/cpuinfo``; ``""`` where it cannot be read (not Linux, not x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def cpu_prefers_bf16() -> bool:
    """True where bfloat16 is the faster compute dtype on this CPU: what ``"auto"`` picks.

    Native bfloat16 (:func:`cpu_supports_bf16`) is not enough on Intel: without AMX, an
    Intel CPU's bf16 matrix products (AVX512-BF16 dot products, through oneDNN) run slower
    than its float32 ones. On a 2-core Intel Xeon with avx512_bf16 and no AMX (2026-12-02,
    ``python benchmarks/cpu_dtype.py``), float32 ran the quickstart 1.4x faster. So an Intel
    CPU gets bfloat16 with AMX-BF16 only. Elsewhere native bf16 decides: AMD's avx512_bf16
    (on a 2-core AMD EPYC, 2026-12-03, the same script: bf16 learns 2.5x and samples 1.8x
    as fast as float32) and ARM's BF16 / SVE-BF16 (not timed).
    """
    if not cpu_supports_bf16():
        return False
    return cpu_vendor() != "GenuineIntel" or "amx_bf16" in cpu_features()


def check_dtype(dtype: str, device: str | None = None) -> None:
    """Raise unless ``dtype`` is one of :data:`DTYPES` and computes on ``device`` (a device
    string; ``None`` counts as the CPU). Torch-free: configs call it before any model loads.

    Raises:
        InvalidOptionError: naming the bad value and the choices.
    """
    if dtype not in DTYPES:
        raise InvalidOptionError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype == "float16" and (device or "cpu").split(":")[0] == "cpu":
        raise InvalidOptionError(
            "dtype='float16' needs a GPU (CPUs compute it slowly and autocast refuses it); "
            "use 'bfloat16', 'float32' or 'auto' on the CPU"
        )


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The compute dtype for ``dtype`` on ``device``.

    ``"auto"``: bfloat16 on a CUDA device that supports it and on a CPU where it is
    faster than float32 (:func:`cpu_prefers_bf16`: native bf16, and AMX on Intel), else
    float32. Never float16: a GPU without
    bfloat16 (a T4, a V100) gets float32: float16's range is narrow, so its training needs
    loss scaling (the trainers' ``GradScaler``) and can still skip steps that overflow; ask
    for ``"float16"`` by name to sample and train in it.

    Raises:
        InvalidOptionError: ``dtype`` is not one of :data:`DTYPES` or a float ``torch.dtype``.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise InvalidOptionError(f"dtype must be a floating-point dtype, got {dtype}")
        return dtype
    kind = torch.device(device).type
    check_dtype(dtype, kind)
    if dtype != "auto":
        return getattr(torch, dtype)
    if kind == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if kind == "cpu" and cpu_prefers_bf16() else torch.float32


def compute_dtype(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.dtype:
    """``dtype``, or the dtype of the model's (frozen or not) input embeddings."""
    import torch

    if dtype is not None:
        return dtype
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if get else None
    if embeddings is not None and embeddings.weight.is_floating_point():
        return embeddings.weight.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``'s type; a no-op for float32."""
    import torch

    if dtype == torch.float32:
        return contextlib.nullcontext()
    if dtype == torch.float16 and device.type == "cpu":
        raise InvalidOptionError("float16 compute needs a GPU; use bfloat16 or float32 on a CPU")
    return torch.autocast(device_type=device.type, dtype=dtype)


def training_dtype(compute: torch.dtype, use_lora: bool) -> torch.dtype:
    """The dtype to load weights in: a LoRA run's frozen base computes in ``compute``
    (no per-step casts, half the memory in bf16); weights that are trained stay float32
    and are autocast to ``compute``."""
    import torch

    return compute if use_lora else torch.float32
