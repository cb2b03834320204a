"""`vllm-overlay lock` and the locked install, against the real local index and engine.

The recipes are the default recipe pointed at the local services
(tools/image_recipes.py), locked by a real `vllm-overlay lock` run: uv resolves
from the local PEP 503 index, which serves the two pinned wheels only (hence
no_deps).  What a lock must hold is read from the recipe's YAML here, never
from the builder's own recipe loader.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import socket
import subprocess
import tarfile
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import docker
import pytest
import yaml

from tests.helpers import run_cli
from tools.gate_recipes import write_gate_recipe
from tools.image_recipes import cli_env, made_images, remove_images, write_recipe_copy
from tools.synthetic import DEFAULT_RECIPE, ROOT

RUN_ID = uuid.uuid4().hex[:10]
RUN_ONLY_LOGS: list[str] = []
HEADER_RE = re.compile(r"# vllm-overlay lock inputs sha256:[0-9a-f]{64}")


def repository(purpose: str) -> str:
    return f"vllm-overlay-ltest-{RUN_ID}/{purpose}"


def lock_of(recipe: Path) -> Path:
    """<recipe dir>/<recipe name>.lock, the name read from the YAML."""
    return recipe.parent / f"{yaml.safe_load(recipe.read_text())['name']}.lock"


def locked_entries(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version or '@ url', sha256 list), read from the requirement lines and their --hash lines."""
    entries = {}
    for m in re.finditer(
        r"(?m)^([A-Za-z0-9._-]+)(==\S+| @ \S+) \\\n((?:[ ]+--hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)", text
    ):
        entries[m.group(1)] = (m.group(2).removeprefix("=="), re.findall(r"sha256:([0-9a-f]{64})", m.group(3)))
    return entries


def edit(recipe: Path, change) -> None:
    data = yaml.safe_load(recipe.read_text())
    change(data)
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))


def ok(*args: object, env: dict[str, str] | None = None) -> str:
    proc = run_cli(*map(str, args), env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def one_line(proc, code: int) -> str:
    """The run's one error line (exit ``code``), after any progress lines."""
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("vllm-overlay: ")]
    assert len(errors) == 1 and proc.stderr.splitlines()[-1] == errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "cause:" not in proc.stderr
    return errors[0]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client(services):
    """The engine; at the end this run's tags go, and the images only this run made."""
    engine = docker.DockerClient(base_url=services["DOCKER_HOST"], timeout=600)
    engine.ping()
    yield engine
    remove_images(engine, (f"vllm-overlay-ltest-{RUN_ID}/",), [i for log in RUN_ONLY_LOGS for i in made_images(log)])
    engine.close()


