"""agentenv envs behind OpenEnv servers (``agentenv serve``), driven by OpenEnv's own client,
and OpenEnv servers (ours and another) used as agentenv envs, down to GRPO training."""

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip(
    "openenv.core", reason="OpenEnv is not installed: pip install 'agentenv[openenv]'"
)

import openenv_servers as servers  # noqa: E402 - also registers CoinCalculator-v0
from openenv.core import GenericEnvClient  # noqa: E402

import agentenv  # noqa: E402
from agentenv.errors import AgentEnvError, InvalidOptionError  # noqa: E402
from agentenv.integrations import openenv as openenv_integration  # noqa: E402
from agentenv.run.tracking import read_metrics  # noqa: E402

ENV = {"source": "word_problems", "prompt_style": "compact"}
WORKSPACE = {"sandbox": "rlimit", "num_tasks": 4}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """The Workspace server's TMPDIR, where each session's sandbox folder lives."""
    return tmp_path_factory.mktemp("scratch")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, scratch):
    log = tmp_path_factory.mktemp("serve") / "workspace.log"
    environ = {"TMPDIR": str(scratch)}
    with servers.serve("Workspace-v0", log, env_kwargs=WORKSPACE, env=environ) as url:
        yield url


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "faulty.log"
    with servers.serve("FaultyCalculator-v0", log, flags=("--step-timeout-s", "0.5")) as url:
        yield url


