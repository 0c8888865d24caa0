"""What ``dtype="auto"`` means on a CPU: bfloat16 where torch reports native bf16."""

import pytest
import torch

from agentenv.lm import precision


@pytest.fixture
def capabilities(monkeypatch):
    """Set what ``torch.cpu.get_capabilities`` reports; the detection's cache is cleared."""

    def report(**features):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: features, raising=False)
        precision.cpu_supports_bf16.cache_clear()

    yield report
    precision.cpu_supports_bf16.cache_clear()


@pytest.mark.parametrize(
    ("features", "native"),
    [
        ({"architecture": "x86_64", "avx2": True, "avx512_bf16": False}, False),  # AVX2 EPYC
        ({"architecture": "x86_64", "avx512_bf16": True}, True),  # AMD Zen 4
        ({"architecture": "x86_64", "amx_bf16": True, "avx512_bf16": True}, True),  # Intel AMX
        ({"architecture": "aarch64", "neon": True, "bf16": True}, True),  # Graviton 3
        ({"architecture": "aarch64", "neon": True}, False),
    ],
)
def test_cpu_bf16_is_read_from_torch_on_any_architecture(capabilities, features, native):
    capabilities(**features)
    assert precision.cpu_supports_bf16() is native
    want = torch.bfloat16 if native else torch.float32
    assert precision.resolve_dtype("auto", "cpu") == want


def test_on_this_x86_linux_cpu_torch_agrees_with_the_kernels_flags():
    """The real report (not a mocked one) against an independent source: /proc/cpuinfo."""
    import os
    import platform

    if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"):
        pytest.skip("the kernel's x86 flags are the independent source here")
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    precision.cpu_supports_bf16.cache_clear()
    assert precision.cpu_supports_bf16() is ("avx512_bf16" in flags or "amx_bf16" in flags)
