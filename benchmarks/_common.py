"""Measurements that more than one benchmark takes: torch's thread count and peak memory.

The scripts run as ``python benchmarks/NAME.py``, so this folder is on ``sys.path`` and
they import it as ``_common``.
"""

from __future__ import annotations

import sys


def torch_threads() -> int:
    """The number of threads torch computes with on this machine."""
    import torch

    return torch.get_num_threads()


def peak_rss_mb() -> float | None:
    """This process's peak resident memory, MiB (None where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes / KiB


def peak_memory(device: str) -> dict[str, float | None]:
    """``peak_rss_mb`` and, on CUDA, ``peak_gpu_mb`` (torch's peak allocation)."""
    out: dict[str, float | None] = {"peak_rss_mb": peak_rss_mb()}
    if device.startswith("cuda"):
        import torch

        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out
