"""The verifiers plugin id for agentenv envs: ``agentenv-verifiers``.

verifiers (>= 0.4) loads a taskset by a top-level module name, so this module re-exports
:mod:`agentenv.integrations.verifiers` (one Taskset, one Env, one Harness in ``__all__``)::

    vf-eval agentenv-verifiers --env.taskset.env-id Calculator-v0 -m MODEL --client.base-url URL
"""

from agentenv.integrations.verifiers import *  # noqa: F403
from agentenv.integrations.verifiers import __all__  # noqa: F401
