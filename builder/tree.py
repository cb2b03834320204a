"""Base tree: read the files members touch, lazily, from a wheel (a zip) or a directory.

Nothing is unpacked: a wheel entry is inflated only when a member touches it.
Both kinds answer the same three questions: what bytes does a path hold,
may a member write there (no escape through a symlink), and what are all the
paths (for ``--full-tree``).
"""

from __future__ import annotations

import base64
import csv
import marshal
import os
import posixpath
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import NamedTuple, Protocol, TextIO

# ISA-L inflates and checks CRC-32 about twice and six times as fast as zlib:
# inflating the touched entries is the largest part of an apply.
from isal import isal_zlib

from builder.errors import InputError
from builder.pin import atomic_write, cache_root, pinned_wheel
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
    return WheelTree(path, cache_root() / "zipindex" / f"{pin.sha256}.marshal")


class _Entry(NamedTuple):
    offset: int
    method: int
    compressed_size: int
    size: int
    crc: int
    external_attr: int
    is_dir: bool
    record_sha256: bytes | None  # the digest the wheel's RECORD gives

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.external_attr >> 16)


def _escapes(link_dir: str, target: str) -> bool:
    """Does a symlink in ``link_dir`` pointing at ``target`` resolve outside the tree root?"""
    if posixpath.isabs(target):
        return True
    return posixpath.normpath(posixpath.join(link_dir, target)).split("/")[0] == ".."


_EXTRA_SLACK = 64  # bytes of local extra field read along with an entry's header
# an index row: offset, method, compressed size, size, CRC-32, external attributes, is a
# directory, has a RECORD digest
_ROW = struct.Struct("<QHQQIIBB")


class WheelTree:
    """A wheel read in place: an entry is inflated only when asked for.

    The central directory is parsed once per wheel and kept beside the cache
    (``index_file``, keyed by the wheel's sha256), because parsing 5,000
    entries in Python costs more than applying a handful of members.
    """

    # (format, holds a symlink, {name: row number}, rows packed as _ROW, 32 bytes of RECORD
    # digest per row): packed, it loads in a fifth of the time of a dict of tuples
    INDEX_FORMAT = 3

    def __init__(self, path: Path, index_file: Path | None = None) -> None:
        self.label = str(path)
        self._path, self._index_file = path, index_file
        self._fd = os.open(path, os.O_RDONLY)

    @cached_property
    def _index(self) -> tuple[bool, dict[str, int], bytes, bytes]:
        """Loaded on first use: worker processes (builder.workers) each load it at once."""
        return self._load_index(self._path, self._index_file)

    @property
    def _symlinks(self) -> bool:
        return self._index[0]

    def _entry(self, name: str) -> _Entry | None:
        _, numbers, rows, digests = self._index
        number = numbers.get(name)
        if number is None:
            return None
        *fields, recorded = _ROW.unpack_from(rows, number * _ROW.size)
        return _Entry(*fields, digests[32 * number : 32 * number + 32] if recorded else None)

    def _load_index(self, path: Path, index_file: Path | None) -> tuple[bool, dict[str, int], bytes, bytes]:
        if index_file is not None:
            try:
                fmt, *index = marshal.loads(index_file.read_bytes())
                if fmt == self.INDEX_FORMAT:
                    return tuple(index)  # type: ignore[return-value]
            except (OSError, ValueError, EOFError, TypeError):
                pass  # absent, unreadable or an older format: parse the zip and write it anew
        try:
            with zipfile.ZipFile(path) as zf:
                recorded = _record_digests(zf)
                infos = zf.infolist()
        except (zipfile.BadZipFile, OSError, zlib.error) as exc:
            raise InputError(f"{path}: not a valid wheel (zip): {exc}") from None
        numbers = {info.filename: n for n, info in enumerate(infos)}
        rows = b"".join(
            _ROW.pack(
                i.header_offset,
                i.compress_type,
                i.compress_size,
                i.file_size,
                i.CRC,
                i.external_attr,
                i.is_dir(),
                i.filename in recorded,
            )
            for i in infos
        )
        digests = b"".join(recorded.get(i.filename, bytes(32)) for i in infos)
        symlinks = any(stat.S_ISLNK(i.external_attr >> 16) for i in infos)
        index = (symlinks, numbers, rows, digests)
        if index_file is not None:
            try:
                atomic_write(index_file, marshal.dumps((self.INDEX_FORMAT, *index)))
            except OSError:
                pass  # a read-only cache only costs parsing again next time
        return index

    def read(self, path: str) -> bytes | None:
        entry = self._entry(path)
        if entry is None or entry.is_dir:
            return None
        try:
            # One read for the local header and the data: the header's name is this path and
            # its extra field is seldom long; when it is, the data is read again.
            guess = 30 + len(path.encode()) + _EXTRA_SLACK
            block = os.pread(self._fd, guess + entry.compressed_size, entry.offset)
            if len(block) < 30 or block[:4] != b"PK\x03\x04":
                raise ValueError("bad local header")
            name_len, extra_len = struct.unpack("<HH", block[26:30])
            start = 30 + name_len + extra_len
            if start + entry.compressed_size <= len(block):
                raw = memoryview(block)[start : start + entry.compressed_size]
            else:
                raw = os.pread(self._fd, entry.compressed_size, entry.offset + start)
            if entry.method == zipfile.ZIP_DEFLATED:
                data = isal_zlib.decompress(raw, -15, entry.size or 1)
            elif entry.method == zipfile.ZIP_STORED:
                data = bytes(raw)
            else:
                raise ValueError(f"compression method {entry.method} is not supported")
            if len(data) != entry.size or isal_zlib.crc32(data) != entry.crc:
                raise ValueError("size or CRC-32 does not match the central directory")
        except (OSError, ValueError, isal_zlib.error, struct.error) as exc:
            raise InputError(f"{self.label}: entry {path} is corrupt: {exc}") from None
        return data

    def recorded_sha256(self, path: str) -> str | None:
        entry = self._entry(path)
        return None if entry is None or entry.record_sha256 is None else entry.record_sha256.hex()

    def check_writable(self, path: str) -> str | None:
        if not self._symlinks:  # wheels seldom hold any: then no path can escape
            return None
        parts = path.split("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            info = self._entry(prefix)
            if info is not None and info.is_symlink:
                target = (self.read(prefix) or b"").decode("utf-8", "replace")
                if _escapes(posixpath.dirname(prefix), target):
                    return f"{prefix} is a symlink to {target}, outside the tree"
        return None

    def walk(self) -> Iterator[tuple[str, bytes, int]]:
        for name in self._index[1]:
            info = self._entry(name)
            assert info is not None
            if info.is_dir or info.is_symlink:
                continue
            yield name, self.read(name) or b"", (info.external_attr >> 16) & 0o777 or 0o644


def _record_digests(zf: zipfile.ZipFile) -> dict[str, bytes]:
    """path -> sha256 from the wheel's ``*.dist-info/RECORD``.  The wheel is verified against
    its pinned sha256, so these are the pinned bytes' own hashes: a manifest's before hashes
    come from here instead of hashing every touched file (pip checks them when it installs)."""
    names = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(names) != 1:
        return {}
    digests = {}
    for row in csv.reader(zf.read(names[0]).decode("utf-8").splitlines()):
        if len(row) >= 2 and row[1].startswith("sha256="):
            encoded = row[1][len("sha256=") :]
            try:
                digest = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            except ValueError:
                continue
            if len(digest) == 32:
                digests[row[0]] = digest
    return digests


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

    def recorded_sha256(self, path: str) -> str | None:
        return None  # a checkout records no hashes: they are computed
