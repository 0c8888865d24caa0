"""agentenv envs through verifiers' own loader and rollouts, against a real local server.

The server is ``transformers serve`` (an OpenAI-compatible HTTP server) on 127.0.0.1,
serving a tiny model that learned one Calculator solution by heart (tests/helpers/
memorized.py): verifiers' harness calls it, the env runs the calculator, and the reward
is the env's.
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


def _load(num_tasks: int = 1, max_turns: int = 5):
    config = AgentEnvEnvConfig(
        taskset={
            "id": TASKSET,
            "env_id": "Calculator-v0",
            "num_tasks": num_tasks,
            "env_kwargs": CALC,
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


@pytest.fixture(scope="module")
def served_model(tokenizer, tmp_path_factory):
    """``transformers serve`` on a free local port with a model that solves test task 0."""
    from agentenv.rollout.episode import ChatFormat

    exe = console_script("transformers")
    if exe is None:
        pytest.skip("the `transformers` command is not installed (beside python or on PATH)")
    try:
        import fastapi  # noqa: F401
    except ImportError:
        pytest.skip("transformers serve needs fastapi: pip install 'agentenv[verifiers]'")
    env = make("Calculator-v0", split="test", **CALC)
    opening, _ = env.reset(options={"task_id": 0})
    call, answer = env.unwrapped.demonstration(env.unwrapped.task)
    result, *_ = env.step(call)
    fmt = ChatFormat(tokenizer)
    prompt = fmt.render(opening, add_generation_prompt=True)
    chat = [
        *opening,
        {"role": "assistant", "content": call},
        {"role": "user", "content": result[0]["content"]},
        {"role": "assistant", "content": answer},
    ]
    model = memorize(tokenizer, fmt.render(chat), prompt)
    folder = tmp_path_factory.mktemp("served") / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    port = _free_port()
    log = open(folder.parent / "serve.log", "w")  # noqa: SIM115 - closed below
    command = [exe, "serve", str(folder), "--device", "cpu"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
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
                    text = (folder.parent / "serve.log").read_text()[-2000:]
                    pytest.fail(f"transformers serve did not start:\n{text}")
                time.sleep(0.5)
        yield {"url": f"http://127.0.0.1:{port}/v1", "model": str(folder), "answer": answer}
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


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
