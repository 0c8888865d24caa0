"""Chunked, prefix-sharing log-probs equal a plain full-vocabulary forward pass."""

import pytest
import torch
from devices import DEVICES, on

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


def branching_batch(tokenizer, seed=1):
    """Rows that share more than the prompt: two write the same first turn and get the
    same reply, then part (one policy token differs); a third parts after one token."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(100, 5000, (n,), generator=g).tolist()

    prompt, turn, reply = rand(30), rand(6), rand(20)
    rows = [
        (prompt + turn + reply + rand(5), [0] * 30 + [1] * 6 + [0] * 20 + [1] * 5),
        (prompt + turn + reply + rand(8), [0] * 30 + [1] * 6 + [0] * 20 + [1] * 8),
        (prompt + turn[:1] + rand(4), [0] * 30 + [1] * 5),
    ]
    t = max(len(ids) for ids, _ in rows)
    ids = torch.full((3, t), tokenizer.pad_token_id)
    attn = torch.zeros((3, t), dtype=torch.long)
    action = torch.zeros((3, t))
    for i, (row, mask) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        action[i, : len(row)] = torch.tensor(mask, dtype=torch.float)
    return ids, attn, action


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scored", ["policy", "all"])
def test_rows_sharing_policy_and_env_tokens_match_a_plain_forward(
    tiny_model, tokenizer, scored, device, monkeypatch
):
    from algorithms.prefix_tree import PrefixTree

    tiny_model = on(tiny_model, device)
    ids, attn, action = (t.to(device) for t in branching_batch(tokenizer))
    mask = action if scored == "policy" else None
    weight = action if scored == "policy" else attn.float()
    weight = weight.clone()
    weight[:, 0] = 0  # position 0 is never scored
    tree = PrefixTree.from_rows(ids, attn, mask)
    # row 1 shares prompt + turn + reply (56 tokens) with row 0, row 2 the prompt + 1 (31)
    assert len(tree) == int(attn.sum()) - 56 - 31
    tiny_model.train()
    params = [p for p in tiny_model.parameters() if p.requires_grad]
    expected = reference(tiny_model, ids, attn, 0.7) * weight
    # different weights per row: a shared node's gradient is the sum of its rows'
    row_weights = torch.tensor([[1.0], [-2.0], [0.5]], device=device)
    grads_expected = torch.autograd.grad((expected * row_weights).sum(), params)
    trees = _count_trees(monkeypatch)
    logp, entropy = forward_logprobs(
        tiny_model, ids, attn, 0.7, action_mask=mask, with_entropy=True
    )
    assert trees == [1]  # run as a tree: it holds 73 of the 102 tokens the prompt leaves
    torch.testing.assert_close(logp, expected, atol=2e-5, rtol=0)
    assert (logp[weight == 0] == 0).all() and (entropy[weight == 0] == 0).all()
    grads = torch.autograd.grad((logp * row_weights).sum(), params)
    for a, b in zip(grads, grads_expected, strict=True):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_the_tree_under_bf16_autocast_is_as_close_as_the_rows(tiny_model, tokenizer, device):
    """In bfloat16 the tree's values differ from the rows' by rounding only: against the
    float32 forward, no further off than the rows run one by one."""
    tiny_model = on(tiny_model, device)
    ids, attn, action = (t.to(device) for t in branching_batch(tokenizer))
    options = {"action_mask": action}
    with torch.no_grad():
        exact, _ = forward_logprobs(tiny_model, ids, attn, **options)
        with torch.autocast(device, dtype=torch.bfloat16):
            tree, _ = forward_logprobs(tiny_model, ids, attn, **options)
            rows, _ = forward_logprobs(tiny_model, ids, attn, share_prefix=False, **options)
    scored = action.bool()
    tree_error, rows_error = ((x - exact).abs()[scored].mean() for x in (tree, rows))
    assert 0 < rows_error < 0.05 and tree_error < 2 * rows_error


def test_a_micro_batch_with_nothing_scored_still_reaches_every_weight(tiny_model, tokenizer):
    """A padding micro-batch (no policy token) gives zeros whose backward gives every
    trainable weight a zero gradient (DDP's backward needs them all)."""
    ids, attn, action = batch(tokenizer)
    tiny_model.train()
    params = [p for p in tiny_model.parameters() if p.requires_grad]
    logp, _ = forward_logprobs(tiny_model, ids, attn, action_mask=torch.zeros_like(action))
    assert (logp == 0).all()
    grads = torch.autograd.grad(logp.sum(), params)
    assert all(g is not None and (g == 0).all() for g in grads)


def test_a_head_that_is_not_bypassed_gives_the_same_values(tiny_model, tokenizer):
    """A model whose head the forward cannot bypass (here: a logit soft-cap in its config,
    which Llama does not apply) scores from the model's own logits, the tree included."""
    from algorithms.logprobs import _plain_head

    ids, attn, action = branching_batch(tokenizer)
    tiny_model.config.final_logit_softcapping = 30.0
    assert _plain_head(tiny_model) is None
    expected = reference(tiny_model, ids, attn, 0.7) * action
    options = {"action_mask": action, "with_entropy": True}
    with torch.no_grad():
        for share in (True, False):  # the tree (73 of 102 tokens), the rows in full
            logp, entropy = forward_logprobs(
                tiny_model, ids, attn, 0.7, share_prefix=share, **options
            )
            torch.testing.assert_close(logp, expected, atol=2e-5, rtol=0)
            assert entropy.shape == ids.shape and (entropy[action == 0] == 0).all()


def _count_trees(monkeypatch) -> list[int]:
    """A one-item list counting the prefix trees run through the model from now on."""
    from algorithms.prefix_tree import PrefixTree

    runs, inputs = [0], PrefixTree.model_inputs
    monkeypatch.setattr(
        PrefixTree, "model_inputs", lambda self: (runs.__setitem__(0, runs[0] + 1), inputs(self))[1]
    )
    return runs


def test_rows_that_share_only_a_prompt_prefill_it_once_instead_of_a_tree(
    tiny_model, tokenizer, monkeypatch
):
    """A tree of rows that share only their prompt saves nothing over prefilling that
    prompt once, and its attention costs more: the rows continue from the prompt's KV
    cache (the same values as the plain forward)."""
    import algorithms.logprobs as logprobs

    ids, attn, action = batch(tokenizer)  # a 40-token prompt, then 7, 12, 4 other tokens
    trees, prefixes, forward = _count_trees(monkeypatch), [], logprobs._forward
    monkeypatch.setattr(logprobs, "_forward", lambda *a: (prefixes.append(a[-1]), forward(*a))[1])
    with torch.no_grad():
        logp, _ = forward_logprobs(tiny_model, ids, attn, 0.7, action_mask=action)
    assert trees == [0] and prefixes == [39]  # the prompt, up to the first scored token
    torch.testing.assert_close(
        logp, reference(tiny_model, ids, attn, 0.7) * action, atol=2e-5, rtol=0
    )


def test_the_tree_runs_only_where_the_attention_takes_its_mask(tiny_model):
    """Flash attention ignores a 4D mask and a sliding window would be lost under the
    tree's: such models run their rows from the common prefix instead."""
    from algorithms.logprobs import tree_attention_applies

    config = tiny_model.config
    assert tree_attention_applies(tiny_model)  # SDPA, full attention
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    assert tree_attention_applies(tiny_model)
    config.layer_types[-1] = "sliding_attention"
    assert not tree_attention_applies(tiny_model)
    config.layer_types = None
    config.sliding_window, config.use_sliding_window = 4096, False  # Qwen2's: not used
    assert tree_attention_applies(tiny_model)
    config.use_sliding_window = True
    assert not tree_attention_applies(tiny_model)
    config.sliding_window = None
    config._attn_implementation = "flash_attention_2"
    assert not tree_attention_applies(tiny_model)
