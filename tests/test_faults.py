"""Faults: a damaged cache, downloads that stall, stop or never end, inputs that are not
files, and bugs (issue 12).

Every run ends with exit 0 and the outputs a clean run gives, or with one line
``vllm-overlay: …`` as the last stderr line and exit 1, 2 or 3 (README, "What the tool
never does"); an unexpected exception is one line asking for a report (exit 70), with the
traceback only under ``--debug``.

The wheel is a small fake one (a zip of a few vllm/*.py files and a RECORD, stored
uncompressed so that an entry can be rewritten in place), served by an HTTP server in
this process; no real wheel and no service is needed.  Runs that could hang, kill or
exhaust the machine (a FIFO, /dev/zero, a killed download) are processes with a timeout
and resource limits; the rest run in this process.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import builder.members
import builder.pin
from builder.cli import main
from tests.helpers import snapshot
from tests.test_fuzz import (
    TREE,
    Run,
    assert_one_line,
    members,
    proc_one_line,
    project,
    run_main,
    run_module,
)
from tools.synthetic import ROOT, VLLM_PIN, write_recipe

FAULTS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# ------------------------------------------------------------------------ the fake wheel

VERSION = VLLM_PIN["version"]
WHEEL = f"vllm-{VERSION}-py3-none-any.whl"
DIST = f"vllm-{VERSION}.dist-info"
FILES = {**TREE, "vllm/untouched.py": b"u = 1\n"}  # what the members patch, and one file they do not
A_PY_ALTERED = FILES["vllm/a.py"].replace(b"line 15\n", b"LINE 15\n")  # same size, outside every hunk


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(files: dict[str, bytes], recorded: dict[str, bytes] | None = None) -> bytes:
    """A wheel of ``files`` (stored, fixed timestamps: the same files give the same bytes, and
    files of the same sizes a wheel of the same size), whose RECORD hashes ``recorded``."""
    meta = {
        f"{DIST}/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}\n".encode(),
        f"{DIST}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    rows = [f"{path},sha256={_record_hash(data)},{len(data)}" for path, data in {**(recorded or files), **meta}.items()]
    entries = {**files, **meta, f"{DIST}/RECORD": ("\n".join([*rows, f"{DIST}/RECORD,,"]) + "\n").encode()}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name, data in entries.items():
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, data)
    return buf.getvalue()


SMALL = build_wheel(FILES)
# A wheel of a few MiB, so that a download can be stopped half way with bytes on disk.
BIG = build_wheel({**FILES, "vllm/blob.bin": random.Random(12).randbytes(3 << 20)})
SHA = {"small": hashlib.sha256(SMALL).hexdigest(), "big": hashlib.sha256(BIG).hexdigest()}
CAP = 64 << 20  # an endless body stops here: a client still reading then never refused it
CHUNK = b"\0" * (1 << 16)


class Server:
    """Serves the fake wheels, and the faults: a body that stalls half way (until released)
    or stops half way, one endless beyond its Content-Length, one endless with none, one
    that declares a terabyte.  ``sent`` records how many body bytes each request got."""

    def __init__(self) -> None:
        self.big_mode = "full"  # "full", "stall" or "close"
        self.half_sent = threading.Event()
        self.release = threading.Event()
        self.sent: dict[str, int] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _head(self, length: int | None) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                if length is not None:
                    self.send_header("Content-Length", str(length))
                self.end_headers()

            def _endless(self, prefix: bytes = b"") -> int:
                sent = 0
                try:
                    self.wfile.write(prefix)
                    sent = len(prefix)
                    while sent < CAP:
                        self.wfile.write(CHUNK)
                        sent += len(CHUNK)
                except OSError:  # the client hung up: what a refusal looks like from here
                    pass
                return sent

            def do_GET(self):
                path = self.path
                sent = 0
                try:
                    if path == "/small":
                        self._head(len(SMALL))
                        self.wfile.write(SMALL)
                        sent = len(SMALL)
                    elif path == "/big":
                        self._head(len(BIG))
                        half = len(BIG) // 2
                        if outer.big_mode == "full":
                            self.wfile.write(BIG)
                            sent = len(BIG)
                        else:
                            self.wfile.write(BIG[:half])
                            self.wfile.flush()
                            sent = half
                            outer.half_sent.set()
                            if outer.big_mode == "stall":
                                outer.release.wait(60)
                    elif path == "/endless-declared":  # Content-Length of the wheel, zeros without end
                        self._head(len(SMALL))
                        sent = self._endless()
                    elif path == "/wheel-then-endless":  # the wheel, then more than Content-Length says
                        self._head(len(SMALL))
                        sent = self._endless(SMALL)
                    elif path == "/endless-undeclared":  # no Content-Length: ends when the connection does
                        self._head(None)
                        sent = self._endless()
                    elif path == "/huge-declared":
                        self._head(10**12)
                        sent = self._endless()
                    else:
                        self.send_error(404)
                except OSError:
                    pass
                outer.sent[path] = outer.sent.get(path, 0) + sent

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def reset(self) -> None:
        self.big_mode = "full"
        self.half_sent.clear()
        self.release.clear()
        self.sent.clear()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.release.set()
    s.httpd.shutdown()


@pytest.fixture
def served(server: Server) -> Iterator[Server]:
    server.reset()
    yield server
    server.release.set()  # a stalled handler ends with its test


def wheel_recipe(root: Path, server: Server, route: str = "/small", which: str = "small") -> Path:
    """A recipe in ``root`` whose vLLM is the fake wheel at ``route``, members fix and more."""
    pin = {"wheel": WHEEL, "sha256": SHA[which], "url": f"{server.url}{route}"}
    recipe = write_recipe(root, {}, ["fix", "more"], vllm=pin)
    for name, data in members().items():
        (root / "overlay" / f"{name}.patch").write_bytes(data)
    return recipe


def outputs_of(root: Path) -> dict[str, dict[str, bytes]]:
    return {name: snapshot(root / name) for name in ("out", "full") if (root / name).exists()}


def apply_both(root: Path, recipe: Path) -> tuple[Run, dict[str, dict[str, bytes]]]:
    """``apply --out out --full-tree full`` in this process, then its outputs (removed)."""
    for name in ("out", "full"):
        shutil.rmtree(root / name, ignore_errors=True)
    run = run_main(["apply", str(recipe), "--out", str(root / "out"), "--full-tree", str(root / "full")], network=True)
    files = outputs_of(root)
    for name in ("out", "full"):
        shutil.rmtree(root / name, ignore_errors=True)
    return run, files


def check_reference(run: Run, files: dict[str, dict[str, bytes]], which: str = "small") -> None:
    """A clean run's outputs are right: its manifest's hashes are the wheel's own files'."""
    assert run.code == 0, run.show()
    manifest = json.loads(files["out"]["manifest.json"])
    assert manifest["pins"]["vllm"]["sha256"] == SHA[which]
    for row in manifest["files"]:
        base = FILES.get(row["path"])
        assert row["before_sha256"] == (None if base is None else hashlib.sha256(base).hexdigest()), row
    assert files["full"]["vllm/untouched.py"] == FILES["vllm/untouched.py"]


def leftovers(cache: Path) -> list[str]:
    """What a finished run must not leave in the cache: .part files and empty directories."""
    wheels = cache / "wheels"
    found = [str(p.relative_to(cache)) for p in cache.rglob("*.part")]
    if wheels.is_dir():
        found += [
            str(d.relative_to(cache)) + "/ (empty)" for d in wheels.rglob("*") if d.is_dir() and not any(d.iterdir())
        ]
    return found


def assert_same_or_one_line(run: Run, files, reference_run: Run, reference) -> None:
    """Contract C: exit 0 with the clean run's key and files, or one line (exit 1, 2 or 3)."""
    assert run.escaped is None, run.show()
    if run.code == 0:
        assert "Traceback" not in run.err, run.show()
        assert run.out == reference_run.out, run.show()
        for name in ("out", "full"):
            changed = sorted(
                set(files[name]) ^ set(reference[name])
                | {k for k in set(files[name]) & set(reference[name]) if files[name][k] != reference[name][k]}
            )
            assert not changed, f"exit 0, but {name}/ differs from a clean run's in {changed}\n{run.show()}"
    else:
        assert_one_line(run, {1, 2, 3})


