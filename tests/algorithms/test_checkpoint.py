"""Checkpoints: atomic writes, complete markers, exact resume for LoRA and full fine-tuning."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from peft import PeftModel
from toy_episodes import SAMPLING, Ep
from transformers import AutoModelForCausalLM

from agentenv.errors import InvalidOptionError
from agentenv.lm.models import tiny_model as build
from algorithms.batching import MicroBatch
from algorithms.checkpoint import MARKER, latest_checkpoint
from algorithms.config import GRPOConfig
from algorithms.grpo import GRPO
from algorithms.logprobs import token_logprobs

# peft 0.21 reads a property transformers 5.23 deprecated; nothing for us to act on
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def make_groups(seed: int = 0) -> list[list[Ep]]:
    rng = random.Random(seed)
    groups = []
    for rewards in ([0, 1, 1, 0], [1, 0, 0, 0]):
        group = []
        for reward in rewards:
            mask = [0] * 4 + [1] * rng.randint(3, 6) + [0] * 3 + [1] * 2
            ids = [rng.randint(100, 5000) for _ in mask]
            group.append(Ep(ids, mask, [-9.0 if m else 0.0 for m in mask], float(reward)))
        groups.append(group)
    return groups


def config(**overrides) -> GRPOConfig:
    base = {"learning_rate": 1e-3, "lora_r": 4, "lora_alpha": 8}
    return GRPOConfig(**{**base, **overrides})


def logprobs_of(model: torch.nn.Module, tokenizer) -> torch.Tensor:
    mb = MicroBatch.from_episodes(
        [e for g in make_groups(seed=7) for e in g], [0.0] * 8, tokenizer.pad_token_id
    )
    with torch.no_grad():
        return token_logprobs(model, mb.input_ids, mb.attention_mask)


def assert_same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for key, state in sa["state"].items():
        for name, value in state.items():
            assert torch.equal(value, sb["state"][key][name]), (key, name)


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
def test_save_load_roundtrip(tmp_path, tokenizer, use_lora):
    cfg, steps = config(use_lora=use_lora, lr_scheduler="linear"), 10
    trainer = GRPO(build(tokenizer), tokenizer, cfg, total_steps=steps, sampling=SAMPLING)
    trainer.learn(make_groups())
    trainer.learn(make_groups(seed=1))
    path = trainer.save(tmp_path / "checkpoint-2")
    assert json.loads((path / MARKER).read_text()) == {"step": 2}
    assert not list(tmp_path.glob("*.tmp-*"))

    # LoRA checkpoints hold only the adapter: the base must be the same; full FT: any init
    fresh = GRPO(
        build(tokenizer, seed=0 if use_lora else 5),
        tokenizer,
        cfg,
        total_steps=steps,
        sampling=SAMPLING,
    )
    assert not torch.allclose(
        logprobs_of(fresh.model, tokenizer), logprobs_of(trainer.model, tokenizer)
    )
    fresh.load(path)
    assert fresh.step == 2
    torch.testing.assert_close(
        logprobs_of(fresh.model, tokenizer),
        logprobs_of(trainer.model, tokenizer),
        atol=1e-6,
        rtol=0,
    )
    assert_same_optimizer_state(fresh.optimizer, trainer.optimizer)
    assert fresh.scheduler.state_dict() == trainer.scheduler.state_dict()
    saved = json.loads((path / "trainer_state.json").read_text())
    assert saved["config"]["use_lora"] is use_lora and saved["step"] == 2


def test_adapter_loads_with_peft(tmp_path, tokenizer):
    trainer = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)
    trainer.learn(make_groups())
    path = trainer.save(tmp_path / "ckpt")
    reloaded = PeftModel.from_pretrained(build(tokenizer), path / "adapter")
    torch.testing.assert_close(
        logprobs_of(reloaded, tokenizer), logprobs_of(trainer.model, tokenizer), atol=1e-6, rtol=0
    )


def test_full_model_is_hugging_face_format(tmp_path, tokenizer):
    trainer = GRPO(build(tokenizer), tokenizer, config(use_lora=False), sampling=SAMPLING)
    trainer.learn(make_groups())
    path = trainer.save(tmp_path / "ckpt")
    reloaded = AutoModelForCausalLM.from_pretrained(path / "model")
    torch.testing.assert_close(
        logprobs_of(reloaded, tokenizer), logprobs_of(trainer.model, tokenizer), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
def test_resume_matches_an_uninterrupted_run(tmp_path, tokenizer, use_lora):
    cfg, steps = config(use_lora=use_lora, beta=0.05, lr_scheduler="cosine"), 5
    uninterrupted = GRPO(build(tokenizer), tokenizer, cfg, total_steps=steps, sampling=SAMPLING)
    for seed in range(3):
        uninterrupted.learn(make_groups(seed))

    first = GRPO(build(tokenizer), tokenizer, cfg, total_steps=steps, sampling=SAMPLING)
    for seed in range(2):
        first.learn(make_groups(seed))
    first.save(tmp_path / "checkpoint-2")
    resumed = GRPO(build(tokenizer), tokenizer, cfg, total_steps=steps, sampling=SAMPLING)
    resumed.load(latest_checkpoint(tmp_path))
    metrics = resumed.learn(make_groups(2))

    assert metrics["step"] == 3 == uninterrupted.step
    for (name, a), b in zip(
        resumed.model.named_parameters(), uninterrupted.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    assert_same_optimizer_state(resumed.optimizer, uninterrupted.optimizer)


def test_a_write_that_fills_the_disk_keeps_the_previous_checkpoint(
    tmp_path, tokenizer, monkeypatch
):
    """ENOSPC part-way through a checkpoint (the optimizer file half written): a clear
    error naming the cause, the intact previous checkpoint and the fix; nothing partial is
    left; a failed re-save of a step keeps the old folder; resuming from the previous
    checkpoint ends with the weights of an uninterrupted run."""
    import errno
    from pathlib import Path

    from agentenv.errors import CheckpointError

    cfg = config(beta=0.05)
    uninterrupted = GRPO(build(tokenizer), tokenizer, cfg, total_steps=5, sampling=SAMPLING)
    for seed in range(3):
        uninterrupted.learn(make_groups(seed))
    run = GRPO(build(tokenizer), tokenizer, cfg, total_steps=5, sampling=SAMPLING)
    for seed in range(2):
        run.learn(make_groups(seed))
    run.save(tmp_path / "checkpoint-2")
    run.learn(make_groups(2))
    save = torch.save

    def full_disk(obj, f, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if str(f).endswith("optimizer.pt"):
            Path(f).write_bytes(b"\0" * 1000)  # the part that fitted
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError) as caught:
        run.save(tmp_path / "checkpoint-3")
    message = str(caught.value)
    assert "No space left on device" in message and "--resume" in message
    assert f"the previous one ({tmp_path / 'checkpoint-2'}) is intact" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]
    with pytest.raises(CheckpointError):  # re-saving step 2's folder at step 3
        run.save(tmp_path / "checkpoint-2")
    assert json.loads((tmp_path / "checkpoint-2" / MARKER).read_text()) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]
    monkeypatch.undo()

    resumed = GRPO(build(tokenizer), tokenizer, cfg, total_steps=5, sampling=SAMPLING)
    resumed.load(latest_checkpoint(tmp_path))
    resumed.learn(make_groups(2))
    for (name, a), b in zip(
        resumed.model.named_parameters(), uninterrupted.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_rng_states_are_restored(tmp_path, tokenizer):
    trainer = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    path = trainer.save(tmp_path / "ckpt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    trainer.load(path)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_latest_checkpoint_ignores_partial_folders(tmp_path, tokenizer):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    trainer = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)
    trainer.save(tmp_path / "checkpoint-1")
    trainer.step = 3
    trainer.save(tmp_path / "checkpoint-3")
    # a run killed while saving step 5: a folder with files but no marker, and a tmp folder
    partial = tmp_path / "checkpoint-5"
    partial.mkdir()
    (partial / "optimizer.pt").write_bytes(b"truncated")
    tmp = tmp_path / "checkpoint-6.tmp-123"
    tmp.mkdir()
    (tmp / MARKER).write_text(json.dumps({"step": 6}))
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-3"
    with pytest.raises(InvalidOptionError, match="not a complete checkpoint"):
        trainer.load(partial)


def test_resaving_a_path_replaces_it(tmp_path, tokenizer):
    trainer = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)
    trainer.save(tmp_path / "ckpt")
    trainer.step = 9
    trainer.save(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / MARKER).read_text()) == {"step": 9}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_load_refuses_a_different_lora_setup(tmp_path, tokenizer):
    path = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING).save(tmp_path / "ckpt")
    other = GRPO(build(tokenizer), tokenizer, config(use_lora=False), sampling=SAMPLING)
    with pytest.raises(InvalidOptionError, match="use_lora=True"):
        other.load(path)
