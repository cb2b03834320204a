"""A newcomer's `make image` (issue 14, part 6), through the Makefile as the README gives it.

On this machine the default recipe's base (nvidia/cuda on Docker Hub) cannot be
pulled: `make image` ends in one line naming the base and its registry and
pointing at recipes/local.yaml, which `make image RECIPE=recipes/local.yaml`
builds end to end on the local services.
"""

from __future__ import annotations

import os
import subprocess

import docker
import pytest
import yaml

from tools.synthetic import DEFAULT_RECIPE, ROOT

LOCAL_RECIPE = ROOT / "recipes" / "local.yaml"


def make_image(services: dict[str, str], produced, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "DOCKER_HOST": services["DOCKER_HOST"],
        "VLLM_OVERLAY_PRODUCED": str(produced),
        "VLLM_OVERLAY_REPOSITORY": "",
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(["make", "-s", "image", *args], cwd=ROOT, env=env, capture_output=True, text=True)


def our_lines(stderr: str) -> list[str]:
    """What the tool printed, without make's own `make: *** ...` line."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("make")]


def test_the_default_recipe_here_is_one_line_naming_the_base_its_registry_and_the_local_recipe(
    services, tmp_path, vllm_wheel
) -> None:
    base = yaml.safe_load(DEFAULT_RECIPE.read_text())["image"]["base"]
    proc = make_image(services, tmp_path / "produced.yaml")
    assert proc.returncode != 0
    error = [line for line in our_lines(proc.stderr) if line.startswith("vllm-overlay:")]
    assert len(error) == 1, proc.stderr[-2000:]
    assert base in error[0] and "docker.io" in error[0] and "RECIPE=recipes/local.yaml" in error[0], error[0]
    assert "exit 3" in proc.stderr or "Error 3" in proc.stderr, proc.stderr[-500:]
    assert not (tmp_path / "produced.yaml").exists()


@pytest.fixture
def local_tags_removed(services):
    """The local recipe's tags are removed afterwards, so every run builds (from the layer cache)."""
    repository = yaml.safe_load(LOCAL_RECIPE.read_text())["image"]["repository"]
    client = docker.DockerClient(base_url=services["DOCKER_HOST"])
    yield repository
    for image in client.images.list(name=repository):
        for tag in image.tags:
            client.images.remove(tag)


def test_make_image_builds_the_local_recipe_end_to_end(services, tmp_path, local_tags_removed) -> None:
    recipe = yaml.safe_load(LOCAL_RECIPE.read_text())
    # The recipe names the services' default addresses; they must be the ones running.
    assert recipe["image"]["pip"]["index_url"] == services["VLLM_OVERLAY_TEST_INDEX"]
    assert recipe["image"]["repository"].startswith(services["VLLM_OVERLAY_TEST_REGISTRY"] + "/")
    assert recipe["image"]["base"] == services["VLLM_OVERLAY_TEST_BASE_IMAGE"]
    produced = tmp_path / "produced.yaml"
    proc = make_image(services, produced, f"RECIPE={LOCAL_RECIPE.relative_to(ROOT)}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = proc.stdout.strip().splitlines()[-1]
    assert reference.startswith(local_tags_removed + ":rk-"), proc.stdout
    [row] = yaml.safe_load(produced.read_text())
    labels = docker.DockerClient(base_url=services["DOCKER_HOST"]).images.get(reference).labels
    assert labels["io.vllm-overlay.image-key"] == row["image_key"]
    key = subprocess.run(
        ["python3", "-m", "builder", "key", str(LOCAL_RECIPE)], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert labels["io.vllm-overlay.runtime-key"] == key.stdout.strip()
