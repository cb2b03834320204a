"""Pin: fetch a pinned wheel once, verify its sha256, keep it in a content-addressed cache.

The wheel is kept at ``wheels/<sha256>/<wheel file name>`` under the cache
root (builder.cache), written to a temp name and renamed once verified.  The
cache's verified-hash memo lets a warm run trust a wheel it has hashed before
without reading 336 MB again; any change of size or mtime makes it hash again.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from builder.cache import HashMemo, cache_root
from builder.errors import InputError, ServiceUnreachable
from builder.recipe import WheelPin

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_zip(path: Path, label: str) -> None:
    """A wheel must open as a zip (reads the central directory only)."""
    try:
        with zipfile.ZipFile(path) as zf:
            zf.infolist()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise InputError(f"not a valid wheel (zip): {exc}", file=label) from None


def pinned_wheel(pin: WheelPin, *, root: Path | None = None, progress: TextIO | None = None) -> Path:
    """Path of the verified wheel for ``pin``, downloading it on first use.

    A local ``pin.path`` wheel is verified in place (its hash remembered); a
    directory is returned as it is (a source checkout has no wheel hash).
    """
    root = root or cache_root()
    progress = progress or sys.stderr
    memo = HashMemo(root)
    label = f"{pin.project} {pin.version} ({pin.wheel})"
    if pin.path is not None:
        if pin.path.is_dir():
            return pin.path
        if not pin.path.is_file():
            raise InputError(f"{pin.path}: no such wheel file or directory", field=f"{pin.project}.path")
        if memo.known(pin.path) != pin.sha256:
            _expect(pin, sha256_file(pin.path), str(pin.path))
            check_zip(pin.path, str(pin.path))
            memo.remember(pin.path, pin.sha256)  # only a verified wheel is remembered
        return pin.path

    dest = _cached_wheel(pin, root)
    if dest.is_file():
        if memo.known(dest) == pin.sha256:
            return dest
        if sha256_file(dest) == pin.sha256:
            memo.remember(dest, pin.sha256)
            return dest
        dest.unlink()  # a damaged cache entry is replaced, never trusted
    url = pin.url or resolve_from_index(pin)
    _download(url, dest, pin, label, progress)
    memo.remember(dest, pin.sha256)
    return dest


def is_fetched(pin: WheelPin, *, root: Path | None = None) -> bool:
    """Whether pinned_wheel() needs no download: a local path, or the wheel in the cache."""
    return pin.path is not None or _cached_wheel(pin, root or cache_root()).is_file()


def _cached_wheel(pin: WheelPin, root: Path) -> Path:
    """Where the cache keeps a fetched wheel: under its sha256, by its file name."""
    return root / "wheels" / pin.sha256 / pin.wheel


def _expect(pin: WheelPin, actual: str, where: str) -> None:
    if actual != pin.sha256:
        raise InputError(f"{where} has sha256 {actual}, the pin says {pin.sha256}", field=f"{pin.project}.sha256")


def resolve_from_index(pin: WheelPin) -> str:
    """Find the wheel's URL in a PEP 691 (JSON) simple index."""
    import urllib.error  # network modules only when the network is used: they cost 15 ms to import
    import urllib.parse
    import urllib.request

    base = pin.index.rstrip("/")
    page = f"{base}/{pin.project}/"
    req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            listing = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ServiceUnreachable(f"cannot read the package index {page}: {exc}", field=pin.project) from None
    for entry in listing.get("files", []):
        if entry.get("filename") == pin.wheel:
            return urllib.parse.urljoin(page, entry["url"])
    raise InputError(f"{pin.wheel} is not listed on {page}", field=f"{pin.project}.wheel")


def _download(url: str, dest: Path, pin: WheelPin, label: str, progress: TextIO | None) -> None:
    """Stream ``url`` to a temp file beside ``dest``, hashing as it goes; rename only when verified."""
    import http.client
    import urllib.error
    import urllib.request

    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        got = 0
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as resp:
                total = int(resp.headers.get("Content-Length") or 0)
                report = _progress_reporter(label, total, progress)
                while chunk := resp.read(CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    got += len(chunk)
                    report(got)
                report(got, final=True)
        except http.client.IncompleteRead:
            got = -1  # the server closed early: reported as truncated below
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise ServiceUnreachable(f"download of {url} failed: {exc}", field=pin.project) from None
        if got < 0 or (total and got != total):
            raise InputError(f"download of {url} is truncated (got fewer than {total} bytes)", field=pin.project)
        _expect(pin, h.hexdigest(), url)
        check_zip(tmp, f"{pin.project}: {url}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
        try:
            dest.parent.rmdir()  # leaves nothing behind when the download failed
        except OSError:
            pass


def _progress_reporter(label: str, total: int, stream: TextIO | None) -> Callable[..., None]:
    last = [0.0]

    def report(done: int, final: bool = False) -> None:
        if stream is None:
            return
        now = time.monotonic()
        if not final and now - last[0] < 0.5:
            return
        last[0] = now
        size = f"{done / 1e6:.1f}/{total / 1e6:.1f} MB ({100 * done / total:.0f}%)" if total else f"{done / 1e6:.1f} MB"
        print(f"download {label}: {size}{' done' if final else ''}", file=stream, flush=True)

    return report
