"""The environment registry: a thin layer over gymnasium's, under the ``agentenv`` namespace.

Every id registered here is a real gymnasium id, so ``gymnasium.make("agentenv/Calculator-v0")``
works in any RL library once ``agentenv`` is imported. Ids may be given with or
without the namespace: ``make("Calculator-v0") == make("agentenv/Calculator-v0")``.

Environments are registered with ``order_enforce=False`` and
``disable_env_checker=True``: :class:`~agentenv.TextEnv` enforces reset-before-step
itself, and the tests run gymnasium's full ``check_env`` on every id. So ``make``
returns the environment itself, and its attributes (``num_tasks``, ``split``,
``tools``) are reachable without ``env.unwrapped``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec

from agentenv.errors import InvalidOptionError, RegistrationError, UnknownEnvError

NAMESPACE = "agentenv"


def env_name(env_id: str) -> str:
    """``"my_envs.py:agentenv/Capitals-v0"`` -> ``"Capitals-v0"``: the id without its module
    or namespace (run directories are named after it)."""
    return env_id.rpartition(":")[2].rpartition("/")[2]


def full_id(env_id: str) -> str:
    """``"Calculator-v0"`` -> ``"agentenv/Calculator-v0"``; namespaced ids pass through."""
    if not isinstance(env_id, str) or not env_id:
        raise UnknownEnvError(f"an environment id must be a non-empty str, got {env_id!r}")
    return env_id if "/" in env_id else f"{NAMESPACE}/{env_id}"


def register(
    id: str,  # noqa: A002 - mirrors gymnasium.register
    entry_point: str | Callable[..., gym.Env],
    *,
    override: bool = False,
    **kwargs: Any,
) -> EnvSpec:
    """Register an environment under the ``agentenv`` namespace.

    Args:
        id: ``"Name-vN"`` (namespaced to ``agentenv/Name-vN``) or a full ``"ns/Name-vN"``.
        entry_point: The env class/factory, or a lazy ``"module.path:ClassName"`` string.
        override: Replace an existing registration instead of raising.
        **kwargs: Default constructor arguments; ``make`` merges the caller's over them.

    Returns:
        The gymnasium :class:`~gymnasium.envs.registration.EnvSpec`.

    Raises:
        RegistrationError: if the id is taken (and ``override`` is False) or malformed.
    """
    env_id = full_id(id)
    if env_id in gym.registry and not override:
        raise RegistrationError(
            f"environment {env_id!r} is already registered; pick another id or pass override=True"
        )
    if isinstance(entry_point, str) and ":" not in entry_point:
        raise RegistrationError(
            f"entry_point must look like 'package.module:ClassName', got {entry_point!r}"
        )
    gym.registry.pop(env_id, None)
    try:
        gym.register(
            id=env_id,
            entry_point=entry_point,
            kwargs=kwargs,
            order_enforce=False,
            disable_env_checker=True,
        )
    except gym.error.Error as exc:
        raise RegistrationError(f"cannot register {env_id!r}: {exc}") from exc
    return gym.spec(env_id)


def deregister(id: str) -> None:  # noqa: A002
    """Remove an id from the registry (useful in tests); unknown ids are ignored."""
    gym.registry.pop(full_id(id), None)


def registry() -> dict[str, EnvSpec]:
    """All ``agentenv/...`` registrations, by full id, sorted."""
    prefix = f"{NAMESPACE}/"
    return {k: gym.registry[k] for k in sorted(gym.registry) if k.startswith(prefix)}


def import_module(name: str) -> None:
    """Import a module for its side effects (its ``register`` calls): a dotted module name,
    found from the working directory too (as ``python -m`` would), or a ``.py`` file path.

    Raises:
        UnknownEnvError: if it cannot be imported, naming it and the error.
    """
    import importlib
    import importlib.util
    import os
    import sys

    try:
        if name.endswith(".py"):
            path = os.path.abspath(name)
            module_name = os.path.splitext(os.path.basename(path))[0]
            if (
                module_name in sys.modules
                and getattr(sys.modules[module_name], "__file__", None) == path
            ):
                return
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            if loader_spec is None or loader_spec.loader is None or not os.path.isfile(path):
                raise FileNotFoundError(f"no such file: {path}")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())
            importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported the same way
        raise UnknownEnvError(
            f"could not import {name!r} to register its environments: "
            f"{type(exc).__name__}: {exc}. Pass a module importable from here "
            "(e.g. my_envs or my_pkg.envs) or a path to a .py file"
        ) from exc


def spec(id: str) -> EnvSpec:  # noqa: A002
    """The spec of a registered id; raises :class:`UnknownEnvError` with close matches.

    ``"module:Name-v0"`` (gymnasium's convention) imports ``module`` first, so that its
    ``register`` call runs; ``module`` may also be a path to a ``.py`` file.
    """
    if ":" in id:
        module, _, id = id.rpartition(":")  # noqa: A001
        import_module(module)
    env_id = full_id(id)
    if env_id not in gym.registry:
        known = list(registry())
        close = difflib.get_close_matches(env_id, known, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise UnknownEnvError(
            f"no environment registered as {env_id!r}.{hint} "
            f"Registered: {', '.join(known) or '(none)'}. See `agentenv list`."
        )
    return gym.spec(env_id)


def make(id: str, **kwargs: Any) -> gym.Env:  # noqa: A002
    """Create a registered environment; ``kwargs`` override the registered defaults.

    Example:
        >>> env = make("Calculator-v0", split="test")
        >>> obs, info = env.reset(seed=0)

    Raises:
        UnknownEnvError: the id is not registered (naming the close ones).
        InvalidOptionError: a keyword the env's constructor does not take (naming the
            closest it does), before the env is built.
    """
    env_spec = spec(id)
    check_kwargs(env_spec, kwargs)
    return gym.make(env_spec.id, **kwargs)


_MAKE_KWARGS = ("max_episode_steps", "disable_env_checker")  # gymnasium.make's own


def check_kwargs(env_spec: EnvSpec, kwargs: dict[str, Any]) -> None:
    """Raise :class:`InvalidOptionError` for a key of ``kwargs`` that the env's constructor
    does not take, naming the closest one it does and all of them. A constructor that
    takes ``**kwargs`` (or whose signature cannot be read) accepts any key."""
    from gymnasium.envs.registration import load_env_creator

    creator = env_spec.entry_point
    try:
        creator = load_env_creator(creator) if isinstance(creator, str) else creator
        params = list(inspect.signature(creator).parameters.values())
    except (ImportError, AttributeError, TypeError, ValueError):
        return  # gymnasium.make reports what is wrong with the entry point
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    valid = [p.name for p in params if p.kind in named]
    for key in kwargs:
        if key not in valid and key not in _MAKE_KWARGS:
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise InvalidOptionError(
                f"{env_spec.id} takes no argument {key!r} (env kwargs); {hint}"
                f"its arguments: {', '.join(valid)}"
            )


def _register_bundled() -> None:
    """Register the environments shipped in the ``envs`` package (lazy entry points)."""
    bundled = {
        "Calculator-v0": "envs.calculator:CalculatorEnv",
        "RAG-v0": "envs.rag:RAGEnv",
        "Workspace-v0": "envs.workspace:WorkspaceEnv",
        "BFCL-v0": "envs.bfcl:BFCLEnv",
        # any OpenEnv server, ours (`agentenv serve`) or another: make(..., base_url=...)
        "OpenEnv-v0": "agentenv.integrations.openenv:OpenEnvClientEnv",
    }
    for name, entry_point in bundled.items():
        if full_id(name) not in gym.registry:
            register(name, entry_point)