# ------------------------------------------------------------- C: a damaged cache, named


CacheDamage = Callable[[Path, Path], None]  # (cache root, cached wheel)


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """New bytes of the same size into the same inode, with atime and mtime put back."""
    st = path.stat()
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def _flip_in_entry(path: Path, entry: str) -> None:
    """Flip a byte of ``entry``'s stored data (its CRC-32 then disagrees), size and mtime kept."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        offset = zf.getinfo(entry).header_offset
    name_len = int.from_bytes(data[offset + 26 : offset + 28], "little")
    extra_len = int.from_bytes(data[offset + 28 : offset + 30], "little")
    at = offset + 30 + name_len + extra_len + 2  # the local header, then the data
    data[at] ^= 0x20
    _rewrite_in_place(path, bytes(data))


def _memo(change: Callable[[str, list], object], spliced: dict[str, str] | None = None) -> CacheDamage:
    """Rewrite verified.json as ``change(key, entry)`` of the wheel's own key and entry, as
    JSON with the text ``spliced`` maps in (what json.dumps cannot write)."""

    def damage(cache: Path, wheel: Path) -> None:
        key = str(wheel.resolve())
        entry = json.loads((cache / "verified.json").read_text())[key]
        text = json.dumps(change(key, entry))
        for old, new in (spliced or {}).items():
            text = text.replace(old, new)
        (cache / "verified.json").write_text(text)

    return damage


def _memo_bytes(data: bytes) -> CacheDamage:
    return lambda cache, wheel: (cache / "verified.json").write_bytes(data)


def _replace_by_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside").write_text("x")


def _make_file(path: Path) -> None:
    shutil.rmtree(path)
    path.write_text("not a directory")


DAMAGE: dict[str, CacheDamage] = {
    "memo: garbage bytes": _memo_bytes(b"\x00\xff{{ not json"),
    "memo: empty": _memo_bytes(b""),
    "memo: not UTF-8": _memo_bytes(b'{"\xff": 1}'),
    "memo: a number too large for a float": _memo_bytes(b"1e999"),
    "memo: nested 100,000 deep": _memo_bytes(b"[" * 100_000 + b"]" * 100_000),
    "memo: a list": _memo(lambda key, entry: [key, entry]),
    "memo: null": _memo(lambda key, entry: None),
    "memo: a string": _memo(lambda key, entry: "verified"),
    "memo: entry an int": _memo(lambda key, entry: {key: 5}),
    "memo: entry null": _memo(lambda key, entry: {key: None}),
    "memo: entry a mapping": _memo(lambda key, entry: {key: {"size": entry[0]}}),
    "memo: entry too short": _memo(lambda key, entry: {key: entry[:2]}),
    "memo: entry too long": _memo(lambda key, entry: {key: [*entry, entry]}),
    "memo: entry of strings": _memo(lambda key, entry: {key: [str(v) for v in entry]}),
    "memo: entry of floats": _memo(lambda key, entry: {key: [float(v) if type(v) is int else v for v in entry]}),
    "memo: entry with a wrong hash": _memo(lambda key, entry: {key: [*entry[:-1], "0" * 64]}),
    "memo: entry with a 5,000-digit size": _memo(
        lambda key, entry: {key: ["SIZE", *entry[1:]]}, {'"SIZE"': "9" * 5000}
    ),
    "memo: a directory": lambda c, w: ((c / "verified.json").unlink(), (c / "verified.json").mkdir()),
    "wheel: truncated": lambda c, w: w.write_bytes(SMALL[: len(SMALL) // 2]),
    "wheel: empty": lambda c, w: w.write_bytes(b""),
    "wheel: garbage, size and mtime kept": lambda c, w: _rewrite_in_place(w, bytes(len(SMALL))),
    "wheel: a byte of a touched file flipped, size and mtime kept": lambda c, w: _flip_in_entry(w, "vllm/a.py"),
    "wheel: a byte of an untouched file flipped, size and mtime kept": lambda c, w: _flip_in_entry(
        w, "vllm/untouched.py"
    ),
    # rewritten with valid CRCs: only a hash of the whole wheel can tell
    "wheel: a touched file altered, CRC valid, size and mtime kept": lambda c, w: _rewrite_in_place(
        w, build_wheel({**FILES, "vllm/a.py": A_PY_ALTERED}, recorded=FILES)
    ),
    "wheel: an untouched file altered, CRC valid, size and mtime kept": lambda c, w: _rewrite_in_place(
        w, build_wheel({**FILES, "vllm/untouched.py": b"U = 1\n"}, recorded=FILES)
    ),
    "wheel: RECORD altered, CRC valid, size and mtime kept": lambda c, w: _rewrite_in_place(
        w, build_wheel(FILES, recorded={**FILES, "vllm/a.py": A_PY_ALTERED})
    ),
    "wheel: replaced by a directory": lambda c, w: _replace_by_dir(w),
    "wheel: a dangling symlink": lambda c, w: (w.unlink(), w.symlink_to(c / "nowhere")),
    "wheel: a symlink to /dev/null": lambda c, w: (w.unlink(), w.symlink_to("/dev/null")),
    "wheel: gone, its directory left": lambda c, w: w.unlink(),
    "wheels/<sha256> is a file": lambda c, w: _make_file(w.parent),
    "wheels is a file": lambda c, w: _make_file(c / "wheels"),
    "a stray .part, the wheel gone": lambda c, w: w.rename(w.parent / f".{WHEEL}.part"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_cache_gives_the_clean_outputs_or_one_line(damage, served, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_OVERLAY_REPOSITORY", raising=False)
    recipe = wheel_recipe(tmp_path, served)
    reference_run, reference = apply_both(tmp_path, recipe)  # fetches: the cache is warm after it
    check_reference(reference_run, reference)
    cache = tmp_path / "cache"
    wheel = cache / "wheels" / SHA["small"] / WHEEL
    assert wheel.is_file() and (cache / "verified.json").is_file()
    DAMAGE[damage](cache, wheel)
    run, files = apply_both(tmp_path, recipe)
    assert_same_or_one_line(run, files, reference_run, reference)


# -------------------------------------------------- C: a damaged cache, at random


def _memo_value(spec, stats: dict):
    """A symbolic memo value made concrete with the cached wheel's real stats."""
    if isinstance(spec, list):
        return [_memo_value(s, stats) for s in spec]
    if isinstance(spec, dict):
        return {(stats["key"] if k == "KEY" else k): _memo_value(v, stats) for k, v in spec.items()}
    return stats.get(spec, spec) if isinstance(spec, str) else spec


