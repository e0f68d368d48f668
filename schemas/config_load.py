"""Loading a config from plain data: YAML (bounded, `schemas.safe_read`) -> `schemas.config`.

Every key is checked against the annotation of its field (`_coerce`): wrong types, unknown
keys (with a "did you mean"), values outside `Literal`s, integers beyond 2**53, NaN and
inf. Each section's errors and each section's `__post_init__` error are collected, so one
run reports every independent mistake (`ConfigErrors`, at most `MAX_ERRORS`).
"""

from __future__ import annotations

import difflib
import math
import os
import types
import typing
from dataclasses import MISSING, fields
from typing import Any, Literal

from .config import MAX_INT, SECTIONS, Config, fail
from .errors import ConfigError, ConfigErrors, OwnValueError, raise_all
from .safe_read import short


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is tuple:
        return "a list"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; convert lists to tuples, ints to floats."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        fail(key, value, "has the wrong type: expected " +
              " or ".join(_type_name(a) for a in args))
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            fail(key, value, f"is not one of {', '.join(map(repr, args))}{hint}")
        return value
    if origin is tuple:
        pairs = bool(args) and typing.get_origin(args[0]) is tuple and \
            typing.get_args(args[0])[-1] is not Ellipsis  # tuple[tuple[str, X], ...]
        if pairs:
            if not isinstance(value, dict):
                fail(key, value, "has the wrong type: expected a mapping (key: value)")
            return tuple((str(k), v) for k, v in value.items())
        if not isinstance(value, (list, tuple)):
            fail(key, value, "has the wrong type: expected a list")
        item = args[0] if args else Any
        return tuple(_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            fail(key, value, "has the wrong type: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(key, value, "has the wrong type: expected an integer")
        if abs(value) > MAX_INT:
            fail(key, value, f"is too large; use at most {MAX_INT} (2**53)")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(key, value, "has the wrong type: expected a number")
        if isinstance(value, int) and abs(value) > MAX_INT:
            fail(key, value, f"is too large; use at most {MAX_INT} (2**53)")
        if not math.isfinite(value):
            fail(key, value, "must be a finite number (not .nan or .inf)")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(key, value, "has the wrong type: expected a string")
        return value
    if isinstance(value, tp):
        return value
    fail(key, value, f"has the wrong type: expected {_type_name(tp)}")


def _label(key: object) -> str:
    """A YAML key as it appears in an error: itself when a short string, else its repr."""
    return key if isinstance(key, str) and len(key) <= 40 else short(key, 40)


def _section(name: str, cls: type, data: Any) -> Any:
    if data is None:  # `options:` with nothing under it
        data = {}
    if not isinstance(data, dict):
        fail(name, data, "must be a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    kwargs, errors = {}, []
    for key, value in data.items():
        try:
            if key not in known:
                close = difflib.get_close_matches(str(key), list(known), 1)
                hint = f"did you mean {name}.{close[0]}?" if close else \
                    f"known keys: {', '.join(known)}"
                raise ConfigError(f"{name}.{_label(key)}: unknown key; {hint}")
            kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
        except ConfigError as e:
            errors.append(e)
    for f in known.values():
        if f.default is MISSING and f.default_factory is MISSING and f.name not in data:
            errors.append(ConfigError(f"{name}.{f.name}: missing; this key is required"))
    if errors:
        errors += _own_value_errors(cls, kwargs, hints)
    raise_all(errors)
    return cls(**kwargs)


def _own_value_errors(cls: type, kwargs: dict[str, Any], hints: dict[str, Any]
                      ) -> list[ConfigError]:
    """The errors a section's keys that did read would get on their own values
    (`OwnValueError`: `tp: 0` beside `engine: vlm`), its missing or mistyped required keys
    filled with a stand-in that is never reported."""
    stand_in = {f.name: typing.get_args(hints[f.name])[0] for f in fields(cls)
                if f.default is MISSING and f.default_factory is MISSING
                and f.name not in kwargs and typing.get_origin(hints[f.name]) is Literal}
    try:
        cls(**kwargs, **stand_in)
    except ConfigErrors as e:
        return [x for x in e.errors if isinstance(x, OwnValueError)]
    except OwnValueError as e:
        return [e]
    except (ConfigError, TypeError):
        return []
    return []


def config_from_dict(data: Any, base_dir: str = ".") -> Config:
    """Build a `Config` from plain data (a parsed YAML document)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: {type(data).__name__} at the top level; the file must be "
                          "a mapping with model, source, target, cluster, options")
    errors: list[ConfigError] = []
    for key in data:
        if key not in SECTIONS:
            close = difflib.get_close_matches(str(key), list(SECTIONS), 1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(SECTIONS)}"
            errors.append(ConfigError(f"{_label(key)}: unknown section; {hint}"))
    for key in ("model", "source", "target"):
        if key not in data:
            errors.append(ConfigError(f"{key}: missing; the config needs a {key} section"))
    built = {}
    for name, cls in SECTIONS.items():
        if name in data:
            try:
                built[name] = _section(name, cls, data[name])
            except ConfigError as e:
                errors.append(e)
    raise_all(errors)
    return Config(**built, base_dir=base_dir)


def load_config(path: str) -> Config:
    """Read a YAML config (bounded: `schemas.safe_read`) with `yaml.safe_load` and check each
    section; every error of every section is reported (`ConfigErrors`)."""
    import yaml

    from .safe_read import check_yaml_events, read_text

    text = read_text(path, "config file", "a YAML config")
    try:
        check_yaml_events(text, path)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file: {path!r} is not valid YAML{where}: {problem}; "
                          "fix the syntax there") from None
    return config_from_dict(data, base_dir=os.path.dirname(os.path.abspath(path)))
