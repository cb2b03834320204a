"""The launch gate on two real engines with the real self-test (issue 13, "Tests with real engines").

Two dockerd instances on two sockets stand in for two hosts; each profile has two ranks, ``a`` on
the first engine and ``b`` on the second, no GPUs, TP 4, the text-only request, the checkpoint
being a synthetic one's absolute path (tests/gate_fixtures.py), the recipe the gate recipe
(tools/gate_recipes.py) whose image ``gate_image`` made and pushed.  Every command runs as
``python -m builder`` with ``VLLM_OVERLAY_PRODUCED`` and ``VLLM_OVERLAY_RECEIPTS`` of its own.

Each gate runs once per module (a self-test costs 25-30 s on the test machine) and its
assertions share it: a passing ``gate --static`` (ratio 2), a failing one (the default
checkpoint), a ``launch up`` whose rank ``b`` names an engine that does not exist (the gate
fails: nothing starts), and a passing ``launch up`` followed by ``status`` and ``down``.  The
stale refusals run no self-test.

The gate image has no ``vllm`` console script (tools/gate_image.py copies the probe venv's
site-packages, not its bin/), so a serving container's ``vllm serve ...`` entrypoint could not
start in it.  ``launch up`` therefore runs on a serve image: the gate image plus
/usr/local/bin/vllm (vLLM's own console script, the same text pip writes), made here on the first
engine, pushed to the local registry and pulled by digest into the second.  It inherits the gate
image's runtime-key and image-key labels, and a rows file of its own names it.
"""

from __future__ import annotations

import io
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from builder import api
from tests.helpers import run_cli
from tools.gate_recipes import pull_by_digest, write_gate_recipe
from tools.image_recipes import changed_overlay

pytest_plugins = ["tests.gate_fixtures"]

LABEL = "io.vllm-overlay"
UNREACHABLE = "unix:///nonexistent.sock"
FAIL_REASON = "prefill dual: extra_page_block_size 128 not in {2, 64}"
# The image's FlashInfer JIT directory (images/Dockerfile.j2: FLASHINFER_WORKSPACE_BASE).
JIT_CACHE = "/var/cache/flashinfer"
# vLLM 0.30.0's console script, as pip writes it into a venv's bin/ (python3.11 is the image's interpreter).
VLLM_SCRIPT = (
    "#!/usr/bin/env python3.11\n"
    "import re\nimport sys\nfrom vllm.entrypoints.cli.main import main\n"
    "if __name__ == '__main__':\n"
    "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
    "    sys.exit(main())\n"
)


