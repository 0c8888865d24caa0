"""The client side: an OpenEnv server as an agentenv env (``OpenEnv-v0``)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any, SupportsFloat

from openenv.core import GenericEnvClient
from websockets.asyncio.client import connect as ws_connect

from agentenv.env.core import TextEnv
from agentenv.env.spaces import Message
from agentenv.errors import AgentEnvError, InvalidOptionError
from agentenv.integrations.openenv.server import INFO_ROUTE, TOKEN_ENV_VAR


def resolve_token(token: str | None) -> str | None:
    """``token``, else ``$AGENTENV_SERVE_TOKEN``, else ``None`` (a server without one)."""
    return token if token is not None else (os.environ.get(TOKEN_ENV_VAR) or None)


def auth_headers(token: str | None) -> dict[str, str]:
    """The header a server started with ``--token`` checks (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def server_info(base_url: str, token: str | None = None) -> dict[str, Any] | None:
    """What an agentenv server's :data:`INFO_ROUTE` answers; ``None`` from another server.

    ``token`` (default ``$AGENTENV_SERVE_TOKEN``) goes as a bearer token.

    Raises:
        AgentEnvError: when nothing answers at ``base_url``, or it refuses the token.
    """
    url = base_url.rstrip("/").replace("ws://", "http://").replace("wss://", "https://")
    request = urllib.request.Request(url + INFO_ROUTE, headers=auth_headers(resolve_token(token)))
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        if exc.code == 401:
            raise AgentEnvError(
                f"{url} refused the request (HTTP 401): it was started with a token; pass "
                f"the same one as token=... or in ${TOKEN_ENV_VAR}"
            ) from exc
        raise AgentEnvError(f"{url}{INFO_ROUTE} answered HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise AgentEnvError(
            f"no OpenEnv server answers at {base_url} ({exc}); start one with "
            "`agentenv serve ENV_ID --port PORT`"
        ) from exc


class TokenClient(GenericEnvClient):
    """OpenEnv's ``GenericEnvClient`` whose WebSocket handshake carries a bearer token
    (openenv-core 0.3's ``connect`` sends no headers; this is its ``connect`` with them)."""

    def __init__(self, token: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._headers = auth_headers(token)

    async def connect(self) -> TokenClient:
        if self._ws is not None:
            return self
        local = any(h in self._ws_url for h in ("://127.0.0.1", "://localhost", "://[::1]"))
        try:
            self._ws = await ws_connect(
                self._ws_url,
                open_timeout=self._connect_timeout,
                max_size=self._max_message_size,
                additional_headers=self._headers,
                **({"proxy": None} if local else {}),  # as OpenEnv's: no proxy to loopback
            )
        except Exception as exc:
            raise ConnectionError(f"Failed to connect to {self._ws_url}: {exc}") from exc
        return self


def _connect(base_url: str, message_timeout_s: float = 300.0, token: str | None = None) -> Any:
    """A connected synchronous OpenEnv session (``GenericEnvClient(...).sync()``), whose
    WebSocket handshake carries ``token`` (default ``$AGENTENV_SERVE_TOKEN``)."""
    token = resolve_token(token)
    kwargs = {"base_url": base_url, "message_timeout_s": message_timeout_s}
    client = GenericEnvClient(**kwargs) if token is None else TokenClient(token, **kwargs)
    session = client.sync()
    session.connect()
    return session


class OpenEnvClientEnv(TextEnv):
    """An OpenEnv server as an agentenv env (``OpenEnv-v0``): one WebSocket session each.

    Against an agentenv server (``agentenv serve``) it is the served env: the same tasks,
    messages, rewards and stop strings; ``reset(options={"task_id": i})`` is task ``i``.
    Against another OpenEnv server, the model's text goes in the action field
    ``action_field``, the observation comes back as one user message (its ``messages``,
    ``text`` or ``prompt`` field if it has one, else its JSON) and task ``i`` of
    ``num_tasks`` is ``reset(seed=i)``.

    Args:
        base_url: The server, e.g. ``"http://127.0.0.1:8000"``.
        split: Which split's tasks (agentenv servers).
        action_field: Field of the server's action that receives the model's text.
        num_tasks: Tasks of a server that is not agentenv's (required there).
        message_timeout_s: Longest wait for one reply of the server.
        token: The server's bearer token (``agentenv serve --token``); default
            ``$AGENTENV_SERVE_TOKEN``, none if unset.
    """

    def __init__(
        self,
        base_url: str = "",
        *,
        split: str = "train",
        action_field: str = "text",
        num_tasks: int | None = None,
        message_timeout_s: float = 300.0,
        token: str | None = None,
        render_mode: str | None = None,
    ):
        super().__init__(split=split, render_mode=render_mode)
        if not base_url.startswith(("http://", "https://", "ws://", "wss://")):
            raise InvalidOptionError(
                f"base_url must be the server's http(s):// or ws(s):// address, got "
                f"{base_url!r}; start one with `agentenv serve ENV_ID --port 8000` and pass "
                "base_url='http://127.0.0.1:8000'"
            )
        self.base_url = base_url.rstrip("/")
        self.action_field = action_field
        self.message_timeout_s = message_timeout_s
        self._token = resolve_token(token)
        self.server_info = server_info(self.base_url, self._token)
        if self.server_info is None and num_tasks is None:
            raise InvalidOptionError(
                f"{self.base_url} is not an agentenv server (no {INFO_ROUTE}): pass num_tasks "
                "(task i is the server's reset(seed=i)) and action_field"
            )
        if num_tasks is not None and num_tasks < 1:
            raise InvalidOptionError(f"num_tasks must be >= 1, got {num_tasks}")
        self._num_tasks = (
            num_tasks if self.server_info is None else self.server_info["num_tasks"][split]
        )
        self._client: Any = None
        self.messages: list[Message] = []

    @property
    def num_tasks(self) -> int:
        return int(self._num_tasks)

    @property
    def stop_strings(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple((self.server_info or {}).get("stop_strings", ()))

    def _session(self) -> Any:
        if self._client is None:
            self._client = _connect(self.base_url, self.message_timeout_s, self._token)
        return self._client

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        task_id = self._pick_task(seed, options)
        if self.server_info is not None:
            result = self._session().reset(seed=seed, task_id=task_id, split=self.split)
        else:
            result = self._session().reset(seed=task_id)
        messages = self._messages(result.observation)
        self.messages = list(messages)
        return messages, {**(result.observation.get("info") or {}), "task_id": task_id}

    def step(self, action: str) -> tuple[list[Message], SupportsFloat, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise InvalidOptionError(f"action must be a str, got {type(action).__name__}")
        result = self._session().step({self.action_field: action})
        observation = result.observation or {}
        messages = self._messages(observation)
        self.messages += [{"role": "assistant", "content": action}, *messages]
        info = dict(observation.get("info") or {})
        if observation.get("correct") is not None:
            info["correct"] = observation["correct"]
        if info.get("stop_reason") in ("timeout", "env_error"):
            raise AgentEnvError(f"the server's env failed: {info.get('error', info)}")
        truncated = result.done and info.get("stop_reason") == "max_turns"
        reward = float(result.reward or 0.0)
        return messages, reward, bool(result.done and not truncated), bool(truncated), info

    def _messages(self, observation: dict[str, Any]) -> list[Message]:
        if isinstance(observation.get("messages"), list):
            return [dict(m) for m in observation["messages"]]
        for key in ("text", "prompt"):
            if isinstance(observation.get(key), str):
                return [{"role": "user", "content": observation[key]}]
        return [{"role": "user", "content": json.dumps(observation, default=str)}]

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in self.messages)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()
