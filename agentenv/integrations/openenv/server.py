"""The server side: an agentenv env as an OpenEnv environment (see the package doc)."""

from __future__ import annotations

import hmac
import json
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, ClassVar

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from agentenv.env.core import SPLITS, ToolEnv
from agentenv.env.parsers import ToolCall
from agentenv.env.registration import make
from agentenv.errors import InvalidOptionError
from agentenv.integrations.trl import class_stem

INFO_ROUTE = "/agentenv/info"
"""GET: the served env's id, tools, stop strings and task counts (what a client needs)."""

TOKEN_ENV_VAR = "AGENTENV_SERVE_TOKEN"
"""The environment variable that holds the server's bearer token (server and clients)."""

OPEN_ROUTES = ("/health",)
"""What a server with a token answers without one (a load balancer's probe)."""


class AgentEnvAction(Action):
    """One step: exactly one of ``text``, ``tool`` (with ``arguments``) or ``answer``."""

    text: str | None = Field(
        default=None,
        description="The model's whole message, parsed by the env's parser (tool calls and/or "
        "the final answer), as agentenv's own loop steps.",
    )
    tool: str | None = Field(default=None, description="Name of one tool to call.")
    arguments: dict[str, Any] = Field(
        default_factory=dict, description="The tool's arguments (with `tool`)."
    )
    answer: str | None = Field(
        default=None, description="The final answer: ends the episode with its reward."
    )

    def problem(self) -> str | None:
        """What makes this action invalid, or ``None`` (checked by the server's ``step``: a
        pydantic validator's error would end the client's session in openenv-core 0.3)."""
        given = [k for k in ("text", "tool", "answer") if getattr(self, k) is not None]
        if len(given) != 1:
            return (
                f"an action sets exactly one of text, tool or answer; got {given or 'none'}: "
                'e.g. {"tool": "calculator", "arguments": {"expression": "2+2"}}'
            )
        if self.arguments and self.tool is None:
            return "arguments go with a tool call; set tool too"
        return None


class AgentEnvObservation(Observation):
    """The env's new messages, ``correct`` once the episode is over, and the env's info.

    ``reward`` and ``done`` are OpenEnv's fields.
    """

    messages: list[dict[str, str]] = Field(
        default_factory=list,
        description="reset: the system prompt and the task; step: tool results or feedback.",
    )
    correct: bool | None = Field(default=None, description="Set when the episode ends.")
    info: dict[str, Any] = Field(
        default_factory=dict,
        description="The env's info: task_id, turn, tool-call counts; stop_reason (answer, "
        "max_turns, timeout, env_error) and error when the episode ends.",
    )


class AgentEnvState(State):
    """``episode_id`` and ``step_count`` (OpenEnv's), and where the episode stands."""

    env_id: str = ""
    split: str = "train"
    task_id: int | None = None
    done: bool = True
    total_reward: float = 0.0


