"""Output: the overlay set on disk, as touched files plus manifest.json, or as a full tree.

Both are written into a temporary sibling directory and renamed into place,
so an interrupted run leaves the previous output (or none), never half of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from builder import __version__
from builder.apply import FileChange, OverlaySet
from builder.cache import replacing
from builder.members import Member
from builder.recipe import Recipe, WheelPin
from builder.tree import Tree

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1


def manifest(recipe: Recipe, overlay: OverlaySet, key: str) -> dict[str, Any]:
    def pin(p: WheelPin) -> dict[str, str]:
        return {"project": p.project, "version": p.version, "wheel": p.wheel, "sha256": p.sha256}

    return {
        "format": MANIFEST_FORMAT,
        "builder": __version__,
        "recipe": recipe.name,
        "runtime_key": key,
        "pins": {"vllm": pin(recipe.vllm), "flashinfer": pin(recipe.flashinfer)},
        "members": [member_row(m) for m in overlay.members],
        "files": [file_row(c) for c in overlay.changes],
    }


def member_row(member: Member) -> dict[str, Any]:
    return {
        "name": member.name,
        "diff_sha256": member.digest,
        "upstream_status": member.upstream_status,
        "standalone": member.standalone,
    }


def file_row(change: FileChange) -> dict[str, Any]:
    return {
        "path": change.path,
        "before_sha256": change.before_sha256,
        "after_sha256": change.after_sha256,
        "members": list(change.members),
    }


def manifest_bytes(data: dict[str, Any]) -> bytes:
    """Indented JSON, except that a list of rows (members, files) has one row per line: that
    reads better for hundreds of files, and the rows go through json's C encoder, which an
    indented dump never uses."""
    fields = []
    for key, value in data.items():
        if isinstance(value, list) and value and all(isinstance(row, dict) for row in value):
            rows = ",\n    ".join(json.dumps(row) for row in value)
            fields.append(f"  {json.dumps(key)}: [\n    {rows}\n  ]")
        else:
            fields.append(f"  {json.dumps(key)}: " + json.dumps(value, indent=2).replace("\n", "\n  "))
    return ("{\n" + ",\n".join(fields) + "\n}\n").encode()


def write_overlay(out: Path, overlay: OverlaySet, manifest_data: dict[str, Any]) -> None:
    """Only the touched files plus manifest.json."""
    with replacing(out) as tmp:
        writer = Writer(tmp)
        write_changes(writer, overlay.changes)
        writer.write(MANIFEST, manifest_bytes(manifest_data), None)


def write_changes(writer: Writer, changes: tuple[FileChange, ...]) -> None:
    """The touched files (a deleted file is just absent)."""
    for change in changes:
        if change.after is not None:
            writer.write(change.path, change.after, change.mode)


def write_full_tree(out: Path, tree: Tree, overlay: OverlaySet, manifest_data: dict[str, Any]) -> None:
    changes = overlay.by_path()
    with replacing(out) as tmp:
        writer = Writer(tmp)
        for path, data, mode in tree.walk():
            if path not in changes:
                writer.write(path, data, mode)
        write_changes(writer, overlay.changes)
        writer.write(MANIFEST, manifest_bytes(manifest_data), None)


def write_files(out: Path, files: dict[str, bytes]) -> None:
    """A directory of exactly these files (e.g. a build context), swapped in whole."""
    with replacing(out) as tmp:
        writer = Writer(tmp)
        for name, data in files.items():
            writer.write(name, data, None)


class Writer:
    """New files under a fresh directory, with plain os calls: hundreds of files are written
    per apply, and pathlib's per-call overhead was a third of the time."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.made: set[str] = {self.root}

    def _make(self, directory: str) -> None:
        """``directory`` and the parents it lacks, below the root (which exists)."""
        missing = []
        while directory not in self.made:
            missing.append(directory)
            directory = directory.rpartition("/")[0]
        for made in reversed(missing):
            try:
                os.mkdir(made)
            except FileExistsError:
                if not os.path.isdir(made):
                    raise
            self.made.add(made)

    def write(self, path: str, data: bytes, mode: int | None) -> None:
        dest = f"{self.root}/{path}"
        parent = dest.rpartition("/")[0]
        if parent not in self.made:
            self._make(parent)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644 if mode is None else mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        if mode is not None:
            os.chmod(dest, mode)  # exactly this mode, whatever the umask
