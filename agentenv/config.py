"""Typed, nested run configuration: one owner per value, strict loading, generated flags.

A run's settings are dataclasses nested in one another (``TrainConfig`` holds a
``RolloutConfig`` that holds the ``SamplingConfig``, and the ``GRPOConfig``). Every value
has exactly one field that owns it: the sampler and the trainer read the temperature from
the same object, so they cannot disagree. This module turns such a tree into:

* a dataclass instance from a nested dict (a YAML/JSON file), where an unknown or misspelt
  key is an :class:`~agentenv.errors.InvalidOptionError` naming the key, where it sits,
  the closest valid key and every valid one -- raised before any model is loaded;
* command-line flags, one per leaf field, with the field's help text and default
  (:func:`add_flags`). Leaf names are unique across the tree (one owner), so the flags
  are flat: ``--temperature``, ``--learning-rate``, ``--group-size``;
* overrides that deep-merge: file first, then flags, each touching only the fields it
  names (:func:`merge`), so ``--beta 0.04`` never resets the file's learning rate.

Fields carry their help as ``metadata={"help": ...}`` (:func:`option`), the convention of
TRL's configs and ``transformers.HfArgumentParser``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from agentenv.errors import InvalidOptionError

T = TypeVar("T")


def option(default: Any, help: str) -> Any:  # noqa: A002 - the metadata key is "help"
    """A dataclass field with a default (lists, dicts and dataclasses copied per instance)
    and its help text."""
    if isinstance(default, list | dict):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"help": help}
        )
    if dataclasses.is_dataclass(default):
        return dataclasses.field(
            default_factory=lambda: copy.deepcopy(default), metadata={"help": help}
        )
    return dataclasses.field(default=default, metadata={"help": help})


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _nested(tp: Any) -> type | None:
    """The dataclass type a field holds, if it holds one."""
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _unknown(key: str, where: str, section: str, known: list[str]) -> InvalidOptionError:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return InvalidOptionError(
        f"unknown key {key!r} in {section} of {where}; {hint}valid keys there: "
        f"{', '.join(sorted(known))}"
    )


def from_dict(cls: type[T], data: dict[str, Any], where: str = "config", section: str = "") -> T:
    """Build ``cls`` from a nested dict; nested dataclass fields take nested dicts.

    Raises:
        InvalidOptionError: for an unknown key (naming the closest valid one) or a value
            of the wrong kind where a section is expected; the dataclasses' own
            ``__post_init__`` checks name invalid values.
    """
    section = section or f"the top level ({cls.__name__})"
    if not isinstance(data, dict):
        raise InvalidOptionError(f"{section} of {where} must be a mapping of keys, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown(key, where, section, list(fields))
        sub = _nested(hints[key])
        if sub is not None and isinstance(value, dict):
            value = from_dict(sub, value, where, f"section {key!r} ({sub.__name__})")
        elif sub is not None and not isinstance(value, sub):
            raise InvalidOptionError(
                f"{key!r} in {where} is a section ({sub.__name__}); give it a mapping of "
                f"its keys, got {value!r}"
            )
        kwargs[key] = value
    return cls(**kwargs)


def coerce_sections(config: Any) -> None:
    """Call from ``__post_init__``: a section field given as a dict (``grpo={"beta": 0.04}``)
    becomes its dataclass, the dict merged onto the field's default (strict keys)."""
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        value, sub = getattr(config, f.name), _nested(hints[f.name])
        if sub is None or not isinstance(value, dict):
            continue
        has_factory = f.default_factory is not dataclasses.MISSING
        default = f.default_factory() if has_factory else sub()
        merged = merge(to_dict(default), value)
        name = type(config).__name__
        setattr(
            config, f.name, from_dict(sub, merged, name, f"section {f.name!r} ({sub.__name__})")
        )