class AgentEnvServer(Environment):
    """One OpenEnv session: one agentenv env, made on the first ``reset``.

    :func:`app` makes a subclass per served env that sets the class attributes (OpenEnv
    creates sessions by calling the class with no arguments).
    """

    SUPPORTS_CONCURRENT_SESSIONS: ClassVar[bool] = True  # every instance owns its env
    env_id: ClassVar[str] = ""
    env_kwargs: ClassVar[dict[str, Any]] = {}
    step_timeout_s: ClassVar[float | None] = 60.0

    def __init__(self) -> None:
        super().__init__()
        self._env: Any = None  # the gym-wrapped agentenv env
        self._pool: ThreadPoolExecutor | None = None  # runs steps, so they can time out
        self._state = AgentEnvState(env_id=self.env_id)

    # ---- OpenEnv API ------------------------------------------------------------------
    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        task_id: int | None = None,
        split: str | None = None,
        **kwargs: Any,
    ) -> AgentEnvObservation:
        """Start an episode: task ``task_id`` of ``split`` (default: the served split), or
        one drawn with ``seed``."""
        if kwargs:
            raise InvalidOptionError(
                f"unknown reset argument(s) {sorted(kwargs)}; known: seed, episode_id, "
                "task_id, split"
            )
        split = split or self.env_kwargs.get("split", "train")
        if split not in SPLITS:
            raise InvalidOptionError(f"split must be one of {SPLITS}, got {split!r}")
        if self._env is None or self._env.unwrapped.split != split:
            self._drop_env()
            self._env = make(self.env_id, **{**self.env_kwargs, "split": split})
        options = None if task_id is None else {"task_id": task_id}
        messages, info = self._env.reset(seed=seed, options=options)
        self._state = AgentEnvState(
            episode_id=episode_id,
            env_id=self.env_id,
            split=split,
            task_id=info.get("task_id", task_id),
            done=False,
        )
        return AgentEnvObservation(messages=list(messages), info=_jsonable(info))

    def step(
        self, action: AgentEnvAction, timeout_s: float | None = None, **kwargs: Any
    ) -> AgentEnvObservation:
        """One action; a failed or timed-out step ends the episode (see the module doc)."""
        if self._env is None or self._state.done:
            raise InvalidOptionError(
                "step() before reset() or after the episode ended: call reset() first"
            )
        text = self._text(action)
        limits = [t for t in (timeout_s, self.step_timeout_s) if t]
        limit = min(limits) if limits else None
        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="agentenv-step")
        future: Future = self._pool.submit(self._env.step, text)
        self._state.step_count += 1
        try:
            messages, reward, terminated, truncated, info = future.result(timeout=limit)
        except FutureTimeout:
            self._drop_env(running=future)  # the step may never return: a new env next time
            return self._failed("timeout", f"the step ran past {limit:g} s")
        except Exception as exc:  # noqa: BLE001 - the env's failure ends its episode only
            self._drop_env()
            return self._failed("env_error", f"{type(exc).__name__}: {exc}")
        done = bool(terminated or truncated)
        self._state.done = done
        self._state.total_reward += float(reward)
        info = _jsonable(info)
        if done:
            info["stop_reason"] = "answer" if terminated else "max_turns"
        return AgentEnvObservation(
            messages=list(messages),
            reward=float(reward),
            done=done,
            correct=bool(info.get("correct", False)) if done else None,
            info=info,
        )

    @property
    def state(self) -> AgentEnvState:
        return self._state

    def close(self) -> None:
        """End the session: close its env (a Workspace removes its sandbox)."""
        self._drop_env()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    # ---- helpers ----------------------------------------------------------------------
    def _text(self, action: AgentEnvAction) -> str:
        """The action as the model's text: structured ones through the env's parser."""
        problem = action.problem()
        if problem:
            raise InvalidOptionError(problem)
        if action.text is not None:
            return action.text
        inner = self._env.unwrapped
        format_action = getattr(getattr(inner, "parser", None), "format_action", None)
        if not isinstance(inner, ToolEnv) or format_action is None:
            raise InvalidOptionError(
                f"{self.env_id} takes text actions only (its parser has no format_action); "
                'send {"text": ...}'
            )
        if action.answer is not None:
            return format_action([], action.answer)
        names = [t.name for t in inner.tools]
        if action.tool not in names:
            raise InvalidOptionError(f"unknown tool {action.tool!r}; {self.env_id} has {names}")
        return format_action([ToolCall(action.tool, dict(action.arguments))])

    def _failed(self, stop_reason: str, error: str) -> AgentEnvObservation:
        self._state.done = True
        return AgentEnvObservation(
            done=True,
            reward=0.0,
            correct=False,
            info={"stop_reason": stop_reason, "error": error},
        )

    def _drop_env(self, running: Future | None = None) -> None:
        """Close the env now, or once ``running`` (a step still in its thread) returns."""
        env, self._env = self._env, None
        if env is None:
            return
        if running is None:
            env.close()
        else:
            running.add_done_callback(lambda _: env.close())
            self._pool = None  # its one thread is busy; the next step gets a new one


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` as JSON values (numpy scalars and the like become str)."""
    return json.loads(json.dumps(info, default=str))


def server_class(
    env_id: str, *, step_timeout_s: float | None = 60.0, **env_kwargs: Any
) -> type[AgentEnvServer]:
    """The :class:`AgentEnvServer` subclass that serves ``env_id`` with ``env_kwargs``.

    Makes no env: :func:`app` checks the id and arguments first (:func:`env_info` makes
    the env of each split), before any server starts.
    """
    if step_timeout_s is not None and step_timeout_s <= 0:
        raise InvalidOptionError(f"step_timeout_s must be > 0 or None, got {step_timeout_s}")
    return type(
        f"{class_stem(env_id)}Server",
        (AgentEnvServer,),
        {
            "env_id": env_id,
            "env_kwargs": dict(env_kwargs),
            "step_timeout_s": step_timeout_s,
            "__module__": __name__,
        },
    )


def env_info(env_id: str, **env_kwargs: Any) -> dict[str, Any]:
    """What :data:`INFO_ROUTE` answers: id, tools, stop strings and tasks per split, and
    ``sandbox`` (``"bwrap"`` or ``"rlimit"``) for an env that runs code."""
    info: dict[str, Any] = {"env_id": env_id, "num_tasks": {}, "tools": [], "stop_strings": []}
    for split in SPLITS:
        env = make(env_id, **{**env_kwargs, "split": split})
        try:
            inner = env.unwrapped
            info["num_tasks"][split] = int(inner.num_tasks)
            info["stop_strings"] = list(getattr(inner, "stop_strings", ()) or ())
            if isinstance(inner, ToolEnv):
                info["tools"] = [t.schema["function"] for t in inner.tools]
            if getattr(inner, "sandbox_mode", None) is not None:  # it runs the model's code
                info["sandbox"] = str(inner.sandbox_mode)
        finally:
            env.close()
    return info


class RequireToken:
    """ASGI middleware: HTTP requests and WebSocket handshakes must carry
    ``Authorization: Bearer <token>``; others get HTTP 401 (a WebSocket's handshake, 403).

    :data:`OPEN_ROUTES` stay open. The comparison takes the same time whatever matches.
    """

    def __init__(self, app: Any, token: str):
        if not token:
            raise InvalidOptionError("the server's token is empty; pass a secret")
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # closing before accept refuses the handshake
            await send({"type": "websocket.close", "code": 1008})
            return None
        body = json.dumps(
            {
                "detail": "this agentenv server needs its token: send 'Authorization: Bearer "
                f"TOKEN' (agentenv's clients send ${TOKEN_ENV_VAR} or token=...)"
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return None


def app(
    env_id: str,
    *,
    max_sessions: int = 64,
    step_timeout_s: float | None = 60.0,
    token: str | None = None,
    require_bwrap: bool = False,
    **env_kwargs: Any,
) -> Any:
    """OpenEnv's FastAPI app serving ``env_id``: ``/ws`` sessions (one env each, at most
    ``max_sessions`` at once), OpenEnv's ``/reset``, ``/step``, ``/state``, ``/schema``,
    ``/health``, and :data:`INFO_ROUTE`.

    Args:
        env_id: A registered env id; ``env_kwargs`` go to :func:`agentenv.make`
            (``split`` is the default split of ``reset``).
        max_sessions: Most concurrent sessions (envs); more are refused by OpenEnv.
        step_timeout_s: Longest a step may run before its episode ends as ``timeout``.
        token: When set, every route but ``/health`` needs ``Authorization: Bearer token``
            (:class:`RequireToken`). ``agentenv serve`` requires one off loopback.
        require_bwrap: Refuse an env that runs code (one with a ``sandbox_mode``, like
            Workspace-v0) unless its sandbox is ``bwrap``; ``agentenv serve`` sets it off
            loopback.

    Raises:
        InvalidOptionError: a bad argument, or ``require_bwrap`` and a code-running env
            whose sandbox is not bwrap; before any server starts.
    """
    if max_sessions < 1:
        raise InvalidOptionError(f"max_sessions must be >= 1, got {max_sessions}")
    split = env_kwargs.get("split", "train")
    if split not in SPLITS:
        raise InvalidOptionError(f"split must be one of {SPLITS}, got {split!r}")
    # makes the env of each split: a bad id or argument fails here, before serving
    info = env_info(env_id, **{k: v for k, v in env_kwargs.items() if k != "split"})
    if require_bwrap and info.get("sandbox") not in (None, "bwrap"):
        raise InvalidOptionError(
            f"{env_id} runs the model's code in its {info['sandbox']!r} sandbox, which leaves "
            "the network open and world-readable files visible: serve it to other machines "
            "only with bubblewrap (`apt install bubblewrap`; sandbox='bwrap'), or on "
            "127.0.0.1, or pass --allow-unsandboxed-code (app(require_bwrap=False)) if "
            "everyone who reaches the port may run code on this machine"
        )
    cls = server_class(env_id, step_timeout_s=step_timeout_s, **env_kwargs)
    application = create_app(
        cls,
        AgentEnvAction,
        AgentEnvObservation,
        env_name=env_id.split("/")[-1],
        max_concurrent_envs=max_sessions,
    )
    application.add_api_route(INFO_ROUTE, lambda: info, methods=["GET"], tags=["agentenv"])
    if token is not None:
        application.add_middleware(RequireToken, token=token)
    return application
