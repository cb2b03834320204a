"""Produced-image rows: what was built, from which keys, as ``images/produced.yaml``.

The file is a YAML list, newest row last, rewritten whole to a temporary
name and renamed, so an interrupted run leaves the previous rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from builder.cache import MIB, atomic_write, read_regular
from builder.errors import InputError
from builder.recipe import load_yaml

DEFAULT = Path(__file__).resolve().parent.parent / "images" / "produced.yaml"
PRODUCED_LIMIT = 64 * MIB
HEADER = "# Produced-image rows, written by `vllm-overlay image`; newest last. Do not edit by hand.\n"


def produced_path() -> Path:
    return Path(os.environ.get("VLLM_OVERLAY_PRODUCED", DEFAULT))


def load_rows(path: Path | None = None) -> list[dict[str, Any]]:
    path = path or produced_path()
    try:
        text = read_regular(path, PRODUCED_LIMIT, "the produced-image rows").decode("utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read produced-image rows: {exc}", file=path) from None
    rows = load_yaml(text, path)
    if rows is None:
        return []
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise InputError("expected a list of produced-image rows", file=path)
    for number, row in enumerate(rows):
        for field in ("recipe", "runtime_key", "image_key", "image", "digest", "time"):
            if not isinstance(row.get(field, ""), str):
                raise InputError("expected a string", file=path, field=f"row {number}: {field}")
    return rows


def find_row(image_key: str, path: Path | None = None) -> dict[str, Any] | None:
    return next((r for r in reversed(load_rows(path)) if r.get("image_key") == image_key), None)


def append_row(row: dict[str, Any], path: Path | None = None) -> None:
    path = path or produced_path()
    rows = load_rows(path) + [row]
    atomic_write(path, (HEADER + yaml.safe_dump(rows, sort_keys=False)).encode())