def read_from_image(client, image: str, path: str) -> bytes:
    container = client.containers.create(image, ["true"], network_mode="none")
    try:
        stream, _ = container.get_archive(path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            return tar.extractfile(tar.next()).read()
    finally:
        container.remove(force=True)


# ---- making the lock ----------------------------------------------------------


def test_lock_from_the_local_index_holds_the_pins(services, tmp_path):
    recipe = write_recipe_copy(tmp_path / "recipe.yaml", services, repository("pins"))
    lock = lock_of(recipe)
    made_by_api = lock.read_bytes()
    lock.unlink()

    proc = run_cli("lock", recipe)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(lock)
    assert "lock: resolving for x86_64-manylinux_2_35, Python 3.11, from " + services["VLLM_OVERLAY_TEST_INDEX"] in (
        proc.stderr
    )
    assert re.search(r"(?m)^uv: Resolved 2 packages", proc.stderr), proc.stderr  # uv's progress, streamed
    assert lock.read_bytes() == made_by_api  # the same inputs give the same bytes

    text = lock.read_text()
    assert HEADER_RE.fullmatch(text.splitlines()[0])
    pins = yaml.safe_load(recipe.read_text())
    assert locked_entries(text) == {
        "vllm": (pins["vllm"]["version"], [pins["vllm"]["sha256"]]),
        "flashinfer-python": (pins["flashinfer"]["version"], [pins["flashinfer"]["sha256"]]),
    }
    assert {p.name for p in tmp_path.iterdir()} == {"recipe.yaml", lock.name}  # no temp file left beside it
    planned = ok("plan", recipe, env=cli_env(services, tmp_path / "rows.yaml"))
    assert "stale lock" not in planned


def test_unreachable_index_is_one_line_exit_3_and_writes_nothing(services, tmp_path):
    recipe = write_recipe_copy(tmp_path / "recipe.yaml", services, repository("unreachable"))
    lock = lock_of(recipe)
    before = lock.read_bytes()
    index = f"http://127.0.0.1:{closed_port()}/simple/"
    edit(recipe, lambda d: d["image"]["pip"].update(index_url=index))
    proc = run_cli("lock", recipe)
    line = one_line(proc, 3)
    assert line.startswith(f"vllm-overlay: {recipe}: lock: package index {index} cannot be reached ("), line
    assert line.endswith("; nothing written")
    assert proc.stdout == ""
    assert lock.read_bytes() == before
    assert {p.name for p in tmp_path.iterdir()} == {"recipe.yaml", lock.name}


def test_a_file_at_the_lock_path_that_is_no_lock_is_never_replaced(services, tmp_path):
    recipe = write_recipe_copy(tmp_path / "recipe.yaml", services, repository("foreign"))
    lock = lock_of(recipe)
    lock.write_text("my notes about this recipe\n")
    line = one_line(run_cli("lock", recipe), 2)
    assert line == f"vllm-overlay: {lock}: is there and is not a lock vllm-overlay wrote: not replacing it"
    assert lock.read_text() == "my notes about this recipe\n"


def test_requirements_the_index_cannot_meet_are_one_line_exit_1(services, tmp_path):
    recipe = write_recipe_copy(tmp_path / "recipe.yaml", services, repository("unmet"), unlocked="not yet")
    edit(recipe, lambda d: d["flashinfer"].update(version="0.6.18", wheel="flashinfer_python-0.6.18-py3-none-any.whl"))
    line = one_line(run_cli("lock", recipe), 1)
    assert line.startswith(f"vllm-overlay: {recipe}: lock: uv could not resolve the requirements: ")
    assert "flashinfer-python==0.6.18" in line and line.endswith("; nothing written")
    assert not lock_of(recipe).exists()


def test_mode_vllm_has_nothing_to_lock(services, tmp_path):
    recipe = write_gate_recipe(tmp_path / "recipe.yaml", services, repository("gate"))
    assert not lock_of(recipe).exists()  # the gate's recipes need no lock
    line = one_line(run_cli("lock", recipe), 2)
    assert "image.mode: mode vllm installs nothing: there is nothing to lock" in line
    assert "stale lock" not in ok("plan", recipe, env=cli_env(services, tmp_path / "rows.yaml"))
    assert not lock_of(recipe).exists()


# ---- a recipe has its lock or unlocked -----------------------------------------


def test_lock_or_unlocked_not_both_not_neither(services, tmp_path):
    env = cli_env(services, tmp_path / "rows.yaml")
    recipe = write_recipe_copy(tmp_path / "recipe.yaml", services, repository("rules"), unlocked="a test reason")
    lock = tmp_path / "v41-sm120.lock"
    assert not lock.exists()
    unlocked_key = ok("plan", recipe, env=env).splitlines()[2]

    edit(recipe, lambda d: d["image"].pop("unlocked"))
    neither = one_line(run_cli("plan", recipe, env=env), 2)
    assert f"no lock {lock}: run `vllm-overlay lock {recipe}`" in neither and "image.unlocked" in neither
    assert ok("key", recipe).startswith("rk-")  # the runtime key never needs the lock

    ok("lock", recipe)
    locked_key = ok("plan", recipe, env=env).splitlines()[2]
    assert locked_key != unlocked_key

    edit(recipe, lambda d: d["image"].update(unlocked="a test reason"))
    both = one_line(run_cli("plan", recipe, env=env), 2)
    assert f"{recipe}: image.unlocked: the recipe has its lock {lock}: remove image.unlocked" in both

    edit(recipe, lambda d: d["image"].update(unlocked="another reason"))
    lock.unlink()
    assert ok("plan", recipe, env=env).splitlines()[2] not in (unlocked_key, locked_key)  # the reason is keyed

    edit(recipe, lambda d: (d["image"].pop("unlocked"), d["image"].update(mode="vllm")))
    lock.write_bytes(b"# not even a lock\n")
    stray = one_line(run_cli("plan", recipe, env=env), 2)
    assert f"mode vllm installs nothing, so {lock} is never used: remove it" in stray


def test_default_recipe_is_unlocked_with_its_reason_and_keeps_its_runtime_key(tmp_path):
    data = yaml.safe_load(DEFAULT_RECIPE.read_text())
    assert "download.pytorch.org" in data["image"]["unlocked"]
    assert not (DEFAULT_RECIPE.parent / f"{data['name']}.lock").exists()
    # The runtime key is the tree's: the same with or without the unlocked field.
    copy = tmp_path / "v41.yaml"
    data["image"].pop("unlocked")
    data["overlay"] = str(ROOT / "overlay")
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    assert ok("key", DEFAULT_RECIPE) == ok("key", copy)


def test_malformed_lock_is_one_line_naming_the_file_and_line(services, tmp_path):
    recipe = write_recipe_copy(tmp_path / "recipe.yaml", services, repository("malformed"))
    lock = lock_of(recipe)
    lines = lock.read_text().splitlines(keepends=True)
    lock.write_text("".join(lines[:4]) + "vllm>=0.30\n" + "".join(lines[4:]))
    line = one_line(run_cli("plan", recipe, env=cli_env(services, tmp_path / "rows.yaml")), 2)
    assert line.startswith(f"vllm-overlay: {lock}: line 5: unreadable requirement 'vllm>=0.30'"), line
    lock.write_text("vllm==0.30.0\n")
    line = one_line(run_cli("plan", recipe, env=cli_env(services, tmp_path / "rows.yaml")), 2)
    assert line.startswith(f"vllm-overlay: {lock}: line 1: no '# vllm-overlay lock inputs sha256:...' first line")


# ---- a lock that no longer matches its recipe ----------------------------------


def test_stale_lock_is_reported_by_check_and_plan_and_refused_by_dockerfile_and_image(services, vllm_wheel, tmp_path):
    env = cli_env(services, tmp_path / "rows.yaml")
    recipe = write_recipe_copy(tmp_path / "recipe.yaml", services, repository("stale"))
    lock = lock_of(recipe)
    assert run_cli("check", recipe).returncode == 0

    edit(recipe, lambda d: d["image"].update(python="3.12"))  # the recipe changed after the lock
    check = run_cli("check", recipe)
    assert check.returncode == 1, check.stderr
    stale = [line for line in check.stdout.splitlines() if line.startswith("stale lock: ")]
    assert stale == [
        f"stale lock: {lock}: lock does not match the recipe: made for other inputs than the recipe's"
        f" (its pins, image.python, image.pip or image.torch): run `vllm-overlay lock {recipe}`"
    ], check.stdout
    assert "overlay check: OK" in check.stdout  # the members still apply; the lock alone failed
    report = json.loads(ok_or(run_cli("check", recipe, "--json"), 1))
    assert report["ok"] is False and report["lock"] == stale[0].removeprefix("stale lock: ")

    planned = ok("plan", recipe, env=env)
    assert [line for line in planned.splitlines() if line.startswith("stale lock: ")] == stale

    out = tmp_path / "context"
    refused = one_line(run_cli("dockerfile", recipe, "--out", out), 1)
    assert refused == f"vllm-overlay: not rendering from a stale lock: {stale[0].removeprefix('stale lock: ')}"
    assert not out.exists()
    assert one_line(run_cli("image", recipe, env=env), 1) == refused
    assert not (tmp_path / "rows.yaml").exists()

    ok("lock", recipe)  # made again: it matches
    assert run_cli("check", recipe).returncode == 0
    assert "stale lock" not in ok("plan", recipe, env=env)

    # A lock whose FlashInfer hash is not the recipe's pin (edited, or from another index) is refused too.
    pin = yaml.safe_load(recipe.read_text())["flashinfer"]["sha256"]
    lock.write_text(lock.read_text().replace(pin, hashlib.sha256(b"another file").hexdigest()))
    refused = one_line(run_cli("dockerfile", recipe, "--out", out), 1)
    assert "flashinfer-python's hashes do not include flashinfer.sha256" in refused and str(lock) in refused


def ok_or(proc, code: int) -> str:
    assert proc.returncode == code, proc.stderr
    return proc.stdout


# ---- the locked install, built ---------------------------------------------------


def test_image_installs_from_the_lock(services, client, vllm_wheel, tmp_path):
    recipe = write_recipe_copy(tmp_path / "recipe.yaml", services, repository("locked"))
    lock = lock_of(recipe)
    env = cli_env(services, tmp_path / "rows.yaml")
    proc = run_cli("image", recipe, env=env)
    RUN_ONLY_LOGS.append(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = proc.stdout.strip().splitlines()[-1]
    image = client.images.get(reference)

    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    assert image.labels["io.vllm-overlay.lock"] == f"sha256:{digest}"
    assert "io.vllm-overlay.unlocked" not in image.labels
    history = [step.get("CreatedBy") or "" for step in client.api.history(image.id)]
    install = (
        "python /opt/vllm-overlay/image_checks.py install /opt/vllm-overlay/requirements.lock"
        f" --index-url {services['VLLM_OVERLAY_TEST_INDEX']}"
    )
    assert any(step.endswith(install) for step in history), history
    assert not any("pip install" in step for step in history)  # no resolver step
    assert read_from_image(client, reference, "/opt/vllm-overlay/requirements.lock") == lock.read_bytes()
    installed = read_from_image(client, reference, "/opt/vllm-overlay/installed-wheels.json").decode()
    pins = yaml.safe_load(recipe.read_text())
    for pin in (pins["vllm"], pins["flashinfer"]):
        assert pin["wheel"] in installed and pin["sha256"] in installed
    # and the image says what was installed, with the hashes the lock enforced (not the recipe's words)
    assert image.labels["io.vllm-overlay.installed"] == (
        f"vllm=={pins['vllm']['version']} sha256:{pins['vllm']['sha256']};"
        f" flashinfer-python=={pins['flashinfer']['version']} sha256:{pins['flashinfer']['sha256']}"
    )

    # The image key covers the lock's bytes: the same lock with one more comment is another image.
    context = tmp_path / "context"
    key = ok("dockerfile", recipe, "--out", context).strip()
    assert image.labels["io.vllm-overlay.image-key"] == key
    assert (context / "requirements.lock").read_bytes() == lock.read_bytes()
    lint = subprocess.run(["hadolint", str(context / "Dockerfile")], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr  # the locked install step lints clean too
    lock.write_text(lock.read_text() + "# a note\n")
    assert ok("dockerfile", recipe, "--out", context).strip() != key


def test_wrong_hash_in_the_lock_fails_the_build_naming_the_file(services, client, tmp_path):
    """vLLM from a URL (image.vllm_wheel, no sha256 in the recipe): the lock records the file's sha256;
    a lock whose hash is not the served file's stops the install with one line naming the file."""
    pins = yaml.safe_load(DEFAULT_RECIPE.read_text())
    index = services["VLLM_OVERLAY_TEST_INDEX"]
    with urllib.request.urlopen(index + "vllm/", timeout=30) as response:
        href = re.search(r'href="([^"#]+)', response.read().decode()).group(1)
    url = urllib.parse.urljoin(index + "vllm/", href)
    assert url.endswith("/" + pins["vllm"]["wheel"])
    recipe = write_recipe_copy(
        tmp_path / "recipe.yaml",
        services,
        repository("wrong-hash"),
        name=f"wrong-hash-{RUN_ID}",
        vllm_wheel={"url": url, "unverified": "test: the lock records its sha256"},
    )
    lock = lock_of(recipe)
    entries = locked_entries(lock.read_text())
    assert entries["vllm"] == (f" @ {url}", [pins["vllm"]["sha256"]])  # uv hashed the served file: the pin

    wrong = hashlib.sha256(f"not the wheel {RUN_ID}".encode()).hexdigest()
    lock.write_text(lock.read_text().replace(pins["vllm"]["sha256"], wrong))
    env = cli_env(services, tmp_path / "rows.yaml")
    assert "stale lock" not in ok("plan", recipe, env=env)  # nothing in the recipe pins this file's hash
    proc = run_cli("image", recipe, env=env)
    RUN_ONLY_LOGS.append(proc.stderr)
    assert proc.returncode == 1, proc.stderr[-4000:]
    last = proc.stderr.splitlines()[-1]
    assert last == (
        "vllm-overlay: image build failed: /opt/vllm-overlay/requirements.lock: hash mismatch:"
        f" {pins['vllm']['wheel']} (vllm, lock line {lock_line(lock, 'vllm @')}): expected sha256 {wrong},"
        f" got {pins['vllm']['sha256']}"
    ), proc.stderr[-4000:]
    # The locked install step ran: the one that fetches with hashes required.
    assert "image_checks.py install /opt/vllm-overlay/requirements.lock" in proc.stderr
    assert not (tmp_path / "rows.yaml").exists()


def lock_line(lock: Path, prefix: str) -> int:
    """The 1-based line of the lock that starts with ``prefix`` (pip names the line of a requirement)."""
    [number] = [n for n, line in enumerate(lock.read_text().splitlines(), 1) if line.startswith(prefix)]
    return number


# ---- the workflow's lock job ------------------------------------------------------


def test_workflow_has_a_manual_lock_job_that_uploads_the_lock():
    workflow = yaml.safe_load((ROOT / ".github/workflows/image.yml").read_text())
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as True
    assert "workflow_dispatch" in triggers
    job = workflow["jobs"]["lock"]
    assert job["if"] == "github.event_name == 'workflow_dispatch'"
    runs = " ".join(step.get("run", "") for step in job["steps"])
    assert 'python -m builder lock "$LOCK_RECIPE"' in runs
    upload = [step for step in job["steps"] if step.get("uses", "").startswith("actions/upload-artifact@")]
    assert upload and upload[0]["with"]["path"] == "${{ steps.lock.outputs.path }}"
