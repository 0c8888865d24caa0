"""One flat error hierarchy for agentenv.

Every error a user can trigger derives from :class:`AgentEnvError` and says what
was wrong and how to fix it ("expected X, got Y; do Z").

Tool failures inside an episode are *not* raised: the executor turns them into an
observation the model can read (see :mod:`agentenv.env.tools`). The tool errors here
are used internally and recorded by type in ``info``.

Errors that belong to one env live with it (``envs/<env>/errors.py``, e.g.
:class:`envs.calculator.errors.CalculatorError`) and subclass the classes here.
"""

from __future__ import annotations


class AgentEnvError(Exception):
    """Base class of every agentenv error."""


class UnknownEnvError(AgentEnvError, KeyError):
    """An environment id is not registered."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class RegistrationError(AgentEnvError):
    """An environment could not be registered (bad id, bad entry point)."""


class InvalidOptionError(AgentEnvError, ValueError):
    """A reset option, split name or constructor argument has a bad value."""


class TaskSourceError(AgentEnvError):
    """A task source (generator, dataset or file) could not be loaded or parsed."""


class EngineError(AgentEnvError, RuntimeError):
    """A generation engine failed while running (e.g. its server stopped answering)."""


class EnvFailureError(AgentEnvError, RuntimeError):
    """Too many of a training step's episodes failed (their env raised or timed out)."""


class CheckpointError(AgentEnvError, OSError):
    """A checkpoint could not be written (a full disk, a read-only folder)."""


class ToolDefinitionError(AgentEnvError, TypeError):
    """A Python function cannot be turned into a tool (missing types/docstring)."""


class ToolError(AgentEnvError):
    """Base of the errors a tool call can produce inside an episode.

    ``kind`` is a short stable tag recorded in ``info`` (e.g. ``"parse"``).
    """

    kind: str = "tool"


class UnknownToolError(ToolError):
    """The action calls a tool the environment does not offer."""

    kind = "unknown_tool"


class ToolArgumentError(ToolError):
    """A tool call has missing, unexpected or mistyped arguments."""

    kind = "arguments"


class ToolTimeoutError(ToolError):
    """The tool ran past its wall-clock timeout."""

    kind = "timeout"


class ModelLoadError(AgentEnvError):
    """A model could not be loaded (missing package, bad path, conversion failed)."""
