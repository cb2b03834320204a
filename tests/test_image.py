"""Integration tests of `vllm-overlay image` and `plan` with the real engine, registry and index.

The services (dockerd on a private socket, the registry on 127.0.0.1, the
package index serving the pinned wheels, the Debian base image with Python)
are started by `.ci/services.sh start`; their coordinates come from
tools.services.load_service_env().  Nothing here is skipped: without them the
tests fail with the line that says how to start them.

Every command goes through the CLI.  Each test pushes to or tags its own
repository under the registry (a per-run prefix), so runs never collide, and
writes produced-image rows to its own file (never images/produced.yaml).

The recipe is the default one pointed at the services (tools/image_recipes.py).
The expensive builds are module fixtures, and all of them share the engine's
layer cache for the install steps: only the first build on a fresh engine
installs the 315 MB wheel (about 20 s).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import subprocess
import tarfile
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest
import yaml

from tests.helpers import run_cli
from tools.image_recipes import ACCEPT, changed_overlay, cli_env, made_images, remove_images, write_recipe_copy
from tools.synthetic import DEFAULT_RECIPE, ROOT

ATTENTION = "vllm/models/deepseek_v41/attention.py"
SPARSE = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
SELFTEST = "vllm/models/deepseek_v41/nvidia/sm120_decode_shape_selftest.py"
MEMBERS = "sm120_swa_page_block_size,sm120_decode_shape_selftest"
RUN_ID = uuid.uuid4().hex[:10]
# Logs of the builds that are new on every run (their images are removed at the end; the
# builds every run shares stay, as the engine's cache for the next run).
RUN_ONLY_LOGS: list[str] = []

# Run inside an image: the installed versions, where vllm lives, and the sha256 of given tree paths.
# find_spec does not import vllm (which needs torch, absent with --no-deps).
PROBE = r"""
import hashlib, importlib.metadata as md, importlib.util, json, os, sys
root = os.path.dirname(os.path.dirname(importlib.util.find_spec("vllm").origin))
files = {}
for p in json.loads(sys.argv[1]):
    f = os.path.join(root, p)
    files[p] = hashlib.sha256(open(f, "rb").read()).hexdigest() if os.path.isfile(f) else None
versions = {"vllm": md.version("vllm"), "flashinfer": md.version("flashinfer-python")}
print(json.dumps({**versions, "root": root, "files": files}))
"""


# ---- helpers ------------------------------------------------------------------


@dataclass
class Run:
    """One `image` run of a recipe: its inputs and what it said."""

    recipe: Path
    produced: Path
    repository: str
    proc: subprocess.CompletedProcess

    @property
    def reference(self) -> str:
        return self.proc.stdout.strip().splitlines()[-1]


def repository(services: dict[str, str], purpose: str) -> str:
    return f"{services['VLLM_OVERLAY_TEST_REGISTRY']}/vllm-overlay-itest-{RUN_ID}/{purpose}"


def image_run(services: dict[str, str], recipe: Path, produced: Path, *args: str) -> Run:
    repo = yaml.safe_load(recipe.read_text())["image"]["repository"]
    return Run(recipe, produced, repo, run_cli("image", recipe, *args, env=cli_env(services, produced)))


def rows(produced: Path) -> list[dict]:
    return (yaml.safe_load(produced.read_text()) or []) if produced.exists() else []


def stderr_tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return proc.stderr[-n:]


def steps(stderr: str) -> dict[str, list[str]]:
    """Each build step's instruction with the lines it printed (for both builds of a run)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in stderr.splitlines():
        m = re.match(r"Step \d+/\d+ : (.*)", line)
        if m:
            current = m.group(1)
            out.setdefault(current, [])
        elif current is not None:
            out[current].append(line.strip())
    return out


def step_lines(stderr: str, needle: str) -> list[str]:
    found = [lines for instruction, lines in steps(stderr).items() if needle in instruction]
    assert len(found) == 1, f"expected one build step with {needle!r}, found {len(found)}"
    return found[0]