def write_profile(path: Path, recipe: Path, checkpoint: Path, hosts: tuple[str, str]) -> Path:
    rank = {"gpus": [], "master_addr": "127.0.0.1", "master_port": 29531}
    data = {
        "name": path.stem,
        "recipe": str(recipe),
        "checkpoint": str(checkpoint.resolve()),
        "served_model_name": "v41-gate-test",
        "parallel": {"tensor_parallel_size": 4},
        "requests": {"modality": "LanguageModelOnly", "hf_overrides": {"vision_n_layers": 0}},
        "ranks": [
            {"name": "a", "engine": hosts[0], "node_rank": 0, **rank},
            {"name": "b", "engine": hosts[1], "node_rank": 1, "headless": True, **rank},
        ],
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass
class Run:
    """One CLI run: its process, wall time, window (epoch seconds) and receipt (when it printed one)."""

    profile: Path
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    since: float
    until: float

    @property
    def receipt_path(self) -> Path | None:
        lines = [line for line in self.stdout.splitlines() if line.startswith("receipt ")]
        return Path(lines[-1].removeprefix("receipt ")) if lines else None

    @property
    def receipt(self) -> dict:
        assert self.receipt_path is not None, self.stdout + self.stderr
        return json.loads(self.receipt_path.read_text())

    def table_row(self, rank: str) -> list[str]:
        [row] = [line.split(None, 3) for line in self.stdout.splitlines() if line.split(None, 1)[:1] == [rank]]
        return row

    def __str__(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"


def vo(*args: object, produced: Path, receipts: Path) -> Run:
    env = {"VLLM_OVERLAY_PRODUCED": str(produced), "VLLM_OVERLAY_RECEIPTS": str(receipts)}
    since, t0 = time.time(), time.monotonic()
    proc = run_cli(*map(str, args), env=env)
    seconds, until = time.monotonic() - t0, time.time()
    return Run(Path(str(args[-1])), proc.returncode, proc.stdout, proc.stderr, seconds, since, until)


def argv_of(profile: Path, rank: str) -> list[str]:
    proc = run_cli("launch", "argv", profile, "--rank", rank, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def created(client, run: Run, profile_name: str) -> list[dict]:
    """The engine's container create events in the run's window labelled with the profile."""
    until = max(int(run.until) + 1, int(time.time()))
    filters = {"type": "container", "event": "create", "label": f"{LABEL}.profile={profile_name}"}
    return list(client.events(since=int(run.since) - 1, until=until, filters=filters, decode=True))


def ids(client) -> set[str]:
    return {c.id for c in client.containers.list(all=True)}


def selftest_report(stdout: str) -> dict:
    return json.loads(stdout[: stdout.rstrip().rfind("\n")])


# ---------------------------------------------------------------- the gate runs, once each


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gate-real")


@pytest.fixture(scope="module")
def passed(gate_image, gate_checkpoints, work) -> Run:
    profile = write_profile(work / "pass.yaml", gate_image.recipe, gate_checkpoints["ratio2"], gate_image.hosts)
    return vo("gate", "--static", profile, produced=gate_image.produced, receipts=work / "receipts")


@pytest.fixture(scope="module")
def failed(gate_image, gate_checkpoints, work) -> Run:
    profile = write_profile(work / "fail.yaml", gate_image.recipe, gate_checkpoints["default"], gate_image.hosts)
    return vo("gate", "--static", profile, produced=gate_image.produced, receipts=work / "receipts")


@pytest.fixture(scope="module")
def unreachable(gate_image, gate_checkpoints, work) -> Run:
    hosts = (gate_image.hosts[0], UNREACHABLE)
    profile = write_profile(work / "unreachable.yaml", gate_image.recipe, gate_checkpoints["ratio2"], hosts)
    return vo("launch", "up", "--static", profile, produced=gate_image.produced, receipts=work / "receipts")


@dataclass
class Served:
    up: Run
    image_id: str


@pytest.fixture(scope="module")
def serve_image(gate_image, work) -> tuple[str, Path]:
    """The gate image plus vLLM's console script, in both engines by digest, and its rows file."""
    client = gate_image.client
    script = VLLM_SCRIPT.encode().hex()
    dockerfile = (
        f"FROM {gate_image.reference}\n"
        f"RUN python3.11 -c \"open('/usr/local/bin/vllm', 'wb').write(bytes.fromhex('{script}'))\""
        " && chmod 755 /usr/local/bin/vllm\n"
    )
    tag = f"serve-{gate_image.runtime_key.removeprefix('rk-')[:16]}"
    client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=f"{gate_image.repository}:{tag}", rm=True)
    for line in client.images.push(gate_image.repository, tag=tag, stream=True, decode=True):
        assert "error" not in line, line
    digests = client.images.get(f"{gate_image.repository}:{tag}").attrs["RepoDigests"]
    [reference] = [d for d in digests if d.startswith(gate_image.repository + "@")]
    image = pull_by_digest(gate_image.client2, reference, print)
    [row] = yaml.safe_load(gate_image.produced.read_text())
    produced = work / "serve-produced.yaml"
    row = {**row, "image": f"{gate_image.repository}:{tag}", "digest": reference.split("@", 1)[1]}
    produced.write_text(yaml.safe_dump([row], sort_keys=False))
    return image.id, produced


@pytest.fixture(scope="module")
def served(gate_image, gate_checkpoints, work, serve_image):
    image_id, produced = serve_image
    profile = write_profile(work / "served.yaml", gate_image.recipe, gate_checkpoints["ratio2"], gate_image.hosts)
    key_filter = {"label": [f"{LABEL}.profile-key={api.profile_key(profile)}"]}
    try:
        yield Served(vo("launch", "up", "--static", profile, produced=produced, receipts=work / "receipts"), image_id)
    finally:  # whatever launch down left: only this profile's containers
        for client in gate_image.clients:
            for container in client.containers.list(all=True, filters=key_filter):
                container.remove(force=True)


# ---------------------------------------------------------------- 1. every rank passes


def test_every_rank_passes_static_on_the_ratio2_checkpoint(passed, gate_image, gate_checkpoints) -> None:
    assert passed.returncode == 0, passed
    assert passed.stdout.splitlines()[0] == "gate pass: static (--static: kernel calls not run)"
    for rank, host in zip("ab", gate_image.hosts, strict=True):
        assert passed.table_row(rank) == [rank, host, "PASS", "SELFTEST PASS (static)"]
    receipt = passed.receipt
    assert passed.receipt_path.parent == passed.profile.parent / "receipts"
    assert passed.receipt_path.name.startswith("pass-")
    assert (receipt["outcome"], receipt["passed"], receipt["static"], receipt["error"]) == ("pass", True, True, None)
    assert receipt["profile"]["key"] == api.profile_key(passed.profile)
    assert receipt["profile"]["key"] in passed.stdout
    assert (receipt["runtime_key"], receipt["image_key"]) == (gate_image.runtime_key, gate_image.image_key)
    assert receipt["image"] == {"reference": gate_image.tag, "digest": gate_image.digest}
    checkpoint = str(gate_checkpoints["ratio2"].resolve())
    for rank, host, client in zip(receipt["ranks"], gate_image.hosts, gate_image.clients, strict=True):
        assert rank["engine"] == host
        assert rank["argv"] == argv_of(passed.profile, rank["name"])
        assert rank["argv"][:3] == ["vllm", "serve", checkpoint]
        assert rank["command"][-len(rank["argv"]) + 2 :] == rank["argv"][2:] and "--static" in rank["command"]
        assert rank["image_id"] == client.images.get(gate_image.reference).id
        assert (rank["exit_code"], rank["passed"], rank["failure"]) == (0, True, None)
        assert rank["verdict"] == "SELFTEST PASS (static)"
        # the self-test's whole output: its JSON report, then the verdict line
        assert rank["stdout"].rstrip().splitlines()[-1] == "SELFTEST PASS (static)"
        facts = {f["name"]: f["value"] for f in selftest_report(rank["stdout"])["facts"]}
        assert facts["vllm.version"] == "0.30.0" and facts["vllm.model"] == checkpoint
        assert isinstance(rank["stderr"], str)
        assert receipt["start"] <= rank["start"] <= rank["end"] <= receipt["end"]
    assert receipt["containers"] == []


# ---------------------------------------------------------------- 2. the default checkpoint fails every rank


def test_the_default_checkpoint_fails_every_rank_with_the_reason(failed, gate_image) -> None:
    assert failed.returncode == 1, failed
    for rank, host in zip("ab", gate_image.hosts, strict=True):
        row = failed.table_row(rank)
        assert row[:3] == [rank, host, "FAIL"] and row[3].startswith(FAIL_REASON), row
    receipt = failed.receipt
    assert (receipt["outcome"], receipt["passed"], receipt["static"]) == ("fail", False, True)
    for rank in receipt["ranks"]:
        assert (rank["exit_code"], rank["passed"], rank["failure"]) == (1, False, None)
        assert rank["verdict"].startswith(f"SELFTEST FAIL: {FAIL_REASON}"), rank["verdict"]
        assert rank["stdout"].rstrip().splitlines()[-1] == rank["verdict"]
        assert rank["argv"] == argv_of(failed.profile, rank["name"])


# ---------------------------------------------------------------- 3. a stale row is refused before any container


@pytest.mark.parametrize("how", ["no-row", "recipe-changed", "image-labels"])
def test_a_stale_row_is_refused_before_any_container_starts(
    how, services, gate_image, gate_checkpoints, tmp_path
) -> None:
    recipe, produced = gate_image.recipe, tmp_path / "produced.yaml"
    [row] = yaml.safe_load(gate_image.produced.read_text())
    if how == "no-row":  # a rows file without this image's row (another image key)
        produced.write_text(yaml.safe_dump([{**row, "image_key": "ik-" + "0" * 64}]))
    elif how == "recipe-changed":  # a member changed since the row was made: the recipe's keys are not the row's
        produced.write_text(gate_image.produced.read_text())
        overlay = changed_overlay(tmp_path / "overlay", "stale row test")
        recipe = write_gate_recipe(tmp_path / "recipe.yaml", services, gate_image.repository, overlay=overlay)
    else:  # the row's keys are current, but its digest names an image (the vllm-cpu base) without them
        base = gate_image.client.images.get("vllm-overlay-test/vllm-cpu:0.30.0")
        produced.write_text(yaml.safe_dump([{**row, "digest": base.id}]))
    profile = write_profile(tmp_path / f"stale-{how}.yaml", recipe, gate_checkpoints["ratio2"], gate_image.hosts)
    before = [ids(c) for c in gate_image.clients]
    run = vo("gate", "--static", profile, produced=produced, receipts=tmp_path / "receipts")
    assert run.returncode == 2, run
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("vllm-overlay: image is stale: recipe key rk-"), run
    assert lines[-1].endswith("; run make image"), run
    for client, ids_before in zip(gate_image.clients, before, strict=True):
        assert not created(client, run, profile.stem)  # no container of this profile made, on either engine
        new = [client.api.inspect_container(c)["Config"]["Labels"] or {} for c in ids(client) - ids_before]
        assert not [labels for labels in new if labels.get(f"{LABEL}.profile") == profile.stem]
    if how == "image-labels":  # engines were asked: a receipt says so
        receipt = json.loads(next((tmp_path / "receipts").iterdir()).read_text())
        assert receipt["outcome"] == "refused" and "image is stale" in receipt["error"]
        assert all(rank["exit_code"] is None and not rank["passed"] for rank in receipt["ranks"])
    else:  # refused from the rows alone: no engine asked, one line, no receipt
        assert lines == [lines[-1]], run
        assert "(no produced-image row of " in lines[-1] and " has them)" in lines[-1]
        assert not (tmp_path / "receipts").exists()
        keys = re.match(r"vllm-overlay: image is stale: recipe key (rk-\w+), image key (ik-\w+) ", lines[-1])
        assert keys, lines[-1]
        current = (keys.group(1) == gate_image.runtime_key, keys.group(2) == gate_image.image_key)
        assert current == ((True, True) if how == "no-row" else (False, False))


# ---------------------------------------------------------------- 4. an unreachable engine; 5. up after a failed gate


def test_an_unreachable_engine_fails_its_rank_by_name_and_url(unreachable, gate_image) -> None:
    assert unreachable.returncode == 1, unreachable
    line = f"rank b: engine {UNREACHABLE} cannot be reached: "
    assert unreachable.table_row("b")[:3] == ["b", UNREACHABLE, "FAIL"]
    assert unreachable.table_row("b")[3].startswith(line)
    assert unreachable.table_row("a") == ["a", gate_image.hosts[0], "PASS", "SELFTEST PASS (static)"]
    receipt = unreachable.receipt
    assert (receipt["outcome"], receipt["passed"]) == ("fail", False)
    a, b = receipt["ranks"]
    assert b["failure"].startswith(line) and b["verdict"] == f"SELFTEST FAIL: {b['failure']}"
    assert (b["exit_code"], b["stdout"], b["image_id"]) == (None, None, None) and b["start"] and b["end"]
    # the other rank still ran, whole
    assert (a["exit_code"], a["passed"], a["verdict"]) == (0, True, "SELFTEST PASS (static)")
    assert a["stdout"].rstrip().endswith("SELFTEST PASS (static)") and a["start"] < a["end"]
    assert a["argv"] == argv_of(unreachable.profile, "a")
    assert receipt["start"] and receipt["end"] and receipt["profile"]["key"] == api.profile_key(unreachable.profile)


def test_launch_up_starts_nothing_after_a_failed_gate(unreachable, gate_image) -> None:
    assert unreachable.returncode == 1, unreachable
    assert "vllm-overlay: launch: nothing started: the gate failed" in unreachable.stderr
    assert unreachable.receipt["containers"] == [] and "started " not in unreachable.stdout
    roles = [
        e["Actor"]["Attributes"].get(f"{LABEL}.role") for e in created(gate_image.client, unreachable, "unreachable")
    ]
    assert roles == ["selftest"]  # rank a's self-test, and no serving container
    key = {"label": [f"{LABEL}.profile-key={api.profile_key(unreachable.profile)}"]}
    assert not gate_image.client.containers.list(all=True, filters=key)


# ---------------------------------------------------------------- 5. launch up, status, down after a passing gate


def test_launch_up_creates_one_container_per_rank_with_the_gated_argv(served, gate_image, gate_checkpoints) -> None:
    up = served.up
    assert up.returncode == 0, up
    receipt = up.receipt
    assert (receipt["outcome"], receipt["passed"], receipt["static"]) == ("up", True, True)
    assert [c["rank"] for c in receipt["containers"]] == ["a", "b"]
    checkpoint = str(gate_checkpoints["ratio2"].resolve())
    [row] = yaml.safe_load(gate_image.produced.read_text())
    image_key = row["image_key"]
    for container, rank, client, host in zip(
        receipt["containers"], receipt["ranks"], gate_image.clients, gate_image.hosts, strict=True
    ):
        assert container["engine"] == host and rank["verdict"] == "SELFTEST PASS (static)"
        assert f"started {rank['name']} on {host}: {container['name']} {container['id'][:12]}" in up.stdout
        attrs = client.api.inspect_container(container["id"])
        argv = argv_of(up.profile, rank["name"])
        assert (attrs["Config"]["Entrypoint"] or []) + (attrs["Config"]["Cmd"] or []) == argv == rank["argv"]
        assert attrs["Image"] == served.image_id == rank["image_id"]
        labels = attrs["Config"]["Labels"]
        assert labels[f"{LABEL}.role"] == "serve" and labels[f"{LABEL}.rank"] == rank["name"]
        assert labels[f"{LABEL}.profile-key"] == receipt["profile"]["key"]
        assert labels[f"{LABEL}.runtime-key"] == gate_image.runtime_key
        assert labels[f"{LABEL}.receipt"] == str(up.receipt_path)
        assert attrs["HostConfig"]["IpcMode"] == "host" and attrs["HostConfig"]["NetworkMode"] == "host"
        mounts = {m["Destination"]: m for m in attrs["Mounts"]}
        assert set(mounts) == {checkpoint, JIT_CACHE}, attrs["Mounts"]
        mount = mounts[checkpoint]
        assert (mount["Type"], mount["Source"], mount["RW"]) == ("bind", checkpoint, False)
        # FlashInfer's JIT builds outlive the container: a named volume per image key
        jit = mounts[JIT_CACHE]
        assert (jit["Type"], jit["Name"], jit["RW"]) == ("volume", f"vllm-overlay-flashinfer-{image_key[3:19]}", True)
        # without a GPU vllm serve may exit at once; it ran (or runs) the gated argv either way
        assert attrs["State"]["Status"] in {"running", "exited"}, attrs["State"]
    status = run_cli("launch", "status", up.profile)
    assert status.returncode == 0, status.stderr
    listed = [line.split()[:4] for line in status.stdout.splitlines()]
    expected = [[c["rank"], c["engine"], c["name"], c["id"][:12]] for c in receipt["containers"]]
    assert listed == expected, status.stdout


def test_launch_down_removes_exactly_the_profiles_containers(served, gate_image) -> None:
    assert served.up.returncode == 0, served.up
    ours = [{c["id"]} for c in served.up.receipt["containers"]]
    before = [ids(client) for client in gate_image.clients]
    assert all(mine <= there for mine, there in zip(ours, before, strict=True))
    down = run_cli("launch", "down", served.up.profile)
    assert down.returncode == 0, down.stderr
    assert [line.split()[0] for line in down.stdout.splitlines()] == ["removed", "removed"]
    for client, mine, there in zip(gate_image.clients, ours, before, strict=True):
        assert there - ids(client) == mine  # exactly those, and nothing else, are gone
    status = run_cli("launch", "status", served.up.profile)
    assert (status.returncode, status.stdout, status.stderr.strip()) == (0, "", "no containers of this profile")


def test_a_rank_asking_for_gpus_on_an_engine_without_the_nvidia_runtime_fails_in_one_line(
    gate_image, gate_checkpoints, work
) -> None:
    """The test engines have no NVIDIA runtime: a rank listing GPU ids fails with one line
    saying so, and leaves no container behind on its engine."""
    profile = write_profile(work / "gpus.yaml", gate_image.recipe, gate_checkpoints["ratio2"], gate_image.hosts)
    data = yaml.safe_load(profile.read_text())
    data["ranks"][1]["gpus"] = [0, 1]  # rank b asks for two GPUs: 4 = 2 ranks x 2
    data["ranks"][0]["gpus"] = [0, 1]
    profile.write_text(yaml.safe_dump(data, sort_keys=False))
    before = [ids(client) for client in gate_image.clients]
    run = vo("gate", "--static", profile, produced=gate_image.produced, receipts=work / "receipts")
    assert run.returncode == 1, run
    receipt = run.receipt
    for rank in receipt["ranks"]:
        assert "NVIDIA runtime" in (rank["failure"] or ""), rank
        assert "\n" not in rank["failure"]
        assert rank["passed"] is False
    assert [ids(client) for client in gate_image.clients] == before  # nothing left on either engine
    assert "NVIDIA runtime" in run.table_row("a")[3] and "NVIDIA runtime" in run.table_row("b")[3]
