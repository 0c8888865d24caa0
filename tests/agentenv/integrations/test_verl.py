"""agentenv episodes in verl's own agent-loop worker, served through verl's own client.

What runs is verl 0.9.1's code: ``RLHFDataset`` reads the parquet file ``write_dataset``
wrote, ``AgentLoopWorker`` loads the agent loop YAML, resolves each row's ``agent_name``
through verl's registry, instantiates the loop with hydra and pads the outputs into its
``DataProto``; every turn goes through verl's ``LLMServerClient`` and its
``GlobalRequestLoadBalancer`` Ray actor to a Ray actor server. Only that server is ours
(tests/helpers/verl_server.py: verl's ``generate`` signature and ``TokenOutput`` over
agentenv's sampler), because verl's vLLM replica cannot run beside transformers 5.24.
One Ray session serves the module (``ray.init`` takes ~10 s on 2 cores).
"""

import asyncio
import os
from pathlib import Path

import pytest

pytest.importorskip(
    "verl.experimental.agent_loop",
    reason="verl is not installed: pip install --no-deps verl==0.9.1 ray codetiming "
    "tensordict==0.8.3 hydra-core==1.4.0rc1 (as install.sh does)",
)

import ray  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopWorker,
    _agent_loop_registry,
)
from verl.protocol import DataProto  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerClient  # noqa: E402
from verl.workers.rollout.router import get_router_handle  # noqa: E402
from verl_server import PolicyServer, demonstration_policy, tiny_policy  # noqa: E402

import agentenv.integrations.verl as agentenv_verl  # noqa: E402
from agentenv import make  # noqa: E402
from agentenv.errors import InvalidOptionError  # noqa: E402
from agentenv.lm.backend import SamplingConfig  # noqa: E402
from agentenv.lm.models import tiny_model  # noqa: E402
from agentenv.lm.sampler import TransformersPolicy  # noqa: E402
from agentenv.rollout.collect import ScriptedPolicy, collect  # noqa: E402
from agentenv.rollout.config import RolloutConfig  # noqa: E402
from agentenv.rollout.episode import ChatFormat  # noqa: E402
from algorithms.logprobs import token_logprobs  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
CALC = {"source": "word_problems"}  # tasks with a demonstration (a calculator call)
TARGET = "agentenv.integrations.verl.AgentEnvAgentLoop"


class RecordingClient(LLMServerClient):
    """verl's client, noting the request id of every turn it sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.request_ids = []

    async def generate(self, request_id, **kwargs):
        self.request_ids.append(request_id)
        return await super().generate(request_id, **kwargs)


@pytest.fixture(scope="module")
def server():
    """One Ray session with one ``PolicyServer`` actor behind verl's load balancer."""
    paths = [str(ROOT), str(ROOT / "tests" / "helpers"), os.environ.get("PYTHONPATH", "")]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}},
    )
    try:
        actor = ray.remote(PolicyServer).remote(tiny_policy)
        balancer = get_router_handle(servers={"agentenv-sampler:0": actor})
        yield actor, balancer
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("verl-tiny")
    tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def verl_worker(
    server, model_dir, tmp_path, *, response_length=128, max_new_tokens=None, prompt_length=512
):
    """verl's ``AgentLoopWorker`` (in this process) on verl's generated trainer config,
    loading the agent loop YAML that ``write_agent_loop_config`` writes."""
    import verl

    base = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    config = OmegaConf.load(base)
    config.actor_rollout_ref.model.path = str(model_dir)
    rollout = config.actor_rollout_ref.rollout
    rollout.name = "vllm"
    config.data.max_prompt_length = prompt_length
    config.data.max_response_length = response_length
    yaml = tmp_path / "agentenv_agent.yaml"
    agentenv_verl.write_agent_loop_config(yaml, max_new_tokens=max_new_tokens)
    rollout.agent.agent_loop_config_path = str(yaml)
    client = RecordingClient(config, load_balancer_handle=server[1])
    return AgentLoopWorker(config, client), client


