"""TRL's ``GRPOTrainer`` on an env served by ``agentenv serve``: an ``environment_factory``
whose tool methods and reward run on the server."""

from __future__ import annotations

import inspect
import weakref
from typing import Any

from agentenv.errors import InvalidOptionError
from agentenv.integrations.openenv.client import _connect, resolve_token, server_info
from agentenv.integrations.openenv.server import INFO_ROUTE
from agentenv.integrations.trl import AgentEnvironment, class_stem, tool_method

JSON_TYPES: dict[str, type] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "array": list,
    "object": dict,
}


class RemoteEnvironment(AgentEnvironment):
    """A TRL environment whose episode runs on an agentenv server (one session each).

    Tool methods send ``{"tool": name, "arguments": ...}``; :func:`~agentenv.integrations.
    trl.reward_func` sends the last assistant message as ``{"text": ...}``, so the reward is
    the served env's own, counted in the same episode as the tool calls (TRL's
    ``max_tool_calling_iterations`` and the env's ``max_turns`` both apply).
    """

    _base_url: str = ""
    _token: str | None = None

    def _open(self) -> None:
        self._client = _connect(self._base_url, token=self._token)
        self._server_errors = 0  # the served episode's num_tool_errors so far
        weakref.finalize(self, self._client.close)  # TRL never closes its environments

    def _start(self, task_id: int) -> None:
        self._client.reset(task_id=task_id)
        self._server_errors = 0

    def _run(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        try:
            result = self._client.step({"tool": name, "arguments": arguments})
        except RuntimeError as exc:  # e.g. the episode is over: an error, as text
            return f"Error: {exc}", True
        info = result.observation.get("info", {})
        if "error" in info:  # the step timed out or raised: the served episode is over
            return f"Error: {info['error']}", True
        errors = int(info.get("num_tool_errors", self._server_errors))
        failed, self._server_errors = errors > self._server_errors, errors
        return "\n".join(m["content"] for m in result.observation.get("messages", [])), failed

    def _reward(self, text: str) -> tuple[float, dict[str, Any]]:
        try:
            result = self._client.step({"text": text})
        except RuntimeError:  # the episode ended before the answer (max_turns)
            return 0.0, {"correct": False, "answer": None}
        observation = result.observation
        info = {**observation.get("info", {}), "correct": bool(observation.get("correct"))}
        return float(result.reward or 0.0), info


def _schema_params(parameters: dict[str, Any]) -> list[inspect.Parameter]:
    """Typed parameters for a tool's JSON schema (``nullable``: ``| None``), required first.

    The signature only describes the tool to TRL: the method passes on the arguments the
    model gave, so an omitted one takes the tool's own default on the server."""
    properties = parameters.get("properties", {})
    required = [n for n in properties if n in set(parameters.get("required", []))]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [
        inspect.Parameter(n, kind, annotation=JSON_TYPES.get(properties[n].get("type"), str))
        for n in required
    ]
    for n, p in properties.items():
        if n not in required:  # omitted from a call, it takes the server-side default
            annotation: Any = JSON_TYPES.get(p.get("type"), str)
            if p.get("nullable"):
                annotation = annotation | None
            params.append(inspect.Parameter(n, kind, default=None, annotation=annotation))
    return params


def environment_factory(base_url: str, token: str | None = None) -> type[RemoteEnvironment]:
    """TRL's ``environment_factory`` for the env an agentenv server serves at ``base_url``.

    Its methods are the served env's tools, typed from their JSON schemas. Pass
    :func:`agentenv.integrations.trl.reward_func` as the reward and
    :func:`agentenv.integrations.trl.dataset` (same env id and kwargs as the server) as
    the data. ``token`` is the server's (``agentenv serve --token``; default
    ``$AGENTENV_SERVE_TOKEN``).

    Raises:
        AgentEnvError: when no agentenv server answers at ``base_url``, or it refuses the
            token.
    """
    token = resolve_token(token)
    info = server_info(base_url, token)
    if info is None:
        raise InvalidOptionError(
            f"{base_url} is not an agentenv server (no {INFO_ROUTE}); TRL needs its tool "
            "schemas: serve the env with `agentenv serve`"
        )
    reserved = {"reset", "get_reward"}
    namespace: dict[str, Any] = {}
    for schema in info["tools"]:
        name = schema["name"]
        if name in reserved or name.startswith("_"):
            raise InvalidOptionError(
                f"the served tool {name!r} cannot be a TRL tool method: the names "
                f"{sorted(reserved)} and names starting with '_' are not exposed; rename it"
            )
        parameters = schema.get("parameters", {})
        namespace[name] = tool_method(
            name, schema.get("description", ""), parameters, _schema_params(parameters)
        )
    env_id = info["env_id"]
    namespace.update(
        _base_url=base_url,
        _token=token,
        __doc__=f"The agentenv env {env_id} served at {base_url}, as a TRL environment.",
        __module__=__name__,
    )
    return type(f"Remote{class_stem(env_id)}Environment", (RemoteEnvironment,), namespace)
