"""Base tree: read the files members touch, lazily, from a wheel (a zip) or a directory.

Nothing is unpacked: a wheel entry is inflated only when a member touches it.
Both kinds answer the same three questions: what bytes does a path hold,
may a member write there (no escape through a symlink), and what are all the
paths (for ``--full-tree``).
"""

from __future__ import annotations

import base64
import csv
import os
import posixpath
import stat
import zipfile
import zlib
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Protocol, TextIO

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

    def recorded_sha256(self, path: str) -> str | None:
        """The sha256 the tree itself records for ``path`` (a wheel's RECORD), or None."""


def pinned_tree(pin: WheelPin, progress: TextIO | None = None) -> Tree:
    """The base tree a pin names: the verified wheel (fetched once) or a local directory."""
    path = pinned_wheel(pin, progress=progress)
    if path.is_dir():
        return DirTree(path)
    return WheelTree(path)


def _escapes(link_dir: str, target: str) -> bool:
    """Does a symlink in ``link_dir`` pointing at ``target`` resolve outside the tree root?"""
    if posixpath.isabs(target):
        return True
    return posixpath.normpath(posixpath.join(link_dir, target)).split("/")[0] == ".."


class WheelTree:
    """A wheel read in place: an entry is inflated only when asked for (zipfile checks its
    CRC-32).  Opening parses the central directory; RECORD is read on first use."""

    def __init__(self, path: Path) -> None:
        self.label = str(path)
        try:
            self._zip = zipfile.ZipFile(path)
            self._infos = {info.filename: info for info in self._zip.infolist()}
        except (zipfile.BadZipFile, OSError, zlib.error) as exc:
            raise InputError(f"{path}: not a valid wheel (zip): {exc}", file=path) from None
        self._symlinks = any(stat.S_ISLNK(i.external_attr >> 16) for i in self._infos.values())

    @cached_property
    def _recorded(self) -> dict[str, str]:
        return _record_digests(self._zip)

    def _is_symlink(self, info: zipfile.ZipInfo) -> bool:
        return stat.S_ISLNK(info.external_attr >> 16)

    def read(self, path: str) -> bytes | None:
        info = self._infos.get(path)
        if info is None or info.is_dir():
            return None
        try:
            return self._zip.read(info)
        except (zipfile.BadZipFile, OSError, zlib.error, ValueError, NotImplementedError) as exc:
            raise InputError(f"{self.label}: entry {path} is corrupt: {exc}", file=self.label) from None

    def recorded_sha256(self, path: str) -> str | None:
        return _record_hex(self._recorded.get(path))

    def check_writable(self, path: str) -> str | None:
        if not self._symlinks:  # wheels seldom hold any: then no path can escape
            return None
        parts = path.split("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            info = self._infos.get(prefix)
            if info is not None and self._is_symlink(info):
                target = (self.read(prefix) or b"").decode("utf-8", "replace")
                if _escapes(posixpath.dirname(prefix), target):
                    return f"{prefix} is a symlink to {target}, outside the tree"
        return None

    def paths(self) -> list[str]:
        """Every regular file's path, nothing read."""
        return [n for n, i in self._infos.items() if not i.is_dir() and not self._is_symlink(i)]

    def walk(self) -> Iterator[tuple[str, bytes, int]]:
        for name, info in self._infos.items():
            if info.is_dir() or self._is_symlink(info):
                continue
            yield name, self.read(name) or b"", (info.external_attr >> 16) & 0o777 or 0o644


def _record_digests(zf: zipfile.ZipFile) -> dict[str, str]:
    """path -> the base64 sha256 field of the wheel's ``*.dist-info/RECORD`` (decoded by
    _record_hex when asked for: a run asks for a few of 5,000).  The wheel is verified
    against its pinned sha256, so these are the pinned bytes' own hashes: a manifest's before
    hashes come from here instead of hashing every touched file (pip checks them at install)."""
    names = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(names) != 1:
        return {}
    text = zf.read(names[0]).decode("utf-8")
    # csv for a RECORD that quotes (a path with a comma); splitting is five times faster
    rows = csv.reader(text.splitlines()) if '"' in text else (line.split(",") for line in text.splitlines())
    return {row[0]: row[1][len("sha256=") :] for row in rows if len(row) >= 2 and row[1].startswith("sha256=")}


def _record_hex(encoded: str | None) -> str | None:
    if encoded is None:
        return None
    try:
        digest = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except ValueError:
        return None
    return digest.hex() if len(digest) == 32 else None


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

    def paths(self) -> list[str]:
        """Every regular file's path, nothing read."""
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d != ".git")
            for name in sorted(filenames):
                full = Path(dirpath, name)
                if not full.is_symlink() and full.is_file():
                    out.append(full.relative_to(self.root).as_posix())
        return out

    def walk(self) -> Iterator[tuple[str, bytes, int]]:
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d != ".git")
            for name in sorted(filenames):
                full = Path(dirpath, name)
                if full.is_symlink() or not full.is_file():
                    continue
                rel = full.relative_to(self.root).as_posix()
                yield rel, full.read_bytes(), full.stat().st_mode & 0o777

    def recorded_sha256(self, path: str) -> str | None:
        return None  # a checkout records no hashes: they are computed
