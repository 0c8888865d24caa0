import pytest
import torch
from toy_episodes import answer_episodes as episodes

from agentenv.errors import InvalidOptionError
from agentenv.rollout.episode import Episode
from algorithms.config import SFTConfig
from algorithms.losses import masked_nll
from algorithms.sft import SFT


def test_masked_nll_by_hand():
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -4.0, -8.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    assert masked_nll(logp, mask, num_tokens=3.0).item() == pytest.approx((1 + 2 + 8) / 3)


def test_only_policy_tokens_get_gradient(tiny_model, tokenizer):
    """The loss's gradient w.r.t. each position's output is exactly 0 where nothing is scored.

    The hook sits on the final norm, whose output feeds the LM head (applied in chunks).
    """
    from algorithms.logprobs import token_logprobs

    ep = episodes(tokenizer, 1)[0]
    ids = torch.tensor([ep.input_ids])
    mask = torch.tensor([ep.action_mask], dtype=torch.float32)
    captured = {}

    def keep(_module, _inputs, output):
        output.retain_grad()
        captured["logits"] = output

    handle = tiny_model.model.norm.register_forward_hook(keep)
    masked_nll(token_logprobs(tiny_model, ids, torch.ones_like(ids)), mask, mask.sum()).backward()
    handle.remove()
    grad = captured["logits"].grad[0]  # (T, H); position t-1 scores token t
    scored = {t - 1 for t in range(1, ids.shape[1]) if ep.action_mask[t]}
    for pos in range(ids.shape[1]):
        assert bool(grad[pos].abs().sum() > 0) == (pos in scored)


def test_loss_decreases_and_fit_counts_steps(tiny_model, tokenizer):
    trainer = SFT(tiny_model, tokenizer, SFTConfig(learning_rate=5e-3, epochs=3, batch_size=2))
    eps = episodes(tokenizer)
    history = trainer.fit(eps, progress=False)
    assert len(history) == 3 * 2 and trainer.step == 6
    first = trainer.learn(eps)["sft/loss"]
    for _ in range(5):
        last = trainer.learn(eps)["sft/loss"]
    assert last < first
    base_params = [p for n, p in trainer.model.named_parameters() if "lora_" not in n]
    assert all(not p.requires_grad for p in base_params)


def test_sft_checkpoint_loads_as_peft_adapter(tiny_model, tokenizer, tmp_path):
    from peft import PeftModel

    from agentenv.lm.models import tiny_model as build

    trainer = SFT(tiny_model, tokenizer, SFTConfig(learning_rate=5e-3))
    trainer.learn(episodes(tokenizer))
    path = trainer.save(tmp_path / "ckpt")
    reloaded = PeftModel.from_pretrained(build(tokenizer), path / "adapter")
    ids = torch.tensor([episodes(tokenizer)[0].input_ids])
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits, atol=1e-5, rtol=0
        )


def test_config_validation_and_empty_batch(tiny_model, tokenizer):
    with pytest.raises(InvalidOptionError, match="epochs"):
        SFTConfig(epochs=0)
    with pytest.raises(InvalidOptionError, match="total_steps"):
        SFTConfig(lr_scheduler="cosine")
    trainer = SFT(tiny_model, tokenizer)
    with pytest.raises(InvalidOptionError, match="no policy tokens"):
        trainer.learn([Episode([1, 2], [0, 0], [0.0, 0.0])])
