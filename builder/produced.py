"""Produced-image rows: what was built, from which keys, as ``images/produced.yaml``.

The file is a YAML list, newest row last, one row per repository and image
key, rewritten whole to a temporary name and renamed, so an interrupted run
leaves the previous rows.  A row names its ``repository`` and its ``digest``:
the registry's manifest digest once the image is there (``digest_from:
registry``), else the local image id (``digest_from: engine``).  A row is what
this machine did; for a registry repository, ``plan`` believes only the
registry (builder.plan).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from builder.cache import MIB, atomic_write, locked, read_regular
from builder.errors import InputError
from builder.schema import _show, load_yaml

DEFAULT = Path(__file__).resolve().parent.parent / "images" / "produced.yaml"
PRODUCED_LIMIT = 64 * MIB
HEADER = "# Produced-image rows, written by `vllm-overlay image`; newest last. Do not edit by hand.\n"


def produced_path() -> Path:
    return Path(os.environ.get("VLLM_OVERLAY_PRODUCED", DEFAULT))


STRING_FIELDS = (
    "recipe",
    "repository",
    "runtime_key",
    "image_key",
    "image",
    "digest",
    "digest_from",
    "time",
    "builder",
)


def load_rows(path: Path | None = None) -> list[dict[str, Any]]:
    """The rows, each checked for its shape; anything else is one InputError naming the file
    (and the row and field), exit 2."""
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
        raise InputError("expected a list of produced-image rows (mappings)", file=path)
    for number, row in enumerate(rows):
        for field in STRING_FIELDS:
            if not isinstance(row.get(field, ""), str):
                where = f"row {number}: {field}"
                raise InputError(f"expected a string, got {_show(row[field])}", file=path, field=where)
        if not isinstance(row.get("pins", {}), dict):
            raise InputError("expected a mapping", file=path, field=f"row {number}: pins")
    return rows


def find_row(image_key: str, path: Path | None = None, *, repository: str | None = None) -> dict[str, Any] | None:
    """The newest row with the image key (and, when given, the repository)."""
    return next(
        (
            r
            for r in reversed(load_rows(path))
            if r.get("image_key") == image_key and (repository is None or r.get("repository") == repository)
        ),
        None,
    )


def record_row(row: dict[str, Any], *, replace: bool, path: Path | None = None) -> bool:
    """Keep one row per repository and image key: add ``row`` when there is none; with
    ``replace``, put it in place of the one there (newest last) unless that one already has
    its digest.  Returns whether the file changed.  Under a lock on the file's directory, so two
    runs never drop each other's rows."""
    path = path or produced_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    same = (row["repository"], row["image_key"])
    with locked(path.parent):
        rows = load_rows(path)
        mine = [r for r in rows if (r.get("repository"), r.get("image_key")) == same]
        if mine and (not replace or all(mine[-1].get(k) == row[k] for k in ("digest", "digest_from"))):
            return False
        rows = [r for r in rows if (r.get("repository"), r.get("image_key")) != same] + [row]
        atomic_write(path, (HEADER + yaml.safe_dump(rows, sort_keys=False)).encode())
    return True
