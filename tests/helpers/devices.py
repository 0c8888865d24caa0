"""The devices a decoding test runs on: the CPU always, a CUDA GPU where one is visible
(skipped with the reason elsewhere, e.g. in CI)."""

import copy

import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]


def on(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """``model`` itself on the CPU; a copy of it on another device (a shared fixture stays
    where it was)."""
    return model if device == "cpu" else copy.deepcopy(model).to(device)


# The environment of a test's subprocesses that run on CPU processes (gloo) by design: where
# a GPU is visible, accelerate and torch would otherwise put every rank on it (one GPU cannot
# hold two ranks).
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
