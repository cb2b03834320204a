"""Real engines and a real image for the launch gate's tests (issue 13, "Tests with real engines").

- ``gate_image`` (session): the default recipe overlaid on
  ``vllm-overlay-test/vllm-cpu:0.30.0`` (tools/gate_image.py: the probe venv's
  vLLM 0.30.0 with CPU torch on the Debian base; built here if missing) in
  ``mode: vllm`` (tools/gate_recipes.py), made by ``vllm-overlay image --push``
  into the local registry, then pulled by digest into the second engine (the
  first has it from the build, or pulls it too when the registry answered).
  Returns a ``GateImage``: ``reference`` (``REPO@sha256:…``, what a gate pulls
  and runs), ``tag`` (``REPO:rk-…``, what the CLI printed), ``digest``,
  ``repository``, ``runtime_key``, ``image_key``, ``recipe`` and ``produced``
  (a produced-rows file holding exactly its row), ``hosts`` (both engines'
  URLs) and ``clients`` (a ``docker.DockerClient`` per engine, the same
  order); ``client`` and ``client2`` name them one by one.
- ``gate_checkpoints`` (session): synthetic DeepSeek-V4.1 checkpoints
  (config.json only): ``"ratio2"`` (compress ratios 0, 2, 2: every route
  passes a text-only launch) and ``"default"`` (0, 1, 2: the ratio-1 layer's
  128-token compressed page fails the dual prefill route).

To run the self-test in a container, tools/gate_recipes.py has
``run_selftest_in(client, image, checkpoint, argv=TEXT_ONLY_ARGV, static=True)``:
the module run inside ``image`` on that engine, the checkpoint mounted
read-only at ``/ckpt``; it returns a ``ContainerRun`` (``exit_code``,
``stdout``, ``stderr``, ``verdict``: stdout's last line).

The repository is the same on every run (``127.0.0.1:5000/vllm-overlay-gate/…``),
and nothing is removed at the end: a later run finds the image in the engine,
pushes nothing new and pulls nothing.  A cold run costs about 6 min for the
vllm-cpu base, 5 min for the build and push (gzip of 5.4 GB) and 1.5 min for
the second engine's pull.

A test module uses them with ``pytest_plugins = ["tests.gate_fixtures"]``
(not by importing them: pytest rewrites a plugin's asserts only if it imports
it first); through ``services`` its tests are marked ``services``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest
import yaml

from tests.helpers import run_cli
from tools.checkpoints import write_v41_checkpoint
from tools.gate_image import ensure_vllm_cpu_image
from tools.gate_recipes import pull_by_digest, write_gate_recipe
from tools.image_recipes import cli_env

HOST_VARS = ("DOCKER_HOST", "VLLM_OVERLAY_TEST_DOCKER_HOST2")


def say(message: str) -> None:
    print(f"gate fixtures: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GateImage:
    reference: str  # REPO@sha256:<registry digest>
    tag: str  # REPO:rk-<short runtime key>
    digest: str  # sha256:<registry manifest digest>
    repository: str
    runtime_key: str
    image_key: str
    recipe: Path
    produced: Path
    hosts: tuple[str, str]
    clients: tuple[docker.DockerClient, docker.DockerClient]

    @property
    def client(self) -> docker.DockerClient:
        return self.clients[0]

    @property
    def client2(self) -> docker.DockerClient:
        return self.clients[1]


@pytest.fixture(scope="session")
def gate_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gate-checkpoints")
    return {
        "ratio2": write_v41_checkpoint(root / "v41-ratio2", compress_ratios=(0, 2, 2)),
        "default": write_v41_checkpoint(root / "v41"),
    }


@pytest.fixture(scope="session")
def gate_image(services, tmp_path_factory) -> GateImage:
    hosts = tuple(services[name] for name in HOST_VARS)
    clients = tuple(docker.DockerClient(base_url=host, timeout=1800) for host in hosts)
    for client in clients:
        client.ping()
    t0 = time.monotonic()
    ensure_vllm_cpu_image(clients[0], progress=say)
    work = tmp_path_factory.mktemp("gate-image")
    recipe, produced = write_gate_recipe(work / "recipe.yaml", services), work / "produced.yaml"
    proc = run_cli("image", recipe, "--push", env=cli_env(services, produced))
    assert proc.returncode == 0, proc.stderr[-4000:]
    [row] = yaml.safe_load(produced.read_text())
    repository = yaml.safe_load(recipe.read_text())["image"]["repository"]
    assert row["digest"].startswith("sha256:"), row
    reference = f"{repository}@{row['digest']}"
    for client in clients:
        pull_by_digest(client, reference, say)
    say(f"{reference} in both engines after {time.monotonic() - t0:.0f}s")
    yield GateImage(
        reference=reference,
        tag=row["image"],
        digest=row["digest"],
        repository=repository,
        runtime_key=row["runtime_key"],
        image_key=row["image_key"],
        recipe=recipe,
        produced=produced,
        hosts=hosts,
        clients=clients,
    )
    for client in clients:
        client.close()
