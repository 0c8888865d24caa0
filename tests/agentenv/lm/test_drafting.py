"""Drafted tokens: looked up in the context, kept only where a row draws them."""

import random

import pytest
from devices import DEVICES, on
from draws import assert_same_draws

from agentenv.lm import decoding
from agentenv.lm.backend import SamplingConfig
from agentenv.lm.decoding import Decoder
from agentenv.lm.drafting import lookup
from agentenv.lm.sampler import TransformersPolicy


def prompts(tokenizer):
    """Two chat prompts with a common system message."""
    system = {"role": "system", "content": "You are a careful assistant. " * 4}
    return [
        tokenizer.apply_chat_template(
            [system, {"role": "user", "content": u}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for u in ("What is 2 + 2?", "Spell the word 'calculator' backwards please.")
    ]


@pytest.mark.parametrize(
    ("context", "k", "drafts"),
    [
        ([1, 2, 3, 9, 1, 2, 8, 1, 2, 3], 3, [9, 1, 2]),  # the 3-gram, not the later 2-gram
        ([1, 2, 7, 5, 2, 6, 2], 2, [6, 2]),  # only the last token recurs: its latest copy
        ([4, 5, 4], 5, [5, 4]),  # fewer than k follow
        ([1, 2, 3], 2, []),  # nothing recurs
        ([7], 2, []),
        ([4, 5, 4], 0, []),
    ],
)
def test_lookup_drafts_what_followed_the_latest_copy_of_the_longest_tail(context, k, drafts):
    assert lookup(context, k) == drafts


@pytest.mark.parametrize(
    ("running", "agreed", "length"),
    # the lookup right for 20, 40, 50 or 80 of 98 rows (with the prior of 1 in 2: 1/5,
    # 2/5, 1/2, 4/5)
    [(8, 19, 0), (8, 39, 0), (8, 79, 3), (3, 49, 2), (1, 49, 3)],
)
def test_drafts_per_slot_are_those_with_the_most_tokens_per_cost(
    tiny_model, tokenizer, running, agreed, length
):
    """Hand-computed, a forward of T tokens costing 1 + T / 16, drafts needing 1.15 times
    the tokens per cost of none: 8 slots take 8 tokens for 1.5 (5.33 a unit); with a draft
    each at 1/5, 9.6 for 2 (4.8); at 2/5, 11.2 for 2 (5.6: more, but not 15% more); at
    4/5, 3 drafts take 23.6 tokens for 3 (7.87 a unit; 2 drafts 7.81, 4 drafts 7.68); 3
    slots at 1/2: 2 drafts (3.36 a unit, against 2.53; 1: 3.27, 3: 3.21); 1 slot at 1/2:
    3 drafts (1.5 against 0.94; 4: 1.48)."""
    decoder = TransformersPolicy(tiny_model, tokenizer, draft_tokens=4).decoder(SamplingConfig(8))
    decoder._seen, decoder._agreed = 98.0, float(agreed)
    assert decoder._draft_length(running) == length


def test_a_negative_number_of_drafts_is_refused_with_the_fix(tiny_model, tokenizer):
    from agentenv.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError, match=r"draft_tokens must be >= 0 \(0 turns"):
        TransformersPolicy(tiny_model, tokenizer, draft_tokens=-1)


@pytest.mark.parametrize("temperature", [0.068, 1.0])
@pytest.mark.parametrize("device", DEVICES)
def test_rows_keep_the_drafts_they_draw_and_only_those(
    tiny_model, tokenizer, device, temperature, monkeypatch
):
    """Drafts right and wrong (a row's own continuation with a quarter of its tokens
    replaced, for rows that share a slot: some other row's): every row gets the tokens of
    drawing one at a time with its seed, and close log-probs (float32), up to a draw that
    rounding may flip (tests/helpers/draws.py); drafts were taken, some only in part, and
    slots split where their rows took different ones."""
    model = on(tiny_model, device)
    first, other = prompts(tokenizer)
    batch, seeds = [first] * 6 + [other] * 2, list(range(8))
    sampling = SamplingConfig(max_new_tokens=16, temperature=temperature, stop_strings=[])
    one_at_a_time = TransformersPolicy(model, tokenizer, dtype="float32", draft_tokens=0)
    expected = one_at_a_time.generate(batch, sampling, seeds=seeds)
    assert one_at_a_time.decoded_rows == sum(len(g.token_ids) for g in expected)
    rng = random.Random(0)

    def oracle(context, k):
        context = tuple(context)
        futures = []
        for p, g in zip(batch, expected, strict=True):
            sofar = len(context) - len(p)
            if context[: len(p)] == tuple(p) and context[len(p) :] == tuple(g.token_ids[:sofar]):
                futures.append(g.token_ids[sofar:])
        drafts = list(rng.choice(futures)[:k]) if futures else []
        return [t if rng.random() > 0.25 else rng.randrange(1000) for t in drafts]

    taken = []  # (drafts taken, drafts) at each masking
    masking = Decoder._taken_mask
    split = []
    add_slots = Decoder._add_slots

    def spy_split(self, *args):
        split.append(args)
        return add_slots(self, *args)

    def spy_mask(self, j, k, mask=None):
        taken.append((k, len(self._drafts[j])))
        return masking(self, j, k, mask)

    monkeypatch.setattr(decoding, "lookup", oracle)
    monkeypatch.setattr(Decoder, "_draft_length", lambda self, running: 4)  # every step
    monkeypatch.setattr(Decoder, "_taken_mask", spy_mask)
    monkeypatch.setattr(Decoder, "_add_slots", spy_split)
    policy = TransformersPolicy(model, tokenizer, dtype="float32", share_slots=True, draft_tokens=4)
    got = policy.generate(batch, sampling, seeds=seeds)
    assert_same_draws(got, expected, model=model, prompts=batch, sampling=sampling, seeds=seeds)
    assert policy.decoded_tokens == sum(len(g.token_ids) for g in got)
    assert policy.decoded_rows < 0.8 * policy.decoded_tokens  # drafts taken
    assert any(0 < k < n for k, n in taken)  # some in part
    assert split  # rows of a slot parted (at a draft or after it)


@pytest.mark.parametrize("device", DEVICES)
def test_turns_with_drafts_end_on_their_stop_and_continue_from_their_saved_cache(
    tiny_model, tokenizer, device
):
    """The tiny model at a low temperature repeats itself, so drafts from the context are
    taken: turns end at a stop string completed inside a draft, or at their length, and
    their next turns continue the saved caches (rejected drafts masked out, so a saved
    cache holds exactly the turn's tokens): the same tokens, log-probs and prefilled
    tokens as drawing one at a time."""
    model = on(tiny_model, device)
    first, other = prompts(tokenizer)
    sampling = SamplingConfig(max_new_tokens=14, temperature=0.068, stop_strings=["\n\n\n"])
    reply = tokenizer.encode(" and then?", add_special_tokens=False)

    def run(draft_tokens):
        """Each turn's (prompt, seed, generation), by (episode, turn)."""
        policy = TransformersPolicy(
            model, tokenizer, dtype="float32", share_slots=True, draft_tokens=draft_tokens
        )
        decoder = policy.decoder(sampling)
        turns, asked = {}, {}
        for i, prompt in enumerate([first, first, other, other]):
            asked[i, 0] = (prompt, i)
            decoder.add((i, 0), prompt, seed=i, max_new_tokens=[14, 9, 14, 6][i])
        while len(decoder):
            for (i, turn), generation in decoder.step():
                turns[i, turn] = (*asked[i, turn], generation)
                if turn < 2:  # the episode's next turn: its last turn and a reply
                    prompt = [*asked[i, turn][0], *generation.token_ids, *reply]
                    asked[i, turn + 1] = (prompt, 10 * i + turn)
                    decoder.add((i, turn + 1), prompt, seed=10 * i + turn)
        return policy, turns

    drafting, got = run(4)
    plain, expected = run(0)
    # turns whose prompts agree (all unless an earlier turn parted at a near tie)
    same = [k for k in sorted(expected) if got[k][0] == expected[k][0]]
    assert len(same) >= 10 and all((i, 0) in same for i in range(4))
    assert_same_draws(
        [got[k][2] for k in same],
        [expected[k][2] for k in same],
        model=model,
        prompts=[expected[k][0] for k in same],
        sampling=sampling,
        seeds=[expected[k][1] for k in same],
    )
    got = [turn[2] for turn in got.values()]
    assert {g.finish_reason for g in got} >= {"stop_string", "length"}
    assert plain.prefill_tokens == drafting.prefill_tokens  # every next turn continued
    assert drafting.decoded_rows < 0.8 * drafting.decoded_tokens  # drafts taken
