"""What ``dtype="auto"`` means on a CPU: bfloat16 where it is faster than float32 (native
bf16; on Intel, AMX too)."""

import pytest
import torch

from agentenv.lm import precision


@pytest.fixture
def cpu(monkeypatch):
    """Set what ``torch.cpu.get_capabilities`` reports and the vendor; caches cleared."""

    def report(vendor, **features):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: features, raising=False)
        monkeypatch.setattr(precision, "cpu_vendor", lambda: vendor)
        precision.cpu_features.cache_clear()

    yield report
    precision.cpu_features.cache_clear()


INTEL, AMD = "GenuineIntel", "AuthenticAMD"


@pytest.mark.parametrize(
    ("vendor", "features", "native", "auto"),
    [
        (AMD, {"architecture": "x86_64", "avx2": True, "avx512_bf16": False}, False, "float32"),
        (AMD, {"architecture": "x86_64", "avx512_bf16": True}, True, "bfloat16"),  # Zen 4
        (INTEL, {"avx512_bf16": True, "amx_bf16": True, "amx_tile": True}, True, "bfloat16"),
        # Intel without AMX: native bf16, but its bf16 products are slower than float32's
        (INTEL, {"avx512_bf16": True, "amx_bf16": False}, True, "float32"),
        (INTEL, {"architecture": "x86_64", "avx2": True}, False, "float32"),
        ("", {"architecture": "aarch64", "bf16": True}, True, "bfloat16"),  # Graviton 3
        ("", {"architecture": "aarch64", "neon": True}, False, "float32"),
    ],
)
def test_auto_on_a_cpu_is_bf16_where_it_is_the_faster_dtype(cpu, vendor, features, native, auto):
    cpu(vendor, **features)
    assert precision.cpu_supports_bf16() is native
    assert precision.cpu_prefers_bf16() is (auto == "bfloat16")
    assert precision.resolve_dtype("auto", "cpu") == getattr(torch, auto)
    assert precision.resolve_dtype("bfloat16", "cpu") == torch.bfloat16  # by name: always


def test_features_are_read_from_proc_cpuinfo_where_torch_has_no_report(monkeypatch):
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    precision.cpu_features.cache_clear()
    try:
        import os

        if not os.path.exists("/proc/cpuinfo"):
            assert precision.cpu_features() == frozenset()
            return
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "flags :")
        assert precision.cpu_features() == frozenset(flags.partition(":")[2].split())
    finally:
        precision.cpu_features.cache_clear()


def test_on_this_x86_linux_cpu_torch_agrees_with_the_kernels_flags():
    """The real report and what auto picks, against an independent source: /proc/cpuinfo."""
    import os
    import platform

    if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"):
        pytest.skip("the kernel's x86 flags are the independent source here")
    with open("/proc/cpuinfo") as f:
        lines = f.readlines()
    flags = next(line for line in lines if line.startswith("flags")).split()
    intel = any(line.split() == ["vendor_id", ":", "GenuineIntel"] for line in lines)
    precision.cpu_features.cache_clear()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert precision.cpu_supports_bf16() is native
    faster = native and (not intel or "amx_bf16" in flags)
    assert precision.resolve_dtype("auto", "cpu") == (torch.bfloat16 if faster else torch.float32)
