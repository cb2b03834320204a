"""The gate and launch up/status/down without an engine: each rank's engine is a fake seam
(builder.gate.EngineSeam) or, for the Docker-facing parts, builder.gate.DockerEngine over a
fake Docker client.  What is asserted: verdict aggregation, the table, the receipt's contents
and atomicity (an interrupted gate leaves a whole one), the stale refusal before any run, the
unreachable-engine, GPU-without-runtime and timeout lines, and what launch up starts."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import docker.errors
import pytest
import requests.exceptions
import yaml

from builder import api, gate
from builder.cli import main
from builder.errors import InputError, StorageFailed
from builder.probe import SELFTEST_MODULE, SelftestRun
from tools.synthetic import DEFAULT_RECIPE

ENGINE_A, ENGINE_B = "unix:///fake/a.sock", "unix:///fake/b.sock"
PASS_OUT = '{"routes": {}}\nSELFTEST PASS (static)\n'
FAIL_OUT = (
    '{"routes": {}}\nSELFTEST FAIL: prefill single: topk 1152 not in {128} (flashinfer/x.cu:1); decode kernel: other\n'
)


def write_profile(tmp_path: Path, gpus: list[int] | None = None) -> Path:
    gpus = gpus or []
    data = {
        "name": "unit",
        "recipe": str(DEFAULT_RECIPE),
        "checkpoint": "/models/ratio 2",
        "served_model_name": "v41-test",
        "parallel": {"tensor_parallel_size": 2 * max(1, len(gpus))},
        "engine_args": {"max-model-len": 4096},
        "requests": {"modality": "LanguageModelOnly", "hf_overrides": {"vision_n_layers": 0}},
        "ranks": [
            {"name": "head", "engine": ENGINE_A, "gpus": gpus, "node_rank": 0, "master_addr": "127.0.0.1",
             "master_port": 29501},
            {"name": "worker", "engine": ENGINE_B, "gpus": gpus, "node_rank": 1, "master_addr": "127.0.0.1",
             "master_port": 29501, "headless": True},
        ],
    }  # fmt: skip
    path = tmp_path / "unit.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def keys() -> tuple[str, str]:
    plan = api.plan(DEFAULT_RECIPE)
    return plan.runtime_key, plan.image_key


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys) -> dict:
    """A produced row with the recipe's current keys, receipts in tmp_path, the profile."""
    rk, ik = keys
    produced = tmp_path / "produced.yaml"
    repository = yaml.safe_load(DEFAULT_RECIPE.read_text())["image"]["repository"]
    row = {"recipe": "v41-sm120", "runtime_key": rk, "image_key": ik, "image": "127.0.0.1:5000/vo/t:rk-1",
           "digest": "sha256:" + "d" * 64, "time": "2026-01-01T00:00:00Z", "repository": repository}  # fmt: skip
    produced.write_text(yaml.safe_dump([row]))
    monkeypatch.setenv("VLLM_OVERLAY_PRODUCED", str(produced))
    monkeypatch.setenv("VLLM_OVERLAY_RECEIPTS", str(tmp_path / "receipts"))
    return {"profile": write_profile(tmp_path), "produced": produced, "receipts": tmp_path / "receipts", "row": row}


class FakeEngine:
    """One engine: its image's labels, and what each rank's self-test prints."""

    def __init__(self, url: str, rk: str, ik: str, outputs: dict[str, SelftestRun], calls: list) -> None:
        self.url, self.rk, self.ik, self.outputs, self.calls = url, rk, ik, outputs, calls
        self.started: dict[str, dict] = {}
        self.cancelled = False

    def find_image(self, image, progress):
        self.calls.append(("find", self.url, image.by_digest))
        labels = {"io.vllm-overlay.runtime-key": self.rk, "io.vllm-overlay.image-key": self.ik}
        return gate.FoundImage(f"sha256:image-on-{self.url}", labels)

    def run_selftest(self, job, image_id, labels):
        self.calls.append(("run", self.url, job.name, job.selftest_command(), job.selftest_env(), image_id, labels))
        outcome = self.outputs[job.name]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def start(self, job, image_id, labels):
        self.calls.append(("start", self.url, job.name, list(job.argv), image_id, labels))
        cid = f"c-{job.name}-{len(self.started)}"
        self.started[cid] = {"id": cid, "name": f"n-{job.name}", "status": "running", "rank": job.name,
                             "labels": labels}  # fmt: skip
        return {"id": cid, "name": f"n-{job.name}"}

    def containers(self, labels):
        return [
            {k: v for k, v in c.items() if k != "labels"}
            for c in self.started.values()
            if all(c["labels"].get(k) == v for k, v in labels.items())
        ]

    def remove(self, container_id):
        self.calls.append(("remove", self.url, container_id))
        del self.started[container_id]

    def cancel(self):
        self.cancelled = True


