"""The engine a config names: its settings reach the policy backend."""

import pytest

from agentenv.errors import InvalidOptionError
from agentenv.lm.engine import EngineConfig
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
