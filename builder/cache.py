"""The cache and atomic writes: where the builder keeps what it fetched, and how it writes.

Layout under the cache root (``cache_root()``)::

    wheels/<sha256>/<wheel file name>   a verified wheel (builder.pin)
    verified.json                       path -> (size, mtime_ns, sha256) of files already hashed
    probe-venv/vllm-<version>/          the probe's interpreter (builder.probe_env)

Every input file the builder reads (recipe, member, source, produced rows) goes
through ``read_regular``: a regular file, with a size ceiling, opened so that a
FIFO or a device cannot make it wait or read without end.

Every file the builder writes goes through ``atomic_write`` (a temp name beside
it, then a rename), so a reader sees the old file or the new one, never half;
output directories are swapped in whole the same way (builder.output).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from builder.errors import InputError


def cache_root() -> Path:
    """$VLLM_OVERLAY_CACHE, else $XDG_CACHE_HOME/vllm-overlay, else ~/.cache/vllm-overlay."""
    explicit = os.environ.get("VLLM_OVERLAY_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "vllm-overlay" if xdg else Path.home() / ".cache" / "vllm-overlay"


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temp name beside ``path`` and rename: readers see old or new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class HashMemo:
    """sha256 of files, remembered in ``verified.json`` by path with the file's size, mtime,
    ctime and inode: a file changed in place (its ctime moves even when its size and mtime
    are put back) or replaced (a new inode) is hashed again.  An unreadable or malformed
    memo is dropped with a notice (``self.notice``), never believed."""

    def __init__(self, root: Path) -> None:
        self.file = root / "verified.json"
        self.notice: str | None = None
        self.entries: dict[str, list] = {}
        try:
            entries = json.loads(read_regular(self.file, 16 * MIB, "the verified-hash memo"))
        except FileNotFoundError:
            return
        except (OSError, ValueError, RecursionError, InputError):
            self.notice = f"cache: {self.file} is unreadable; hashing again"
            return
        if isinstance(entries, dict) and all(_memo_entry(v) for v in entries.values()):
            self.entries = entries
        else:
            self.notice = f"cache: {self.file} is not a verified-hash memo; hashing again"

    @staticmethod
    def _identity(st: os.stat_result) -> list[int]:
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]

    def known(self, path: Path) -> str | None:
        """The remembered sha256, if the file is the one hashed and unchanged since."""
        entry = self.entries.get(str(path.resolve()))
        if entry and entry[:4] == self._identity(path.stat()):
            return entry[4]
        return None

    def remember(self, path: Path, digest: str) -> None:
        self.entries[str(path.resolve())] = [*self._identity(path.stat()), digest]
        try:
            atomic_write(self.file, json.dumps(self.entries, indent=0, sort_keys=True).encode())
        except OSError:
            pass  # a read-only cache only costs a re-hash next time


def _memo_entry(value: object) -> bool:
    """[size, mtime_ns, ctime_ns, inode, sha256 hex]: what remember() writes."""
    return (
        isinstance(value, list)
        and len(value) == 5
        and all(type(v) is int for v in value[:4])
        and isinstance(value[4], str)
        and len(value[4]) == 64
    )


KIB, MIB = 1 << 10, 1 << 20


def read_regular(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The bytes of ``path``, which must be a regular file of at most ``limit`` bytes (a
    symlink to one is followed).  Opened non-blocking: a FIFO is refused, never waited on.
    FileNotFoundError and other OSErrors are the caller's to word."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{what} is not a regular file", file=path)
        chunks, size = [], 0
        while chunk := os.read(fd, min(limit + 1 - size, max(st.st_size + 1, 1 << 16))):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise InputError(f"{what} is larger than {limit // KIB} KiB (the limit for one)", file=path)
        return b"".join(chunks)
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path``, for work two runs must not interleave: a directory is
    locked itself (no lock file to leave behind), anything else is a lock file, made if
    missing."""
    if path.is_dir():
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
