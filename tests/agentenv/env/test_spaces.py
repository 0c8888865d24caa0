import numpy as np
import pytest
from gymnasium import spaces

from agentenv.env.spaces import FreeText, Messages


def test_free_text_contains_any_unicode_up_to_max_length():
    space = FreeText(max_length=10)
    assert isinstance(space, spaces.Text)
    assert "héllo\n<x>" in space
    assert "" in space
    assert "x" * 11 not in space
    assert 5 not in space


def test_free_text_sample_is_seeded_and_contained():
    a, b = FreeText(seed=3), FreeText(seed=3)
    samples = [a.sample() for _ in range(20)]
    assert samples == [b.sample() for _ in range(20)]
    assert all(s in a for s in samples)
    assert len(set(samples)) > 1


def test_messages_contains_exact_message_dicts():
    space = Messages(max_messages=2, max_content_length=5)
    assert [] in space
    assert [{"role": "user", "content": "hi"}] in space
    assert [{"role": "assistant", "content": "hi"}] not in space  # envs never speak as assistant
    assert [{"role": "user", "content": "hi", "extra": 1}] not in space
    assert [{"role": "user", "content": 3}] not in space
    assert [{"role": "user", "content": "toolong"}] not in space
    assert [{"role": "user", "content": ""}] * 3 not in space
    assert ({"role": "user", "content": ""},) not in space


def test_messages_sample_seed_roundtrip():
    space = Messages(seed=7)
    first = [space.sample() for _ in range(10)]
    space.seed(7)
    assert [space.sample() for _ in range(10)] == first
    assert all(s in space for s in first)


def test_messages_rejects_empty_roles_and_mask():
    with pytest.raises(ValueError, match="at least one role"):
        Messages(roles=())
    with pytest.raises(NotImplementedError):
        Messages().sample(mask=np.zeros(1))