@pytest.fixture(scope="module")
def calculator(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "calculator.log"
    with servers.serve("Calculator-v0", log, env_kwargs=ENV) as url:
        yield url


TOKEN = "s3cret-for-the-tests"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """Calculator-v0 served with ``--token``, as it would be on 0.0.0.0 (here on loopback)."""
    log = tmp_path_factory.mktemp("serve") / "guarded.log"
    with servers.serve("Calculator-v0", log, env_kwargs=ENV, flags=("--token", TOKEN)) as url:
        yield url


def session(url):
    return GenericEnvClient(base_url=url).sync()


def test_openenv_client_plays_an_episode_on_our_server(calculator):
    local = agentenv.make("Calculator-v0", **ENV).unwrapped
    local_obs, _ = local.reset(options={"task_id": 3})
    gold = local.task.answer
    with session(calculator) as env:
        result = env.reset(task_id=3)
        assert result.observation["messages"] == local_obs
        assert result.observation["info"]["task_id"] == 3 and not result.done

        result = env.step({"tool": "calculator", "arguments": {"expression": "6*7"}})
        assert result.observation["messages"] == [{"role": "tool", "content": "42"}]
        assert (result.reward, result.done, result.observation["correct"]) == (0.0, False, None)
        state = env.state()
        assert (state["step_count"], state["task_id"], state["done"]) == (1, 3, False)

        result = env.step({"answer": str(gold)})
        assert (result.reward, result.done, result.observation["correct"]) == (1.0, True, True)
        assert result.observation["info"]["stop_reason"] == "answer"
        assert env.state()["total_reward"] == 1.0

        with pytest.raises(RuntimeError, match="call reset\\(\\) first"):
            env.step({"answer": "1"})  # the episode is over


def test_text_actions_step_exactly_as_the_local_env(calculator):
    actions = [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>',
        "no call here",
        "<answer>12</answer>",
    ]
    local = agentenv.make("Calculator-v0", split="test", **ENV)
    expected = [local.reset(seed=5, options={"task_id": 7})[0]]
    expected += [local.step(a)[:3] for a in actions]
    with session(calculator) as env:
        got = [env.reset(seed=5, task_id=7, split="test").observation["messages"]]
        for action in actions:
            r = env.step({"text": action})
            got.append((r.observation["messages"], r.reward, r.done))
    assert got == expected


def test_bad_actions_and_resets_are_errors_that_name_the_fix(calculator):
    with session(calculator) as env:
        env.reset(task_id=0)
        with pytest.raises(RuntimeError, match="exactly one of text, tool or answer"):
            env.step({"text": "x", "answer": "1"})
        with pytest.raises(RuntimeError, match="unknown tool 'search'.*\\['calculator'\\]"):
            env.step({"tool": "search", "arguments": {"query": "x"}})
        with pytest.raises(RuntimeError, match="task_id'\\] must be an int in \\[0, "):
            env.reset(task_id=10**9)
        with pytest.raises(RuntimeError, match="unknown reset argument.*'colour'"):
            env.reset(colour="red")
        assert env.reset(task_id=1).observation["info"]["task_id"] == 1  # session still fine


def test_sixteen_concurrent_workspace_sessions_share_no_files(workspace, scratch):
    listings, errors = {}, []

    def play(i):
        try:
            with session(workspace) as env:
                env.reset(task_id=0)
                wrote = env.step(
                    {
                        "tool": "write_file",
                        "arguments": {"path": f"mine_{i}.txt", "content": "x"},
                    }
                )
                assert "error" not in wrote.observation["messages"][0]["content"].lower()
                time.sleep(0.5)  # every session has written before any lists
                listed = env.step({"tool": "list_files", "arguments": {}})
                listings[i] = listed.observation["messages"][0]["content"]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"session {i}: {exc!r}")

    threads = [threading.Thread(target=play, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and len(listings) == 16
    for i, listing in listings.items():
        seen = {j for j in range(16) if f"mine_{j}.txt" in listing}
        assert seen == {i}, f"session {i} sees {sorted(seen)}"
    deadline = time.monotonic() + 30  # closed sessions leave no sandbox behind
    while any(p.name.startswith("agentenv-ws-") for p in scratch.iterdir()):
        assert time.monotonic() < deadline, sorted(p.name for p in scratch.iterdir())
        time.sleep(0.1)


def test_a_killed_client_session_removes_its_sandbox(workspace, scratch):
    def sandboxes():
        return {p for p in scratch.iterdir() if p.name.startswith("agentenv-ws-")}

    before = sandboxes()
    client = subprocess.Popen(
        [sys.executable, "-c", (
            "import time\n"
            "from openenv.core import GenericEnvClient\n"
            f"env = GenericEnvClient(base_url={workspace!r}).sync()\n"
            "env.reset(task_id=0)\n"
            "print('ready', flush=True)\n"
            "time.sleep(600)\n"
        )],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert client.stdout.readline().strip() == "ready"
    (mine,) = sandboxes() - before  # the session's sandbox, mid-episode
    os.kill(client.pid, signal.SIGKILL)
    client.wait()
    deadline = time.monotonic() + 30
    while mine.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not mine.exists()


def test_a_slow_step_ends_its_episode_as_timeout_and_the_session_goes_on(faulty):
    with session(faulty) as env:
        env.reset(task_id=0)
        started = time.monotonic()
        result = env.step({"text": "sleep"})
        assert time.monotonic() - started < servers.SLOW_STEP_S
        assert (result.done, result.reward, result.observation["correct"]) == (True, 0.0, False)
        assert result.observation["info"]["stop_reason"] == "timeout"
        assert env.reset(task_id=1).observation["info"]["task_id"] == 1  # a fresh env
        assert not env.step({"text": "no call"}).done  # and it steps

    client = agentenv.make("OpenEnv-v0", base_url=faulty)
    client.reset(options={"task_id": 0})
    with pytest.raises(AgentEnvError, match="ran past 0.5 s"):
        client.step("sleep")  # collect() ends the episode as env_error
    client.close()


def test_a_step_that_raises_ends_only_its_episode(faulty):
    with session(faulty) as env:
        env.reset(task_id=0)
        result = env.step({"text": "raise"})
        assert result.done and result.observation["info"]["stop_reason"] == "env_error"
        assert "the tool's backend is down" in result.observation["info"]["error"]
        assert env.reset(task_id=2).observation["info"]["task_id"] == 2


def test_agentenv_client_env_is_the_served_env(calculator):
    remote = agentenv.make("OpenEnv-v0", base_url=calculator, split="test")
    local = agentenv.make("Calculator-v0", split="test", **ENV)
    try:
        inner = remote.unwrapped
        assert inner.num_tasks == local.unwrapped.num_tasks
        assert inner.stop_strings == local.unwrapped.stop_strings
        assert (
            remote.reset(seed=1, options={"task_id": 4})[0]
            == local.reset(seed=1, options={"task_id": 4})[0]
        )
        gold = local.unwrapped.task.answer
        for action in ['<tool_call>{"name": "calculator", "arguments": {}}</tool_call>',
                       f"<answer>{gold}</answer>"]:  # fmt: skip
            got, want = remote.step(action), local.step(action)
            assert got[:4] == want[:4] and got[4].get("correct") == want[4].get("correct")
    finally:
        remote.close()
        local.close()


def test_client_env_rejects_a_bad_address_before_connecting():
    with pytest.raises(InvalidOptionError, match="agentenv serve ENV_ID --port 8000"):
        agentenv.make("OpenEnv-v0", base_url="localhost:8000")
    with pytest.raises(AgentEnvError, match="no OpenEnv server answers at http://127.0.0.1:9"):
        agentenv.make("OpenEnv-v0", base_url="http://127.0.0.1:9")


def test_client_env_on_an_openenv_server_that_is_not_agentenvs(tmp_path):
    with servers.serve_foreign(tmp_path / "echo.log") as url:
        with pytest.raises(InvalidOptionError, match="not an agentenv server.*num_tasks"):
            agentenv.make("OpenEnv-v0", base_url=url)
        with pytest.raises(InvalidOptionError, match="not an agentenv server.*agentenv serve"):
            openenv_integration.environment_factory(url)  # TRL needs the tool schemas
        env = agentenv.make("OpenEnv-v0", base_url=url, action_field="message", num_tasks=5)
        try:
            obs, info = env.reset(options={"task_id": 3})
            assert obs == [{"role": "user", "content": "Say the number 3."}]
            obs, reward, terminated, truncated, _ = env.step("It is 3")
            assert obs == [{"role": "user", "content": "you said It is 3"}]
            assert (reward, terminated, truncated) == (1.0, True, False)
        finally:
            env.close()


def test_grpo_trains_on_a_remote_env_exactly_as_on_the_local_one(tiny_model_dir, tmp_path):
    """Same seed, same tokens, masks, rewards, advantages and losses, local or served."""
    from agentenv.run.config import TrainConfig
    from agentenv.run.train import train

    def run(env_id, env_kwargs, out):
        config = TrainConfig(
            model=tiny_model_dir,
            env_id=env_id,
            env_kwargs=env_kwargs,
            steps=2,
            batch_size=2,
            rollout={
                "group_size": 4,
                "max_turns": 2,
                "max_episode_tokens": 256,
                "sampling": {"max_new_tokens": 6},
            },  # fmt: skip
            eval_tasks=2,
            save_every=2,
            log_episodes=8,
            output_dir=str(tmp_path / out),
            grpo={"learning_rate": 1e-3},
        )
        run_dir = train(config=config)
        episodes = []
        for step in (1, 2):
            lines = (run_dir / "episodes" / f"step_{step:06d}.jsonl").read_text().splitlines()
            keep = ("input_ids", "action_mask", "reward", "advantage", "stop_reason")
            episodes += [{k: json.loads(line)[k] for k in keep} for line in lines]
        return read_metrics(run_dir), episodes

    with servers.serve("CoinCalculator-v0", tmp_path / "coin.log", env_kwargs=ENV) as url:
        remote, remote_episodes = run("OpenEnv-v0", {"base_url": url}, "remote")
    local, local_episodes = run("CoinCalculator-v0", ENV, "local")
    assert remote_episodes == local_episodes and len(local_episodes) == 16
    assert {e["reward"] for e in local_episodes} == {0.0, 1.0}  # something to learn from
    keys = ["step", "loss", "grad_norm", "rewards/mean", "rollout/tokens", "eval/mean_reward"]
    assert [r["step"] for r in remote] == [0, 1, 2, 2]
    assert [{k: r.get(k) for k in keys} for r in remote] == [
        {k: r.get(k) for k in keys} for r in local
    ]
    assert any(r.get("loss") for r in local)  # a real update, not all zeros


def test_trl_tool_methods_of_a_served_env_have_the_local_schemas(workspace):
    from transformers.utils import get_json_schema

    from agentenv.integrations import trl

    remote = openenv_integration.environment_factory(workspace)
    local = trl.environment_factory("Workspace-v0", **WORKSPACE)
    names = [t.name for t in agentenv.make("Workspace-v0", **WORKSPACE).unwrapped.tools]
    assert len(names) >= 4
    for name in names:
        assert get_json_schema(getattr(remote, name)) == get_json_schema(getattr(local, name))


def test_trl_grpo_trainer_runs_a_step_on_a_served_env(calculator, tokenizer, tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed: pip install 'agentenv[trl]'")
    from trl_steps import memorized_policy, train_one_step

    from agentenv.integrations import trl

    tokenizer = trl.tool_chat_template(copy.deepcopy(tokenizer))  # the fixture is shared
    rows = trl.dataset("Calculator-v0", num_tasks=1, **ENV)
    gold = agentenv.make("Calculator-v0", **ENV).unwrapped.get_task(0).answer
    turns = [("calculator", {"expression": f"{gold}+0"}), f"<answer>{gold}</answer>"]
    local = trl.environment_factory("Calculator-v0", **ENV)
    model = memorized_policy(tokenizer, local, rows[0], turns)
    trainer = train_one_step(
        model, tokenizer, openenv_integration.environment_factory(calculator), rows, tmp_path
    )

    log = trainer.state.log_history[0]
    assert trainer.state.global_step == 1
    assert [e._task_id for e in trainer.environments] == [0, 0]
    assert [e._tool_calls for e in trainer.environments] == [1, 1]  # TRL called the server
    assert log["tools/call_frequency"] > 0 and log["tools/failure_frequency"] == 0
    assert log["rewards/reward_func/mean"] == 1.0  # the served env's reward reached TRL


def _http_status(url, token=None, method="GET"):
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    headers["Content-Type"] = "application/json"
    data = b"{}" if method == "POST" else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_server_with_a_token_refuses_requests_without_it(guarded):
    info = guarded + openenv_integration.INFO_ROUTE
    assert _http_status(guarded + "/health") == 200  # a load balancer's probe stays open
    assert _http_status(info) == 401
    assert _http_status(info, token="wrong") == 401
    assert _http_status(info, token=TOKEN) == 200
    assert _http_status(guarded + "/reset", method="POST") == 401
    assert _http_status(guarded + "/reset", token=TOKEN, method="POST") == 200
    with pytest.raises(ConnectionError, match="403"):  # the WebSocket handshake, refused
        session(guarded).connect()
    with pytest.raises(ConnectionError, match="403"):
        openenv_integration.TokenClient("wrong", base_url=guarded).sync().connect()
    with pytest.raises(AgentEnvError, match="HTTP 401.*AGENTENV_SERVE_TOKEN"):
        agentenv.make("OpenEnv-v0", base_url=guarded)


def test_the_right_token_plays_an_episode_from_the_flag_or_the_variable(guarded, monkeypatch):
    local = agentenv.make("Calculator-v0", **ENV).unwrapped
    local_obs, _ = local.reset(options={"task_id": 2})
    env = agentenv.make("OpenEnv-v0", base_url=guarded, token=TOKEN)
    try:
        assert env.reset(options={"task_id": 2})[0] == local_obs
        _, reward, terminated, _, info = env.step(f"<answer>{local.task.answer}</answer>")
        assert (reward, terminated, info["correct"]) == (1.0, True, True)
    finally:
        env.close()
    monkeypatch.setenv("AGENTENV_SERVE_TOKEN", TOKEN)
    remote = openenv_integration.environment_factory(guarded)()  # TRL's factory, no argument
    remote.reset(task_id=2)
    assert remote.calculator(expression="6*7") == "42"


def test_serve_off_loopback_needs_a_token_and_a_bwrap_sandbox_for_code(monkeypatch, capsys):
    from agentenv.cli import main

    monkeypatch.delenv("AGENTENV_SERVE_TOKEN", raising=False)
    assert main(["serve", "Calculator-v0", "--host", "0.0.0.0"]) == 2
    assert "--host 0.0.0.0 lets other machines reach the env: pass --token" in (
        capsys.readouterr().err
    )
    workspace = ["serve", "Workspace-v0", "--env-kwargs", json.dumps(WORKSPACE)]
    assert main([*workspace, "--host", "0.0.0.0", "--token", "t"]) == 2
    err = capsys.readouterr().err
    assert "'rlimit' sandbox" in err and "--allow-unsandboxed-code" in err
    with pytest.raises(InvalidOptionError, match="rlimit.*bubblewrap"):
        openenv_integration.app("Workspace-v0", require_bwrap=True, **WORKSPACE)
    assert openenv_integration.app("Workspace-v0", require_bwrap=False, **WORKSPACE) is not None
    assert openenv_integration.env_info("Workspace-v0", **WORKSPACE)["sandbox"] == "rlimit"
    assert "sandbox" not in openenv_integration.env_info("Calculator-v0", **ENV)


def test_eight_concurrent_conversation_sessions_each_keep_their_own_cart(tmp_path):
    """The shop example (a ConversationEnv with a stateful toolset) served: 8 sessions at
    once each play a task's demonstration; each gets the follow-up user turn and reward 1,
    as the local env does: no cart is shared between sessions."""
    import importlib.util
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / "examples" / "conversation_env.py"
    spec = importlib.util.spec_from_file_location("conversation_env_openenv", example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    local = module.ShopEnv(split="train")
    demos = []
    for task in range(8):
        local.reset(options={"task_id": task})
        demos.append(local.demonstration(local.task))
    results, errors = {}, []

    def play(i, url):
        try:
            with session(url) as env:
                env.reset(task_id=i)
                for action in demos[i]:
                    r = env.step({"text": action})
                    time.sleep(0.05)  # interleave the sessions' steps
                results[i] = (r.reward, r.done)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"session {i}: {exc!r}")

    with servers.serve("examples.conversation_env:Shop-v0", tmp_path / "shop.log") as url:
        threads = [threading.Thread(target=play, args=(i, url)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert errors == [] and results == {i: (1.0, True) for i in range(8)}
