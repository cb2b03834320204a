"""An empty Docker engine, standing in for a fresh CI runner (tests/test_ci_cache.py, bench/image.py).

A private dockerd on a new data root beside the services' own (same filesystem,
the first engine's storage driver), its own socket, exec root and pid file,
host networking only.  Nothing is in it: every image it needs is pulled from
the local registry, as a hosted runner pulls from the project's registry.  It is
stopped and its data root removed when the context ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

DATA_DIR = Path(os.environ.get("VO_DATA_DIR", "/var/lib/vllm-overlay"))
STARTUP_SECONDS = 60


def _driver(first_engine: str) -> str:
    """The first engine's storage driver (overlay2, or vfs where overlay mounts fail)."""
    import docker

    return docker.DockerClient(base_url=first_engine).info()["Driver"]


def _unmount_below(root: Path) -> None:
    """Mounts a killed dockerd left under ``root`` (its netns, overlay merges), deepest first."""
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(str(root) + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True)


@contextlib.contextmanager
def fresh_engine(first_engine: str) -> Iterator[str]:
    """Start an empty dockerd; yield its ``unix://`` address."""
    root = DATA_DIR / f"fresh-{uuid.uuid4().hex[:8]}"
    sock, log = root / "docker.sock", root / "dockerd.log"
    root.mkdir(parents=True)
    argv = [
        "dockerd",
        f"--host=unix://{sock}",
        f"--data-root={root / 'data'}",
        f"--exec-root={root / 'exec'}",
        f"--pidfile={root / 'dockerd.pid'}",
        f"--storage-driver={_driver(first_engine)}",
        "--iptables=false",
        "--ip-masq=false",
        "--bridge=none",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ping(sock, proc, log)
        yield f"unix://{sock}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _unmount_below(root)
        shutil.rmtree(root, ignore_errors=True)


def _wait_ping(sock: Path, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fresh dockerd exited {proc.returncode}: {log.read_text()[-400:]}")
        if sock.exists() and _ping(sock):
            return
        time.sleep(0.2)
    raise RuntimeError(f"fresh dockerd did not answer on {sock} in {STARTUP_SECONDS}s (log: {log})")


def _ping(sock: Path) -> bool:
    import docker

    try:
        return bool(docker.DockerClient(base_url=f"unix://{sock}", timeout=5).ping())
    except Exception:  # not up yet
        return False


def image_count(engine: str) -> int:
    import docker

    return len(docker.DockerClient(base_url=engine).images.list(all=True))


if __name__ == "__main__":  # a quick look: start one, print its address and what is in it, stop it
    from tools.services import load_service_env

    with fresh_engine(load_service_env()["DOCKER_HOST"]) as engine:
        print(json.dumps({"engine": engine, "images": image_count(engine)}))
