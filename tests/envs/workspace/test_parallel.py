"""200 episodes in parallel threads, hostile actions mixed in: nothing may be left behind."""

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import agentenv
from envs.workspace import SandboxLimits, _procs, as_actions, solve_task

EPISODES = 200
WORKERS = 16
LIMITS = SandboxLimits(timeout_s=1.0, memory_bytes=256 << 20, max_processes=8)


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


def _episode(env, i: int) -> tuple[float, bool, int | None]:
    env.reset(seed=i)
    uid = env.workspace.uid
    if i % 4 == 0:  # solved properly
        actions = as_actions(solve_task(env.task))
    else:  # two hostile actions, then give up
        actions = [HOSTILE[i % len(HOSTILE)], HOSTILE[(i * 7 + 3) % len(HOSTILE)]]
        actions.append("<answer>done</answer>")
    for action in actions:
        _, reward, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            return float(reward), i % 4 == 0, uid
    raise AssertionError(f"episode {i} did not end")


def test_200_parallel_episodes_with_hostile_actions_leave_nothing_behind(mode, children):
    start = time.monotonic()
    envs = [
        agentenv.make("Workspace-v0", sandbox=mode, limits=LIMITS, num_tasks=64)
        for _ in range(WORKERS)
    ]
    local = threading.local()
    free = list(envs)
    lock = threading.Lock()

    def run(i: int):
        if not hasattr(local, "env"):
            with lock:
                local.env = free.pop()
        return _episode(local.env, i)

    try:
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            results = list(pool.map(run, range(EPISODES)))
    finally:
        for env in envs:
            env.close()
    elapsed = time.monotonic() - start
    solved = [reward for reward, scripted, _ in results if scripted]
    assert len(results) == EPISODES and solved and all(r == 1.0 for r in solved)
    assert not os.path.exists("/tmp/agentenv-parallel-escape")
    assert not children()
    for _, _, uid in results:
        if uid is not None:
            assert _procs.live_pids_of_uid(uid) == [], uid
    assert elapsed < 60, f"200 episodes took {elapsed:.1f} s"
