"""What the engine tests share: a tiny model vLLM accepts, prompts, and the trainer's
recomputation of a sampled turn's log-probs."""

from __future__ import annotations

import torch

from agentenv.lm.backend import SamplingConfig

SAMPLING = SamplingConfig(max_new_tokens=16, temperature=1.0, stop_strings=[])


def small(tokenizer, seed=0):
    """2 layers, head size 64 (vLLM's CPU attention refuses the default tiny model's 16)."""
    from agentenv.lm.models import tiny_model

    return tiny_model(tokenizer, hidden_size=128, num_heads=2, seed=seed)


def save_small(tokenizer, path) -> str:
    """:func:`small` and the tokenizer as a model folder vLLM can serve."""
    small(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def prompts(tokenizer):
    return [
        tokenizer.encode("Hello there, how are you today", add_special_tokens=False),
        tokenizer.encode("2 + 3 =", add_special_tokens=False),
    ]


def recomputed(model, prompt, generation, temperature=1.0):
    """The trainer's log-probs of ``generation``'s tokens (float32)."""
    ids = torch.tensor([[*prompt, *generation.token_ids]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)


def check_tokens_logprobs_and_seeds(policy, model, tokenizer):
    """An engine's turns: ids and the log-probs ``model`` gives them (of the distribution
    sampled from, temperature included), text decoded from the ids, and a row's tokens
    fixed by its seed whatever its batch."""
    import pytest

    rows = prompts(tokenizer)
    got = policy.generate(rows, SAMPLING, seeds=[1, 2])
    assert [len(g.token_ids) for g in got] == [16, 16]
    assert [g.finish_reason for g in got] == ["length", "length"]
    for prompt, g in zip(rows, got, strict=True):
        assert g.text == tokenizer.decode(g.token_ids, skip_special_tokens=True)
        want = recomputed(model, prompt, g)
        torch.testing.assert_close(torch.tensor(g.sampler_logprobs), want, atol=1e-4, rtol=0)
    again = policy.generate([rows[1], rows[0], rows[1]], SAMPLING, seeds=[2, 1, 7])
    assert again[0].token_ids == got[1].token_ids and again[1].token_ids == got[0].token_ids
    assert again[2].token_ids != got[1].token_ids
    hot = SamplingConfig(max_new_tokens=8, temperature=2.0, stop_strings=[])
    g = policy.generate([rows[0]], hot, seeds=[3])[0]
    want = recomputed(model, rows[0], g, temperature=2.0)
    torch.testing.assert_close(torch.tensor(g.sampler_logprobs), want, atol=1e-4, rtol=0)
    assert g.sampler_logprobs != pytest.approx(recomputed(model, rows[0], g).tolist(), abs=1e-3)


def check_stop_string(policy, tokenizer):
    """A stop string ends the turn at the token that completes it (that token kept)."""
    import pytest

    prompt = prompts(tokenizer)[0]
    free = policy.generate([prompt], SAMPLING, seeds=[5])[0]
    stop = tokenizer.decode(free.token_ids[5:6])  # a string the seeded turn produces
    assert stop.strip(), "pick a token with visible text"
    first = next(i for i in range(16) if stop in tokenizer.decode(free.token_ids[: i + 1]))
    cut = SamplingConfig(max_new_tokens=16, temperature=1.0, stop_strings=[stop])
    got = policy.generate([prompt], cut, seeds=[5])[0]
    assert got.finish_reason == "stop_string"
    assert got.token_ids == free.token_ids[: first + 1]
    assert got.sampler_logprobs == pytest.approx(free.sampler_logprobs[: first + 1], abs=1e-5)


def check_continuous_collection(policy, model, tokenizer):
    """``collect`` with ``batching="continuous"`` over ``policy``'s own running batch:
    episodes overlap, every episode's sampler log-probs are ``model``'s of exactly its
    ids (so its tokens and masks are its own), and the same seeds collect the same
    episodes in lock-step."""
    import dataclasses

    import agentenv
    from agentenv.rollout.collect import collect
    from agentenv.rollout.config import RolloutConfig
    from agentenv.rollout.episode import ChatFormat

    config = RolloutConfig(
        group_size=3,
        max_turns=2,
        batching="continuous",
        sampling=SamplingConfig(max_new_tokens=12, temperature=1.0),
    )

    def make_env():
        return agentenv.make("Calculator-v0", prompt_style="compact")

    fmt = ChatFormat(tokenizer)
    groups, metrics = collect(make_env, [0, 1], policy, fmt, config, sample_seed=3)
    episodes = [e for g in groups for e in g]
    assert len(episodes) == 6 and metrics["rollout/rows_mean"] > 1
    assert metrics["rollout/tokens"] == sum(e.num_policy_tokens for e in episodes) > 0
    assert max(e.num_turns for e in episodes) == 2
    for e in episodes:
        ids = torch.tensor([e.input_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        mask = torch.tensor(e.action_mask[1:], dtype=torch.bool)
        mine = logp.gather(1, ids[0, 1:, None]).squeeze(1)[mask]
        theirs = torch.tensor(e.sampler_logprobs[1:])[mask]
        torch.testing.assert_close(theirs, mine, atol=1e-4, rtol=0)
    lock = dataclasses.replace(config, batching="lockstep")
    again, _ = collect(make_env, [0, 1], policy, fmt, lock, sample_seed=3)
    assert [e.input_ids for g in again for e in g] == [e.input_ids for e in episodes]
