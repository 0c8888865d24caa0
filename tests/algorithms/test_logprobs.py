"""Chunked, prefix-sharing log-probs equal a plain full-vocabulary forward pass."""

import pytest
import torch

from algorithms.logprobs import forward_logprobs


def batch(tokenizer, n=3, prompt_len=40, seed=0):
    """Right-padded rows sharing a ``prompt_len``-token prompt, then different completions."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, 5000, (prompt_len,), generator=g)
    lengths = [7, 12, 4, 9][:n]
    t = prompt_len + max(lengths)
    ids = torch.full((n, t), tokenizer.pad_token_id)
    attn = torch.zeros((n, t), dtype=torch.long)
    action = torch.zeros((n, t))
    for i, k in enumerate(lengths):
        ids[i, :prompt_len] = prompt
        ids[i, prompt_len : prompt_len + k] = torch.randint(100, 5000, (k,), generator=g)
        attn[i, : prompt_len + k] = 1
        action[i, prompt_len : prompt_len + k] = 1
    return ids, attn, action


def reference(model, ids, attn, temperature=1.0):
    """log p of each token from the model's full logits (N, T, V)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1] / temperature
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0)).masked_fill(attn == 0, 0.0)


@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize("chunk_tokens", [1024, 5])
def test_values_and_gradients_match_a_plain_forward(
    tiny_model, tokenizer, share_prefix, chunk_tokens
):
    ids, attn, action = batch(tokenizer)
    tiny_model.train()
    params = [p for p in tiny_model.parameters() if p.requires_grad]

    expected = reference(tiny_model, ids, attn, 0.7) * action  # (N, T)
    grads_expected = torch.autograd.grad(expected.sum(), params)
    logp, entropy = forward_logprobs(
        tiny_model,
        ids,
        attn,
        0.7,
        action_mask=action,
        with_entropy=True,
        chunk_tokens=chunk_tokens,
        share_prefix=share_prefix,
    )
    assert logp.shape == entropy.shape == ids.shape
    torch.testing.assert_close(logp * action, expected, atol=2e-5, rtol=0)
    assert (logp[:, :40] == 0).all()  # before the first policy token: no logits at all
    grads = torch.autograd.grad((logp * action).sum(), params)
    for a, b in zip(grads, grads_expected, strict=True):  # float32 summation order only
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    with torch.no_grad():  # entropy of softmax(logits / T) at each scored position
        logits = tiny_model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / 0.7
        p = torch.softmax(logits, -1)
        ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(  # at policy tokens; nothing else is scored
        entropy[:, 1:], ent * action[:, 1:], atol=1e-4, rtol=0
    )
    assert (logp[action == 0] == 0).all()


@pytest.mark.parametrize("chunk_tokens", [1024, 5])
def test_entropy_for_a_bonus_has_the_plain_forwards_gradient(tiny_model, tokenizer, chunk_tokens):
    ids, attn, action = batch(tokenizer)
    tiny_model.train()
    params = [p for p in tiny_model.parameters() if p.requires_grad]
    logits = tiny_model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / 0.7
    plain = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)  # (N, T-1)
    expected = (plain * action[:, 1:]).sum()
    grads_expected = torch.autograd.grad(expected, params)
    _, entropy = forward_logprobs(
        tiny_model,
        ids,
        attn,
        0.7,
        action_mask=action,
        with_entropy=True,
        entropy_grad=True,
        chunk_tokens=chunk_tokens,
    )
    total = (entropy * action).sum()
    assert total.item() == pytest.approx(expected.item(), rel=1e-5)
    grads = torch.autograd.grad(total, params)
    for a, b in zip(grads, grads_expected, strict=True):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    _, detached = forward_logprobs(
        tiny_model, ids, attn, 0.7, action_mask=action, with_entropy=True
    )
    assert not detached.requires_grad  # no bonus: the entropy is a metric only


def test_shared_prefix_under_bf16_autocast_is_close(tiny_model, tokenizer):
    ids, attn, action = batch(tokenizer)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a, _ = forward_logprobs(tiny_model, ids, attn, action_mask=action, share_prefix=True)
        b, _ = forward_logprobs(tiny_model, ids, attn, action_mask=action, share_prefix=False)
    assert ((a - b).abs() * action).max() < 0.05
