"""Shared fixtures. Tests never touch the network; the real model is cached once.

``AGENTENV_HOME`` is left alone: the converted SmolLM2 lives in the user's normal cache
(``~/.cache/agentenv``) so the ~20 s conversion happens once, not once per run.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

# Whole files of the slow tier (besides single tests marked ``slow``): other processes,
# servers and other libraries' trainers, each test seconds to a minute on 2 cores (CI's
# durations). ``pytest -m "not slow"`` is the fast tier for development; CI and the
# README's command run everything.
SLOW_FILES = (
    "tests/agentenv/run/test_multiprocess.py",
    "tests/algorithms/test_ddp.py",
    "tests/agentenv/lm/test_vllm_engine.py",
    "tests/agentenv/lm/test_server_engine.py",
    "tests/agentenv/integrations/test_verifiers.py",
    "tests/agentenv/integrations/test_verl.py",
    "tests/agentenv/integrations/test_trl.py",
    "tests/agentenv/integrations/test_openenv.py",
    "tests/envs/workspace/test_parallel.py",
)


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        if item.path.relative_to(root).as_posix() in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each test starts with no accelerate state: accelerate keeps one device (and TRL's
    trainer one mixed precision) per process, and where a GPU is visible tests train on
    both the CPU and the GPU."""
    yield
    import sys

    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer (left padding, pad = ``<|im_end|>``)."""
    from agentenv.lm.models import load_tokenizer

    return load_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    """A fresh 2-layer random Llama with SmolLM2's vocabulary (seed 0, eval mode)."""
    from agentenv.lm.models import tiny_model as build

    return build(tokenizer)


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the real SmolLM2-135M-Instruct, float32 on CPU, eval mode.

    Shared by the whole session: do not modify it (e.g. with peft); call ``load()`` for
    a private copy instead (about a second once cached).
    """
    from agentenv.lm.models import load

    # float32 on the CPU even where a GPU is visible or the CPU has bf16
    return load("smollm2-135m-instruct", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    """A tiny random model and SmolLM2's tokenizer saved as a local HF folder (a ``--model``)."""
    from agentenv.lm.models import tiny_model as build

    path = tmp_path_factory.mktemp("tiny-model")
    build(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