def verl_rollout(worker, tokenizer, rows, tmp_path):
    """The rows through verl's dataset, collate and worker, greedy (verl's validation)."""
    data = tmp_path / "rows.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), data)
    config = worker.config.data
    dataset = RLHFDataset(data_files=[str(data)], tokenizer=tokenizer, config=config)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    batch.meta_info["validate"] = True  # verl's val_kwargs: temperature 0
    return asyncio.run(worker.generate_sequences(batch))


def unpadded(out, i):
    """Row ``i`` of verl's padded batch: prompt, response, mask, log-probs, reward."""
    b = out.batch
    p = b["prompts"].shape[1]
    keep_p = b["attention_mask"][i, :p].bool()
    n = int(b["attention_mask"][i, p:].sum())
    return (
        b["prompts"][i][keep_p].tolist(),
        b["responses"][i, :n].tolist(),
        b["response_mask"][i, :n].tolist(),
        b["rollout_log_probs"][i, :n].tolist(),
        float(b["rm_scores"][i].sum()),
    )


def agentenv_episode(policy, tokenizer, row, response_length, max_new_tokens=256):
    """The same task through agentenv's own ``collect``, greedy, same token budget."""
    extra = row["extra_info"]
    env_id, kwargs = extra["env_id"], agentenv_verl.EpisodeSpec.from_row(extra).env_kwargs
    fmt = ChatFormat(tokenizer)
    env = make(env_id, **kwargs)
    prompt = fmt.prompt_ids(env.reset(options={"task_id": extra["task_id"]})[0])
    config = RolloutConfig(
        group_size=1,
        max_turns=extra["max_turns"],
        max_episode_tokens=len(prompt) + response_length,
        sampling=SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0),
        show_progress=False,
    )
    options = [{"task_id": extra["task_id"]}]
    groups, _ = collect(lambda: make(env_id, **kwargs), [None], policy, fmt, config,
                        options=options)  # fmt: skip
    return groups[0][0], len(prompt)


def test_agent_name_resolves_through_verls_registry(tmp_path):
    assert _agent_loop_registry[agentenv_verl.AGENT_NAME] == {"_target_": TARGET}
    yaml = agentenv_verl.write_agent_loop_config(tmp_path / "a.yaml", max_new_tokens=32)
    loaded = OmegaConf.to_container(OmegaConf.load(yaml))
    assert loaded == [{"name": "agentenv", "_target_": TARGET, "max_new_tokens": 32}]


def test_dataset_rows_are_verls_rl_format(tmp_path, tokenizer):
    path = agentenv_verl.write_dataset("Calculator-v0", tmp_path / "t.parquet", num_tasks=3,
                                       max_turns=2, **CALC)  # fmt: skip
    rows = agentenv_verl.dataset_rows("Calculator-v0", num_tasks=3, max_turns=2, **CALC)
    opening = make("Calculator-v0", **CALC).reset(options={"task_id": 2})[0]
    assert rows[2]["prompt"] == opening and rows[2]["agent_name"] == "agentenv"
    assert rows[2]["extra_info"] == {
        "index": 2,
        "env_id": "Calculator-v0",
        "env_kwargs": '{"source": "word_problems"}',
        "split": "train",
        "task_id": 2,
        "max_turns": 2,
    }
    config = OmegaConf.create({"max_prompt_length": 512, "prompt_key": "prompt"})
    item = RLHFDataset(data_files=[str(path)], tokenizer=tokenizer, config=config)[2]
    assert item["raw_prompt"] == opening and item["agent_name"] == "agentenv"
    assert agentenv_verl.EpisodeSpec.from_row(item["extra_info"]) == agentenv_verl.EpisodeSpec(
        "Calculator-v0", dict(CALC), "train", task_id=2, max_turns=2
    )


