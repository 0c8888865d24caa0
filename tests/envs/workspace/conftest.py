"""Fixtures of the Workspace env tests: sandbox modes, small limits, and a leak check.

Every test here runs under ``no_leftovers`` (autouse): afterwards no new
``agentenv-ws-*`` folder may exist and no process may be left -- neither a child of
this process nor any process of a private uid a workspace used during the test.
Workspaces of a test session live in a private temporary folder (``session_tempdir``),
so a Workspace env used elsewhere on the machine meanwhile does not trip the check.
Tests of the ``bwrap`` mode skip where bubblewrap is missing or not permitted; the
``rlimit`` mode always runs.
"""

from __future__ import annotations

import gc
import glob
import os
import shutil
import tempfile
import time

import psutil
import pytest

import agentenv
from envs.workspace import (
    SandboxLimits,
    SandboxUnavailableError,
    Workspace,
    _procs,
    detect_backend,
)
from envs.workspace import workspace as workspace_module

MODES = ("rlimit", "bwrap")
# Small limits keep the hostile tests fast and gentle on a shared 2-core machine.
SMALL = SandboxLimits(
    timeout_s=2.0,
    memory_bytes=256 << 20,
    file_size_bytes=4 << 20,
    max_processes=12,
    max_open_files=64,
    max_output_bytes=16 << 10,
)


def backend_or_skip(mode: str):
    """The backend for ``mode``; skips the test when bwrap cannot run here."""
    try:
        return detect_backend(mode)
    except SandboxUnavailableError as exc:
        pytest.skip(f"{mode} sandbox unavailable here: {exc}")


@pytest.fixture(params=MODES)
def mode(request) -> str:
    """Each sandbox mode in turn (bwrap skipped where unavailable)."""
    backend_or_skip(request.param)
    return request.param


@pytest.fixture
def small() -> SandboxLimits:
    """Small sandbox limits (2 s, 256 MiB, 12 processes) for fast hostile tests."""
    return SMALL


@pytest.fixture
def make_workspace():
    """Factory ``make_workspace(mode, files=None, **kwargs)``; closes them after the test."""
    made: list[Workspace] = []

    def make(mode: str, files=None, **kwargs) -> Workspace:
        kwargs.setdefault("limits", SMALL)
        made.append(Workspace(files, backend=backend_or_skip(mode), **kwargs))
        return made[-1]

    yield make
    for ws in made:
        ws.close()


@pytest.fixture
def children():
    """``children()`` -> live (non-zombie) descendants of this test process."""
    return live_children


@pytest.fixture(autouse=True, scope="session")
def registered():
    """Register Workspace-v0 if the registry does not ship it yet."""
    if agentenv.env.registration.full_id("Workspace-v0") not in agentenv.registry():
        agentenv.register("Workspace-v0", "envs.workspace:WorkspaceEnv", override=True)
    yield


@pytest.fixture
def used_uids(monkeypatch) -> list[int]:
    """Private uids handed to workspaces during the test."""
    uids: list[int] = []
    real = workspace_module.allocate_uid

    def record() -> int:
        uid = real()
        uids.append(uid)
        return uid

    monkeypatch.setattr(workspace_module, "allocate_uid", record)
    return uids


@pytest.fixture(scope="session", autouse=True)
def session_tempdir():
    """Point ``tempfile`` (and so every workspace of this session) at a private folder."""
    path = tempfile.mkdtemp(prefix="agentenv-tests-")
    os.chmod(path, 0o711)  # like /tmp for the sandbox's uids: traverse, not list
    saved = tempfile.tempdir
    tempfile.tempdir = path
    yield path
    tempfile.tempdir = saved
    shutil.rmtree(path, ignore_errors=True)


def _workspace_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "agentenv-ws-*")))


def live_children() -> list[psutil.Process]:
    """Live (non-zombie) descendants of this test process."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.fixture(autouse=True)
def no_leftovers(used_uids):
    """Fail the test if it leaves a workspace folder or a process behind."""
    before = _workspace_dirs()
    yield
    deadline = time.monotonic() + 3.0
    collected = False
    while True:
        dirs = sorted(_workspace_dirs() - before)
        procs = live_children()
        by_uid = {uid: _procs.live_pids_of_uid(uid) for uid in used_uids}
        by_uid = {uid: pids for uid, pids in by_uid.items() if pids}
        if not (dirs or procs or by_uid) or time.monotonic() > deadline:
            break
        if not collected:  # an env dropped without close() goes when it is collected; a
            gc.collect()  # collection costs 0.6 s late in the suite, so only when needed
            collected = True
        time.sleep(0.05)
    assert not dirs, f"workspace folders left behind: {dirs}"
    assert not procs, f"child processes left behind: {procs}"
    assert not by_uid, f"sandbox processes left behind (uid: pids): {by_uid}"
