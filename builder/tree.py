"""Base tree: read the files members touch, lazily, from a wheel (a zip) or a directory.

Nothing is unpacked: a wheel entry is inflated only when a member touches it.
Both kinds answer the same three questions: what bytes does a path hold,
may a member write there (no escape through a symlink), and what are all the
paths (for ``--full-tree``).
"""

from __future__ import annotations

import os
import posixpath
import stat
import sys
import zipfile
from pathlib import Path
from typing import Iterator, Protocol, TextIO

from builder.errors import InputError
from builder.pin import pinned_wheel
from builder.recipe import WheelPin


class Tree(Protocol):
    label: str

    def read(self, path: str) -> bytes | None:
        """The file's bytes, or None when the tree has no such file."""

    def check_writable(self, path: str) -> str | None:
        """Why writing ``path`` would leave the tree (through a symlink), or None."""

    def walk(self) -> Iterator[tuple[str, bytes, int]]:
        """Every regular file: (path, bytes, mode)."""


def open_tree(path: Path) -> Tree:
    return DirTree(path) if path.is_dir() else WheelTree(path)


def pinned_tree(pin: WheelPin, progress: TextIO | None = None) -> Tree:
    """The base tree a pin names: the verified wheel (fetched once) or a local directory."""
    return open_tree(pinned_wheel(pin, progress=progress))


def _escapes(link_dir: str, target: str) -> bool:
    """Does a symlink in ``link_dir`` pointing at ``target`` resolve outside the tree root?"""
    if posixpath.isabs(target):
        return True
    return posixpath.normpath(posixpath.join(link_dir, target)).split("/")[0] == ".."


class WheelTree:
    """A wheel read in place; the central directory is read once, entries on demand."""

    def __init__(self, path: Path) -> None:
        self.label = str(path)
        try:
            self._zip = zipfile.ZipFile(path)
            self._entries = {info.filename: info for info in self._zip.infolist()}
        except (zipfile.BadZipFile, OSError) as exc:
            raise InputError(f"{path}: not a valid wheel (zip): {exc}") from None

    def _is_symlink(self, info: zipfile.ZipInfo) -> bool:
        return stat.S_ISLNK(info.external_attr >> 16)

    def read(self, path: str) -> bytes | None:
        info = self._entries.get(path)
        if info is None or info.is_dir():
            return None
        try:
            return self._zip.read(info)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise InputError(f"{self.label}: entry {path} is corrupt: {exc}") from None

    def check_writable(self, path: str) -> str | None:
        parts = path.split("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            info = self._entries.get(prefix)
            if info is not None and self._is_symlink(info):
                target = self._zip.read(info).decode("utf-8", "replace")
                if _escapes(posixpath.dirname(prefix), target):
                    return f"{prefix} is a symlink to {target}, outside the tree"
        return None

    def walk(self) -> Iterator[tuple[str, bytes, int]]:
        for name, info in self._entries.items():
            if info.is_dir() or self._is_symlink(info):
                continue
            mode = (info.external_attr >> 16) & 0o777 or 0o644
            yield name, self._zip.read(info), mode


class DirTree:
    """A directory, e.g. a vLLM checkout; symlinks are followed only inside it."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.label = str(root)

    def read(self, path: str) -> bytes | None:
        if self.check_writable(path):
            return None
        full = self.root / path
        try:
            return full.read_bytes() if full.is_file() else None
        except OSError as exc:
            raise InputError(f"{self.label}: cannot read {path}: {exc}") from None

    def check_writable(self, path: str) -> str | None:
        parts = path.split("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            full = self.root / prefix
            if full.is_symlink():
                resolved = Path(os.path.realpath(full))
                if resolved != self.root and self.root not in resolved.parents:
                    return f"{prefix} is a symlink to {os.readlink(full)}, outside the tree"
        return None

    def walk(self) -> Iterator[tuple[str, bytes, int]]:
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d != ".git")
            for name in sorted(filenames):
                full = Path(dirpath, name)
                if full.is_symlink() or not full.is_file():
                    continue
                rel = full.relative_to(self.root).as_posix()
                yield rel, full.read_bytes(), full.stat().st_mode & 0o777
