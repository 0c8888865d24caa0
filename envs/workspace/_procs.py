"""Finding and killing sandboxed processes through ``/proc`` (Linux only).

A sandbox run is found three ways: its process group (``killpg``), its session (for
code that changed its process group) and, when the host is root, its private uid. The
uid is the reliable one: ``kill(-1, SIGKILL)`` issued *as that uid* reaches every
process of the uid in one atomic sweep (the kernel holds the task list while it
signals, so a fork bomb cannot outrun it), wherever the processes moved.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from pathlib import Path


@functools.cache
def boot_source() -> str:
    """Source of :mod:`envs.workspace._boot`, passed to ``python -c``."""
    return Path(__file__).with_name("_boot.py").read_text()


def _status_fields(pid: str) -> tuple[str, int, int] | None:
    """``(state letter, real uid, threads)`` of ``pid`` from ``/proc/<pid>/status``."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            data = f.read(2048)
        state = data[data.index(b"\nState:") + 8 : data.index(b"\nState:") + 9]
        at = data.index(b"\nUid:") + 5
        uid = int(data[at : data.index(b"\t", at + 1)])
        at = data.find(b"\nThreads:")
        threads = int(data[at + 9 : data.index(b"\n", at + 1)]) if at >= 0 else 1
    except (OSError, ValueError):  # gone, unreadable, or an unexpected layout
        return None
    return state.decode("ascii", "replace"), uid, threads


def _pids() -> list[str]:
    try:
        return [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:  # pragma: no cover - no /proc
        return []


def live_pids_of_uid(uid: int) -> list[int]:
    """Pids whose real uid is ``uid``, zombies excluded."""
    found = []
    for pid in _pids():
        fields = _status_fields(pid)
        if fields and fields[1] == uid and fields[0] != "Z":
            found.append(int(pid))
    return found


def count_tasks_of_uid(uid: int) -> int:
    """Processes and threads of real uid ``uid`` (what ``RLIMIT_NPROC`` counts)."""
    return sum(f[2] for f in map(_status_fields, _pids()) if f and f[1] == uid)


def session_pids(sid: int) -> list[int]:
    """Live pids in session ``sid``."""
    found = []
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(pid))
    return found


def wait_gone(sid: int, timeout_s: float = 5.0) -> bool:
    """Wait until session ``sid`` has no live process; ``False`` if some remain."""
    deadline = time.monotonic() + timeout_s
    while session_pids(sid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid``; a missing group is fine."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_session(sid: int, rounds: int = 5) -> None:
    """SIGKILL every process of session ``sid`` (for hosts that cannot switch uid)."""
    for _ in range(rounds):
        pids = [p for p in session_pids(sid) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)


def kill_uid(python: str, uid: int, rounds: int = 10) -> int:
    """Kill every process of ``uid`` by running ``kill(-1, SIGKILL)`` as that uid.

    Only spawns the killer when a live process of the uid exists. Needs root.

    Returns:
        How many live processes were found at the first look.
    """
    first = -1
    argv = [python, "-I", "-S", "-c", boot_source(), "action=kill", f"uid={uid}", "--"]
    for attempt in range(rounds):
        live = live_pids_of_uid(uid)
        if first < 0:
            first = len(live)
        if not live:
            return first
        subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
            check=False,
            timeout=30,
        )
        time.sleep(0.002 * attempt)
    return first