def read_from_image(client: docker.DockerClient, image: str, path: str) -> bytes:
    """A file's bytes, copied out of a created (never started) container."""
    container = client.containers.create(image, ["true"], network_mode="none")
    try:
        stream, _ = container.get_archive(path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            return tar.extractfile(member).read()
    finally:
        container.remove(force=True)


def probe_image(client: docker.DockerClient, image: str, python: str, paths: list[str]) -> dict:
    out = client.containers.run(image, [python, "-c", PROBE, json.dumps(paths)], remove=True, network_mode="none")
    return json.loads(out.decode().strip().splitlines()[-1])


def parents(client: docker.DockerClient, image_id: str) -> list[str]:
    """The image and its parent chain in the engine (the classic builder keeps one image per step)."""
    chain = []
    while image_id:
        chain.append(image_id)
        image_id = client.images.get(image_id).attrs.get("Parent") or ""
    return chain


def layers(client: docker.DockerClient, image: str) -> list[str]:
    return client.images.get(image).attrs["RootFS"]["Layers"]


def cli_out(*args: object, env: dict[str, str] | None = None) -> str:
    proc = run_cli(*map(str, args), env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


# ---- fixtures -----------------------------------------------------------------


@pytest.fixture(scope="module")
def client(services):
    """The engine; at the end this run's tags are removed, and the images only this run made.

    An image left with no tag and no child goes, with its untagged parents up to the
    first one still in use (the cached install steps stay, for the next run).
    """
    engine = docker.DockerClient(base_url=services["DOCKER_HOST"], timeout=600)
    engine.ping()
    yield engine
    prefixes = (
        f"{services['VLLM_OVERLAY_TEST_REGISTRY']}/vllm-overlay-itest-{RUN_ID}/",
        f"vllm-overlay-itest-{RUN_ID}/",
    )
    remove_images(engine, prefixes, [i for log in RUN_ONLY_LOGS for i in made_images(log)])
    engine.close()


@pytest.fixture(scope="module")
def default_build(services, client, tmp_path_factory) -> Run:
    """The default recipe, built once (cold: about 25 s, most of it the 315 MB wheel's install)."""
    work = tmp_path_factory.mktemp("default")
    recipe = write_recipe_copy(work / "recipe.yaml", services, repository(services, "default"))
    run = image_run(services, recipe, work / "produced.yaml")
    assert run.proc.returncode == 0, stderr_tail(run.proc)
    return run


@pytest.fixture(scope="module")
def applied(default_build, tmp_path_factory) -> Path:
    """`vllm-overlay apply --out` of the same recipe: the touched files and manifest.json."""
    out = tmp_path_factory.mktemp("applied") / "overlay"
    cli_out("apply", default_build.recipe, "--out", out)
    return out


@pytest.fixture(scope="module")
def changed_build(services, default_build, tmp_path_factory) -> Run:
    """The same recipe with one member's hunk changed (a comment line beside swa_block_size = 64)."""
    work = tmp_path_factory.mktemp("changed")
    # The run id makes the change new to the engine on every run, so the overlay steps do run.
    overlay = changed_overlay(work / "overlay", f"run {RUN_ID}")
    recipe = write_recipe_copy(work / "recipe.yaml", services, repository(services, "changed"), overlay=overlay)
    run = image_run(services, recipe, work / "produced.yaml")
    RUN_ONLY_LOGS.append(run.proc.stderr)
    assert run.proc.returncode == 0, stderr_tail(run.proc)
    return run


@pytest.fixture(scope="module")
def vllm_base(services, client) -> str:
    """A stand-in for an existing vLLM image: the test base with vllm and flashinfer pip-installed, unpatched.

    Its tag is the same on every run and is kept, so only the first run on an engine installs the wheels.
    """
    tag = "vllm-overlay-itest/vllm-base:0.30.0"
    index = services["VLLM_OVERLAY_TEST_INDEX"]
    dockerfile = (
        f"FROM {services['VLLM_OVERLAY_TEST_BASE_IMAGE']}\n"
        f"RUN python3 -m pip install --no-cache-dir --break-system-packages --no-deps --index-url {index} "
        "vllm==0.30.0 flashinfer-python==0.6.18.post1\n"
    )
    client.images.build(
        fileobj=io.BytesIO(dockerfile.encode()), tag=tag, network_mode="host", rm=True, forcerm=True, pull=False
    )
    return tag


# ---- tests --------------------------------------------------------------------


def test_default_recipe_image_holds_the_patched_tree(services, client, default_build, applied) -> None:
    ref = default_build.reference
    assert ref.startswith(default_build.repository + ":rk-")
    manifest = json.loads((applied / "manifest.json").read_text())
    paths = [f["path"] for f in manifest["files"]]
    assert {ATTENTION, SPARSE, SELFTEST} <= set(paths)

    found = probe_image(client, ref, "python", paths)
    assert (found["vllm"], found["flashinfer"]) == ("0.30.0", "0.6.18.post1")
    shown = client.containers.run(
        ref, ["python", "-m", "pip", "show", "vllm", "flashinfer-python"], remove=True, network_mode="none"
    ).decode()
    assert re.findall(r"(?m)^(Name|Version): (.*)$", shown) == [
        ("Name", "vllm"),
        ("Version", "0.30.0"),
        ("Name", "flashinfer-python"),
        ("Version", "0.6.18.post1"),
    ]
    # Every touched file is the one `apply` wrote (the self-test module included, new in this tree) ...
    for path in paths:
        assert found["files"][path] == hashlib.sha256((applied / path).read_bytes()).hexdigest(), path
    assert found["files"][SELFTEST] is not None
    # ... and the two patched sources are byte-identical, read straight out of the image.
    for path in (ATTENTION, SPARSE, SELFTEST):
        assert read_from_image(client, ref, f"{found['root']}/{path}") == (applied / path).read_bytes(), path

    labels = client.images.get(ref).labels
    env = cli_env(services, default_build.produced.parent / "empty.yaml")
    runtime_key = cli_out("key", default_build.recipe).strip()
    image_key = cli_out("dockerfile", default_build.recipe, "--out", default_build.produced.parent / "context").strip()
    planned = cli_out("plan", default_build.recipe, env=env)
    assert labels["io.vllm-overlay.runtime-key"] == runtime_key == manifest["runtime_key"]
    assert labels["io.vllm-overlay.image-key"] == image_key
    assert f"image key   {image_key}" in planned and f"runtime key {runtime_key}" in planned
    assert ref == f"{default_build.repository}:rk-{runtime_key.removeprefix('rk-')[:16]}"
    assert labels["io.vllm-overlay.members"] == MEMBERS
    assert labels["io.vllm-overlay.pins"] == (
        "vllm==0.30.0 sha256:ef52ee58c410ead0b8afb190838fa4cbcb52075596f67862a03859d984966ac4; "
        "flashinfer-python==0.6.18.post1 sha256:adb6d2952b47131138e108bd2999b1fe18b71f1a4c0b2684f168753db9563991"
    )
    # No torch and no nvcc in the test base: the labels say so rather than being left out.
    assert labels["io.vllm-overlay.torch-cuda"] == "none"
    assert labels["io.vllm-overlay.nvcc"] == "none"
    assert labels["io.vllm-overlay.cuda-mismatch-accepted"] == ACCEPT
    revision = (
        subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        or "unknown"
    )
    assert labels["org.opencontainers.image.revision"] == revision
    assert labels["org.opencontainers.image.title"] == "vllm-overlay v41-sm120"
    assert labels["org.opencontainers.image.version"] == f"0.30.0-{runtime_key.removeprefix('rk-')[:16]}"
    assert labels["org.opencontainers.image.base.name"] == services["VLLM_OVERLAY_TEST_BASE_IMAGE"]
    assert "org.opencontainers.image.base.digest" not in labels  # the base is not pinned by digest here
    source = yaml.safe_load(DEFAULT_RECIPE.read_text())["image"].get("source")
    assert labels.get("org.opencontainers.image.source") == source
    # The tags: by runtime key, by image key, and the recipe's moving tag, all on the one image.
    image = client.images.get(ref)
    assert {
        ref,
        f"{default_build.repository}:ik-{image_key.removeprefix('ik-')[:16]}",
        f"{default_build.repository}:v41-sm120",
    } <= set(image.tags)

    [row] = rows(default_build.produced)
    assert (row["recipe"], row["runtime_key"], row["image_key"], row["image"]) == (
        "v41-sm120",
        runtime_key,
        image_key,
        ref,
    )
    assert row["digest"] == image.id
    assert row["pins"] == {"vllm": "0.30.0", "flashinfer": "0.6.18.post1"}


def test_second_run_builds_nothing(services, client, default_build) -> None:
    before = client.images.get(default_build.reference).id
    again = image_run(services, default_build.recipe, default_build.produced)
    assert again.proc.returncode == 0, stderr_tail(again.proc)
    assert not re.search(r"(?m)^Step \d+", again.proc.stderr), again.proc.stderr
    assert "up to date" in again.proc.stderr
    assert again.reference == default_build.reference
    assert client.images.get(default_build.reference).id == before
    assert len(rows(default_build.produced)) == 1


def test_member_change_rebuilds_only_the_overlay_layers(services, client, default_build, changed_build) -> None:
    old_rk, new_rk = (cli_out("key", r.recipe).strip() for r in (default_build, changed_build))
    ctx = changed_build.produced.parent
    old_ik, new_ik = (
        cli_out("dockerfile", r.recipe, "--out", ctx / f"context-{i}").strip()
        for i, r in enumerate((default_build, changed_build))
    )
    assert old_rk != new_rk and old_ik != new_ik
    old, new = client.images.get(default_build.reference), client.images.get(changed_build.reference)
    assert new.labels["io.vllm-overlay.runtime-key"] == new_rk and new.labels["io.vllm-overlay.image-key"] == new_ik

    # The install steps came from the engine's cache; the overlay steps ran.
    log = changed_build.proc.stderr
    for needle in ("-m venv", "COPY image_checks.py", "image_checks.py install", "image_checks.py pins"):
        assert step_lines(log, needle)[:1] == ["---> Using cache"], (needle, step_lines(log, needle))
    assert any(line.startswith("---> Running in") for line in step_lines(log, "image_checks.py stage"))

    # Layers: the two images share the installed stage (one image in the engine, the pins step) and
    # differ only in the overlay layers after it: the staged files, the manifest, the finish step.
    shared = [i for i in parents(client, new.id) if i in set(parents(client, old.id))]
    installed = shared[0]
    assert "image_checks.py pins" in client.api.history(installed)[0]["CreatedBy"]
    old_layers, new_layers, base_layers = layers(client, old.id), layers(client, new.id), layers(client, installed)
    common = next(
        (i for i, (a, b) in enumerate(zip(old_layers, new_layers, strict=False)) if a != b),
        min(len(old_layers), len(new_layers)),
    )
    assert common == len(base_layers)
    assert old_layers[:common] == new_layers[:common] == base_layers
    assert len(old_layers) == len(new_layers)
    assert 2 <= len(new_layers) - common <= 3, (len(new_layers), common)
    # The base image's own layers and the install layers are all in the shared part.
    assert (
        layers(client, services["VLLM_OVERLAY_TEST_BASE_IMAGE"])
        == base_layers[: len(layers(client, services["VLLM_OVERLAY_TEST_BASE_IMAGE"]))]
    )
    assert (
        len(base_layers) >= len(layers(client, services["VLLM_OVERLAY_TEST_BASE_IMAGE"])) + 2
    )  # venv, installed wheels


def test_push_then_plan_answers_from_the_registry(services, client, default_build, tmp_path) -> None:
    # The same recipe under another repository: the engine already has the image (same image key).
    repo = repository(services, "pushed")
    recipe = write_recipe_copy(tmp_path / "recipe.yaml", services, repo)
    empty, produced, gh_before, gh_after = (
        tmp_path / n for n in ("empty.yaml", "produced.yaml", "gh-before", "gh-after")
    )
    runtime_key = cli_out("key", recipe).strip()
    image_key = client.images.get(default_build.reference).labels["io.vllm-overlay.image-key"]
    ik_tag = f"{repo}:ik-{image_key.removeprefix('ik-')[:16]}"

    before = run_cli("plan", recipe, env=cli_env(services, empty, GITHUB_OUTPUT=str(gh_before)))
    assert before.returncode == 0, before.stderr
    assert before.stdout.startswith("rebuild"), before.stdout
    assert gh_before.read_text() == f"rebuild=true\nkey={runtime_key}\nimage-key={image_key}\n"

    pushed = image_run(services, recipe, produced, "--push")
    assert pushed.proc.returncode == 0, stderr_tail(pushed.proc)
    host = services["VLLM_OVERLAY_TEST_REGISTRY"]
    name = repo.removeprefix(host + "/")
    with urllib.request.urlopen(f"http://{host}/v2/{name}/tags/list", timeout=30) as response:
        tags = set(json.load(response)["tags"])
    assert tags == {f"rk-{runtime_key.removeprefix('rk-')[:16]}", ik_tag.rsplit(":", 1)[1], "v41-sm120"}
    [row] = rows(produced)
    assert row["digest"].startswith("sha256:") and row["image"] == pushed.reference

    after = run_cli("plan", recipe, env=cli_env(services, empty, GITHUB_OUTPUT=str(gh_after)))
    assert after.returncode == 0, after.stderr
    first = after.stdout.splitlines()[0]
    assert first.startswith("up-to-date") and "registry" in first and ik_tag in first, after.stdout
    assert not empty.exists()  # the answer came from the registry, not from a row
    assert gh_after.read_text() == f"rebuild=false\nkey={runtime_key}\nimage-key={image_key}\n"


def test_installed_file_differing_from_the_manifest_fails_the_build(services, default_build, tmp_path) -> None:
    # An existing-vLLM base whose attention.py is already patched: the pins check finds it differing
    # from vLLM's RECORD (what pip installed), before the overlay's "before" hashes are compared.
    recipe = write_recipe_copy(
        tmp_path / "recipe.yaml",
        services,
        repository(services, "prepatched"),
        mode="vllm",
        base=default_build.reference,
    )
    produced = tmp_path / "produced.yaml"
    run = image_run(services, recipe, produced)
    assert run.proc.returncode == 1, stderr_tail(run.proc)
    last = run.proc.stderr.splitlines()[-1]
    assert last.startswith("vllm-overlay: image build failed: vllm 0.30.0: "), stderr_tail(run.proc)
    assert re.search(
        r"installed files differ from its RECORD: .*vllm/models/deepseek_v41/attention\.py \(sha256 ", last
    )
    assert "Traceback" not in run.proc.stderr
    assert rows(produced) == []


def test_existing_vllm_base_is_overlaid_and_verified(services, client, vllm_base, applied, tmp_path) -> None:
    recipe = write_recipe_copy(
        tmp_path / "recipe.yaml", services, repository(services, "vllm-mode"), mode="vllm", base=vllm_base
    )
    produced = tmp_path / "produced.yaml"
    run = image_run(services, recipe, produced)
    assert run.proc.returncode == 0, stderr_tail(run.proc)
    assert "pip install" not in "".join(steps(run.proc.stderr))  # the base brings vLLM; nothing is installed
    paths = [f["path"] for f in json.loads((applied / "manifest.json").read_text())["files"]]
    found = probe_image(client, run.reference, "python3.11", paths)
    assert (found["vllm"], found["flashinfer"]) == ("0.30.0", "0.6.18.post1")
    assert found["root"].startswith("/usr/local/lib/python3.11/")  # the base's own interpreter, not a venv
    for path in paths:
        assert found["files"][path] == hashlib.sha256((applied / path).read_bytes()).hexdigest(), path
    labels = client.images.get(run.reference).labels
    assert labels["io.vllm-overlay.runtime-key"] == cli_out("key", recipe).strip()
    assert labels["org.opencontainers.image.base.name"] == vllm_base
    assert [r["image"] for r in rows(produced)] == [run.reference]


def test_cuda_mismatch_fails_unless_the_recipe_accepts_it(services, tmp_path) -> None:
    recipe = write_recipe_copy(
        tmp_path / "recipe.yaml", services, repository(services, "cuda-mismatch"), accept_cuda_mismatch=None
    )
    produced = tmp_path / "produced.yaml"
    run = image_run(services, recipe, produced)
    assert run.proc.returncode == 1, stderr_tail(run.proc)
    messages = [line for line in run.proc.stderr.splitlines() if "CUDA mismatch" in line]
    assert messages and all("CUDA 12.8.1" in m and "libcudart.so.13" in m for m in messages), stderr_tail(run.proc)
    assert run.proc.stderr.splitlines()[-1].startswith("vllm-overlay: image build failed")
    assert rows(produced) == []


@pytest.mark.parametrize("engine", ["unix:///nonexistent.sock", "ssh://nobody@127.0.0.1:1"])
def test_unreachable_engine_is_one_line_exit_3(services, tmp_path, engine) -> None:
    """A service that did not answer is exit 3, not bad input (2): the recipe is fine.  An
    ssh:// engine goes through the system ssh client (docker-py still needs paramiko for it)."""
    recipe = write_recipe_copy(tmp_path / "recipe.yaml", services, repository(services, "unreachable"))
    produced = tmp_path / "produced.yaml"
    env = cli_env(services, produced, DOCKER_HOST=engine)
    proc = run_cli("image", recipe, env=env)
    assert proc.returncode == 3, proc.stderr
    *before, last = proc.stderr.splitlines()
    assert last.startswith("vllm-overlay: Docker engine at " + engine), proc.stderr
    # the system ssh client says why in a line of its own, to the stderr docker-py gives it
    assert (
        all(line.startswith("ssh: ") for line in before)
        and len(before) <= (1 if "ssh" in engine else 0)
        and "cannot be reached" in proc.stderr
    )
    assert proc.stdout == "" and not produced.exists()


def test_an_image_built_from_the_overlay_image_is_not_taken_for_it(services, client, tmp_path) -> None:
    # An image built FROM the overlay image inherits every label, the image key's included.
    repo = repository(services, "derived")
    # A name of its own: a new image key, so this run builds it.
    recipe = write_recipe_copy(tmp_path / "recipe.yaml", services, repo, name=f"v41-sm120-derived-{RUN_ID}")
    produced = tmp_path / "produced.yaml"
    first = image_run(services, recipe, produced)
    RUN_ONLY_LOGS.append(first.proc.stderr)
    assert first.proc.returncode == 0, stderr_tail(first.proc)
    built = client.images.get(first.reference)
    derived, _ = client.images.build(
        fileobj=io.BytesIO(f"FROM {built.id}\nRUN touch /derived\n".encode()),
        tag=f"vllm-overlay-itest-{RUN_ID}/derived:latest",
        rm=True,
        network_mode="none",
    )
    assert derived.labels["io.vllm-overlay.image-key"] == built.labels["io.vllm-overlay.image-key"]
    for tag in built.tags:  # only the derived image is left carrying the key among tagged images
        client.images.remove(tag, noprune=True)

    again = image_run(services, recipe, produced)
    assert again.proc.returncode == 0, stderr_tail(again.proc)
    assert client.images.get(again.reference).id == built.id != derived.id
