"""The base image for the launch gate's tests: vLLM 0.30.0 that really imports, with a CPU torch.

The test image of tests/test_image.py installs vLLM with ``--no-deps``, so
``import vllm`` fails in it and a self-test run there proves nothing.  This
module builds ``vllm-overlay-test/vllm-cpu:0.30.0``: the local Debian base
(``vllm-overlay-test/debian-python:bookworm-dev``, Debian's Python 3.11) with the
probe venv's site-packages (vLLM 0.30.0, its dependencies, torch 2.13.0+cpu;
built by ``make setup``, about 5.5 GB) copied to
``/usr/local/lib/python3.11/dist-packages``, a directory on the base
python3.11's own path: no venv, no PYTHONPATH.  The image also says it is a
CPU image (``VLLM_TARGET_DEVICE=cpu``: vLLM cannot infer a device without a
GPU) and works offline (``HF_HUB_OFFLINE=1``).

The build context is a tar stream made here, sent to the engine through a
pipe as it is written (no 5.5 GB file on this disk): a Dockerfile and the
site-packages tree, owner root, file modes and mtimes kept (the venv's .pyc
files stay valid).  The image carries ``io.vllm-overlay.test.identity``, the
sha256 over a layout version, the base image's id and the sha256 of the
venv's ``pip freeze --all``; an image with that label is kept and nothing is
built.  Progress goes to stderr.

    python3 -m tools.gate_image [--docker-host URL] [--tag TAG] [--venv DIR] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

TAG = "vllm-overlay-test/vllm-cpu:0.30.0"
BASE = "vllm-overlay-test/debian-python:bookworm-dev"
VLLM_VERSION = "0.30.0"
# Where the base's python3.11 looks first for installed packages (Debian's site layout).
DEST = "/usr/local/lib/python{python}/dist-packages"
LAYOUT = "1"  # bump when the Dockerfile below changes what the image holds
LABEL_IDENTITY = "io.vllm-overlay.test.identity"
LABEL_FREEZE = "io.vllm-overlay.test.venv-freeze"
LABEL_BASE = "io.vllm-overlay.test.base-id"
CHUNK = 1 << 20
REPORT_EVERY = 512 << 20  # a progress line per this many bytes of context

Progress = Callable[[str], object]


class GateImageError(Exception):
    """The image cannot be made; the message is one line."""


def say(message: str) -> None:
    print(f"gate-image: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Venv:
    """The probe venv: its interpreter, site-packages, Python version and freeze hash."""

    python: Path
    site_packages: Path
    python_version: str  # "3.11"
    freeze_sha256: str


def probe_venv(venv: Path | None = None) -> Venv:
    """The probe venv ``make setup`` built (or ``venv``), with the sha256 of its ``pip freeze --all``."""
    if venv is None:
        from builder.probe_env import COMPLETE_MARKER, probe_venv_dir

        venv = probe_venv_dir(VLLM_VERSION)
        if not (venv / COMPLETE_MARKER).is_file():
            raise GateImageError(f"the probe venv {venv} is not built (no {COMPLETE_MARKER}); run: make probe-venv")
    python = venv / "bin" / "python"
    found = sorted((venv / "lib").glob("python3.*/site-packages"))
    if not python.exists() or len(found) != 1:
        raise GateImageError(f"{venv} is not a venv with one lib/python3.X/site-packages")
    site = found[0]
    proc = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--all", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_NO_INPUT": "1"},
    )
    if proc.returncode != 0:
        raise GateImageError(f"pip freeze in {venv} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return Venv(
        python=python,
        site_packages=site,
        python_version=site.parent.name.removeprefix("python"),
        freeze_sha256=hashlib.sha256(proc.stdout.encode()).hexdigest(),
    )


def identity(venv: Venv, base_id: str) -> str:
    material = f"vllm-overlay-test-vllm-cpu {LAYOUT}\nbase {base_id}\nfreeze sha256:{venv.freeze_sha256}\n"
    return "sha256:" + hashlib.sha256(material.encode()).hexdigest()


def dockerfile(base: str, venv: Venv, ident: str, base_id: str) -> str:
    dest = DEST.format(python=venv.python_version)
    return (
        f"FROM {base}\n"
        "ENV VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1\n"
        f"COPY site-packages/ {dest}/\n"
        f'LABEL {LABEL_IDENTITY}="{ident}" {LABEL_FREEZE}="sha256:{venv.freeze_sha256}" {LABEL_BASE}="{base_id}" '
        f'org.opencontainers.image.title="vLLM {VLLM_VERSION} with CPU torch, for vllm-overlay\'s gate tests"\n'
    )


def _write_context(out: io.BufferedWriter, text: str, site: Path, progress: Progress, sent: list[int]) -> None:
    """The context as an uncompressed tar stream: Dockerfile, then site-packages/ (sorted)."""
    next_report = [REPORT_EVERY]

    def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        sent[0] += info.size
        if sent[0] >= next_report[0]:
            progress(f"context: {sent[0] / 2**30:.1f} GiB sent")
            next_report[0] += REPORT_EVERY
        return info

    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        data = text.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
        tar.add(site, arcname="site-packages", recursive=True, filter=owned_by_root)


@contextlib.contextmanager
def streamed_context(text: str, site: Path, progress: Progress) -> Iterator[Iterator[bytes]]:
    """A generator of the context tar's bytes, written by a thread through a pipe."""
    read_fd, write_fd = os.pipe()
    reader = os.fdopen(read_fd, "rb", buffering=0)
    writer = os.fdopen(write_fd, "wb", buffering=CHUNK)
    failed: list[BaseException] = []
    sent = [0]

    def write() -> None:
        try:
            _write_context(writer, text, site, progress, sent)
        except BaseException as exc:  # reported by the caller
            failed.append(exc)
        finally:
            with contextlib.suppress(OSError):
                writer.close()

    thread = threading.Thread(target=write, name="gate-image-context", daemon=True)
    thread.start()

    def chunks() -> Iterator[bytes]:
        while block := reader.read(CHUNK):
            yield block
        if failed and not isinstance(failed[0], BrokenPipeError):
            raise GateImageError(f"writing the build context failed: {failed[0]}")
        progress(f"context: {sent[0] / 2**30:.2f} GiB sent in all")

    try:
        yield chunks()
    finally:
        reader.close()  # a writer still blocked on the pipe gets EPIPE and ends
        thread.join()


