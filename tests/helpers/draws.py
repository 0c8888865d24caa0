"""Two decoding paths' draws compared where float rounding may part them.

Two paths that decode the same rows with the same seeds (drafted against one token at a
time, batched against alone, slots shared or not, one kernel against another) compute a
step's logits with other matmul shapes and accumulation orders, so their logits differ by
rounding, by how much depending on the CPU's kernels (AVX2, AVX-512, AMX) or the GPU. A
row draws a token by searching its generator's uniform number ``u`` in the CDF of its
distribution (:func:`agentenv.lm.draw.sample`): where ``u`` lies within rounding of a
boundary between two tokens, the two paths may draw different tokens, rightly, and from
there on the row's continuations go apart. A test demanding identical tokens then passes
on one CPU and fails on another (issue 57: an AVX2-only CPU, temperature 0.068).

:func:`assert_same_draws` asserts what rounding cannot excuse:

- up to the first position where a row's tokens differ, the two paths drew the same
  tokens with log-probs within ``atol``; a row that never parts has the same tokens, the
  same length and the same finish reason;
- at that position the parting is a near tie under a float64 forward of the same weights
  over the row's prompt and common tokens: with sampling, ``u`` lies within ``margin`` of
  every CDF boundary between the two drawn tokens; greedy, the two tokens' logits are
  within ``2 * logit_tol`` of each other. After it the row is free.

``LOGIT_TOL`` is how far a path's logits may be from the float64 forward's; the CDF margin
follows from it: logits moved by at most ``e = logit_tol / temperature`` move any CDF
boundary ``C`` by at most ``C (1 - C) (exp(2 e) - 1) <= (exp(2 e) - 1) / 4``. A path that
draws from the wrong logits (a misaligned draft, another row's cache, a dropped mask) parts
where no boundary is near ``u`` and fails.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch

from agentenv.lm.backend import Generation, SamplingConfig
from agentenv.lm.draw import warpers as _warpers
from agentenv.rollout.episode import Episode

# How far a path's logits may be from a float64 forward of the same weights (for bf16:
# of the weights rounded to bf16), by the path's dtype. Measured on an AVX2-only AMD EPYC
# (plain forwards of 4 x 60 random tokens): float32 4e-7 on the tiny random model, 1.8e-6
# on the sharp one (tests/agentenv/lm/conftest.py); bf16 0.005 and 0.034. The row that
# parted on that CPU (issue 57) had u 7e-8 from the boundary, against a margin of 7e-4.
LOGIT_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.1}


def parting(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (the shorter one's length if one is
    a prefix of the other and they differ in length), or None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_draws(
    got: Sequence[Generation],
    expected: Sequence[Generation],
    *,
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    seeds: Sequence[int] | None = None,
    atol: float = 1e-5,
    dtype: str | torch.dtype = torch.float32,
) -> int:
    """Assert that ``got`` and ``expected`` (one generation per row of ``prompts``) drew
    the same tokens wherever rounding cannot have parted them (module docstring); return
    how many rows parted at a near tie.

    ``model`` is the model both paths decode (its weights: a float64 copy is made only if
    a row parts); ``seeds`` the rows' seeds (needed for sampling: a row's ``u`` at
    position ``i`` is one minus its generator's ``i``-th float64 draw); ``dtype`` the
    dtype both paths decode in (it sets the tolerance, :data:`LOGIT_TOL`).
    """
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    logit_tol = LOGIT_TOL[dtype]
    assert len(got) == len(expected) == len(prompts), (len(got), len(expected), len(prompts))
    sampled = sampling.temperature > 0
    assert seeds is not None or not sampled, "sampled rows are compared by their seeds"
    reference = None
    parted = 0
    for row, (g, e, prompt) in enumerate(zip(got, expected, prompts, strict=True)):
        at = parting(g.token_ids, e.token_ids)
        common = len(e.token_ids) if at is None else at
        torch.testing.assert_close(
            torch.tensor(g.sampler_logprobs[:common], dtype=torch.float64),
            torch.tensor(e.sampler_logprobs[:common], dtype=torch.float64),
            atol=atol,
            rtol=0,
            msg=lambda m, row=row: f"row {row}: log-probs of the common tokens differ: {m}",
        )
        if at is None:
            assert g.finish_reason == e.finish_reason, (row, g.finish_reason, e.finish_reason)
            continue
        assert at < min(len(g.token_ids), len(e.token_ids)), (
            f"row {row}: one path ended after {at} common tokens, the other went on "
            f"({g.finish_reason!r} vs {e.finish_reason!r})"
        )
        if reference is None:
            reference = copy.deepcopy(model).to("cpu", dtype).to(torch.float64).eval()
        logits = _logits(reference, [*prompt, *e.token_ids[:at]])
        a, b = sorted((g.token_ids[at], e.token_ids[at]))
        if sampled:
            u = _uniform(seeds[row], at)
            cdf = _cdf(logits, sampling)
            e2 = 2 * logit_tol / sampling.temperature
            margin = min(1.0, math.expm1(e2) / 4)
            # every boundary from the upper one of a to the lower one of b within margin of u
            low, high = cdf[a].item(), cdf[b - 1].item()
            ok = u - margin <= low and high <= u + margin
            detail = f"u={u:.9f}, CDF boundaries {low:.9f}..{high:.9f}, margin {margin:.2e}"
        else:
            gap = abs(logits[a] - logits[b]).item()
            ok = gap <= 2 * logit_tol
            detail = f"float64 logits {gap:.3e} apart, tolerance {2 * logit_tol:.1e}"
        assert ok, (
            f"row {row} parts at token {at} ({e.token_ids[at]} expected, {g.token_ids[at]} "
            f"drawn) where rounding cannot part it: {detail}"
        )
        parted += 1
    return parted


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The next token's logits (V,) after ``ids``, float64, from a plain forward."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].double()


def _cdf(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The CDF (V,) drawn from: logits / temperature, then top-k and top-p, as the sampler."""
    scores = (logits / sampling.temperature)[None]
    for warp in _warpers(sampling):
        scores = warp(None, scores)
    return torch.softmax(scores[0], dim=-1).cumsum(-1)


