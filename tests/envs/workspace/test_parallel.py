"""200 episodes in parallel threads, hostile actions mixed in: nothing may be left behind."""

import json
import os
import queue
from concurrent.futures import ThreadPoolExecutor

import agentenv
from envs.workspace import SandboxLimits, _procs, as_actions, solve_task

EPISODES = 200
WORKERS = 16
# Hostile actions get a tight wall clock so the test stays short; the scripted solutions get
# room, because on a loaded 2-core CI box 16 threads of fork bombs and busy loops can delay a
# legitimate `python` start past one second (that is contention, not a sandbox failure).
HOSTILE_LIMITS = SandboxLimits(timeout_s=1.0, memory_bytes=256 << 20, max_processes=8)
SOLVER_LIMITS = SandboxLimits(timeout_s=20.0, memory_bytes=256 << 20, max_processes=8)


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


HOSTILE = [
    call("read_file", path="../../etc/passwd"),
    call("write_file", path="/tmp/agentenv-parallel-escape", content="x"),
    call("run_python", code="import os\nwhile True: os.fork()"),
    call("run_python", code="while True: pass"),
    call("run_python", code="x = []\nwhile True: x.append(bytearray(10**7))"),
    call("run_python", code="import subprocess\nsubprocess.Popen(['sleep', '300'])"),
    call("run", command="sleep 300 & sleep 301 & echo started"),
    call("run_python", code="import os\nos.symlink('/', 'slash')\nos.kill(os.getppid(), 9)"),
    call("read_file", path="slash/etc/shadow"),
    call("run_python", code="print('x' * 10_000_000)"),
]


def _episode(env, i: int) -> tuple[float, bool, int | None, str]:
    env.reset(seed=i)
    uid = env.workspace.uid
    if i % 4 == 0:  # solved properly
        actions = as_actions(solve_task(env.task))
    else:  # two hostile actions, then give up
        actions = [HOSTILE[i % len(HOSTILE)], HOSTILE[(i * 7 + 3) % len(HOSTILE)]]
        actions.append("<answer>done</answer>")
    transcript = []
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        transcript.append(obs[-1]["content"][:300] if obs else "")
        if terminated or truncated:
            return float(reward), i % 4 == 0, uid, " | ".join(transcript)
    raise AssertionError(f"episode {i} did not end")


def test_200_parallel_episodes_with_hostile_actions_leave_nothing_behind(mode, children):
    # scripted-solution envs and hostile envs, each checked out for one episode at a time
    pools = {solver: queue.Queue() for solver in (True, False)}
    envs = []
    for solver, limits in ((True, SOLVER_LIMITS), (False, HOSTILE_LIMITS)):
        for _ in range(WORKERS):
            env = agentenv.make("Workspace-v0", sandbox=mode, limits=limits, num_tasks=64)
            envs.append(env)
            pools[solver].put(env)

    def run(i: int):
        free = pools[i % 4 == 0]
        env = free.get()
        try:
            return _episode(env, i)
        finally:
            free.put(env)

    try:
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            results = list(pool.map(run, range(EPISODES)))
    finally:
        for env in envs:
            env.close()
    assert len(results) == EPISODES
    solved = [(reward, transcript) for reward, scripted, _, transcript in results if scripted]
    assert len(solved) == EPISODES // 4
    failed = [transcript for reward, transcript in solved if reward != 1.0]
    assert not failed, f"{len(failed)} scripted solutions failed, e.g.: {failed[0]}"
    assert not os.path.exists("/tmp/agentenv-parallel-escape")
    assert not children()
    for _, _, uid, _ in results:
        if uid is not None:
            assert _procs.live_pids_of_uid(uid) == [], uid
