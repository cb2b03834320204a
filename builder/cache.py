"""The cache and atomic writes: where the builder keeps what it fetched, and how it writes.

Layout under the cache root (``cache_root()``)::

    wheels/<sha256>/<wheel file name>   a verified wheel (builder.pin)
    verified.json                       path -> (size, mtime_ns, sha256) of files already hashed
    probe-venv/vllm-<version>/          the probe's interpreter (builder.probe_env)

Every file the builder writes goes through ``atomic_write`` (a temp name beside
it, then a rename), so a reader sees the old file or the new one, never half;
output directories are swapped in whole the same way (builder.output).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


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
    """sha256 of files, remembered by (path, size, mtime_ns) in ``verified.json``."""

    def __init__(self, root: Path) -> None:
        self.file = root / "verified.json"
        try:
            self.entries: dict[str, list] = json.loads(self.file.read_text())
        except (OSError, ValueError):
            self.entries = {}

    def known(self, path: Path) -> str | None:
        """The remembered sha256, if the file's size and mtime are unchanged since it was hashed."""
        st = path.stat()
        entry = self.entries.get(str(path.resolve()))
        if entry and entry[0] == st.st_size and entry[1] == st.st_mtime_ns:
            return entry[2]
        return None

    def remember(self, path: Path, digest: str) -> None:
        st = path.stat()
        self.entries[str(path.resolve())] = [st.st_size, st.st_mtime_ns, digest]
        try:
            atomic_write(self.file, json.dumps(self.entries, indent=0, sort_keys=True).encode())
        except OSError:
            pass  # a read-only cache only costs a re-hash next time
