"""Recipes for image builds against the local services (tests/test_image.py and bench/image.py).

The default recipe with only the base image, Python, the package index (the
local one, without dependencies: the CUDA closure is several GB), the
CUDA-mismatch acceptance and the repository changed.  The default recipe's
install sources outside the index (vLLM's +cu128 wheel URL on GitHub, the
cu128 torch) cannot be reached from here; the index override replaces them.

A recipe in mode cuda is locked against the local index by a real
`vllm-overlay lock` run (api.lock: uv, the two pinned wheels and their sha256,
with no_deps: the index serves those two wheels only), and its default
``unlocked`` reason is dropped; pass ``unlocked=<reason>`` to keep it unlocked.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

from tools.synthetic import DEFAULT_RECIPE, ROOT

ACCEPT = "integration test: PyPI CUDA 13 wheels without torch on a CPU-only Debian base"
# The hunk line of sm120_swa_page_block_size that a "member change" rewrites (a comment beside swa_block_size = 64).
CHANGED_LINE = "+    # FlashInfer's SM120 DSv4 decode kernel serves 64-token pages only\n"


def cli_env(services: dict[str, str], produced: Path, **extra: str) -> dict[str, str]:
    """The CLI's environment: the services' engine, a produced-rows file of our own.

    An ambient repository override or GitHub output file (as in a CI job) must not leak in.
    """
    return {
        "DOCKER_HOST": services["DOCKER_HOST"],
        "VLLM_OVERLAY_PRODUCED": str(produced),
        "VLLM_OVERLAY_REPOSITORY": "",
        "GITHUB_OUTPUT": "",
        **extra,
    }


def write_recipe_copy(
    path: Path,
    services: dict[str, str],
    repo: str,
    *,
    overlay: Path = ROOT / "overlay",
    name: str | None = None,
    **image: object,
) -> Path:
    """The default recipe, pointed at the services, and locked in mode cuda; ``image`` overrides
    more (None removes a key), ``name`` the recipe's name."""
    from builder import api

    data = yaml.safe_load(DEFAULT_RECIPE.read_text())
    if name is not None:
        data["name"] = name
    settings = data["image"]
    settings.update(
        base=services["VLLM_OVERLAY_TEST_BASE_IMAGE"],
        python="3.11",
        pip={"index_url": services["VLLM_OVERLAY_TEST_INDEX"], "no_deps": True},
        accept_cuda_mismatch=ACCEPT,
        repository=repo,
    )
    settings.pop("torch", None)
    settings.pop("vllm_wheel", None)
    settings.pop("unlocked", None)
    for key, value in image.items():
        if value is None:
            settings.pop(key, None)
        else:
            settings[key] = value
    data["overlay"] = str(overlay)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    if settings.get("mode", "cuda") == "cuda" and "unlocked" not in settings:
        api.lock(path)
    return path


def changed_overlay(dest: Path, note: str) -> Path:
    """A copy of the overlay with one member's hunk changed: ``note`` appended to a comment line."""
    shutil.copytree(ROOT / "overlay", dest)
    patch = dest / "sm120_swa_page_block_size.patch"
    text = patch.read_text()
    if text.count(CHANGED_LINE) != 1:
        raise RuntimeError(f"{patch}: the line to change is not there once: {CHANGED_LINE!r}")
    patch.write_text(text.replace(CHANGED_LINE, CHANGED_LINE[:-1] + f" ({note})\n"))
    return dest


def made_images(build_log: str) -> list[str]:
    """The images a classic build made, from its log: each step's image, unless FROM named it or the cache gave it.

    Oldest first; they are new to the engine, so a run may remove them (newest first) once untagged.
    """
    made: list[str] = []
    instruction, cached = "", False
    for line in build_log.splitlines():
        line = line.strip()
        step = re.match(r"Step \d+/\d+ : (\S+)", line)
        if step:
            instruction, cached = step.group(1).upper(), False
        elif line == "---> Using cache":
            cached = True
        elif (m := re.fullmatch(r"---> ([0-9a-f]{12})", line)) and instruction != "FROM" and not cached:
            made.append(m.group(1))
    return made


def remove_images(client, tag_prefixes: tuple[str, ...], made: list[str]) -> None:
    """Untag what carries one of ``tag_prefixes`` (newest first; an image left unused goes, with its
    unused untagged parents), then remove the untagged images in ``made``, newest first."""
    import docker

    ours = [i for i in client.images.list() if any(t.startswith(tag_prefixes) for t in i.tags)]
    for image in sorted(ours, key=lambda i: i.attrs["Created"], reverse=True):
        for tag in image.tags:
            if tag.startswith(tag_prefixes):
                try:
                    client.images.remove(tag)
                except docker.errors.APIError:
                    pass
    for image_id in reversed(made):
        try:
            if not client.images.get(image_id).tags:
                client.images.remove(image_id, noprune=True)
        except docker.errors.APIError:  # gone already, or in use
            pass
