"""Pin: fetch a pinned wheel once, verify its sha256, keep it in a content-addressed cache.

The wheel is kept at ``wheels/<sha256>/<wheel file name>`` under the cache
root (builder.cache), written to a temp name and renamed once verified.  The
cache's verified-hash memo lets a warm run trust a wheel it has hashed before
without reading 336 MB again; any change of size or mtime makes it hash again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from builder.cache import MIB, HashMemo, cache_root, locked
from builder.errors import InputError, ServiceUnreachable, StorageFailed
from builder.recipe import WheelPin

CHUNK = 1 << 20
TIMEOUT = 60  # seconds, for every network read
# The largest wheel fetched when the index declares no size (vLLM 0.30.0's is 315 MB).
MAX_WHEEL_BYTES = 2 << 30
INDEX_PAGE_LIMIT = 16 << 20


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
    if memo.notice:
        print(memo.notice, file=progress, flush=True)
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
    _remove_stale_part(dest, progress)
    if dest.is_symlink() or dest.exists():
        if dest.is_file() and memo.known(dest) == pin.sha256:
            return dest
        if dest.is_file() and sha256_file(dest) == pin.sha256:
            memo.remember(dest, pin.sha256)
            return dest
        # a damaged cache entry is replaced, never trusted
        print(f"cache: {dest} does not match its sha256; fetching it again", file=progress, flush=True)
        _remove(dest)
    url, declared = (pin.url, None) if pin.url else resolve_from_index(pin)
    _download(url, dest, pin, label, progress, declared)
    memo.remember(dest, pin.sha256)
    return dest


def _cached_wheel(pin: WheelPin, root: Path) -> Path:
    """Where the cache keeps a fetched wheel: under its sha256, by its file name."""
    return root / "wheels" / pin.sha256 / pin.wheel


def _expect(pin: WheelPin, actual: str, where: str) -> None:
    if actual != pin.sha256:
        raise InputError(f"{where} has sha256 {actual}, the pin says {pin.sha256}", field=f"{pin.project}.sha256")


def index_files(project: str, index: str) -> tuple[str, list[dict]]:
    """The page URL and the file entries of ``project``'s PEP 691 (JSON) page on ``index``."""
    import http.client  # network modules only when the network is used: they cost 15 ms to import
    import urllib.error
    import urllib.request

    page = f"{index.rstrip('/')}/{project}/"
    req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
            body = resp.read(INDEX_PAGE_LIMIT + 1)
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        raise ServiceUnreachable(f"cannot read the package index {page}: {exc}", field=project) from None
    try:
        if len(body) > INDEX_PAGE_LIMIT:
            raise ValueError(f"larger than {INDEX_PAGE_LIMIT // MIB} MiB")
        files = json.loads(body)["files"]
        if not isinstance(files, list):
            raise TypeError("files is not a list")
    except (ValueError, KeyError, TypeError) as exc:
        raise ServiceUnreachable(f"the package index {page} answered with no PEP 691 page: {exc}") from None
    return page, [f for f in files if isinstance(f, dict) and isinstance(f.get("filename"), str)]


def resolve_from_index(pin: WheelPin) -> tuple[str, int | None]:
    """The wheel's URL in a PEP 691 (JSON) simple index, and its size when the index
    declares one (PEP 700): the download may not exceed it."""
    import urllib.parse

    page, files = index_files(pin.project, pin.index)
    entries = [e for e in files if e["filename"] == pin.wheel]
    if entries and not isinstance(entries[0].get("url"), str):
        raise ServiceUnreachable(
            f"the package index {page} answered with no PEP 691 page: its entry for the wheel has no url"
        )
    if not entries:
        raise InputError(f"{pin.wheel} is not listed on {page}", field=f"{pin.project}.wheel")
    url = urllib.parse.urljoin(page, entries[0]["url"])
    if not url.startswith(("https://", "http://")):
        raise InputError(f"the index lists {pin.wheel} at {url}: only http(s) downloads", field=pin.project)
    size = entries[0].get("size")
    return url, size if type(size) is int and size > 0 else None


def _download(url: str, dest: Path, pin: WheelPin, label: str, progress: TextIO | None, declared: int | None) -> None:
    """Stream ``url`` to ``.<wheel>.part`` beside ``dest``, hashing as it goes, at most the
    size the index declared (else MAX_WHEEL_BYTES) and never more than the server's own
    Content-Length; rename only when verified.  Runs under a lock on the wheel's directory,
    so a ``.part`` left by a killed run is removed here, never raced."""
    import http.client
    import urllib.error
    import urllib.request

    ceiling = declared or MAX_WHEEL_BYTES
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageFailed(f"cannot make {dest.parent}: {exc.strerror or exc}") from None
    tmp = _part(dest)
    with locked(dest.parent):
        try:
            h = hashlib.sha256()
            got = total = 0
            try:
                with open(tmp, "wb") as out, urllib.request.urlopen(url, timeout=TIMEOUT) as resp:
                    total = int(resp.headers.get("Content-Length") or 0)
                    if total > ceiling:
                        raise InputError(f"{url} is {total} bytes, more than the {ceiling} allowed", field=pin.project)
                    report = _progress_reporter(label, total, progress)
                    while chunk := resp.read(CHUNK):
                        got += len(chunk)
                        if got > ceiling or (total and got > total):
                            limit = min(x for x in (ceiling, total) if x)
                            raise InputError(f"download of {url} exceeds {limit} bytes", field=pin.project)
                        out.write(chunk)
                        h.update(chunk)
                        report(got)
                    report(got, final=True)
            except http.client.IncompleteRead:
                got = -1  # the server closed early: reported as truncated below
            except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as exc:
                raise ServiceUnreachable(f"download of {url} failed: {exc}", field=pin.project) from None
            if got < 0 or (total and got != total):
                raise InputError(f"download of {url} is truncated (got fewer than {total} bytes)", field=pin.project)
            _expect(pin, h.hexdigest(), url)
            check_zip(tmp, f"{pin.project}: {url}")
            os.replace(tmp, dest)
        except OSError as exc:
            raise StorageFailed(f"cannot write {tmp}: {exc.strerror or exc}") from None
        finally:
            tmp.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                dest.parent.rmdir()  # empty only when the download failed: then nothing is left


def _part(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.part"


def _remove_stale_part(dest: Path, progress: TextIO) -> None:
    """A ``.part`` left by a killed download goes (under the lock: a download running now
    holds it, and removes or renames its own ``.part`` before letting go)."""
    tmp = _part(dest)
    if not (tmp.exists() or tmp.is_symlink()) or not dest.parent.is_dir():
        return
    with locked(dest.parent):
        if tmp.exists() or tmp.is_symlink():
            print(f"cache: removing {tmp.name}, left by a download that did not finish", file=progress, flush=True)
            _remove(tmp)


def _remove(path: Path) -> None:
    """A cache entry, whatever it has become (a file, a link, a directory)."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as exc:
        raise StorageFailed(f"cannot remove the damaged cache entry {path}: {exc.strerror or exc}") from None


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
