"""agentenv envs through verifiers' own loader and rollouts, against a real local server.

The server is ``transformers serve`` (an OpenAI-compatible HTTP server) on 127.0.0.1,
serving tiny models that learned one episode by heart (tests/helpers/memorized.py): a
Calculator solution, and a Tally-v0 conversation (two user turns over a stateful tool,
tests/helpers/tally_env.py). verifiers' harness calls the model, the env runs the tools
and the user's follow-up, and the reward is the env's.
"""

import asyncio
import os
import socket
import subprocess
import time
import urllib.request

import pytest

pytest.importorskip(
    "verifiers.v1", reason="verifiers>=0.4 is not installed: pip install 'agentenv[verifiers]'"
)

import verifiers.v1 as vf  # noqa: E402
from memorized import memorize  # noqa: E402
from scripts import console_script  # noqa: E402

from agentenv import make  # noqa: E402
from agentenv.integrations import task_rows  # noqa: E402
from agentenv.integrations.verifiers import AgentEnvEnvConfig  # noqa: E402

TASKSET = "agentenv-verifiers"  # the top-level plugin module agentenv_verifiers
CALC = {"source": "word_problems"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(num_tasks: int = 1, max_turns: int = 5, env_id="Calculator-v0", env_kwargs=CALC):
    config = AgentEnvEnvConfig(
        taskset={
            "id": TASKSET,
            "env_id": env_id,
            "num_tasks": num_tasks,
            "env_kwargs": env_kwargs,
        },
        agent={"max_turns": max_turns},
    )
    return vf.load_environment(config)


def test_verifiers_loads_the_plugin_and_its_tasks_are_the_envs():
    env = _load(num_tasks=3)
    assert type(env).__name__ == "AgentEnvEnv"
    tasks = list(env.taskset.take(3))
    rows = task_rows("Calculator-v0", split="test", num_tasks=3, **CALC)
    assert [t.data.task_id for t in tasks] == [0, 1, 2]
    for task, row in zip(tasks, rows, strict=True):
        assert task.data.system_prompt == row["prompt"][0]["content"]
        assert task.data.prompt == row["prompt"][1]["content"]


def _memorized_folder(tokenizer, folder, env, task_id: int):
    """A tiny model that plays ``env``'s demonstration of task ``task_id`` (tool results
    and follow-ups as user messages, as AgentEnvEnv sends them), saved in ``folder``."""
    from agentenv.rollout.episode import ChatFormat

    opening, _ = env.reset(options={"task_id": task_id})
    chat = list(opening)
    for action in env.unwrapped.demonstration(env.unwrapped.task):
        new, *_ = env.step(action)
        chat.append({"role": "assistant", "content": action})
        chat += [{"role": "user", "content": m["content"]} for m in new]
    fmt = ChatFormat(tokenizer)
    prompt = fmt.render(opening, add_generation_prompt=True)
    model = memorize(tokenizer, fmt.render(chat), prompt)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), chat


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``transformers serve`` on a free local port; it loads each request's model (a
    folder) on demand."""
    exe = console_script("transformers")
    if exe is None:
        pytest.skip("the `transformers` command is not installed (beside python or on PATH)")
    try:
        import fastapi  # noqa: F401
    except ImportError:
        pytest.skip("transformers serve needs fastapi: pip install 'agentenv[verifiers]'")
    port = _free_port()
    path = tmp_path_factory.mktemp("served") / "serve.log"
    log = open(path, "w")  # noqa: SIM115 - closed below
    command = [exe, "serve", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    log.flush()
                    pytest.fail(f"transformers serve did not start:\n{path.read_text()[-2000:]}")
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def served_model(server, tokenizer, tmp_path_factory):
    """A served model that solves Calculator test task 0 (a call, then the answer)."""
    env = make("Calculator-v0", split="test", **CALC)
    folder, chat = _memorized_folder(tokenizer, tmp_path_factory.mktemp("calc"), env, 0)
    return {"url": server, "model": folder, "answer": chat[-1]["content"]}


@pytest.fixture(scope="module")
def served_tally(server, tokenizer, tmp_path_factory):
    """A served model that plays Tally-v0 task 0, a conversation (tests/helpers/tally_env.py)."""
    import tally_env  # noqa: F401 - registers Tally-v0

    env = make("Tally-v0")
    folder, chat = _memorized_folder(tokenizer, tmp_path_factory.mktemp("tally"), env, 0)
    return {"url": server, "model": folder, "chat": chat}


def _rollouts(env, served, n: int):
    os.environ["AGENTENV_TEST_KEY"] = "local"
    context = vf.ModelContext(
        model=served["model"],
        client=vf.EvalClientConfig(base_url=served["url"], api_key_var="AGENTENV_TEST_KEY"),
        sampling=vf.SamplingConfig(temperature=0.0, max_tokens=96),
    )

    async def run():
        async with env.serving():
            task = next(iter(env.taskset.take(1)))
            slots = list(env.slots(task, n))
            return await asyncio.gather(*(env.run_slot(s, context) for s in slots))

    return [trace for episode in asyncio.run(run()) for trace in episode.traces]


def test_verifiers_rollouts_against_a_served_model_are_scored_by_the_env(served_model):
    traces = _rollouts(_load(), served_model, n=2)
    assert len(traces) == 2
    for trace in traces:
        assert trace.ok, trace.errors
        assert trace.reward == 1.0  # the env scored the memorised answer
        assert trace.metrics["correct"] == 1.0 and trace.metrics["num_tool_calls"] == 1.0
        roles = [m.role for m in trace.messages]
        assert roles == ["system", "user", "assistant", "user", "assistant"]
        assert "<tool_call>" in trace.messages[2].content  # the model's own call
        assert trace.messages[-1].content.strip() == served_model["answer"]


def test_a_conversation_through_verifiers_follows_up_on_the_state_it_left(served_tally):
    """Tally-v0: the user's second turn arrives as the next user message, and the answer to
    it is right only if the first turn's addition is still in the episode's tally."""
    env = _load(max_turns=6, env_id="tally_env:Tally-v0", env_kwargs={})
    (trace,) = _rollouts(env, served_tally, n=1)
    assert trace.ok, trace.errors
    roles = [m.role for m in trace.messages]
    assert roles == ["system", "user", *["assistant", "user"] * 3, "assistant"]
    contents = [m.content.strip() for m in trace.messages[1:]]
    assert contents == [m["content"] for m in served_tally["chat"][1:]]
    assert contents[4] == "Add 3 more." and contents[6] == "tally: 5"  # 2 + 3: state kept
    assert trace.reward == 1.0 and trace.metrics["correct"] == 1.0
    assert trace.metrics["env_turns"] == 4.0 and trace.metrics["num_tool_calls"] == 2.0
    assert trace.info["turn_rewards"] == [0.0, 1.0, 0.0, 1.0]  # each user turn's score


def test_the_agents_max_turns_ends_a_rollout_the_env_has_not(served_model):
    traces = _rollouts(_load(max_turns=1), served_model, n=1)
    (trace,) = traces
    assert trace.stop_condition == "max_turns" and trace.is_truncated
    assert trace.reward == 0.0 and trace.metrics["num_tool_calls"] == 1.0


def test_the_llm_judge_reaches_an_openai_compatible_server(served_model):
    """agentenv.run.judge.OpenAIJudge against the same real server (its model cannot grade: the
    reply has no <score>, so the judge falls back and says why)."""
    from agentenv.run.judge import LLMJudge, OpenAIJudge

    backend = OpenAIJudge(served_model["url"], served_model["model"], max_tokens=8)
    judge = LLMJudge(backend, fallback=0.5)
    (verdict,) = judge.score_batch([("What is 2 + 2?", "4", "4")])
    assert verdict.reply and verdict.reward == 0.5
    assert verdict.error == "no <score>N</score> in the reply"
    assert judge.stats["calls"] == 1
