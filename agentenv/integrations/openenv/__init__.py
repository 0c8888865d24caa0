"""agentenv envs served as OpenEnv environments, and OpenEnv servers used as agentenv envs.

OpenEnv (``pip install 'agentenv[openenv]'``, PyPI ``openenv-core``) runs an environment as a
server: a WebSocket session per client, each with its own env instance, speaking
``reset`` / ``step`` / ``state``. TRL, SkyRL and verifiers consume such servers.

**Serve** any registered env (bundled or your own) with ``agentenv serve ENV_ID --port N``,
or build the app with :func:`app` and run it under any ASGI server. Each session owns one
agentenv env, closed (a Workspace's sandbox removed) when the session ends, however it ends.
A step is one of (see :class:`AgentEnvAction`):

* ``{"text": "..."}``: the model's whole message, parsed by the env's parser, exactly as
  in agentenv's own loop;
* ``{"tool": "calculator", "arguments": {"expression": "2+2"}}``: one tool call;
* ``{"answer": "4"}``: the final answer, which ends the episode with the env's reward.

Every observation (:class:`AgentEnvObservation`) carries the env's new ``messages``, its
``reward`` and ``done``, ``correct`` once the episode ends, and the env's ``info``
(``task_id``, ``turn``, ``stop_reason``; a field of its own: openenv-core 0.3 sends no
``metadata``). ``reset(seed=, task_id=, split=)``
picks the task. A step that runs longer than the server's ``step_timeout_s`` (or the
request's ``timeout_s``, if shorter) ends the episode with ``stop_reason="timeout"``; a
step that raises ends it with ``stop_reason="env_error"``: as in agentenv's rollouts, the
failure ends one episode, not the server.

**Connect** to a server with :class:`OpenEnvClientEnv`, registered as ``OpenEnv-v0``::

    env = agentenv.make("OpenEnv-v0", base_url="http://127.0.0.1:8000")
    agentenv train OpenEnv-v0 --env-kwargs '{"base_url": "http://127.0.0.1:8000"}'

so agentenv's GRPO trains on a remote env.

**Off this machine** (``--host 0.0.0.0``) ``agentenv serve`` requires a shared secret,
``--token`` or ``$AGENTENV_SERVE_TOKEN``: every request but ``/health`` must carry
``Authorization: Bearer TOKEN`` (:class:`RequireToken`), and :class:`OpenEnvClientEnv` and
:func:`environment_factory` send ``token=`` or the same variable. There it also refuses an
env that runs code outside bubblewrap (Workspace-v0 in ``rlimit`` mode) unless
``--allow-unsandboxed-code``. A server that is not agentenv's works too:
``action_field`` names the action field that receives the model's text and ``num_tasks``
how many seeds make its tasks (task ``i`` is ``reset(seed=i)``).
"""

try:  # every submodule imports OpenEnv; the package runs first and says how to install it
    import openenv.core  # noqa: F401
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        f"agentenv.integrations.openenv needs OpenEnv ({exc}); install it with "
        "`pip install 'agentenv[openenv]'` (PyPI openenv-core)"
    ) from exc

from agentenv.integrations.openenv.client import (  # noqa: E402
    OpenEnvClientEnv,
    TokenClient,
    server_info,
)
from agentenv.integrations.openenv.server import (  # noqa: E402
    INFO_ROUTE,
    AgentEnvAction,
    AgentEnvObservation,
    AgentEnvServer,
    AgentEnvState,
    RequireToken,
    app,
    env_info,
    server_class,
)
from agentenv.integrations.openenv.trl import RemoteEnvironment, environment_factory  # noqa: E402

__all__ = [
    "INFO_ROUTE",
    "AgentEnvAction",
    "AgentEnvObservation",
    "AgentEnvServer",
    "AgentEnvState",
    "OpenEnvClientEnv",
    "RemoteEnvironment",
    "RequireToken",
    "TokenClient",
    "app",
    "env_info",
    "environment_factory",
    "server_class",
    "server_info",
]
