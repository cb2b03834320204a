"""Output: the overlay set on disk, as touched files plus manifest.json, or as a full tree
(and the image build context, through the same door).

Each is written into a temporary sibling directory and renamed into place, so
an interrupted run leaves the previous output (or none), never half of one.
What may be replaced is decided by a marker only this tool writes
(``.vllm-overlay-output``: the command and runtime key), never by a file name:
an existing directory without it is refused unless it is empty, and so is a
destination that holds, or lies inside, the recipe, the overlay or the cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import __version__
from builder.apply import FileChange, OverlaySet
from builder.cache import locked
from builder.errors import InputError, StorageFailed
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


def write_overlay(out: Destination, overlay: OverlaySet, manifest_data: dict[str, Any]) -> None:
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


def write_full_tree(out: Destination, tree: Tree, overlay: OverlaySet, manifest_data: dict[str, Any]) -> None:
    changes = overlay.by_path()
    with replacing(out) as tmp:
        writer = Writer(tmp)
        for path, data, mode in tree.walk():
            if path not in changes:
                writer.write(path, data, mode)
        write_changes(writer, overlay.changes)
        writer.write(MANIFEST, manifest_bytes(manifest_data), None)


def write_files(out: Destination, files: dict[str, bytes]) -> None:
    """A directory of exactly these files (e.g. a build context), swapped in whole."""
    with replacing(out) as tmp:
        writer = Writer(tmp)
        for name, data in files.items():
            writer.write(name, data, None)


MARKER = ".vllm-overlay-output"
MARKER_FORMAT = 1


@dataclass(frozen=True)
class Destination:
    """Where a command writes its output, and what that output may never touch."""

    path: Path
    command: str  # e.g. "apply --out": recorded in the marker
    runtime_key: str
    protected: tuple[tuple[str, Path], ...] = ()  # (what, path): the recipe, the overlay, the cache

    @classmethod
    def of(cls, raw: str | Path, option: str, command: str, runtime_key: str, protected: dict[str, Path]):
        if not str(raw).strip():
            raise InputError("an empty path", field=option)
        return cls(Path(raw), command, runtime_key, tuple(protected.items()))

    def marker(self) -> bytes:
        data = {
            "tool": "vllm-overlay",
            "format": MARKER_FORMAT,
            "command": self.command,
            "runtime_key": self.runtime_key,
        }
        return (json.dumps(data, indent=2) + "\n").encode()


def is_earlier_output(directory: Path) -> bool:
    """Whether ``directory`` holds this tool's marker (a regular file naming the tool)."""
    marker = directory / MARKER
    try:
        if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > 4096:
            return False
        return json.loads(marker.read_text(encoding="utf-8")).get("tool") == "vllm-overlay"
    except (OSError, ValueError, AttributeError):
        return False


def check_destination(dest: Destination) -> None:
    """Refuse, with one line, a destination this run may not replace (before any work)."""
    _refuse_protected(dest)
    _refuse_unless_replaceable(dest)


def _refuse_unless_replaceable(dest: Destination) -> None:
    out = dest.path
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"{parent} is not a directory, so this cannot be made", file=out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise InputError("exists and is not a directory; refusing to replace it", file=out)
    if out.is_dir() and any(out.iterdir()) and not is_earlier_output(out):
        raise InputError(
            f"exists and is not an earlier vllm-overlay output (no {MARKER}); refusing to replace it", file=out
        )


def _refuse_protected(dest: Destination) -> None:
    out = dest.path.resolve()
    for what, path in dest.protected:
        guarded = path.resolve()
        if out == guarded or out in guarded.parents:
            raise InputError(f"holds the {what} ({path}); choose another output directory", file=dest.path)
        if guarded in out.parents:
            raise InputError(f"is inside the {what} ({path}); choose another output directory", file=dest.path)


@contextlib.contextmanager
def replacing(dest: Destination) -> Iterator[Path]:
    """Yield a fresh directory beside ``dest.path`` holding the marker; when the body
    succeeds, swap it in for ``dest.path`` (whose earlier output goes).  On any failure the
    fresh directory goes and ``dest.path`` is as it was."""
    out = dest.path
    check_destination(dest)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except (FileExistsError, NotADirectoryError) as exc:
        raise InputError(f"cannot make its parent directory: {exc.strerror}", file=out) from None
    except OSError as exc:
        raise StorageFailed(f"cannot write here: {exc.strerror or exc}", file=out) from None
    try:
        (tmp / MARKER).write_bytes(dest.marker())
        yield tmp
        tmp.chmod(0o755)
        with locked(out.parent):
            _refuse_unless_replaceable(dest)  # again: another run may have written it meanwhile
            old = None
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
                os.replace(out, old / "x")
            os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:  # the disk, not the input: full, read-only, no permission
        inside = str(exc.filename or "").removeprefix(f"{tmp}/") if exc.filename != str(tmp) else ""
        what = f"cannot write {inside}" if inside and not inside.startswith("/") else "cannot write"
        raise StorageFailed(f"{what}: {exc.strerror or exc}", file=out) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


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
            except (FileExistsError, NotADirectoryError):
                if os.path.islink(made) or not os.path.isdir(made):
                    rel = made[len(self.root) + 1 :]
                    raise InputError(f"{rel}: collides with another output path (a file and a directory)") from None
            self.made.add(made)

    def write(self, path: str, data: bytes, mode: int | None) -> None:
        parts = path.split("/")
        if path.startswith("/") or "\0" in path or any(part in ("", ".", "..") for part in parts):
            raise InputError(f"refusing to write {path!r}: outside the output directory")
        dest = f"{self.root}/{path}"
        parent = dest.rpartition("/")[0]
        if parent not in self.made:
            self._make(parent)
        try:
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644 if mode is None else mode)
        except (FileExistsError, IsADirectoryError, NotADirectoryError):
            raise InputError(f"{path}: collides with another output path (a file and a directory)") from None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        if mode is not None:
            os.chmod(dest, mode)  # exactly this mode, whatever the umask
