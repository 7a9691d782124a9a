"""Strict parsing of nested dataclasses from JSON-like dicts, and the small value checks the blocks share.

Unknown keys, wrong types and invalid choices raise ``ValueError`` naming the full key path
and the valid choices, before anything is built.
"""

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin


MAX_JSON_BYTES = 8 << 20  # configs, sidecars and metadata of checkpoints are kilobytes


def read_json(path: "str | os.PathLike") -> Any:
    """A JSON file's value; a missing, unreadable, malformed or oversized (``MAX_JSON_BYTES``) file
    is a ValueError naming the file (and the line and column where the JSON breaks), not a traceback."""
    try:
        size = os.path.getsize(path)
        if size > MAX_JSON_BYTES:
            raise ValueError(f"{path}: {size:,} bytes, more than the {MAX_JSON_BYTES:,} a JSON config or sidecar "
                             f"may have; refused unread")
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to be a config or sidecar; refused") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None


def read_json_object(path: "str | os.PathLike") -> dict:
    """``read_json`` of a file whose top level must be an object (a config, a sidecar)."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A config warning as ``warning: message``, without the file, line and source of the call
    (a ``warnings.formatwarning``)."""
    return f"warning: {message}\n"


def warn_one_line(message: str) -> None:
    """``warnings.warn(message)`` shown as :func:`one_line_warning` (the caller's caller named)."""
    import warnings

    shown_as = warnings.formatwarning
    warnings.formatwarning = one_line_warning
    try:
        warnings.warn(message, stacklevel=3)
    finally:
        warnings.formatwarning = shown_as


def parse_dataclass(cls: type, data: Any, path: str) -> Any:
    """Build ``cls`` from ``data``; every key of ``data`` must be a field of ``cls``."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; valid keys are {sorted(fields)}"
                         f"{did_you_mean(unknown, fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _parse_value(hints[name], value, f"{path}.{name}") for name, value in data.items()}
    return cls(**kwargs)


def did_you_mean(unknown: "list[str]", valid) -> str:
    """``"; did you mean 'hidden_size'?"`` for the unknown keys that are close to a valid one (a
    misspelling), naming each where there are several; ``""`` where none is."""
    close = {key: difflib.get_close_matches(key, sorted(valid), n=1) for key in unknown}
    close = {key: match[0] for key, match in close.items() if match}
    if not close:
        return ""
    if len(unknown) == 1:
        return f"; did you mean {next(iter(close.values()))!r}?"
    return "; did you mean " + ", ".join(f"{match!r} for {key!r}" for key, match in close.items()) + "?"


def _parse_value(hint: Any, value: Any, path: str) -> Any:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        options = get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise ValueError(f"{path}: must not be null")
        non_none = [o for o in options if o is not type(None)]
        assert len(non_none) == 1, f"unsupported union {hint}"
        return _parse_value(non_none[0], value, path)
    if origin is Literal:
        choices = get_args(hint)
        if value not in choices:
            raise ValueError(f"{path}: invalid value {value!r}; valid choices are {list(choices)}")
        return value
    if origin in (list, tuple):
        (item,) = get_args(hint)[:1]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}: expected a list, got {type(value).__name__}")
        items = [_parse_value(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected an object, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(hint):
        return parse_dataclass(hint, value, path)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{path}: expected a string, got {value!r}")
        return value
    if hint is Any:
        return value
    raise AssertionError(f"unsupported type {hint} at {path}")


def check_choice(path: str, value: Any, choices: tuple) -> None:
    """Raise a ValueError if ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{path}: invalid value {value!r}; valid choices are {list(choices)}")


def to_dict(obj: Any) -> Any:
    """A dataclass (nested) as plain JSON-serialisable data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def check_positive(name: str, value: int) -> None:
    """Raise a ValueError naming ``name`` if ``value`` is not a positive integer."""
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def check_alpha(alpha: float, name: str = "alpha") -> None:
    """Raise a ValueError naming ``name`` if the interpolation weight ``alpha`` is outside [0, 1]."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {alpha}")


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": [1, {"c": 2}]}}`` as ``{"a.b.0": 1, "a.b.1.c": 2}``: a config's values by their
    dotted keys, as overrides and messages name them."""
    if isinstance(config, dict):
        items = config.items()
    elif isinstance(config, list):
        items = enumerate(config)
    else:
        return {prefix[:-1]: config}
    out = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def check_finite(data: dict) -> None:
    """Raise a ValueError naming the key of the first number in ``data`` (a parsed JSON config, its
    overrides applied) that is NaN or infinite (JSON's ``NaN`` and ``Infinity``, which Python's
    parser accepts): no key of a run config takes one."""
    for name, value in flatten(data).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set ``dotted.key=value`` pairs in a JSON-like dict (values parsed as JSON when they are)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form dotted.key=value")
        key, raw = item.split("=", 1)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        parts = key.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            nxt = node[_index(node, part, item)] if isinstance(node, list) else node.setdefault(part, {})
            if not isinstance(nxt, (dict, list)):
                raise ValueError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not an object")
            node = nxt
        last = parts[-1]
        if isinstance(node, list):
            node[_index(node, last, item)] = value
        else:
            node[last] = value
    return data


def _index(node: list, part: str, item: str) -> int:
    """``part`` as an index into the list ``node``; ValueError naming the override where it is none."""
    if not part.isdigit() or int(part) >= len(node):
        raise ValueError(f"override {item!r}: {part!r} is not an index of a list of {len(node)} item(s); valid "
                         f"indices are {list(range(len(node)))}")
    return int(part)
