"""The reference decoding path against the fast sampler, in float32.

Both draw with :func:`agentenv.lm.draw.sample` from a seed per row, so they must draw the
same tokens wherever float rounding of their logits cannot flip a draw, with log-probs
equal to rounding: ``assert_same_draws`` (tests/helpers/draws.py) checks exactly that,
on whatever CPU runs the test."""

import pytest
import torch
from draws import assert_same_draws

from agentenv.errors import InvalidOptionError
from agentenv.lm.backend import SamplingConfig
from agentenv.lm.reference import ReferencePolicy, TurnBatch
from agentenv.lm.sampler import TransformersPolicy

GREEDY = SamplingConfig(max_new_tokens=10, temperature=0.0, stop_strings=[])
SAMPLED = SamplingConfig(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, stop_strings=[])
SEEDS = [11, 12, 13, 14]


def prompts(tokenizer):
    """Four prompts of different lengths (the reference path left-pads them)."""
    system = {"role": "system", "content": "You are a careful assistant. " * 4}
    users = ["2 + 2?", "Name a colour.", "Spell 'calculator' backwards please.", "Hi"]
    return [
        tokenizer.apply_chat_template(
            [system, {"role": "user", "content": u}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for u in users
    ]


@pytest.mark.parametrize("which", ["tiny_model", "sharp_model"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_reference_draws_what_the_fast_sampler_draws(request, tokenizer, which, sampling):
    model = request.getfixturevalue(which)
    ps = prompts(tokenizer)
    seeds = SEEDS if sampling.temperature > 0 else None
    ref = ReferencePolicy(model, tokenizer, dtype="float32").generate(ps, sampling, seeds=seeds)
    fast = TransformersPolicy(model, tokenizer, dtype="float32").generate(ps, sampling, seeds=seeds)
    assert [len(g.token_ids) for g in ref] == [sampling.max_new_tokens] * 4
    assert_same_draws(ref, fast, model=model, prompts=ps, sampling=sampling, seeds=seeds)


def test_a_continued_turn_is_prefilled_whole_to_the_same_tokens(sharp_model, tokenizer):
    """The fast sampler continues from its saved KV cache; the reference prefills again."""
    ps = prompts(tokenizer)
    ref = ReferencePolicy(sharp_model, tokenizer, dtype="float32")
    fast = TransformersPolicy(sharp_model, tokenizer, dtype="float32")
    first = fast.generate(ps, SAMPLED, seeds=SEEDS)
    env = tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    )
    turn2 = [p + g.token_ids + env for p, g in zip(ps, first, strict=True)]
    assert all(fast._lookup(tuple(p)) is not None for p in turn2)  # the fast one continues
    seeds = [s + 100 for s in SEEDS]
    got, expected = (
        ref.generate(turn2, SAMPLED, seeds=seeds),
        fast.generate(turn2, SAMPLED, seeds=seeds),
    )
    assert_same_draws(
        got, expected, model=sharp_model, prompts=turn2, sampling=SAMPLED, seeds=seeds
    )


def test_lora_is_sampled_unmerged_and_without_dropout(tiny_model, tokenizer):
    from algorithms.lora import apply_lora

    peft_model = apply_lora(tiny_model, 4, 8, 0.5, ["q_proj", "v_proj", "up_proj"], seed=0)
    with torch.no_grad():  # LoRA B starts at 0: give the adapter a say
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    peft_model.train()  # as in a training run: dropout on, until the sampler turns it off
    ps = prompts(tokenizer)
    ref = ReferencePolicy(peft_model, tokenizer, dtype="float32")
    got = ref.generate(ps, SAMPLED, seeds=SEEDS)
    assert peft_model.training  # restored
    assert [g.token_ids for g in ref.generate(ps, SAMPLED, seeds=SEEDS)] == [
        g.token_ids for g in got
    ]  # no dropout in the draws
    fast = TransformersPolicy(peft_model, tokenizer, dtype="float32").generate(
        ps, SAMPLED, seeds=SEEDS
    )
    assert_same_draws(got, fast, model=peft_model, prompts=ps, sampling=SAMPLED, seeds=SEEDS)
    with peft_model.disable_adapter():
        base = ReferencePolicy(peft_model, tokenizer, dtype="float32").generate(
            ps, SAMPLED, seeds=SEEDS
        )
    assert [g.sampler_logprobs for g in base] != [g.sampler_logprobs for g in got]


def test_stops_and_limits_end_each_row_as_the_fast_sampler_does(tiny_model, tokenizer):
    ps = prompts(tokenizer)
    ref = ReferencePolicy(tiny_model, tokenizer, dtype="float32")
    full = ref.generate(ps, GREEDY)
    stop = tokenizer.decode(full[1].token_ids[1:3])  # row 1 stops after <= 3 tokens
    sampling = SamplingConfig(10, temperature=0.0, stop_strings=[stop])
    cut = ref.generate(ps, sampling)
    assert cut[1].finish_reason == "stop_string" and len(cut[1].token_ids) <= 3
    assert stop in cut[1].text and cut[1].token_ids == full[1].token_ids[: len(cut[1].token_ids)]
    fast = TransformersPolicy(tiny_model, tokenizer, dtype="float32").generate(ps, sampling)
    assert_same_draws(cut, fast, model=tiny_model, prompts=ps, sampling=sampling)

    token = full[0].token_ids[2]  # a stop token: kept, and the turn ends with it
    stopped = ReferencePolicy(tiny_model, tokenizer, dtype="float32", stop_token_ids=[token])
    gen = stopped.generate(ps[:1], GREEDY)[0]
    first = full[0].token_ids.index(token)
    assert gen.finish_reason == "stop" and gen.token_ids == full[0].token_ids[: first + 1]

    short = ref.generate(ps, GREEDY, max_new_tokens=[2, 10, 5, 1])
    assert [len(g.token_ids) for g in short] == [2, 10, 5, 1]
    for g, f in zip(short, full, strict=True):
        assert g.token_ids == f.token_ids[: len(g.token_ids)]
    with pytest.raises(InvalidOptionError, match="max_new_tokens must be >= 1"):
        ref.generate(ps[:1], GREEDY, max_new_tokens=[0])


def test_the_running_batch_returns_every_added_row_at_its_next_step(tiny_model, tokenizer):
    ps = prompts(tokenizer)
    ref = ReferencePolicy(tiny_model, tokenizer, dtype="float32")
    batch = ref.decoder(SAMPLED)
    assert isinstance(batch, TurnBatch) and len(batch) == 0 and batch.step() == []
    for i, p in enumerate(ps):
        batch.add(f"row{i}", p, seed=SEEDS[i], max_new_tokens=4 + i)
    assert len(batch) == 4
    out = dict(batch.step())
    assert len(batch) == 0 and sorted(out) == ["row0", "row1", "row2", "row3"]
    alone = [ref.generate([p], SAMPLED, seeds=[SEEDS[i]])[0] for i, p in enumerate(ps)]
    for i in range(4):  # each row: its own seed, its own limit
        assert out[f"row{i}"].token_ids == alone[i].token_ids[: 4 + i]