def to_dict(config: Any) -> dict[str, Any]:
    """The nested dict of a config (what ``config.json`` holds; :func:`from_dict` reads it)."""
    return dataclasses.asdict(config)


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: dicts merge key by key (sections, and dict values such as
    ``env_kwargs``); any other value is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or JSON config file into a dict."""
    path = Path(path)
    if not path.is_file():
        raise InvalidOptionError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise InvalidOptionError(f"{path} must hold a mapping of config keys, got {data!r}")
    return data


# ---- command-line flags ------------------------------------------------------------------


def _leaves(
    config: Any, prefix: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], Any, Any, Any]]:
    """``(path, dataclasses.Field, type, value)`` of every non-section field, depth first."""
    out = []
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and _nested(hints[f.name]) is not None:
            out += _leaves(value, (*prefix, f.name))
        else:
            out.append(((*prefix, f.name), f, hints[f.name], value))
    return out


def parse_json_object(text: str) -> dict:
    """An argparse ``type``: a JSON object (``--env-kwargs '{"source": "gsm8k"}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _scalar(tp: Any) -> tuple[Any, bool]:
    """``(base type, accepts None)`` of ``X`` or ``X | None``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else str), True
    return tp, False


def _converter(base: Any, optional: bool, flag: str) -> Any:
    def convert(text: str) -> Any:
        if optional and text.lower() in ("none", "null"):
            return None
        try:
            return base(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"{flag} expects {base.__name__}{' or none' if optional else ''}, got {text!r}"
            ) from exc

    return convert


def _declared_by(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO that declares the field ``name`` (the most derived one)."""
    return next(k for k in cls.__mro__ if name in k.__dict__.get("__annotations__", {}))


def _summary(text: str) -> str:
    """The first clause of a help text or docstring (``"How episodes are collected and
    sampled (section)."`` -> ``"How episodes are collected and sampled"``)."""
    text = " ".join(text.replace("``", "").split())
    for stop in (" (", ". ", "; ", ": "):
        text = text.split(stop)[0]
    return text.rstrip(".")


def _group(
    parser: argparse.ArgumentParser, groups: dict[Any, Any], config: Any, path: tuple[str, ...]
) -> Any:
    """The help group of the field at ``path``: one per section of the config tree, and in a
    section one per class of its dataclass hierarchy (``grpo``: the trainer's optimisation
    and LoRA settings, then GRPO's own)."""
    section, node, owner = path[:-1], config, None
    for key in section:
        owner = next(f for f in dataclasses.fields(node) if f.name == key)
        node = getattr(node, key)
    declared = _declared_by(type(node), path[-1])
    if (section, declared) not in groups:
        about = owner.metadata.get("help", "") if owner is not None else ""
        if declared is not type(node) or not about:  # a base class's fields, or the top
            about = declared.__doc__ or declared.__name__
        title = f"{'.'.join(section) or 'top level'}: {_summary(about)}"
        groups[section, declared] = parser.add_argument_group(title.replace("%", "%%"))
    return groups[section, declared]


def _states_default(text: str, default: Any) -> bool:
    """Whether ``(default: X)`` would add nothing: the help states the default itself
    (``"(default runs/<env>-<time>)"``), or it is None (what None means the help says)."""
    return default is None or "default" in text.lower()


def add_flags(parser: argparse.ArgumentParser, config: Any) -> dict[str, tuple[str, ...]]:
    """Add one flag per leaf field of ``config`` (a default instance) to ``parser``.

    Flags are ``--field-name``, grouped in the help by section; ``--field_name`` also works
    (not shown). Their help is the field's, followed by the instance's default unless the
    help states it. Given flags land in the namespace under their path joined by ``.``;
    flags not given are absent (so they cannot override a file).
    Returns ``{dest: path}`` for :func:`flag_overrides`.

    Raises:
        ValueError: two fields share a name (a value with two owners).
    """
    dests: dict[str, tuple[str, ...]] = {}
    seen: dict[str, tuple[str, ...]] = {}
    groups: dict[Any, Any] = {}
    for path, f, tp, default in _leaves(config):
        name = path[-1]
        if name in seen:
            raise ValueError(
                f"config field {name!r} is owned twice: {'.'.join(seen[name])} and "
                f"{'.'.join(path)}; give each value one owner"
            )
        seen[name] = path
        dest = ".".join(path)
        dests[dest] = path
        flag = f"--{name.replace('_', '-')}"
        text = f.metadata.get("help", "")
        kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS}
        base, optional = _scalar(tp)
        origin = typing.get_origin(base)
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is list or base is list:
            item = (typing.get_args(base) or (str,))[0]  # list[float]: each item a float
            kwargs.update(nargs="*", metavar="ITEM")
            if item in (int, float):
                kwargs.update(type=_converter(item, False, flag), metavar=item.__name__.upper())
        elif origin is dict or base is dict:
            kwargs.update(type=parse_json_object, metavar="JSON")
        elif base in (int, float, str):
            kwargs.update(type=_converter(base, optional, flag), metavar=base.__name__.upper())
        else:
            kwargs.update(type=str)
        if not _states_default(text, default):
            shown = json.dumps(default) if isinstance(default, dict | list) else default
            text = f"{text} (default: {shown})"
        group = _group(parser, groups, config, path)
        group.add_argument(flag, **kwargs, help=text.replace("%", "%%"))
        if "_" in name:  # the underscore spelling works too; the help shows one
            group.add_argument(f"--{name}", **kwargs, help=argparse.SUPPRESS)
    return dests


def flag_overrides(args: argparse.Namespace, dests: dict[str, tuple[str, ...]]) -> dict:
    """The nested dict of the flags actually given (see :func:`add_flags`)."""
    out: dict[str, Any] = {}
    for dest, path in dests.items():
        if hasattr(args, dest):
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = getattr(args, dest)
    return out


def agentenv_home() -> Path:
    """Return agentenv's cache folder: ``$AGENTENV_HOME`` or ``~/.cache/agentenv``."""
    return Path(os.environ.get("AGENTENV_HOME") or "~/.cache/agentenv").expanduser()
