"""Mask exactness: every mask-1 token was sampled by the policy, nothing else is."""

import functools
import json

import pytest
import torch

import agentenv
from agentenv.lm.backend import SamplingConfig
from agentenv.rollout.collect import ScriptedPolicy, collect
from agentenv.rollout.config import RolloutConfig
from agentenv.rollout.episode import ChatFormat, Episode, EpisodeBuilder, collate

# A Qwen2.5-style template with tool support: tool results are grouped into a user turn
# wrapped in <tool_response> tags (as Qwen2.5 and TRL's qwen2_5.jinja render them).
QWEN_STYLE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A template that only knows system/user/assistant (raises on any other role).
STRICT = (
    "{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m.role) }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATES = {"smollm2": None, "qwen_style": QWEN_STYLE, "strict": STRICT}


def call(expression: str) -> str:
    payload = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(payload)}</tool_call>"


def scripted(prompt: str) -> str:
    """Turn 1: two calls (one bad); turn 2: one call; turn 3: the answer."""
    turn = prompt.count("<|im_start|>assistant") - 1
    return [
        call("6 * 7") + " and " + call("1/0"),
        "Let me check. " + call("40 + 2"),
        "<answer>42</answer>",
    ][min(turn, 2)]


def run_scripted(tokenizer, template):
    fmt = ChatFormat(tokenizer, chat_template=template)
    policy = ScriptedPolicy(tokenizer, scripted)
    config = RolloutConfig(
        group_size=2, max_turns=5, sampling=SamplingConfig(64), show_progress=False
    )
    # a generous tool time limit: the calls' results are under test, not their wall-clock
    # (CI once lost the "division by zero" result here, which a call past the default 2 s
    # limit would do; it did not reproduce in 40 runs)
    make = functools.partial(agentenv.make, "Calculator-v0", tool_timeout_s=60.0)
    groups, _ = collect(make, [0, 1], policy, fmt, config)
    return fmt, policy, [e for g in groups for e in g]


@pytest.mark.parametrize("kind", TEMPLATES)
def test_mask_marks_exactly_the_sampled_tokens(tokenizer, kind):
    fmt, policy, episodes = run_scripted(tokenizer, TEMPLATES[kind])
    assert fmt.tool_role == ("user" if kind == "strict" else "tool")
    n = len(episodes)  # generate() is called once per turn for all n trajectories
    for i, ep in enumerate(episodes):
        spans = ep.policy_spans()
        assert ep.num_turns == 3 and len(spans) == 3 and ep.stop_reason == "terminated"
        for turn, (start, end) in enumerate(spans):  # stored ids == generated ids exactly
            assert ep.input_ids[start:end] == policy.generated[turn * n + i]
        texts = [tokenizer.decode(ep.input_ids[s:e], skip_special_tokens=True) for s, e in spans]
        assert texts == [m["content"] for m in ep.messages if m["role"] == "assistant"]
        # everything outside the spans is prompt/environment/template text
        env_text = tokenizer.decode(
            [t for t, m in zip(ep.input_ids, ep.action_mask, strict=True) if not m]
        )
        assert "<tool_call>" not in env_text.split("<|im_start|>user", 2)[-1]
        assert "42" in env_text and "division by zero" in env_text


@pytest.mark.parametrize("kind", TEMPLATES)
def test_episode_tokens_equal_full_template_render(tokenizer, kind):
    """Incremental building gives the same tokens as rendering the whole chat at once."""
    fmt, _, episodes = run_scripted(tokenizer, TEMPLATES[kind])
    ep = episodes[0]
    full = fmt.render(fmt.map_roles(ep.messages))
    assert tokenizer.decode(ep.input_ids) == full.removesuffix("\n")
    if kind == "qwen_style":
        assert "<tool_response>\n42\n</tool_response>" in full