class Fleet:
    """The fake engines of one test, by URL; ``factory`` is what the gate is given."""

    def __init__(self, keys, outputs=None, labels=None) -> None:
        rk, ik = labels or keys
        self.calls: list = []
        outputs = outputs or {"head": SelftestRun(0, PASS_OUT, "log"), "worker": SelftestRun(0, PASS_OUT, "log")}
        self.engines = {url: FakeEngine(url, rk, ik, outputs, self.calls) for url in (ENGINE_A, ENGINE_B)}

    def factory(self, url: str):
        return self.engines[url]

    def kinds(self) -> list[str]:
        return [call[0] for call in self.calls]


def receipts_in(directory: Path) -> list[Path]:
    return sorted(directory.iterdir()) if directory.exists() else []


def test_every_rank_passes_table_and_receipt(env, keys) -> None:
    fleet = Fleet(keys)
    result = api.gate(env["profile"], static=True, engines=fleet.factory)
    assert result.passed and result.outcome == "pass"
    table = result.table()
    assert "gate unit: static (--static" in table
    assert re.search(rf"head\s+{re.escape(ENGINE_A)}\s+PASS\s+SELFTEST PASS \(static\)", table)
    assert re.search(rf"worker\s+{re.escape(ENGINE_B)}\s+PASS", table)

    (receipt,) = receipts_in(env["receipts"])
    assert receipt == result.receipt
    assert re.fullmatch(r"unit-\d{8}T\d{6}Z\.json", receipt.name)
    data = json.loads(receipt.read_text())
    rk, ik = keys
    assert data["profile"]["key"] == api.profile_key(env["profile"])
    assert (data["runtime_key"], data["image_key"]) == (rk, ik)
    assert data["image"] == {"reference": env["row"]["image"], "digest": env["row"]["digest"]}
    assert data["static"] is True and data["passed"] is True and data["outcome"] == "pass"
    assert data["containers"] == []
    for rank in data["ranks"]:
        argv = api.launch_argv(env["profile"], rank["name"])
        assert rank["argv"] == argv
        assert rank["command"] == ["python", "-m", SELFTEST_MODULE, "--json", "--static", "--", *argv[2:]]
        assert rank["stdout"] == PASS_OUT and rank["stderr"] == "log" and rank["exit_code"] == 0
        assert rank["verdict"] == "SELFTEST PASS (static)" and rank["passed"] is True
        assert rank["start"] <= rank["end"]
        assert rank["image_id"] == f"sha256:image-on-{rank['engine']}"
    # each rank ran on its own engine, with the CPU device (no GPU requested) and the labels
    runs = [c for c in fleet.calls if c[0] == "run"]
    assert {(c[1], c[2]) for c in runs} == {(ENGINE_A, "head"), (ENGINE_B, "worker")}
    for run in runs:
        assert run[4] == {**gate.SELFTEST_ENV, "VLLM_TARGET_DEVICE": "cpu"}
        assert run[6]["io.vllm-overlay.profile-key"] == data["profile"]["key"]


def test_without_static_the_flag_is_not_passed_and_the_header_says_so(env, keys) -> None:
    fleet = Fleet(keys)
    result = api.gate(env["profile"], engines=fleet.factory)
    assert "--static" not in [c for c in fleet.calls if c[0] == "run"][0][3]
    assert "gate unit: full" in result.table()
    assert json.loads(result.receipt.read_text())["static"] is False


def test_a_gpu_rank_does_not_get_the_cpu_device(tmp_path, env, keys) -> None:
    fleet = Fleet(keys)
    api.gate(write_profile(tmp_path, gpus=[0, 1]), engines=fleet.factory)
    assert all("VLLM_TARGET_DEVICE" not in c[4] for c in fleet.calls if c[0] == "run")


