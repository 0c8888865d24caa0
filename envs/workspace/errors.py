"""Errors of the Workspace env.

The :class:`~agentenv.errors.ToolError` subclasses are raised inside tool calls; the
executor turns them into ``Error: ...`` observations and counts them by ``kind`` in
``info["tool_errors"]``. :class:`SandboxUnavailableError` is raised to the *user*
(at construction) when the requested sandbox cannot run on this machine.
"""

from __future__ import annotations

from agentenv.errors import AgentEnvError, ToolError


class PathError(ToolError, ValueError):
    """A path is outside the workspace, malformed, missing or of the wrong type."""

    kind = "path"


class WorkspaceLimitError(ToolError):
    """A file is too large, the workspace holds too many files, or a quota was exceeded."""

    kind = "limit"


class SandboxError(ToolError):
    """Code run in the sandbox was stopped by a limit (wall clock, CPU, quota, signal)."""

    kind = "sandbox"


class SandboxUnavailableError(AgentEnvError, RuntimeError):
    """The requested sandbox mode cannot run here (e.g. ``bwrap`` missing or not permitted)."""