def _client(docker_host: str | None):
    import docker

    return docker.DockerClient(base_url=docker_host, timeout=3600) if docker_host else docker.from_env(timeout=3600)


def run_python(client, image: str, code: str) -> str:
    """``python3 -c code`` in a throw-away container without network; its stdout, or one line on failure."""
    container = client.containers.run(image, ["python3", "-c", code], detach=True, network_mode="none")
    try:
        status = container.wait()
        out = container.logs(stdout=True, stderr=False).decode(errors="replace")
        if status.get("StatusCode") != 0:
            err = container.logs(stdout=False, stderr=True).decode(errors="replace").strip().splitlines()
            raise GateImageError(f"python3 in {image} exited {status.get('StatusCode')}: {(err or ['?'])[-1]}")
        return out.strip()
    finally:
        container.remove(force=True)


def ensure_vllm_cpu_image(
    client=None,
    *,
    tag: str = TAG,
    base: str = BASE,
    venv: Path | None = None,
    force: bool = False,
    progress: Progress = say,
) -> str:
    """``tag`` in the engine of ``client`` (default: DOCKER_HOST), built unless an image with this
    venv's and base's identity is there already.  Returns the image id."""
    import docker

    client = client or _client(None)
    found = probe_venv(venv)
    try:
        base_image = client.images.get(base)
    except docker.errors.ImageNotFound:
        raise GateImageError(f"base image {base} is not in the engine; run: bash .ci/services.sh start") from None
    ident = identity(found, base_image.id)
    from builder.cache import cache_root, locked

    with locked(cache_root() / "probe-venv" / ".gate-image.lock"):
        with contextlib.suppress(docker.errors.ImageNotFound):
            have = client.images.get(tag)
            if have.labels.get(LABEL_IDENTITY) == ident and not force:
                progress(f"{tag} is up to date ({have.id}, identity {ident})")
                return have.id
            progress(f"{tag} is there with identity {have.labels.get(LABEL_IDENTITY)}; building it again")
        got = run_python(client, base, "import sys; print('%d.%d' % sys.version_info[:2])")
        if got != found.python_version:
            raise GateImageError(f"{base} has Python {got}; the probe venv is Python {found.python_version}")
        progress(f"building {tag} from {base} (Python {got}) and {found.site_packages}")
        t0 = time.monotonic()
        text = dockerfile(base, found, ident, base_image.id)
        image_id = None
        with streamed_context(text, found.site_packages, progress) as context:
            for chunk in client.api.build(
                fileobj=context,
                custom_context=True,
                tag=tag,
                rm=True,
                forcerm=True,
                pull=False,
                network_mode="none",
                decode=True,
            ):
                if "error" in chunk:
                    raise GateImageError(f"building {tag} failed: {chunk['error'].strip()}")
                if line := chunk.get("stream", "").rstrip():
                    progress(line)
                if "aux" in chunk and "ID" in chunk["aux"]:
                    image_id = chunk["aux"]["ID"]
        if image_id is None:
            raise GateImageError(f"building {tag} gave no image")
        size = client.images.get(image_id).attrs["Size"]
        progress(f"built {tag} ({image_id}, {size / 2**30:.2f} GiB) in {time.monotonic() - t0:.0f}s")
        code = "import vllm, torch; print(vllm.__version__, torch.__version__)"
        progress(f"check: python3 -c {code!r} -> {run_python(client, tag, code)}")
        return image_id


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.gate_image", description=__doc__.split("\n\n")[0])
    parser.add_argument("--docker-host", help="the engine (default: DOCKER_HOST, else the services' first engine)")
    parser.add_argument("--tag", default=TAG)
    parser.add_argument("--base", default=BASE)
    parser.add_argument("--venv", type=Path, help="a venv to take site-packages from (default: the probe venv)")
    parser.add_argument("--force", action="store_true", help="build even when the image is up to date")
    args = parser.parse_args(argv)
    import docker

    host = args.docker_host or os.environ.get("DOCKER_HOST")
    if not host:
        from tools.services import ServicesNotRunning, load_service_env

        try:
            host = load_service_env()["DOCKER_HOST"]
        except ServicesNotRunning as exc:
            say(f"error: {exc}")
            return 1
    try:
        client = _client(host)
        ensure_vllm_cpu_image(client, tag=args.tag, base=args.base, venv=args.venv, force=args.force)
    except (GateImageError, docker.errors.DockerException, OSError) as exc:
        say(f"error: {(str(exc).strip().splitlines() or [type(exc).__name__])[0]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
