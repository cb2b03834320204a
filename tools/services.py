"""Where the real components of the integration tests are, and the parts of
`.ci/services.sh` that are Python rather than daemon plumbing.

`.ci/services.sh start` starts dockerd (two: the second stands in for a second host),
the registry and the package index,
imports the base image, and writes their coordinates to an env file
(`/run/vllm-overlay/env`, or `$VO_ENV_FILE`) as NAME=VALUE lines.
The file wins; the environment fills in what the file lacks (or stands in
for a missing file, e.g. when the services run elsewhere).

What the script asks of this module (``python3 -m tools.services``, from the
repository root; progress on stderr as ``services: ...``, an error is one
``services: error: ...`` line and exit code 1):

    pick-port PREFERRED            a free 127.0.0.1 port (PREFERRED, else the next above) on stdout
    prepare-index --cache DIR      the package index's tree under DIR/index (or --root): the
                                   default recipe's vllm and flashinfer wheels, verified, and
                                   their PEP 503 pages
    json-field NAME                the top-level field NAME of the JSON object on stdin
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = ROOT / "recipes" / "v41-sm120.yaml"
SERVICE_VARS = (
    "DOCKER_HOST",  # unix:///run/vllm-overlay/docker.sock
    "VLLM_OVERLAY_TEST_DOCKER_HOST2",  # unix:///run/vllm-overlay/docker2.sock: the second engine (a second host)
    "VLLM_OVERLAY_TEST_REGISTRY",  # 127.0.0.1:5000
    "VLLM_OVERLAY_TEST_INDEX",  # http://127.0.0.1:5001/simple/
    "VLLM_OVERLAY_TEST_BASE_IMAGE",  # vllm-overlay-test/debian-python:bookworm-dev
)
START_COMMAND = "bash .ci/services.sh start"
HOST = "127.0.0.1"
PORT_SPAN = 100  # how many ports pick_port() tries, PREFERRED included


class ServicesNotRunning(RuntimeError):
    """The real components are not started (or not fully)."""


class ServicesError(Exception):
    """A step of `.ci/services.sh` that cannot go on; its message is one line."""


def env_file() -> Path:
    state = os.environ.get("VO_STATE_DIR", "/run/vllm-overlay")
    return Path(os.environ.get("VO_ENV_FILE", f"{state}/env"))


def load_service_env() -> dict[str, str]:
    """SERVICE_VARS from the env file, else from the environment."""
    found: dict[str, str] = {}
    path = env_file()
    if path.is_file():
        for line in path.read_text().splitlines():
            name, sep, value = line.partition("=")
            if sep and name in SERVICE_VARS and value:
                found[name] = value
    for name in SERVICE_VARS:
        if name not in found and os.environ.get(name):
            found[name] = os.environ[name]
    missing = [name for name in SERVICE_VARS if name not in found]
    if missing:
        where = f"{path}" if path.is_file() else f"{path} (absent)"
        raise ServicesNotRunning(
            f"test services not configured: {', '.join(missing)} not set in the "
            f"environment or {where}; start them with: {START_COMMAND}"
        )
    return found


def log(message: str) -> None:
    """A progress line, in the script's style."""
    print(f"services: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------- ports


def port_free(port: int, host: str = HOST) -> bool:
    """Whether ``host:port`` can be bound as the servers bind it: with SO_REUSEADDR,
    so a port held only by TIME_WAIT connections counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(preferred: int, host: str = HOST, span: int = PORT_SPAN) -> int:
    """``preferred`` if free, else the next free port above it (``span`` ports tried in all)."""
    if not 1 <= preferred <= 65535:
        raise ServicesError(f"port {preferred} is not a TCP port (1..65535)")
    last = min(preferred + span - 1, 65535)
    for port in range(preferred, last + 1):
        if port_free(port, host):
            return port
    raise ServicesError(f"no free port on {host} in {preferred}..{last}")


# --------------------------------------------------------------------- JSON


def json_field(text: str, name: str, what: str = "input") -> object:
    """The top-level field ``name`` of the JSON object ``text`` (e.g. `docker info`'s Driver)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ServicesError(f"{what} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ServicesError(f"{what} is not a JSON object, got {type(data).__name__}")
    if name not in data:
        raise ServicesError(f"{what} has no field {name!r}")
    return data[name]


# ------------------------------------------------------------ package index


@dataclass(frozen=True)
class IndexPin:
    """A wheel the index serves: its distribution name, version, file name and sha256."""

    project: str
    version: str
    wheel: str
    sha256: str


def recipe_pins(recipe: str | os.PathLike[str] = DEFAULT_RECIPE) -> tuple[IndexPin, ...]:
    """The recipe's `vllm` and `flashinfer` pins, read (and validated) by the builder's loader."""
    try:
        from builder.errors import OverlayError
        from builder.recipe import load_recipe
    except ImportError as exc:  # e.g. PyYAML missing: the project's dependencies are not installed
        raise ServicesError(f"reading the recipe needs the project's dependencies ({exc}); run: make setup") from None
    try:
        loaded = load_recipe(recipe)
    except OverlayError as exc:
        raise ServicesError(str(exc)) from None
    return tuple(IndexPin(p.project, p.version, p.wheel, p.sha256) for p in (loaded.vllm, loaded.flashinfer))


def normalized(project: str) -> str:
    """The PEP 503 normalized name, which is the project's page under simple/."""
    return re.sub(r"[-_.]+", "-", project).lower()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _hash_or_none(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


def _link_or_copy(src: Path, dest: Path) -> None:
    """``dest`` becomes ``src``'s bytes: a hard link where the file system allows, else a copy;
    whatever was at ``dest`` is replaced only once the new file is complete."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def pip_download(pin: IndexPin, dest: Path, pip_log: Path | None = None) -> None:
    """`pip download --no-deps --only-binary=:all: project==version` into ``dest``; pip's
    output goes to ``pip_log``.  pip's own settings (PIP_INDEX_URL, ...) apply, but not the
    machine's constraints file: it must not change which file is fetched."""
    env = dict(os.environ, PIP_CONSTRAINT="")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["-d", str(dest), f"{pin.project}=={pin.version}"]
    if pip_log is not None:
        pip_log.parent.mkdir(parents=True, exist_ok=True)
    with open(pip_log or os.devnull, "wb") as out:
        rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        last = ""
        if pip_log is not None:
            lines = pip_log.read_text(errors="replace").strip().splitlines()
            last = lines[-1].strip() if lines else ""
        raise ServicesError(f"pip download {pin.project}=={pin.version} failed: {last or f'exit code {rc}'}")


def fetch_wheel(
    pin: IndexPin,
    files: Path,
    cache: Path,
    *,
    pip_log: Path | None = None,
    say: Callable[[str], None] = log,
) -> Path:
    """``files/<wheel>`` with the pinned sha256: kept if it has it, else linked from the
    builder's pin cache (``cache/wheels/<sha256>/<wheel>``, when that copy has it), else
    downloaded with pip.  A file that does not match the pin is never put in place."""
    target = files / pin.wheel
    have = _hash_or_none(target)
    pinned = cache / "wheels" / pin.sha256 / pin.wheel
    if have != pin.sha256 and pinned.is_file() and sha256_file(pinned) == pin.sha256:
        _link_or_copy(pinned, target)
        have = pin.sha256
        say(f"index: {pin.wheel} taken from the pin cache {pinned}")
    if have == pin.sha256:
        say(f"index: {pin.wheel} cached, sha256 ok")
        return target
    if have is not None:
        say(f"index: {pin.wheel} cached with sha256 {have}, expected {pin.sha256}; downloading again")
    t0 = time.monotonic()
    say(f"index: downloading {pin.project}=={pin.version} with pip")
    with tempfile.TemporaryDirectory(prefix=".download.", dir=files.parent) as tmp:
        got = Path(tmp) / pin.wheel
        pip_download(pin, Path(tmp), pip_log)
        if not got.is_file():
            names = " ".join(sorted(p.name for p in Path(tmp).iterdir())) or "nothing"
            raise ServicesError(f"pip download {pin.project}=={pin.version} did not give {pin.wheel} (got: {names})")
        have = sha256_file(got)
        if have != pin.sha256:
            raise ServicesError(f"{pin.wheel} from pip download has sha256 {have}, expected {pin.sha256}")
        os.replace(got, target)
    say(f"index: {pin.wheel} downloaded in {time.monotonic() - t0:.1f}s, sha256 ok")
    return target


def root_page(pins: Iterable[IndexPin]) -> str:
    """simple/index.html: one link per project."""
    lines = ["<!DOCTYPE html><html><body>"]
    for pin in pins:
        name = html.escape(normalized(pin.project))
        lines.append(f'<a href="{name}/">{name}</a><br>')
    lines.append("</body></html>")
    return "\n".join(lines) + "\n"


def project_page(pin: IndexPin) -> str:
    """simple/<project>/index.html: the wheel under ../../files/, its sha256 in the fragment
    (pip checks the download against it)."""
    href = html.escape(f"../../files/{pin.wheel}#sha256={pin.sha256}")
    return "\n".join(
        ["<!DOCTYPE html><html><body>", f'<a href="{href}">{html.escape(pin.wheel)}</a><br>', "</body></html>", ""]
    )


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_pages(root: Path, pins: Sequence[IndexPin]) -> None:
    """The PEP 503 pages for ``pins`` under ``root/simple`` (cheap; rewritten every time)."""
    _write(root / "simple" / "index.html", root_page(pins))
    for pin in pins:
        _write(root / "simple" / normalized(pin.project) / "index.html", project_page(pin))


def prepare_index(
    root: Path,
    pins: Sequence[IndexPin],
    cache: Path,
    *,
    pip_log: Path | None = None,
    say: Callable[[str], None] = log,
) -> None:
    """Lay out the package index: ``root/files/<wheel>`` for each pin, verified, then
    ``root/simple/index.html`` and ``root/simple/<project>/index.html``.  The pages are
    written only when every wheel is in place."""
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    (root / "simple").mkdir(parents=True, exist_ok=True)
    for pin in pins:
        fetch_wheel(pin, files, cache, pip_log=pip_log, say=say)
    write_pages(root, pins)


# ----------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m tools.services", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pick-port", help="print PREFERRED if free on 127.0.0.1, else the next free port above")
    p.add_argument("preferred", type=int)
    p = sub.add_parser("prepare-index", help="fetch and verify the pinned wheels, write the PEP 503 pages")
    p.add_argument("--cache", type=Path, required=True, help="cache root: the builder's pin cache is CACHE/wheels")
    p.add_argument("--root", type=Path, help="the index's directory (default CACHE/index)")
    p.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE, help="whose vllm and flashinfer pins to serve")
    p.add_argument("--pip-log", type=Path, help="where pip download's output goes")
    p = sub.add_parser("json-field", help="print the top-level field NAME of the JSON object on stdin")
    p.add_argument("name")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "pick-port":
            print(pick_port(args.preferred))
        elif args.command == "prepare-index":
            root = args.root or args.cache / "index"
            prepare_index(root, recipe_pins(args.recipe), args.cache, pip_log=args.pip_log)
        elif args.command == "json-field":
            value = json_field(sys.stdin.read(), args.name, "stdin")
            print(value if isinstance(value, str) else json.dumps(value))
    except (ServicesError, OSError) as exc:
        print(f"services: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
