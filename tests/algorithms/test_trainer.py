"""The trainer base: loss scaling in float16 (torch's GradScaler), on whatever device runs.

A CPU cannot autocast to float16, so there the scaled step runs in float32 with the scaler
switched on by hand: the mechanics (scale, unscale before clipping, skip on overflow, the
scale in the checkpoint) are the same code; on a GPU the real float16 step runs too.
"""

import copy

import pytest
import torch
from toy_episodes import answer_episodes as episodes

from algorithms.config import SFTConfig
from algorithms.sft import SFT

CONFIG = SFTConfig(learning_rate=1e-2, batch_size=4)


def trainable(trainer):
    return [p.detach().clone() for p in trainer._params]


def scaled(trainer, scale):
    trainer.scaler = torch.amp.GradScaler(
        trainer.accelerator.device.type, init_scale=scale, growth_interval=1000
    )
    return trainer


@pytest.mark.parametrize(
    ("dtype", "enabled"),
    [(torch.float16, True), (torch.bfloat16, False), (torch.float32, False)],
)
def test_loss_scaling_is_on_in_float16_only(tiny_model, tokenizer, dtype, enabled):
    trainer = SFT(tiny_model, tokenizer, CONFIG, dtype=dtype)
    assert trainer.scaler.is_enabled() is enabled
    assert ("scaler" in trainer.extra_state()) is enabled


def test_a_scaled_step_is_the_unscaled_step_and_an_overflow_is_skipped(tiny_model, tokenizer):
    eps = episodes(tokenizer)
    plain = SFT(copy.deepcopy(tiny_model), tokenizer, CONFIG)
    loss_scaled = scaled(SFT(copy.deepcopy(tiny_model), tokenizer, CONFIG), 2.0**10)
    assert not plain.scaler.is_enabled() and loss_scaled.scaler.is_enabled()

    a, b = plain.learn(eps), loss_scaled.learn(eps)
    assert b["sft/loss"] == pytest.approx(a["sft/loss"], rel=1e-6)
    # the norm is of the unscaled gradients, clipped as they would be without scaling
    assert b["sft/grad_norm"] == pytest.approx(a["sft/grad_norm"], rel=1e-5)
    for p, q in zip(trainable(plain), trainable(loss_scaled), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
    assert loss_scaled.scaler.get_scale() == 2.0**10  # no overflow: the scale holds

    overflowing = scaled(loss_scaled, 2.0**127)  # loss * scale is inf in float32
    before = trainable(overflowing)
    out = overflowing.learn(eps)
    assert not torch.isfinite(torch.tensor(out["sft/grad_norm"]))
    for p, q in zip(before, trainable(overflowing), strict=True):
        assert torch.equal(p, q)  # the step was skipped
    assert overflowing.scaler.get_scale() == 2.0**126  # and the scale halved


def test_the_loss_scale_is_checkpointed(tiny_model, tokenizer, tmp_path):
    eps = episodes(tokenizer)
    trainer = scaled(SFT(copy.deepcopy(tiny_model), tokenizer, CONFIG), 2.0**127)
    trainer.learn(eps)  # overflows: the scale halves to 2**126
    trainer.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "scaler.pt").is_file()
    resumed = scaled(SFT(copy.deepcopy(tiny_model), tokenizer, CONFIG), 1.0)
    resumed.load(tmp_path / "ckpt")
    assert resumed.scaler.get_scale() == 2.0**126


@pytest.mark.skipif(not torch.cuda.is_available(), reason="float16 autocast needs a GPU")
def test_a_float16_step_on_a_gpu_is_scaled_and_learns(tiny_model, tokenizer):
    eps = episodes(tokenizer)
    trainer = SFT(tiny_model, tokenizer, CONFIG, dtype=torch.float16)
    assert trainer.accelerator.device.type == "cuda" and trainer.scaler.is_enabled()
    first = trainer.learn(eps)["sft/loss"]
    for _ in range(5):
        last = trainer.learn(eps)
    assert torch.isfinite(torch.tensor(last["sft/grad_norm"]))
    assert last["sft/loss"] < first
