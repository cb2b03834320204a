"""The recipe of the launch gate's tests: the default recipe overlaid on vllm-overlay-test/vllm-cpu:0.30.0.

As tools/image_recipes.py's write_recipe_copy, with ``image.mode: vllm`` (the
base already holds the pinned vLLM 0.30.0 and FlashInfer 0.6.18.post1, with
CPU torch, from the probe venv: tools/gate_image.py), ``image.base`` that
image, Python 3.11 (Debian's, the base's own interpreter), no pip settings
(nothing is installed), and the CUDA mismatch accepted: the vLLM wheel is
PyPI's CUDA 13 build and torch has no CUDA at all.  The image's build-time
checks still verify the installed versions and that every file the overlay
touches equals the pinned tree's before patching it.

Also here, for the gate's tests and bench/: running the image's self-test in a
container on a given engine (``run_selftest_in``) and pulling an image by
digest (``pull_by_digest``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.gate_image import TAG as VLLM_CPU_IMAGE
from tools.image_recipes import write_recipe_copy

ACCEPT = "gate tests: PyPI CUDA 13 vLLM wheel with a CPU torch on a CPU-only Debian base"
# The repository under the local registry; the same on every run, so the registry and the
# engines keep one copy and a later run finds it (nothing is rebuilt or pushed again).
REPOSITORY = "vllm-overlay-gate/v41-sm120"
PYTHON = "python3.11"  # the interpreter the self-test runs with inside the image


def gate_repository(services: dict[str, str]) -> str:
    return f"{services['VLLM_OVERLAY_TEST_REGISTRY']}/{REPOSITORY}"


def write_gate_recipe(path: Path, services: dict[str, str], repo: str | None = None, **image: object) -> Path:
    """The default recipe in ``mode: vllm`` on the vllm-cpu image, pushed to the local registry;
    ``image`` overrides more (None removes a key), as in write_recipe_copy."""
    settings: dict[str, object] = {
        "mode": "vllm",
        "base": VLLM_CPU_IMAGE,
        "python": "3.11",
        "pip": None,
        "accept_cuda_mismatch": ACCEPT,
        **image,
    }
    return write_recipe_copy(path, services, repo or gate_repository(services), **settings)


# ------------------------------------------------- the self-test in a container

CHECKPOINT_MOUNT = "/ckpt"
# A rank's argv for the synthetic checkpoints: TP 4, text-only (the default launch profile's request;
# as given, the vision width 1152 fails every route).
TEXT_ONLY_ARGV = (CHECKPOINT_MOUNT, "-tp", "4", "--language-model-only", "--hf-overrides.vision_n_layers", "0")
SELFTEST_MODULE = "vllm.models.deepseek_v41.nvidia.sm120_decode_shape_selftest"
# What the self-test needs in a container on a host without a GPU (as builder/probe.py's selftest_env):
# the CPU device (the vllm-cpu image sets it too), vLLM's log lines off stdout, no hub lookups.
SELFTEST_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_STREAM": "ext://sys.stderr", "HF_HUB_OFFLINE": "1"}
RUN_TIMEOUT = 600


@dataclass(frozen=True)
class ContainerRun:
    """A finished container: its exit code and output."""

    exit_code: int
    stdout: str
    stderr: str

    @property
    def verdict(self) -> str:
        """The last line of stdout (the self-test's verdict)."""
        lines = self.stdout.strip().splitlines()
        return lines[-1] if lines else ""


def pull_by_digest(client, reference: str, progress: Callable[[str], object] = print):
    """``REPO@sha256:…`` in the engine of ``client``: found there, else pulled from the registry."""
    import docker

    try:
        return client.images.get(reference)
    except docker.errors.ImageNotFound:
        t0 = time.monotonic()
        image = client.images.pull(reference)
        progress(f"pulled {reference} into {client.api.base_url} in {time.monotonic() - t0:.0f}s")
        return image


def run_selftest_in(
    client,
    image: str,
    checkpoint: Path,
    argv: Sequence[str] = TEXT_ONLY_ARGV,
    *,
    static: bool = True,
    timeout: int = RUN_TIMEOUT,
) -> ContainerRun:
    """``python3.11 -m <self-test> [--static] --json -- ARGV`` in ``image`` on the engine of ``client``,
    ``checkpoint`` mounted read-only at /ckpt, no network; the container is removed after."""
    flags = ["--static", "--json"] if static else ["--json"]
    container = client.containers.run(
        image,
        [PYTHON, "-m", SELFTEST_MODULE, *flags, "--", *argv],
        detach=True,
        environment=SELFTEST_ENV,
        network_mode="none",
        volumes={str(checkpoint): {"bind": CHECKPOINT_MOUNT, "mode": "ro"}},
    )
    try:
        status = container.wait(timeout=timeout)
        out = container.logs(stdout=True, stderr=False).decode(errors="replace")
        err = container.logs(stdout=False, stderr=True).decode(errors="replace")
        return ContainerRun(status["StatusCode"], out, err)
    finally:
        container.remove(force=True)