def test_one_failing_rank_fails_the_gate_with_its_first_reason(env, keys) -> None:
    fleet = Fleet(keys, {"head": SelftestRun(0, PASS_OUT, ""), "worker": SelftestRun(1, FAIL_OUT, "")})
    result = api.gate(env["profile"], static=True, engines=fleet.factory)
    assert not result.passed and result.outcome == "fail"
    assert re.search(r"worker\s+\S+\s+FAIL\s+prefill single: topk 1152 not in \{128\} \(flashinfer/x.cu:1\)$",
                     result.table(), re.M)  # fmt: skip
    data = json.loads(result.receipt.read_text())
    assert [r["passed"] for r in data["ranks"]] == [True, False]
    assert data["ranks"][1]["verdict"] == FAIL_OUT.splitlines()[-1]


def test_a_pass_line_with_a_nonzero_exit_or_not_last_is_a_failure(env, keys) -> None:
    fleet = Fleet(keys, {"head": SelftestRun(3, PASS_OUT, ""), "worker": SelftestRun(0, PASS_OUT + "trailing\n", "")})
    result = api.gate(env["profile"], engines=fleet.factory)
    assert [r.passed for r in result.ranks] == [False, False]


def test_another_repositorys_row_is_refused_as_stale(env, keys) -> None:
    env["produced"].write_text(yaml.safe_dump([{**env["row"], "repository": "127.0.0.1:5000/someone/else"}]))
    fleet = Fleet(keys)
    with pytest.raises(InputError, match=r"^image is stale: .*\(no produced-image row of vllm-overlay/v41-sm120 has"):
        api.gate(env["profile"], engines=fleet.factory)
    assert fleet.calls == [] and receipts_in(env["receipts"]) == []  # refused before any engine was asked


def test_no_produced_row_is_refused_before_any_engine_is_asked(env, keys) -> None:
    env["produced"].write_text("[]\n")
    fleet = Fleet(keys)
    with pytest.raises(InputError, match=r"^image is stale: recipe key rk-[0-9a-f]{64}, image key ik-[0-9a-f]{64} "):
        api.gate(env["profile"], engines=fleet.factory)
    assert fleet.calls == [] and receipts_in(env["receipts"]) == []
    assert main(["gate", str(env["profile"])]) == 2


def test_an_image_with_another_runtime_key_is_refused_before_any_container(env, keys, capsys) -> None:
    fleet = Fleet(keys, labels=("rk-" + "0" * 64, keys[1]))
    with pytest.raises(InputError) as caught:
        api.gate(env["profile"], engines=fleet.factory)
    message = str(caught.value)
    assert message.startswith(f"image is stale: recipe key {keys[0]}, image key {keys[1]} (rank head's engine")
    assert message.endswith("; run make image") and "\n" not in message
    assert "run" not in fleet.kinds() and "start" not in fleet.kinds()
    (receipt,) = receipts_in(env["receipts"])  # engines were asked: the receipt says what they had
    data = json.loads(receipt.read_text())
    assert data["outcome"] == "refused" and data["error"] == message
    assert all(r["verdict"] == "SELFTEST FAIL: not run: the image is stale" for r in data["ranks"])


def test_unreachable_engine_fails_its_rank_names_it_and_leaves_a_receipt(env, keys, tmp_path) -> None:
    fleet = Fleet(keys)
    dead = f"unix://{tmp_path}/nothing.sock"
    profile = env["profile"]
    profile.write_text(profile.read_text().replace(ENGINE_B, dead))
    result = api.gate(
        profile, static=True, engines=lambda url: gate.DockerEngine(url) if url == dead else fleet.factory(url)
    )
    assert not result.passed
    head, worker = result.ranks
    assert head.passed
    assert worker.reason.startswith(f"rank worker: engine {dead} cannot be reached: ")
    assert "\n" not in worker.reason
    data = json.loads(result.receipt.read_text())
    assert data["outcome"] == "fail" and data["ranks"][1]["failure"] == worker.failure
    assert data["ranks"][1]["start"] and data["ranks"][1]["end"] and data["ranks"][1]["argv"]


