"""CI's rebuild on an empty engine reuses the registry's layers (issue 14, part 4).

A fresh CI runner has an empty Docker engine.  `vllm-overlay image` pulls the
recipe's previous image (its moving tag) and builds with it as cache, so a
member change there pulls the install layers and rebuilds only the overlay.

The fresh runner is a second dockerd on an empty data root (tools/fresh_engine.py);
the base image comes from the local registry, as a hosted runner pulls its base.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import docker
import pytest
import yaml

from tests.helpers import run_cli
from tools.fresh_engine import fresh_engine, image_count
from tools.image_recipes import changed_overlay, cli_env, write_recipe_copy

RUN_ID = uuid.uuid4().hex[:10]
LABEL = "io.vllm-overlay"


def steps(log: str) -> list[tuple[str, list[str]]]:
    """Each classic build step's instruction and the lines it printed, in order."""
    out: list[tuple[str, list[str]]] = []
    for line in log.splitlines():
        line = line.strip()
        if line.startswith("Step ") and " : " in line:
            out.append((line.split(" : ", 1)[1], []))
        elif out:
            out[-1][1].append(line)
    return out


@pytest.fixture(scope="module")
def pushed_a(services, tmp_path_factory):
    """Recipe A built on the services' engine and pushed, its base taken from the local registry."""
    client = docker.DockerClient(base_url=services["DOCKER_HOST"], timeout=600)
    registry = services["VLLM_OVERLAY_TEST_REGISTRY"]
    base = f"{registry}/vllm-overlay-cicache-{RUN_ID}/base:bookworm-dev"
    client.images.get(services["VLLM_OVERLAY_TEST_BASE_IMAGE"]).tag(base)
    for chunk in client.images.push(base, stream=True, decode=True):
        assert "error" not in chunk, chunk
    work = tmp_path_factory.mktemp("cicache")
    repo = f"{registry}/vllm-overlay-cicache-{RUN_ID}/v41"
    recipe = write_recipe_copy(work / "a" / "recipe.yaml", services, repo, base=base)
    produced = work / "produced-a.yaml"
    proc = run_cli("image", recipe, "--push", env=cli_env(services, produced))
    assert proc.returncode == 0, proc.stderr[-3000:]
    yield {"work": work, "repo": repo, "base": base, "recipe": recipe}
    for image in client.images.list(name=repo):
        for tag in image.tags:
            client.images.remove(tag)
    client.images.remove(base)


@pytest.fixture(scope="module")
def fresh_b(services, pushed_a):
    """Recipe B (one member's hunk changed) built and pushed on an empty engine."""
    work: Path = pushed_a["work"]
    overlay = changed_overlay(work / "b-overlay", f"ci cache {RUN_ID}")
    recipe = write_recipe_copy(
        work / "b" / "recipe.yaml", services, pushed_a["repo"], base=pushed_a["base"], overlay=overlay
    )
    with fresh_engine(services["DOCKER_HOST"]) as engine:
        empty = image_count(engine)
        env = cli_env(services, work / "produced-b.yaml", DOCKER_HOST=engine)
        proc = run_cli("image", recipe, "--push", env=env)
        fresh = docker.DockerClient(base_url=engine)
        made = fresh.images.get(f"{pushed_a['repo']}:{yaml.safe_load(recipe.read_text())['name']}")
        yield {"proc": proc, "empty": empty, "labels": made.labels, "recipe": recipe}


def test_the_fresh_engine_starts_empty_and_builds_b(fresh_b) -> None:
    assert fresh_b["empty"] == 0
    assert fresh_b["proc"].returncode == 0, fresh_b["proc"].stderr[-3000:]


def test_a_member_change_on_an_empty_engine_reuses_the_pulled_install_layers(fresh_b, pushed_a) -> None:
    log = fresh_b["proc"].stderr
    assert f"pull {pushed_a['repo']}:" in log and "as build cache" in log, log[:2000]
    # both pulls (the base, then A) stream a line per layer and the engine's closing status
    assert f"pull base {pushed_a['base']} from " in log
    assert re.search(r"^  layer \d+ [0-9a-f]{12}: Pull complete$", log, re.M), log[:2000]
    assert len(re.findall(r"^  Status: Downloaded newer image for ", log, re.M)) == 2, log[:3000]
    ran = steps(log)
    installs = [lines for instruction, lines in ran if "install" in instruction and instruction.startswith("RUN")]
    assert installs, "no install step in the build"
    for lines in installs:  # every install step came from the pulled image, none ran
        assert "---> Using cache" in lines, lines
        assert not any("Successfully installed" in line or "Downloading" in line for line in lines), lines
    # the overlay was rebuilt: its staging step ran (a new member hunk)
    [stage] = [lines for instruction, lines in ran if "image_checks.py stage" in instruction]
    assert "---> Using cache" not in stage and any("staged" in line for line in stage), stage


def test_the_image_built_on_the_empty_engine_is_bs(fresh_b) -> None:
    key = run_cli("key", fresh_b["recipe"])
    assert key.returncode == 0, key.stderr
    assert fresh_b["labels"][f"{LABEL}.runtime-key"] == key.stdout.strip()
