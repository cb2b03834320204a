"""Schema helpers shared by the YAML inputs (recipes, launch profiles): field checks that name
a field by its dotted path, and the strict YAML loader.

A check is ``check(where, value) -> validated value``; ``where`` is the dotted path
(``vllm.sha256``, ``ranks[1].engine``), and an error is an InputError carrying it as its
field, to which the loader of the file adds the file.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from builder.errors import InputError


class _Field:
    """One field of the schema: its check, and whether it may be left out."""

    def __init__(self, check: Callable[[str, Any], Any], required: bool = True) -> None:
        self.check = check
        self.required = required


def _string(pattern: re.Pattern[str] | None = None, expected: str = "") -> Callable[[str, Any], str]:
    def check(where: str, value: Any) -> str:
        if not isinstance(value, str):
            raise _field_error(
                where,
                f"expected a string{' (quote it)' if isinstance(value, (int, float)) else ''}, got {_show(value)}",
            )
        if pattern is not None and not pattern.fullmatch(value):
            raise _field_error(where, f"expected {expected}, got {_quoted(value)}")
        return value

    return check


def _boolean(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _field_error(where, f"expected true or false, got {_show(value)}")
    return value


def _list_of(item: Callable[[str, Any], Any]) -> Callable[[str, Any], tuple[Any, ...]]:
    def check(where: str, value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise _field_error(where, f"expected a list, got {_show(value)}")
        return tuple(item(f"{where}[{i}]", v) for i, v in enumerate(value))

    return check


def _mapping(schema: dict[str, _Field]) -> Callable[[str, Any], dict[str, Any]]:
    def check(where: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _field_error(where or "(top level)", f"expected a mapping, got {_show(value)}")
        prefix = f"{where}." if where else ""
        for key in value:
            if key not in schema:
                label = key if isinstance(key, str) else _quoted(key)
                close = difflib.get_close_matches(label, list(schema), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise _field_error(f"{prefix}{label}", f"unknown field ({hint}expected one of: {', '.join(schema)})")
        out: dict[str, Any] = {}
        for key, spec in schema.items():
            if key not in value:
                if spec.required:
                    raise _field_error(f"{prefix}{key}", "missing required field")
                continue
            out[key] = spec.check(f"{prefix}{key}", value[key])
        return out

    return check


def _field_error(where: str, what: str) -> InputError:
    """A field's error: named by its dotted path; the file's loader adds the file."""
    return InputError(what, field=where)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return _quoted(value)
    kind = {dict: "a mapping", list: "a list", bool: "a boolean", type(None): "nothing"}.get(type(value))
    return kind or f"{type(value).__name__} {_quoted(value)[:80]}"


def _quoted(value: Any) -> str:
    """repr(), at most 80 characters; safe for any value YAML makes (an integer of
    thousands of digits cannot be turned into a string)."""
    try:
        text = repr(value)
    except ValueError:
        return "(a number too long to show)"
    return text if len(text) <= 80 else text[:77] + "..."


def load_yaml(text: str, path: Path) -> Any:
    """YAML with the strict safe loader; anything it refuses is one InputError naming the line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        line = mark.line + 1 if mark is not None else None
        raise InputError(f"invalid YAML: {problem}", file=path, line=line) from None
    except (ValueError, TypeError, RecursionError) as exc:  # e.g. an integer too long to convert
        raise InputError(f"invalid YAML: {_quoted(str(exc))}", file=path) from None


class _StrictLoader(yaml.SafeLoader):
    """The safe loader, refusing duplicate keys (PyYAML silently keeps the last).  The pure
    Python one: libyaml's C parser crashes the process on input nested 100,000 deep, where
    this one raises RecursionError (a recipe costs it a few milliseconds)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    keys: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(None, None, "a key that is a list or a mapping", mark) from None
        if key in keys:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {_quoted(key)}", key_node.start_mark)
        keys.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)  # type: ignore[arg-type]


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