def test_interrupted_gate_leaves_a_complete_receipt_and_cancels(env, keys) -> None:
    fleet = Fleet(keys, {"head": SelftestRun(0, PASS_OUT, ""), "worker": KeyboardInterrupt()})
    with pytest.raises(KeyboardInterrupt):
        api.gate(env["profile"], static=True, engines=fleet.factory)
    (receipt,) = receipts_in(env["receipts"])  # and no temporary file beside it
    data = json.loads(receipt.read_text())
    assert data["outcome"] == "interrupted" and data["end"] and not data["passed"]
    assert {r["name"]: r["verdict"] for r in data["ranks"]}["worker"] == "SELFTEST FAIL: interrupted"
    assert all(engine.cancelled for engine in fleet.engines.values())
    assert main(["gate", str(env["profile"])]) != 0


def test_receipt_is_written_whole_or_not_at_all(env, keys, monkeypatch) -> None:
    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(StorageFailed, match="cannot write the receipt: No space left on device"):
        api.gate(env["profile"], engines=Fleet(keys).factory)
    assert receipts_in(env["receipts"]) == []  # the temporary file went too


def test_two_gates_in_one_second_keep_both_receipts(env, keys) -> None:
    first = api.gate(env["profile"], engines=Fleet(keys).factory)
    second = api.gate(env["profile"], engines=Fleet(keys).factory)
    assert first.receipt != second.receipt and len(receipts_in(env["receipts"])) == 2


def test_timeout_must_be_positive(env, keys) -> None:
    with pytest.raises(InputError, match="timeout must be positive"):
        api.gate(env["profile"], timeout=0, engines=Fleet(keys).factory)


