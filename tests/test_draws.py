"""The helper that compares two decoding paths' draws (tests/helpers/draws.py), on a
model whose next-token distribution is set by hand."""

from types import SimpleNamespace

import pytest
import torch
from draws import _uniform, assert_same_draws

from agentenv.lm.backend import Generation, SamplingConfig

SAMPLED = SamplingConfig(max_new_tokens=4, temperature=1.0, stop_strings=[])
GREEDY = SamplingConfig(max_new_tokens=4, temperature=0.0, stop_strings=[])


class Fixed(torch.nn.Module):
    """Every position's logits are ``logits`` (V,)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.as_tensor(logits, dtype=torch.float64))

    def forward(self, ids):
        return SimpleNamespace(logits=self.logits.expand(*ids.shape, -1))


def gen(tokens, logps=None, reason="length"):
    return Generation(list(tokens), logps or [-1.0] * len(tokens), "", reason)


def split_at(boundary):
    """Logits of 3 tokens whose first CDF boundary is ``boundary`` (the second at 0.99)."""
    return torch.tensor([boundary, 0.99 - boundary, 0.01]).log()


def test_equal_rows_pass_and_log_probs_beyond_atol_fail():
    model = Fixed(split_at(0.5))
    same = dict(model=model, prompts=[[1]], sampling=SAMPLED, seeds=[0])
    assert assert_same_draws([gen([0, 1])], [gen([0, 1])], **same) == 0
    with pytest.raises(AssertionError, match="row 0: log-probs"):
        assert_same_draws([gen([0, 1], [-1.0, -1.1])], [gen([0, 1])], **same)
    with pytest.raises(AssertionError):  # the same tokens, another finish reason
        assert_same_draws([gen([0, 1], reason="stop")], [gen([0, 1])], **same)


def test_a_row_parting_at_a_cdf_boundary_passes_and_one_far_from_it_fails():
    """Seed 0's second draw: tokens 0 and 1 may part where the boundary between them is
    within rounding of u, and not 0.05 away."""
    u = _uniform(0, 1)
    tie, far = Fixed(split_at(u + 1e-6)), Fixed(split_at(u - 0.05))
    rows = [gen([2, 0, 1])], [gen([2, 1, 1])]
    assert assert_same_draws(*rows, model=tie, prompts=[[1]], sampling=SAMPLED, seeds=[0]) == 1
    with pytest.raises(AssertionError, match="row 0 parts at token 1 .* rounding cannot"):
        assert_same_draws(*rows, model=far, prompts=[[1]], sampling=SAMPLED, seeds=[0])
    with pytest.raises(AssertionError, match="rounding cannot"):  # another seed's u
        assert_same_draws(*rows, model=tie, prompts=[[1]], sampling=SAMPLED, seeds=[1])


def test_tokens_two_apart_part_only_if_every_boundary_between_them_is_near_u():
    u = _uniform(3, 0)
    both = Fixed(torch.tensor([u, 1e-9, 1 - u]).log())  # token 1's mass is nothing
    wide = Fixed(torch.tensor([u, 0.01, 0.99 - u]).log())
    rows = [gen([0])], [gen([2])]
    assert assert_same_draws(*rows, model=both, prompts=[[1]], sampling=SAMPLED, seeds=[3]) == 1
    with pytest.raises(AssertionError, match="rounding cannot"):
        assert_same_draws(*rows, model=wide, prompts=[[1]], sampling=SAMPLED, seeds=[3])


def test_greedy_rows_part_only_at_a_near_tie_of_their_logits():
    rows = [gen([0, 1])], [gen([0, 2])]
    tied = Fixed([0.0, 1.0, 1.0 + 1e-5])
    apart = Fixed([0.0, 1.0, 1.01])
    assert assert_same_draws(*rows, model=tied, prompts=[[1]], sampling=GREEDY) == 1
    with pytest.raises(AssertionError, match="logits 1.000e-02 apart"):
        assert_same_draws(*rows, model=apart, prompts=[[1]], sampling=GREEDY)
    # bf16's tolerance takes a 0.01 gap as rounding
    assert assert_same_draws(*rows, model=apart, prompts=[[1]], sampling=GREEDY, dtype="bfloat16")


def test_a_row_that_ends_where_the_other_goes_on_fails():
    model = Fixed(split_at(0.5))
    with pytest.raises(AssertionError, match="one path ended after 2 common tokens"):
        assert_same_draws(
            [gen([0, 1], reason="stop")], [gen([0, 1, 1])], model=model, prompts=[[1]],
            sampling=SAMPLED, seeds=[0],
        )  # fmt: skip
