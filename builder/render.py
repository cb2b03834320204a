"""Render: the recipe's Dockerfile, its image key, and the build context.

The template is rendered with Jinja2 in strict mode (an undefined variable is
an error).  Every recipe value that reaches it has been validated by
builder.recipe so it cannot add an instruction (no newlines, quotes or shell
characters).  The image key covers the runtime key, every image setting and
the rendered Dockerfile itself; it is computed from a rendering whose own
image-key label and revision are placeholders, so neither feeds back into it,
and a new commit of this tool does not force a rebuild.
"""

from __future__ import annotations

import hashlib
import io
import shlex
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from builder.apply import OverlaySet
from builder.key import short_key
from builder.lock import image_lock
from builder.output import MANIFEST, manifest_bytes
from builder.recipe import URL_RE, Recipe

IMAGES = Path(__file__).resolve().parent.parent / "images"
TEMPLATE = IMAGES / "Dockerfile.j2"
CHECKS = IMAGES / "image_checks.py"
IMAGE_KEY_FORMAT = 1
PLACEHOLDER = "@@"
# Where the image's FlashInfer keeps its JIT builds (FLASHINFER_WORKSPACE_BASE); a launch mounts a volume here.
FLASHINFER_WORKSPACE = "/var/cache/flashinfer"
LOCK_IN_CONTEXT = "requirements.lock"  # the recipe's lock, as the build context holds it


@dataclass(frozen=True)
class RenderedImage:
    dockerfile: str
    image_key: str
    runtime_key: str
    lock: Any = None  # builder.lock.Lock the image installs from; None: unlocked, or mode vllm

    @property
    def short_image_key(self) -> str:
        return self.image_key.removeprefix("ik-")[:16]


def python_in_image(recipe: Recipe) -> str:
    """The interpreter the checks run with: the venv's in CUDA mode, the base's own in vllm mode."""
    return "python" if recipe.image.mode == "cuda" else f"python{recipe.image.python}"


def index_option_list(recipe: Recipe, trusted_host_flag: str = "--trusted-host") -> list[str]:
    """The recipe's package sources as pip's options (uv calls a trusted host --allow-insecure-host)."""
    pip = recipe.image.pip
    opts = ["--index-url", pip.index_url]
    for url in pip.extra_index_urls:
        opts += ["--extra-index-url", url]
    for url in pip.find_links:
        opts += ["--find-links", url]
    for host in pip.trusted_hosts:
        opts += [trusted_host_flag, host]
    return opts


def index_options(recipe: Recipe) -> str:
    """Where pip finds the locked files (the locked install never resolves: no --no-deps needed)."""
    return " ".join(shlex.quote(o) for o in index_option_list(recipe))


def pip_options(recipe: Recipe) -> str:
    opts = index_option_list(recipe) + (["--no-deps"] if recipe.image.pip.no_deps else [])
    return " ".join(shlex.quote(o) for o in opts)


def requirement_list(recipe: Recipe) -> list[str]:
    """What the image installs, as pip requirements: the unlocked install line and the lock's input."""
    wheel = recipe.image.vllm_wheel
    if wheel is None:
        vllm = f"vllm=={recipe.vllm.version}"
    else:  # pip checks a #sha256= fragment on a direct URL
        vllm = f"vllm @ {wheel.url}" + (f"#sha256={wheel.sha256}" if wheel.sha256 else "")
    reqs = [vllm, f"flashinfer-python=={recipe.flashinfer.version}"]
    if recipe.image.torch:
        reqs.append(f"torch=={recipe.image.torch}")
    return reqs


def requirements(recipe: Recipe) -> str:
    return " ".join(shlex.quote(r) for r in requirement_list(recipe))


def _template() -> jinja2.Template:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.from_string(TEMPLATE.read_text(encoding="utf-8"))