def test_env_delta_after_a_length_cut_turn_closes_the_turn(tokenizer):
    fmt = ChatFormat(tokenizer)
    opening = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    builder = EpisodeBuilder(fmt, opening, max_tokens=500)
    cut = tokenizer.encode("I am still thin", add_special_tokens=False)  # no end token
    builder.add_policy(cut, [-0.5] * len(cut), "I am still thin")
    assert builder.add_env([{"role": "tool", "content": "r"}])
    ep = builder.build()
    end = ep.policy_spans()[0][1]
    assert tokenizer.decode(ep.input_ids[end:]) == (
        "<|im_end|>\n<|im_start|>tool\nr<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ep.sampler_logprobs[ep.policy_spans()[0][0]] == -0.5 and ep.sampler_logprobs[end] == 0.0


def test_overflowing_observation_is_truncated_with_marker_not_dropped(tokenizer):
    fmt = ChatFormat(tokenizer)
    opening = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    builder = EpisodeBuilder(fmt, opening, max_tokens=120)
    ids = tokenizer.encode("ok", add_special_tokens=False) + [tokenizer.eos_token_id]
    builder.add_policy(ids, [0.0] * len(ids), "ok")
    assert builder.add_env([{"role": "tool", "content": "word " * 2000}], min_room=16)
    assert len(builder.input_ids) <= 120 - 16
    assert builder.messages[-1]["content"].endswith("[... truncated to fit the context window ...]")
    assert "truncated to fit" in tokenizer.decode(builder.input_ids)
    prompt_len = len(fmt.prompt_ids(opening))
    full = EpisodeBuilder(fmt, opening, max_tokens=prompt_len + len(ids) + 10)
    full.add_policy(ids, [0.0] * len(ids), "ok")
    assert not full.add_env([{"role": "tool", "content": "x"}], min_room=16)  # no room at all


def test_collate_pads_right_and_aligns_masks():
    a = Episode([5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -1.0, -2.0], reward=1.0)
    b = Episode([5, 6, 9], [0, 1, 0], [0.0, -0.5, 0.0], reward=0.0)
    batch = collate([a, b], [0.5, -0.5], pad_token_id=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [5, 6, 9, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch["action_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert batch["sampler_logprobs"].tolist() == [[0, 0, -1, -2], [0, -0.5, 0, 0]]
    assert batch["advantages"].tolist() == [0.5, -0.5]
    assert batch["rewards"].dtype == torch.float32
    with pytest.raises(ValueError, match="equal lengths"):
        Episode([1, 2], [0], [0.0, 0.0])


def _trl_templates() -> dict[str, str]:
    """The ChatML-family templates TRL installs (Qwen 2.5 / 3 / 3.5 / 3.6, training variants)."""
    try:
        import trl
    except ImportError:
        return {}
    from pathlib import Path

    folder = Path(trl.__file__).parent / "chat_templates"
    return {
        p.stem: p.read_text()
        for p in sorted(folder.glob("qwen*.jinja"))
        if "_vl" not in p.stem  # vision templates: same text turns, image parts aside
    }


TRL_TEMPLATES = _trl_templates()
needs_trl = pytest.mark.skipif(
    not TRL_TEMPLATES, reason="TRL is not installed: its chat templates are the test data"
)


def thinking(prompt: str) -> str:
    """Think + call, think + nothing (the env answers with a user reminder), think + answer.

    The turn is the number of plans so far.
    """
    turn = prompt.count("[plan]")
    plan = f"<think>\n[plan] step {turn}\n</think>\n\n"
    if prompt.endswith("<think>\n"):  # the template opened the thinking block itself
        plan = plan.removeprefix("<think>\n")
    return plan + [call("6 * 7"), "Hmm.", "<answer>42</answer>"][min(turn, 2)]


def faithful(renders: list[str], prompts: list[str], sampled: list[str]) -> bool:
    """Whether the template renders each earlier turn as the policy saw and sampled it."""
    return all(
        later.startswith(prompt + text.removesuffix("<|im_end|>"))
        for later, prompt, text in zip(renders[1:], prompts, sampled, strict=False)
    )


@needs_trl
@pytest.mark.parametrize("name", sorted(TRL_TEMPLATES))
def test_templates_that_re_render_history_still_give_exact_episodes(tokenizer, name):
    fmt = ChatFormat(tokenizer, chat_template=TRL_TEMPLATES[name])
    policy = ScriptedPolicy(tokenizer, thinking)
    config = RolloutConfig(group_size=1, max_turns=5, sampling=SamplingConfig(64))
    config.show_progress = False
    groups, _ = collect(lambda: agentenv.make("Calculator-v0"), [0], policy, fmt, config)
    ep = groups[0][0]
    spans = ep.policy_spans()
    assert ep.stop_reason == "terminated" and len(spans) == 3
    for turn, (start, end) in enumerate(spans):
        assert ep.input_ids[start:end] == policy.generated[turn]  # exactly as sampled
        assert f"[plan] step {turn}" in tokenizer.decode(ep.input_ids[start:end])
    env_ids = [t for t, m in zip(ep.input_ids, ep.action_mask, strict=True) if not m]
    env_text = tokenizer.decode(env_ids[len(fmt.prompt_ids(ep.messages[:2])) :])
    assert "[plan]" not in env_text and "No tool call or final answer" in env_text
    assert "42" in env_text and "<|im_start|>assistant" in env_text

    # Each turn's prompt against the template's own render of the chat so far.
    assistant_at = [i for i, m in enumerate(ep.messages) if m["role"] == "assistant"]
    renders = [
        fmt.render(fmt.map_roles(ep.messages[:i]), add_generation_prompt=True) for i in assistant_at
    ]
    prompts = [tokenizer.decode(ep.input_ids[:start]) for start, _ in spans]
    sampled = [tokenizer.decode(ep.input_ids[start:end]) for start, end in spans]
    assert prompts[0] == renders[0]  # the opening is always the template's render
    if faithful(renders, prompts, sampled):
        assert prompts == renders  # every prompt is exactly what the template renders
    else:  # the template re-renders history: the episode keeps what the policy saw
        assert prompts != renders
        for i in (1, 2):
            assert prompts[i].startswith(prompts[i - 1] + sampled[i - 1])


@needs_trl
def test_the_trl_templates_include_both_kinds(tokenizer):
    """The test above runs both branches: some templates re-render history, some do not."""
    kinds = {}
    for name, template in TRL_TEMPLATES.items():
        fmt = ChatFormat(tokenizer, chat_template=template)
        opening = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        prompt = fmt.render(opening, add_generation_prompt=True)
        text = thinking(prompt)
        chat = [*opening, {"role": "assistant", "content": text}, {"role": "user", "content": "r"}]
        later = fmt.render(chat, add_generation_prompt=True)
        kinds[name] = faithful([prompt, later], [prompt], [text])
    assert kinds["qwen2_5"] and kinds["qwen2_5_training"] and kinds["qwen3_instruct_2507"]
    assert not kinds["qwen3"]  # drops the <think> part of turns before the last user message


def test_an_episode_built_by_hand_takes_its_turns_from_the_mask():

    e = Episode([1, 2, 3, 4, 5, 6], [0, 1, 1, 0, 1, 0], [0.0] * 6, reward=1.0)
    assert e.turn_spans == [(1, 3), (4, 5)]
    assert e.step_rewards == e.turn_rewards == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"turn_rewards must have one value per policy turn \(2\)"):
        Episode([1, 2, 3], [0, 1, 0], [0.0] * 3, turn_spans=[(1, 2), (2, 2)], turn_rewards=[1.0])