def _uniform(seed: int, at: int) -> float:
    """The ``u`` in (0, 1] with which a row seeded ``seed`` draws its ``at``-th token."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(at + 1):
        r = torch.rand(1, 1, dtype=torch.float64, generator=generator)
    return 1 - r.item()


def assert_same_episode_draws(
    got: Sequence[Sequence[Episode]],
    expected: Sequence[Sequence[Episode]],
    *,
    model: torch.nn.Module,
    sampling: SamplingConfig,
    sample_seed: int,
    atol: float = 1e-5,
) -> int:
    """Assert that two collections of the same groups with the same ``sample_seed``
    (another batching, envs answering in another order) hold the same episodes wherever
    rounding cannot have parted them; return how many episodes parted at a near tie.

    An episode equal to its counterpart has log-probs within ``atol`` and the same reward,
    stop reason and turns. One that differs agrees up to its first policy turn whose tokens
    differ, and that turn parts at a near tie (:func:`assert_same_draws`, the turn's seed
    from :func:`~agentenv.rollout.collect.trajectory_seed`); what follows it is free.
    """
    from agentenv.rollout.collect import trajectory_seed

    parted = 0
    for b, (group, other) in enumerate(zip(got, expected, strict=True)):
        for member, (x, y) in enumerate(zip(group, other, strict=True)):
            where = f"group {b}, episode {member}"
            spans = x.policy_spans()
            if x.input_ids == y.input_ids and x.action_mask == y.action_mask:
                torch.testing.assert_close(
                    torch.tensor(x.sampler_logprobs, dtype=torch.float64),
                    torch.tensor(y.sampler_logprobs, dtype=torch.float64),
                    atol=atol,
                    rtol=0,
                    msg=lambda m, where=where: f"{where}: log-probs differ: {m}",
                )
                assert (x.reward, x.stop_reason, x.num_turns) == (
                    y.reward,
                    y.stop_reason,
                    y.num_turns,
                ), where
                continue
            for turn, ((s, e), (s2, e2)) in enumerate(zip(spans, y.policy_spans(), strict=False)):
                assert (s, x.input_ids[:s]) == (s2, y.input_ids[:s2]), (
                    f"{where}: turn {turn}'s prompts differ though the turns before agree"
                )
                a, c = x.input_ids[s:e], y.input_ids[s2:e2]
                if a == c:
                    continue
                seed = trajectory_seed(sample_seed, x.seed, member, turn)
                turns = [
                    Generation(ep.input_ids[i:j], ep.sampler_logprobs[i:j], "", "")
                    for ep, (i, j) in ((x, (s, e)), (y, (s2, e2)))
                ]
                prompt = x.input_ids[:s]
                assert_same_draws(
                    turns[:1], turns[1:], model=model, prompts=[prompt], sampling=sampling,
                    seeds=[seed], atol=atol,
                )  # fmt: skip
                parted += 1
                break
            else:
                raise AssertionError(f"{where}: the episodes differ outside the policy's turns")
    return parted
