"""The engine a config names: its settings reach the policy backend."""

import pytest

from agentenv.errors import InvalidOptionError
from agentenv.lm.backend import EngineConfig
from agentenv.lm.engines import make_policy


@pytest.mark.parametrize(("draft_tokens", "expected"), [(None, 4), (0, 0), (2, 2)])
def test_the_agentenv_engine_drafts_as_configured(tiny_model, tokenizer, draft_tokens, expected):
    config = EngineConfig(draft_tokens=draft_tokens)
    policy = make_policy(config, tiny_model, tokenizer, model_name="tiny", dtype="float32")
    assert policy.draft_tokens == expected  # None: the CPU's default


def test_a_negative_draft_count_is_refused_with_the_fix():
    with pytest.raises(
        InvalidOptionError, match=r"draft_tokens must be >= 0 .*0 turns drafting off.*got -1"
    ):
        EngineConfig(draft_tokens=-1)


def test_draft_tokens_with_another_engine_is_refused():
    with pytest.raises(InvalidOptionError, match=r"draft_tokens is the agentenv engine's.*'vllm'"):
        EngineConfig(engine="vllm", draft_tokens=0)


def test_the_reference_engine_is_the_plain_path(tiny_model, tokenizer):
    from agentenv.lm.reference import ReferencePolicy

    config = EngineConfig(engine="reference")
    policy = make_policy(config, tiny_model, tokenizer, model_name="tiny", dtype="float32")
    assert isinstance(policy, ReferencePolicy) and policy.model is tiny_model  # no copy


def test_without_the_fast_sampler_the_agentenv_engine_falls_back_and_says_so(
    tiny_model, tokenizer, monkeypatch, caplog
):
    import sys

    from agentenv.lm import engines
    from agentenv.lm.reference import ReferencePolicy

    assert engines.fast_sampler_missing() is None  # this transformers: the fast path runs
    monkeypatch.setitem(sys.modules, "agentenv.lm.sampler", None)  # as if it failed to import
    reason = engines.fast_sampler_missing()
    assert reason is not None and "cannot be imported" in reason
    with caplog.at_level("WARNING", logger="agentenv.lm.engines"):
        policy = make_policy(EngineConfig(), tiny_model, tokenizer, model_name="t", dtype="float32")
    assert isinstance(policy, ReferencePolicy)
    assert [r.getMessage() for r in caplog.records] == [
        f"decoding with the reference path: the fast sampler {reason}"
    ]


def test_a_major_release_the_fast_sampler_was_not_built_on_falls_back(
    tiny_model, tokenizer, monkeypatch, caplog
):
    from agentenv.lm import engines
    from agentenv.lm.reference import ReferencePolicy

    real = engines._version
    monkeypatch.setattr(engines, "_version", lambda n: "6.0.1" if n == "transformers" else real(n))
    reason = engines.fast_sampler_missing()
    assert reason == "is built on transformers 5.x, and this is transformers 6.0.1"
    with caplog.at_level("WARNING", logger="agentenv.lm.engines"):
        policy = make_policy(EngineConfig(), tiny_model, tokenizer, model_name="t", dtype="float32")
    assert isinstance(policy, ReferencePolicy)
    assert [r.getMessage() for r in caplog.records] == [
        f"decoding with the reference path: the fast sampler {reason}"
    ]
