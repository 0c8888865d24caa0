"""The rollout benchmark's fixed-work prompt: the plain one, and one grown to a length."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import rollout  # noqa: E402


def test_the_fixed_prompt_grows_by_the_fewest_words_that_reach_the_length(tokenizer):
    plain = rollout.fixed_prompt(tokenizer)
    messages = [
        {"role": "system", "content": "You solve math problems. Use the calculator tool."},
        {"role": "user", "content": rollout.QUESTION},
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert plain == list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # as before
    for tokens in (len(plain) + 1, 450, 1000):
        ids = rollout.fixed_prompt(tokenizer, tokens)
        words = next(k for k in range(tokens) if rollout.prompt_ids(tokenizer, k) == ids)
        assert len(ids) >= tokens > len(rollout.prompt_ids(tokenizer, words - 1))
        assert tokenizer.decode(ids).count(rollout.QUESTION) == 1
    assert rollout.prompt_ids(tokenizer, 20) != rollout.prompt_ids(tokenizer, 21)


def test_a_run_with_one_fast_path_off_turns_off_that_path_alone(tiny_model, tokenizer):
    policy = rollout.make_policy(
        "agentenv", tiny_model, tokenizer, "tiny", "float32", ("reuse_cache",)
    )
    assert not policy.reuse_cache and policy.share_prefix
    assert policy.fast_paths["reuse_cache"] == "switched off"
    assert [k for k, why in policy.fast_paths.items() if why == "switched off"] == ["reuse_cache"]