def _render(
    template: jinja2.Template,
    recipe: Recipe,
    runtime_key: str,
    image_key: str,
    revision: str,
    source: str,
    lock: Any,
) -> str:
    try:
        return template.render(
            source=source,
            recipe=recipe,
            image=recipe.image,
            python=python_in_image(recipe),
            pip_options=pip_options(recipe),
            index_options=index_options(recipe),
            requirements=requirements(recipe),
            lock=lock,
            lock_file=LOCK_IN_CONTEXT,
            runtime_key=runtime_key,
            short_key=short_key(runtime_key),
            image_key=image_key,
            revision=revision,
            members=list(recipe.members),
            flashinfer_workspace=FLASHINFER_WORKSPACE,
        )
    except jinja2.TemplateError as exc:
        raise RuntimeError(f"{TEMPLATE}: {exc}") from exc


def image_key_material(recipe: Recipe, runtime_key: str, skeleton: str, lock: Any = None) -> bytes:
    image = recipe.image
    lines = [
        f"vllm-overlay-image-key {IMAGE_KEY_FORMAT}",
        f"runtime-key {runtime_key}",
        f"flashinfer {recipe.flashinfer.version} sha256:{recipe.flashinfer.sha256}",
        f"base {image.base}",
        f"mode {image.mode}",
        f"cuda {image.cuda}",
        f"arch torch={image.torch_cuda_arch_list} flashinfer={image.flashinfer_cuda_arch_list}",
        f"python {image.python}",
        f"pip {pip_options(recipe)}",
        f"requirements {requirements(recipe)}",
        f"dockerfile sha256:{hashlib.sha256(skeleton.encode()).hexdigest()}",
        f"checks sha256:{hashlib.sha256(CHECKS.read_bytes()).hexdigest()}",
    ]
    if image.mode == "cuda":  # what the install step installs from
        lines.append(f"lock sha256:{lock.sha256}" if lock is not None else f"unlocked {image.unlocked}")
    return ("\n".join(lines) + "\n").encode()


def render_image(recipe: Recipe, runtime_key: str, revision: str | None = None) -> RenderedImage:
    """The Dockerfile and its image key.  Mode cuda reads the recipe's lock (or its image.unlocked);
    whether the lock still matches the recipe is the caller's to ask (builder.lock.lock_problem)."""
    lock = image_lock(recipe)
    template = _template()
    skeleton = _render(template, recipe, runtime_key, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, lock)
    image_key = "ik-" + hashlib.sha256(image_key_material(recipe, runtime_key, skeleton, lock)).hexdigest()
    if revision is None:
        revision, source = _git("rev-parse", "HEAD") or "unknown", recipe.image.source or _origin_url()
    else:
        source = recipe.image.source or ""
    dockerfile = _render(template, recipe, runtime_key, image_key, revision, source, lock)
    return RenderedImage(dockerfile, image_key, runtime_key, lock)


def _git(*args: str) -> str | None:
    """A git answer about this checkout, or None outside git."""
    try:
        out = subprocess.run(["git", *args], cwd=IMAGES.parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _origin_url() -> str:
    """The checkout's origin, for the source label: only a plain URL without credentials."""
    url = _git("config", "--get", "remote.origin.url") or ""
    return url if URL_RE.fullmatch(url) and "@" not in url else ""


def context_files(rendered: RenderedImage, overlay: OverlaySet, manifest_data: dict) -> dict[str, bytes]:
    """Every file of the build context, by its path in the context."""
    files = {
        "Dockerfile": rendered.dockerfile.encode(),
        CHECKS.name: CHECKS.read_bytes(),
        MANIFEST: manifest_bytes(manifest_data),
    }
    if rendered.lock is not None:
        files[LOCK_IN_CONTEXT] = rendered.lock.data
    for change in overlay.changes:
        if change.after is not None:
            files[f"overlay/{change.path}"] = change.after
    return files


def context_tar(files: dict[str, bytes]) -> bytes:
    """A deterministic tar of the context: sorted, mtime 0, root-owned, so equal inputs give equal COPY layers."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    return buf.getvalue()
