"""Workspace env: file tasks in a fresh sandboxed folder per episode (``agentenv/Workspace-v0``).

See :class:`~envs.workspace.env.WorkspaceEnv` for the environment,
:mod:`envs.workspace.sandbox` for how code is isolated, and
:mod:`envs.workspace.tasks` for the task families and their checkers.
"""

from envs.workspace.backend import BWRAP_INSTALL, Backend, allocate_uid
from envs.workspace.env import WorkspaceEnv, describe_run
from envs.workspace.errors import (
    PathError,
    SandboxError,
    SandboxUnavailableError,
    WorkspaceLimitError,
)
from envs.workspace.paths import FileLimits, resolve_path
from envs.workspace.sandbox import RunResult, Sandbox, SandboxLimits, detect_backend
from envs.workspace.tasks import (
    LEVELS,
    CheckResult,
    as_actions,
    check_task,
    family_names,
    load_tasks,
    solve_task,
    split_of,
)
from envs.workspace.workspace import Workspace

__all__ = [
    "BWRAP_INSTALL",
    "LEVELS",
    "Backend",
    "CheckResult",
    "FileLimits",
    "PathError",
    "RunResult",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxUnavailableError",
    "Workspace",
    "WorkspaceEnv",
    "WorkspaceLimitError",
    "allocate_uid",
    "as_actions",
    "check_task",
    "describe_run",
    "detect_backend",
    "family_names",
    "load_tasks",
    "resolve_path",
    "solve_task",
    "split_of",
]