_ATOMS = st.one_of(
    st.sampled_from(["size", "mtime", "ctime", "ino", "sha", "zeros", "KEY"]),
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
MEMO = st.one_of(
    st.recursive(
        _ATOMS,
        lambda children: (
            st.lists(children, max_size=6)
            | st.dictionaries(st.one_of(st.just("KEY"), st.text(max_size=8)), children, max_size=3)
        ),
        max_leaves=12,
    ),
    st.lists(st.sampled_from(["size", "mtime", "ctime", "ino", "sha", "zeros"]), max_size=6).map(
        lambda entry: {"KEY": entry}
    ),
)


@contextlib.contextmanager
def warm_project(server):
    """A project on the fake wheel in a fresh directory (hypothesis examples cannot share
    pytest's tmp_path), its cache warm from a clean run whose outputs are the reference:
    (root, recipe, reference run, reference files)."""
    server.reset()
    with (
        tempfile.TemporaryDirectory(prefix="vllm-overlay-faults.") as tmp,
        mock.patch.dict(os.environ, {"VLLM_OVERLAY_CACHE": str(Path(tmp, "cache"))}),
    ):
        root = Path(tmp)
        recipe = wheel_recipe(root, server)
        reference_run, reference = apply_both(root, recipe)
        check_reference(reference_run, reference)
        yield root, recipe, reference_run, reference


@FAULTS
@given(memo=st.one_of(MEMO.map(lambda v: ("json", v)), st.binary(max_size=40).map(lambda b: ("bytes", b))))
def test_any_verified_json_gives_the_clean_outputs_or_one_line(memo, server):
    with warm_project(server) as (root, recipe, reference_run, reference):
        cache = root / "cache"
        wheel = cache / "wheels" / SHA["small"] / WHEEL
        st_ = wheel.stat()
        stats = {
            "size": st_.st_size,
            "mtime": st_.st_mtime_ns,
            "ctime": st_.st_ctime_ns,
            "ino": st_.st_ino,
            "sha": SHA["small"],
            "zeros": "0" * 64,
            "key": str(wheel.resolve()),
        }
        kind, value = memo
        if kind == "json":
            (cache / "verified.json").write_text(json.dumps(_memo_value(value, stats)))
        else:
            (cache / "verified.json").write_bytes(value)
        run, files = apply_both(root, recipe)
        assert_same_or_one_line(run, files, reference_run, reference)


@FAULTS
@given(flips=st.lists(st.tuples(st.integers(0, len(SMALL) - 1), st.integers(1, 255)), min_size=1, max_size=4))
def test_a_wheel_flipped_in_place_gives_the_clean_outputs_or_one_line(flips, server):
    """Bytes of the cached wheel changed anywhere (headers, directory, data), its size and
    mtime put back."""
    with warm_project(server) as (root, recipe, reference_run, reference):
        wheel = root / "cache" / "wheels" / SHA["small"] / WHEEL
        data = bytearray(wheel.read_bytes())
        for at, xor in flips:
            data[at] ^= xor
        _rewrite_in_place(wheel, bytes(data))
        run, files = apply_both(root, recipe)
        assert_same_or_one_line(run, files, reference_run, reference)


# ------------------------------------------------------------ D: downloads that go wrong


def _limits(memory: int = 1 << 30, file_size: int = 256 << 20) -> Callable[[], None]:
    """preexec_fn: a process that reads without end runs out of these, not of the machine."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    return apply


def light_snapshot(directory: Path) -> dict[str, object]:
    """snapshot(), with files over 1 MiB (a sparse terabyte) told by size and mtime, unread."""
    out: dict[str, object] = {}
    for p in sorted(directory.rglob("*")):
        st_ = p.lstat()
        regular = p.is_file() and not p.is_symlink()
        big = regular and st_.st_size > (1 << 20)
        out[str(p.relative_to(directory))] = (
            (st_.st_size, st_.st_mtime_ns) if big else p.read_bytes() if regular else "<link, dir or special>"
        )
    return out


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_OVERLAY_CACHE=str(cache))
    env.pop("VLLM_OVERLAY_REPOSITORY", None)
    return env


def _wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _bytes_under(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.exists() else 0


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_a_download_killed_midway_leaves_at_most_a_part_the_next_run_removes(how, served, tmp_path):
    recipe = wheel_recipe(tmp_path, served, "/big", "big")
    cache = tmp_path / "cache"
    served.big_mode = "stall"
    argv = [sys.executable, "-m", "builder", "apply", str(recipe), "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_limits()
    )
    try:
        assert served.half_sent.wait(30), "the download never started"
        _wait_for(lambda: _bytes_under(cache / "wheels") > 0, 10)  # some of it on disk
        proc.send_signal(getattr(signal, how))
        proc.wait(30)
    finally:
        proc.kill()
        proc.communicate()
        served.release.set()
    left = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and p.name != "verified.json")
    assert len(left) <= 1 and all(name.endswith(".part") for name in left), left
    if how == "SIGKILL":  # the premise: killed with half the wheel on disk, in a .part
        assert len(left) == 1, "the kill left no .part: the download had not started"
    assert not (tmp_path / "out").exists()
    served.big_mode = "full"
    again = run_module("apply", str(recipe), "--out", str(tmp_path / "out"), cwd=tmp_path, env=_env(cache))
    assert again.returncode == 0, again.stderr
    assert "Traceback" not in again.stderr
    assert leftovers(cache) == [], (leftovers(cache), again.stderr)
    assert (cache / "wheels" / SHA["big"] / WHEEL).read_bytes() == BIG
    assert (tmp_path / "out" / "vllm" / "b.py").read_bytes() == b"def b():\n    return 3\n"


def test_a_part_left_beside_a_cached_wheel_is_removed_by_the_next_run(served, tmp_path, monkeypatch):
    """A ``.part`` a killed run left is the next run's to remove, also when that run finds
    the wheel already cached (it had been fetched by a run that finished meanwhile)."""
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_OVERLAY_REPOSITORY", raising=False)
    recipe = wheel_recipe(tmp_path, served)
    reference_run, reference = apply_both(tmp_path, recipe)
    check_reference(reference_run, reference)
    wheel = tmp_path / "cache" / "wheels" / SHA["small"] / WHEEL
    (wheel.parent / f".{WHEEL}.part").write_bytes(SMALL[:100])
    run, files = apply_both(tmp_path, recipe)
    assert_same_or_one_line(run, files, reference_run, reference)
    assert leftovers(tmp_path / "cache") == [], run.show()


def test_a_server_that_closes_early_is_one_line_and_the_next_run_succeeds(served, tmp_path):
    recipe = wheel_recipe(tmp_path, served, "/big", "big")
    cache = tmp_path / "cache"
    served.big_mode = "close"
    first = run_module("apply", str(recipe), "--out", str(tmp_path / "out"), cwd=tmp_path, env=_env(cache))
    proc_one_line(first, {2, 3})
    assert not (tmp_path / "out").exists()
    left = sorted(str(p.relative_to(cache)) for p in (cache / "wheels").rglob("*") if p.is_file())
    assert len(left) <= 1 and all(name.endswith(".part") for name in left), left
    served.big_mode = "full"
    again = run_module("apply", str(recipe), "--out", str(tmp_path / "out"), cwd=tmp_path, env=_env(cache))
    assert again.returncode == 0, again.stderr
    assert leftovers(cache) == [], (leftovers(cache), again.stderr)


@pytest.mark.parametrize("route", ["/endless-declared", "/endless-undeclared", "/huge-declared", "/wheel-then-endless"])
def test_a_download_without_end_is_refused_and_leaves_nothing(route, served, tmp_path, monkeypatch):
    """A body longer than its Content-Length, one with none, one that declares a terabyte:
    the download stops at the Content-Length or at the documented maximum (2 GiB, shrunk here
    to 8 MiB so the test reads 8 MiB), with one line; nothing is left in the cache.  The wheel
    followed by more than its Content-Length may also be taken (what was read is the wheel)."""
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_OVERLAY_REPOSITORY", raising=False)
    monkeypatch.setattr(builder.pin, "MAX_WHEEL_BYTES", 8 << 20)
    recipe = wheel_recipe(tmp_path, served, route)
    run, files = apply_both(tmp_path, recipe)
    assert run.escaped is None, run.show()
    _wait_for(lambda: route in served.sent, 10)
    assert served.sent.get(route, 0) < CAP, f"read {served.sent.get(route)} bytes of {route} without refusing it"
    if route == "/wheel-then-endless" and run.code == 0:
        check_reference(run, files)
    else:
        assert_one_line(run, {2, 3})
    assert leftovers(tmp_path / "cache") == [], leftovers(tmp_path / "cache")


@pytest.mark.parametrize("field", ["url", "index"])
def test_a_pin_on_dev_zero_is_refused_before_any_read(field, tmp_path):
    """``file:///dev/zero`` as a pin's url or index: refused as bad input (only http(s); a
    local wheel goes through path:), by every command, with nothing read or written."""
    with project() as p:
        text = p.recipe.read_text()
        path_line = next(line for line in text.splitlines() if line.startswith("  path: "))
        p.recipe.write_text(text.replace(path_line + "\n", f'  {field}: "file:///dev/zero"\n'))
        before = snapshot(p.root)
        keyed = run_main(["key", str(p.recipe)])
        assert_one_line(keyed, {2}, f"vllm.{field}")
        proc = run_module(
            "apply", str(p.recipe), "--out", str(p.out), cwd=p.root, env={}, timeout=30, preexec_fn=_limits()
        )
        proc_one_line(proc, {2}, f"vllm.{field}")
        assert snapshot(p.root) == before


# --------------------------------------------------------- D: inputs that are not files


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


def _directory(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.mkdir()


def _sparse(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # a terabyte of holes: no member is that large


NOT_FILES = {"a FIFO": _fifo, "a link to /dev/zero": _dev_zero, "a directory": _directory, "a sparse terabyte": _sparse}


@pytest.mark.parametrize("which", ["member", "recipe"])
@pytest.mark.parametrize("what", list(NOT_FILES))
def test_an_input_that_is_not_a_plain_file_is_one_line_without_waiting(what, which, tmp_path):
    """Refused at once (exit 2, one line), in a process with a 30 s timeout and 1 GiB of
    memory: never waited on, never read to its end."""
    with project() as p:
        target = p.member("fix") if which == "member" else p.recipe
        NOT_FILES[what](target)
        before = light_snapshot(p.root)
        started = time.monotonic()
        proc = run_module(
            "apply", str(p.recipe), "--out", str(p.out), cwd=p.root, env={}, timeout=30, preexec_fn=_limits()
        )
        proc_one_line(proc, {2})
        assert time.monotonic() - started < 30
        assert light_snapshot(p.root) == before


# ------------------------------------------------------------- E: a bug is one line


def _boom(*args, **kwargs):
    raise ZeroDivisionError("a bug planted by the test")


def test_an_unexpected_exception_is_one_line_asking_for_a_report(monkeypatch):
    """No traceback, one line that says where and asks for a report (exit 70, README)."""
    monkeypatch.setattr(builder.members, "parse_member", _boom)
    with project() as p:
        run = run_main(["key", str(p.recipe)])
    assert run.escaped is None, run.show()
    assert run.code == 70, run.show()
    lines = run.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm-overlay: "), run.show()
    assert "please report" in lines[0] and "ZeroDivisionError" in lines[0], run.show()
    assert "test_faults.py:" in lines[0], run.show()  # where: the file and line that raised
    assert "Traceback" not in run.err


def test_debug_shows_the_traceback_of_an_unexpected_exception(monkeypatch):
    monkeypatch.setattr(builder.members, "parse_member", _boom)
    with project() as p:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(["--debug", "key", str(p.recipe)])
            except ZeroDivisionError:
                return  # re-raised: python -m builder prints the traceback
    assert code != 0 and "Traceback (most recent call last)" in err.getvalue(), (code, err.getvalue())
    assert "ZeroDivisionError" in err.getvalue()


def test_debug_is_an_option_of_the_command_line():
    with project() as p:
        proc = run_module("--debug", "key", str(p.recipe), cwd=p.root, env={"VLLM_OVERLAY_CACHE": str(p.cache)})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("rk-") and proc.stderr == ""


def test_a_bug_in_a_process_is_one_line_without_debug_and_a_traceback_with_it(tmp_path):
    """The same through ``python -m builder`` (the bug planted before the module runs)."""
    with project() as p:
        plant = (
            "import runpy, sys, builder.members as m\n"
            "def boom(*a, **k):\n    raise ZeroDivisionError('planted')\n"
            "m.parse_member = boom\n"
            "sys.argv = ['vllm-overlay', *sys.argv[1:]]\n"
            "runpy.run_module('builder', run_name='__main__', alter_sys=True)\n"
        )
        results = {}
        for debug in ([], ["--debug"]):
            results[bool(debug)] = subprocess.run(
                [sys.executable, "-c", plant, *debug, "key", str(p.recipe)],
                cwd=p.root,
                env=_env(p.cache),
                capture_output=True,
                text=True,
                timeout=60,
            )
    quiet, loud = results[False], results[True]
    assert quiet.returncode == 70, quiet.stderr
    assert quiet.stderr.count("\n") == 1 and "please report" in quiet.stderr and "Traceback" not in quiet.stderr
    assert loud.returncode != 0 and "Traceback (most recent call last)" in loud.stderr
    assert "ZeroDivisionError: planted" in loud.stderr


def test_the_fake_wheel_is_what_the_tests_think(tmp_path):
    """The fixtures' own checks: rewriting an entry keeps the wheel's size, and the CRC of a
    rewritten entry is valid (only the wheel's sha256 can tell)."""
    altered = build_wheel({**FILES, "vllm/a.py": A_PY_ALTERED}, recorded=FILES)
    assert len(altered) == len(SMALL) and altered != SMALL
    with zipfile.ZipFile(io.BytesIO(altered)) as zf:
        assert zf.testzip() is None
        assert zlib.crc32(zf.read("vllm/a.py")) == zf.getinfo("vllm/a.py").CRC
    assert len(build_wheel(FILES, recorded={**FILES, "vllm/a.py": A_PY_ALTERED})) == len(SMALL)