def test_cli_exit_codes(env, keys, monkeypatch, capsys) -> None:
    fleet = Fleet(keys)
    monkeypatch.setattr(gate, "connect_engine", fleet.factory)
    assert main(["gate", str(env["profile"]), "--static"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and re.search(r"^receipt .*unit-\d{8}T\d{6}Z(-\d+)?\.json$", out, re.M)
    fleet.engines[ENGINE_A].outputs["head"] = SelftestRun(1, FAIL_OUT, "")
    assert main(["gate", str(env["profile"]), "--static"]) == 1


# ---------------------------------------------------------------- launch up, status, down


def test_launch_up_after_a_failed_gate_starts_nothing(env, keys, monkeypatch, capsys) -> None:
    fleet = Fleet(keys, {"head": SelftestRun(0, PASS_OUT, ""), "worker": SelftestRun(1, FAIL_OUT, "")})
    result = api.launch_up(env["profile"], static=True, engines=fleet.factory)
    assert not result.passed and result.containers == [] and "start" not in fleet.kinds()
    monkeypatch.setattr(gate, "connect_engine", fleet.factory)
    assert main(["launch", "up", str(env["profile"]), "--static"]) == 1
    assert "nothing started: the gate failed" in capsys.readouterr().err


def test_launch_up_starts_the_gated_argv_then_status_and_down(env, keys, monkeypatch, capsys) -> None:
    fleet = Fleet(keys)
    result = api.launch_up(env["profile"], static=True, engines=fleet.factory)
    assert result.outcome == "up"
    starts = [c for c in fleet.calls if c[0] == "start"]
    runs = {c[2]: c for c in fleet.calls if c[0] == "run"}
    assert [(c[1], c[2]) for c in starts] == [(ENGINE_A, "head"), (ENGINE_B, "worker")]
    for _, _url, name, argv, image_id, labels in starts:
        assert argv == api.launch_argv(env["profile"], name)  # the argv the gate tested
        assert runs[name][3][6:] == argv[2:] and image_id == runs[name][5]  # ... in the image it tested
        assert labels == {
            "io.vllm-overlay.role": "serve",
            "io.vllm-overlay.profile": "unit",
            "io.vllm-overlay.profile-key": result.profile_key,
            "io.vllm-overlay.runtime-key": keys[0],
            "io.vllm-overlay.receipt": str(result.receipt),
            "io.vllm-overlay.rank": name,
        }
    data = json.loads(result.receipt.read_text())
    assert data["outcome"] == "up"
    assert [(c["rank"], c["engine"], c["id"]) for c in data["containers"]] == [
        ("head", ENGINE_A, "c-head-0"),
        ("worker", ENGINE_B, "c-worker-0"),
    ]

    # a second up is refused after its gate (the profile is already up), nothing more started
    with pytest.raises(InputError, match="already up"):
        api.launch_up(env["profile"], static=True, engines=fleet.factory)
    assert len([c for c in fleet.calls if c[0] == "start"]) == 2

    # status lists, down removes exactly those (a container of another profile stays)
    fleet.engines[ENGINE_A].started["other"] = {"id": "other", "name": "x", "status": "running", "rank": "head",
                                               "labels": {"io.vllm-overlay.profile-key": "pk-other"}}  # fmt: skip
    status = api.launch_status(env["profile"], engines=fleet.factory)
    assert [(s.engine, [c["id"] for c in s.containers]) for s in status] == [
        (ENGINE_A, ["c-head-0"]),
        (ENGINE_B, ["c-worker-0"]),
    ]
    monkeypatch.setattr(gate, "connect_engine", fleet.factory)
    assert main(["launch", "status", str(env["profile"])]) == 0
    assert "c-head-0" in capsys.readouterr().out
    assert main(["launch", "down", str(env["profile"])]) == 0
    assert sorted(c[2] for c in fleet.calls if c[0] == "remove") == ["c-head-0", "c-worker-0"]
    assert list(fleet.engines[ENGINE_A].started) == ["other"]
    assert main(["launch", "status", str(env["profile"])]) == 0


# ---------------------------------------------------------------- DockerEngine over a fake client


class FakeContainer:
    def __init__(self, client, kwargs) -> None:
        self.client, self.kwargs = client, kwargs
        self.id, self.name = f"id{len(client.created)}", f"name{len(client.created)}"
        self.killed = False

    def start(self):
        if self.client.start_error:
            raise docker.errors.APIError("500 Server Error", explanation=self.client.start_error)

    def wait(self, timeout=None):
        self.client.wait_timeouts.append(timeout)
        if self.client.hang:
            raise requests.exceptions.ConnectionError("UnixHTTPConnectionPool(host='localhost'): Read timed out.")
        return {"StatusCode": 0}

    def kill(self):
        self.killed = True

    def logs(self, stdout=True, stderr=True):
        return b"SELFTEST PASS (static)\n" if stdout else b"err\n"


class FakeClient:
    def __init__(self, start_error=None, hang=False, image_labels=None) -> None:
        self.start_error, self.hang = start_error, hang
        self.created: list[FakeContainer] = []
        self.removed: list[str] = []
        self.wait_timeouts: list = []
        client = self

        class Containers:
            def create(self, image, **kwargs):
                container = FakeContainer(client, {"image": image, **kwargs})
                client.created.append(container)
                return container

        class Api:
            def remove_container(self, cid, force=False):
                client.removed.append(cid)

        class Images:
            def get(self, image_id):
                return SimpleNamespace(id=image_id, labels=dict(image_labels or {}))

        self.containers, self.api, self.images = Containers(), Api(), Images()

    def ping(self):
        return True


def docker_job(tmp_path, gpus=(), timeout=5.0) -> gate.RankJob:
    profile = api.load_profile(write_profile(tmp_path, gpus=list(gpus)))
    return gate._jobs(profile, True, timeout)[0]


def test_docker_engine_runs_the_selftest_as_the_entrypoint(tmp_path) -> None:
    client = FakeClient()
    engine = gate.DockerEngine(ENGINE_A, connect=lambda url: client)
    job = docker_job(tmp_path)
    run = engine.run_selftest(job, "sha256:img", {"l": "v"})
    assert run.passed and run.stderr == "err\n"
    (container,) = client.created
    kwargs = container.kwargs
    assert kwargs["image"] == "sha256:img" and kwargs["entrypoint"] == job.selftest_command()
    assert "command" not in kwargs and kwargs["device_requests"] == []  # no GPU listed: none requested
    assert kwargs["environment"]["VLLM_TARGET_DEVICE"] == "cpu"
    (mount,) = kwargs["mounts"]
    assert (mount["Source"], mount["Target"], mount["ReadOnly"], mount["Type"]) == (
        "/models/ratio 2",
        "/models/ratio 2",
        True,
        "bind",
    )
    assert client.removed == [container.id] and client.wait_timeouts == [5.0]


def test_docker_engine_gpus_without_the_nvidia_runtime_is_one_line(tmp_path) -> None:
    client = FakeClient(start_error='could not select device driver "" with capabilities: [[gpu]]')
    engine = gate.DockerEngine(ENGINE_A, connect=lambda url: client)
    job = docker_job(tmp_path, gpus=(0, 1))
    with pytest.raises(gate.RankFailed) as caught:
        engine.run_selftest(job, "sha256:img", {})
    assert str(caught.value).startswith(f"engine {ENGINE_A} has no NVIDIA runtime, but the rank requests GPUs 0,1 (")
    (request,) = client.created[0].kwargs["device_requests"]
    assert request["DeviceIDs"] == ["0", "1"] and request["Capabilities"] == [["gpu"]]
    assert client.removed == [client.created[0].id]  # the container that could not start is gone


def test_docker_engine_timeout_kills_and_fails(tmp_path) -> None:
    client = FakeClient(hang=True)
    engine = gate.DockerEngine(ENGINE_A, connect=lambda url: client)
    run = engine.run_selftest(docker_job(tmp_path, timeout=2.5), "sha256:img", {})
    assert not run.passed and run.returncode == 124 and client.created[0].killed
    assert run.verdict == "SELFTEST FAIL: did not finish within 2.5 s"  # though its last line said PASS
    assert run.stdout == "SELFTEST PASS (static)\n" and run.stderr == "err\n"  # the output so far, kept
    assert client.removed == [client.created[0].id]


def test_docker_engine_serving_container_is_the_gated_argv(tmp_path) -> None:
    client = FakeClient()
    engine = gate.DockerEngine(ENGINE_A, connect=lambda url: client)
    job = docker_job(tmp_path)
    started = engine.start(job, "sha256:img", {"io.vllm-overlay.rank": "head"})
    kwargs = client.created[0].kwargs
    assert started == {"id": "id0", "name": "name0"}
    assert kwargs["entrypoint"] == list(job.argv) and job.argv[:2] == ("vllm", "serve")
    assert (kwargs["ipc_mode"], kwargs["network_mode"]) == ("host", "host")
    assert kwargs["labels"] == {"io.vllm-overlay.rank": "head"} and "environment" not in kwargs
    assert [m["Target"] for m in kwargs["mounts"]] == [job.checkpoint]  # the image names no JIT directory


def test_docker_engine_serving_container_mounts_a_jit_volume_per_image_key(tmp_path) -> None:
    labels = {
        "io.vllm-overlay.flashinfer-jit-cache": "/var/cache/flashinfer",
        "io.vllm-overlay.image-key": "ik-" + "ab" * 32,
    }
    client = FakeClient(image_labels=labels)
    engine = gate.DockerEngine(ENGINE_A, connect=lambda url: client)
    job = docker_job(tmp_path)
    engine.start(job, "sha256:img", {})
    mounts = {m["Target"]: m for m in client.created[0].kwargs["mounts"]}
    assert set(mounts) == {job.checkpoint, "/var/cache/flashinfer"}
    jit = mounts["/var/cache/flashinfer"]
    assert (jit["Type"], jit["Source"], jit["ReadOnly"]) == ("volume", "vllm-overlay-flashinfer-" + "ab" * 8, False)
    # the self-test container gets no JIT volume: it compiles nothing worth keeping
    engine.run_selftest(job, "sha256:img", {})
    assert [m["Target"] for m in client.created[1].kwargs["mounts"]] == [job.checkpoint]


def test_docker_engine_unreachable_is_one_line_naming_the_url(tmp_path) -> None:
    dead = f"unix://{tmp_path}/none.sock"
    with pytest.raises(gate.RankFailed, match=rf"^engine {re.escape(dead)} cannot be reached: "):
        gate.DockerEngine(dead).find_image(gate.ImageRef("r/x:t", "sha256:" + "0" * 64, "rk", "ik"), print)


def test_a_rank_past_its_timeout_fails_the_gate(env, keys) -> None:
    late = gate.TimedOutRun(124, PASS_OUT, "", 900.0)
    fleet = Fleet(keys, {"head": SelftestRun(0, PASS_OUT, ""), "worker": late})
    result = api.gate(env["profile"], static=True, engines=fleet.factory)
    assert not result.passed
    assert re.search(r"worker\s+\S+\s+FAIL\s+did not finish within 900 s$", result.table(), re.M)
    data = json.loads(result.receipt.read_text())
    assert data["ranks"][1]["exit_code"] == 124 and data["ranks"][1]["stdout"] == PASS_OUT
