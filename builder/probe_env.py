"""The probe environment: a cached venv with the pinned vLLM, and shadow trees.

The self-test member runs against the real vLLM tree (its serve parser, its
ModelConfig, its attention classes). On a machine without a GPU that needs a
venv holding vLLM and its dependencies with a CPU build of torch
(``ensure_probe_venv``). To run the self-test against a patched tree without
copying vLLM, ``shadow_tree`` builds a package directory that links to the
installed vLLM everywhere except along the paths of the overlay's files.

"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath

from builder.cache import atomic_write, cache_root, locked
from builder.errors import ProbeEnvError

# torch pinned by vLLM 0.30.0; installed first so pip picks the build the
# machine provides (a CPU build on the CI machine) before vLLM's own resolve.
TORCH_VERSION = "2.13.0"
# PyPI builds of these fail to load beside a CPU torch build.
UNINSTALL_AFTER = ("torchvision", "torchaudio", "torchcodec")
COMPLETE_MARKER = ".complete"

Progress = Callable[[str], object]


def probe_venv_dir(version: str = "0.30.0", cache_dir: Path | str | None = None) -> Path:
    base = Path(cache_dir) if cache_dir is not None else cache_root()
    return base / "probe-venv" / f"vllm-{version}"


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _marker_text(version: str) -> str:
    return f"vllm=={version}\ntorch=={TORCH_VERSION}\n"


def _stream(cmd: list[str], progress: Progress, env: Mapping[str, str] | None = None) -> None:
    """Run ``cmd``, passing each output line to ``progress``; raise on failure."""
    progress("$ " + " ".join(cmd))
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=dict(env) if env is not None else None,
        )
    except OSError as exc:
        raise ProbeEnvError(f"cannot run {cmd[0]}: {exc}") from None
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip("\n")
        progress(line)
        tail = (tail + [line])[-5:]
    rc = proc.wait()
    if rc != 0:
        detail = " | ".join(t.strip() for t in tail if t.strip())
        raise ProbeEnvError(f"{' '.join(cmd[:4])} ... exited {rc}: {detail}")


def ensure_probe_venv(
    version: str = "0.30.0",
    cache_dir: Path | str | None = None,
    progress: Progress = print,
) -> Path:
    """Return the python of a venv holding ``vllm==version`` and its deps.

    The venv lives at ``<cache>/probe-venv/vllm-<version>``. Venvs hard-code
    their own path, so it is built in place under a lock and a
    ``.complete`` marker is written last; a venv without the marker (an
    interrupted build) is removed and rebuilt. Steps: ``pip install
    torch==2.13.0``, ``pip install vllm==<version>``, then uninstall
    torchvision, torchaudio and torchcodec. pip's output is streamed to
    ``progress`` line by line.
    """
    venv = probe_venv_dir(version, cache_dir)
    python = _venv_python(venv)
    marker = venv / COMPLETE_MARKER
    if marker.is_file() and python.exists():
        return python
    lock = venv.parent / f".vllm-{version}.lock"
    with locked(lock):
        # Another process may have finished while we waited for the lock.
        if marker.is_file() and python.exists():
            return python
        if venv.exists() or venv.is_symlink():
            progress(f"removing incomplete probe venv {venv}")
            if venv.is_symlink() or venv.is_file():
                venv.unlink()
            else:
                shutil.rmtree(venv)
        progress(f"building probe venv {venv}")
        try:
            _stream([sys.executable, "-m", "venv", str(venv)], progress)
            pip = [str(python), "-m", "pip"]
            env = dict(os.environ)
            env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
            _stream(pip + ["install", f"torch=={TORCH_VERSION}"], progress, env)
            _stream(pip + ["install", f"vllm=={version}"], progress, env)
            _stream(pip + ["uninstall", "-y", *UNINSTALL_AFTER], progress, env)
        except BaseException:
            # Leave no half-built venv that looks usable; the marker is
            # absent anyway, so the next call rebuilds.
            shutil.rmtree(venv, ignore_errors=True)
            raise
        atomic_write(marker, _marker_text(version).encode())
        progress(f"probe venv ready: {python}")
    return python


# --------------------------------------------------------------------------
# Shadow trees
# --------------------------------------------------------------------------


def _check_rel(rel: str) -> PurePosixPath:
    p = PurePosixPath(rel)
    if (
        not rel
        or p.is_absolute()
        or "\\" in rel
        or "\0" in rel
        or any(part in ("", ".", "..") for part in rel.split("/"))
    ):
        raise ProbeEnvError(f"shadow tree: bad overlay path {rel!r}")
    return p


def shadow_tree(
    site_packages_vllm_dir: Path | str,
    overlay_files: Mapping[str, bytes],
    dest: Path | str,
) -> Path:
    """Build an importable ``vllm`` package at ``dest/vllm`` and return ``dest``.

    Every entry of the installed package (``site_packages_vllm_dir``) is a
    symlink to the original, except along the paths of ``overlay_files``
    (keys are tree paths such as ``vllm/models/x.py``): directories on those
    paths are real directories whose other entries are symlinks, and the
    touched files are real files holding the given bytes (new files are
    created). Put ``dest`` first on PYTHONPATH. ``dest`` must not exist or
    be empty.
    """
    src = Path(site_packages_vllm_dir)
    if not (src / "__init__.py").is_file():
        raise ProbeEnvError(f"shadow tree: {src} is not a vllm package directory")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise ProbeEnvError(f"shadow tree: {dest} is not empty")
    pkg = src.name

    # Relative paths inside the package, per overlay file.
    files: dict[PurePosixPath, bytes] = {}
    for rel, data in overlay_files.items():
        p = _check_rel(rel)
        if p.parts[0] != pkg or len(p.parts) < 2:
            raise ProbeEnvError(f"shadow tree: {rel!r} is not inside {pkg}/")
        files[PurePosixPath(*p.parts[1:])] = data

    # Directories that must be real (the package root and every parent).
    real_dirs: set[PurePosixPath] = {PurePosixPath(".")}
    for rel in files:
        for parent in rel.parents:
            real_dirs.add(parent)

    def build(rel_dir: PurePosixPath) -> None:
        out_dir = dest / pkg / rel_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        in_dir = src / rel_dir
        names = set(os.listdir(in_dir)) if in_dir.is_dir() else set()
        names |= {r.name for r in files if r.parent == rel_dir} | {
            d.name for d in real_dirs if d != PurePosixPath(".") and d.parent == rel_dir
        }
        for name in sorted(names):
            rel = rel_dir / name if rel_dir != PurePosixPath(".") else PurePosixPath(name)
            target = out_dir / name
            if rel in files:
                target.write_bytes(files[rel])
            elif rel in real_dirs:
                if (src / rel).exists() and not (src / rel).is_dir():
                    raise ProbeEnvError(f"shadow tree: {pkg}/{rel} is a file in the tree")
                build(rel)
            elif name == "__pycache__":
                # Bytecode caches are keyed by source mtime/size; let Python
                # write its own rather than share the original's.
                continue
            else:
                os.symlink(os.path.abspath(src / rel), target)

    build(PurePosixPath("."))
    return dest