def test_greedy_episodes_equal_agentenvs_own_collect(server, model_dir, tmp_path, tokenizer):
    worker, client = verl_worker(server, model_dir, tmp_path, response_length=160, max_new_tokens=8)
    rows = agentenv_verl.dataset_rows("Calculator-v0", num_tasks=2, max_turns=3, **CALC)
    out = verl_rollout(worker, tokenizer, rows, tmp_path)
    model = tiny_model(tokenizer)
    local = TransformersPolicy(model, tokenizer, dtype="float32")
    for i, row in enumerate(rows):
        episode, n_prompt = agentenv_episode(local, tokenizer, row, 160, max_new_tokens=8)
        prompt, response, mask, logps, reward = unpadded(out, i)
        assert prompt + response == episode.input_ids and len(prompt) == n_prompt
        assert mask == episode.action_mask[n_prompt:]  # policy 1, env turns 0
        assert 0 in mask and mask[0] == 1
        assert reward == episode.reward == 0.0  # a random model answers nothing
        fields = out.non_tensor_batch
        assert fields["stop_reason"][i] == episode.stop_reason == "max_turns"
        assert fields["policy_turns"][i] == episode.num_turns == 3
        assert fields["__num_turns__"][i] == 1 + 3 + 2  # prompt, 3 turns, 2 env replies
        assert fields["truncated"][i] is False
        # the server's log-probs: agentenv's sampler's, and the trainer's recomputation
        assert logps == pytest.approx(episode.sampler_logprobs[n_prompt:], abs=1e-5)
        ids = torch.tensor([episode.input_ids])
        with torch.no_grad():
            recomputed = token_logprobs(model, ids, torch.ones_like(ids))[0, n_prompt:]
        on = torch.tensor(mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(logps)[on], recomputed[on], atol=1e-4)
        assert (torch.tensor(logps)[~on] == 0).all()
    # three turns per episode, each under its episode's one request id (sticky session)
    assert len(client.request_ids) == 6 and len(set(client.request_ids)) == 2
    calls = ray.get(server[0].requests.remote())
    assert {c["max_tokens"] for c in calls} == {8}
    assert all(c["stop"] == ["</tool_call>", "</answer>"] and c["temperature"] == 0 for c in calls)


def test_response_length_truncates_like_collect(server, model_dir, tmp_path, tokenizer):
    # 20 response tokens: the first turn may take only 20 of its 24, then no env reply fits
    worker, client = verl_worker(server, model_dir, tmp_path, response_length=20, max_new_tokens=24)
    row = agentenv_verl.dataset_rows("Calculator-v0", num_tasks=1, max_turns=5, **CALC)[0]
    out = verl_rollout(worker, tokenizer, [row], tmp_path)
    local = TransformersPolicy(tiny_model(tokenizer), tokenizer, dtype="float32")
    episode, n_prompt = agentenv_episode(local, tokenizer, row, 20, max_new_tokens=24)
    prompt, response, mask, _, _ = unpadded(out, 0)
    assert prompt + response == episode.input_ids
    assert len(response) == 20 == out.batch["responses"].shape[1] and mask == [1] * 20
    assert ray.get(server[0].requests.remote())[-1]["max_tokens"] == 20
    assert out.non_tensor_batch["stop_reason"][0] == episode.stop_reason == "max_tokens"
    assert out.non_tensor_batch["truncated"][0] is True


def test_demonstration_earns_the_envs_reward(server, model_dir, tmp_path, tokenizer):
    ray.get(server[0].set_policy.remote(lambda: demonstration_policy("Calculator-v0", CALC, 0)))
    try:
        worker, _ = verl_worker(server, model_dir, tmp_path)
        row = agentenv_verl.dataset_rows("Calculator-v0", num_tasks=1, max_turns=4, **CALC)[0]
        out = verl_rollout(worker, tokenizer, [row], tmp_path)
    finally:
        ray.get(server[0].set_policy.remote(tiny_policy))
    local = demonstration_policy("Calculator-v0", CALC, 0)
    episode, n_prompt = agentenv_episode(local, tokenizer, row, 128)
    prompt, response, mask, _, reward = unpadded(out, 0)
    assert isinstance(local, ScriptedPolicy)
    assert prompt + response == episode.input_ids and mask == episode.action_mask[n_prompt:]
    assert reward == episode.reward == 1.0  # the env's score of the answer, as rm_scores
    assert out.batch["rm_scores"][0].nonzero().flatten().tolist() == [len(response) - 1]
    fields = out.non_tensor_batch
    assert fields["stop_reason"][0] == "terminated" and fields["turn_scores"][0] == [0.0, 1.0]
    assert fields["__num_turns__"][0] == 4  # prompt, call, tool result, answer
    tool_turn = tokenizer.decode([t for t, m in zip(response, mask, strict=True) if m == 0])
    # the policy sampled its <|im_end|>; the env's tokens are the rest of the template
    result = episode.messages[3]  # the calculator's answer to the call
    assert result["role"] == "tool"
    assert (
        tool_turn == f"\n<|im_start|>tool\n{result['content']}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_bfcl_conversation_runs_in_verls_worker(server, model_dir, tmp_path, tokenizer):
    """BFCL-v0 (a ConversationEnv with stateful tools) in verl's worker, playing train task
    0's ground truth: the tokens and masks of agentenv's own episode, each follow-up user
    message an env turn (mask 0), BFCL's verdict of each user turn in turn_rewards, reward 1."""
    pytest.importorskip("bfcl_eval", reason="bfcl-eval is not installed (install.sh does)")
    ray.get(server[0].set_policy.remote(lambda: demonstration_policy("BFCL-v0", {}, 0)))
    try:
        worker, _ = verl_worker(
            server, model_dir, tmp_path, response_length=3072, prompt_length=1536
        )
        row = agentenv_verl.dataset_rows("BFCL-v0", num_tasks=1, max_turns=40)[0]
        out = verl_rollout(worker, tokenizer, [row], tmp_path)
    finally:
        ray.get(server[0].set_policy.remote(tiny_policy))
    episode, n_prompt = agentenv_episode(
        demonstration_policy("BFCL-v0", {}, 0), tokenizer, row, 3072
    )
    prompt, response, mask, _, reward = unpadded(out, 0)
    assert prompt + response == episode.input_ids and mask == episode.action_mask[n_prompt:]
    assert reward == episode.reward == 1.0
    follow_ups = make("BFCL-v0").unwrapped.get_task(0).metadata["user_turns"]
    assert len(follow_ups) >= 1
    fields = out.non_tensor_batch
    assert fields["stop_reason"][0] == episode.stop_reason == "terminated"
    assert fields["turn_scores"][0] == episode.step_rewards  # 1 at the end: the outcome
    assert fields["turn_rewards"][0] == episode.turn_rewards  # BFCL's verdict per user turn
    assert episode.turn_rewards.count(1.0) == 1 + len(follow_ups)
    env_text = tokenizer.decode([t for t, m in zip(response, mask, strict=True) if m == 0])
    for message in follow_ups:  # each later user turn reached the model as a user message
        assert f"<|im_start|>user\n{message}<|im_end|>" in env_text


def test_a_bad_row_names_the_fix(server, model_dir, tmp_path, tokenizer):
    worker, _ = verl_worker(server, model_dir, tmp_path)
    row = agentenv_verl.dataset_rows("Calculator-v0", num_tasks=1, **CALC)[0]
    row["extra_info"]["env_id"] = "Calculatr-v0"
    with pytest.raises(InvalidOptionError, match=r"'Calculatr-v0'.*Did you mean.*my_pkg\.envs"):
        verl_rollout(worker, tokenizer, [row], tmp_path)
    with pytest.raises(InvalidOptionError, match="neither task_id nor seed.*dataset_rows"):
        agentenv_verl.EpisodeSpec.from_row({"env_id": "Calculator-v0"})
    with pytest.raises(InvalidOptionError, match="no agentenv env_id.*dataset_rows"):
        agentenv_verl.EpisodeSpec.from_row({"index": 0})


def test_an_env_that_raises_ends_its_episode_and_trains_nothing(
    server, model_dir, tmp_path, tokenizer
):
    """The env's step raises on the first turn: the episode ends there as ``env_error``
    (the error kept), with the turn the policy sampled in the response but masked out,
    and the worker's batch goes on."""
    worker, _ = verl_worker(server, model_dir, tmp_path)
    row = agentenv_verl.dataset_rows("Calculator-v0", num_tasks=1, max_turns=3, **CALC)[0]
    row["extra_info"]["env_id"] = "raising_env:RaisingCalculator-v0"  # imported by the loop
    out = verl_rollout(worker, tokenizer, [row], tmp_path)
    _, response, mask, _, reward = unpadded(out, 0)
    fields = out.non_tensor_batch
    assert fields["stop_reason"][0] == "env_error"
    assert "the tool's backend is down" in fields["env_error"][0]
    assert len(response) > 0 and mask == [0] * len(response) and reward == 0.0
