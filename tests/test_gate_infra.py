"""The launch gate's test infrastructure works: two engines, one image in which the self-test really runs.

The image is the default recipe overlaid on vllm-overlay-test/vllm-cpu:0.30.0
(tests/gate_fixtures.py), pushed to the local registry and pulled by digest
into the second engine.  In each engine, the self-test module of the image
gives, for a TP 4 text-only launch, ``SELFTEST PASS (static)`` on the ratio-2
synthetic checkpoint and ``SELFTEST FAIL`` (the dual prefill route's page) on
the default one.
"""

from __future__ import annotations

import json

import pytest

from builder.probe import SELFTEST_MODULE, TEXT_ONLY
from tools import gate_recipes
from tools.gate_image import LABEL_IDENTITY
from tools.gate_image import TAG as VLLM_CPU_IMAGE
from tools.gate_recipes import CHECKPOINT_MOUNT, TEXT_ONLY_ARGV, run_selftest_in

pytest_plugins = ["tests.gate_fixtures"]

ENGINES = [0, 1]


@pytest.fixture(scope="module", params=ENGINES, ids=["engine1", "engine2"])
def engine(request, gate_image):
    return gate_image.clients[request.param]


def test_both_engines_are_separate_daemons(services, gate_image) -> None:
    first, second = (c.info() for c in gate_image.clients)
    assert gate_image.hosts == (services["DOCKER_HOST"], services["VLLM_OVERLAY_TEST_DOCKER_HOST2"])
    assert gate_image.hosts[1].endswith("/docker2.sock")
    assert first["DockerRootDir"] != second["DockerRootDir"]
    assert first["Driver"] == second["Driver"]
    # A container made in one engine is not in the other.
    made = gate_image.client.containers.create(gate_image.reference, ["true"], network_mode="none")
    try:
        assert not gate_image.client2.containers.list(all=True, filters={"id": made.id})
    finally:
        made.remove(force=True)


def test_image_is_the_recipes_and_in_both_engines_by_digest(gate_image) -> None:
    assert gate_image.reference == f"{gate_image.repository}@{gate_image.digest}"
    assert gate_image.repository.startswith("127.0.0.1:")
    ids = []
    for client in gate_image.clients:
        image = client.images.get(gate_image.reference)
        assert gate_image.reference in image.attrs["RepoDigests"]
        assert image.labels["io.vllm-overlay.runtime-key"] == gate_image.runtime_key
        assert image.labels["io.vllm-overlay.image-key"] == gate_image.image_key
        assert image.labels["org.opencontainers.image.base.name"] == VLLM_CPU_IMAGE
        assert image.labels[LABEL_IDENTITY].startswith("sha256:")  # inherited from the vllm-cpu base
        ids.append(image.id)
    assert ids[0] == ids[1]  # the same image config in both engines


def test_vllm_and_cpu_torch_import_in_the_image(engine, gate_image) -> None:
    code = "import json, vllm, torch; print(json.dumps([vllm.__version__, torch.__version__, torch.version.cuda]))"
    out = engine.containers.run(gate_image.reference, ["python3.11", "-c", code], remove=True, network_mode="none")
    assert json.loads(out.decode().strip().splitlines()[-1]) == ["0.30.0", "2.13.0+cpu", None]


def test_selftest_passes_on_the_ratio2_checkpoint(engine, gate_image, gate_checkpoints) -> None:
    run = run_selftest_in(engine, gate_image.reference, gate_checkpoints["ratio2"], TEXT_ONLY_ARGV)
    assert run.exit_code == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.verdict == "SELFTEST PASS (static)"
    report = json.loads(run.stdout[: run.stdout.rstrip().rfind("\n")])
    facts = {f["name"]: f["value"] for f in report["facts"]}
    assert facts["vllm.version"] == "0.30.0" and facts["vllm.model"] == "/ckpt"


def test_selftest_fails_on_the_default_checkpoint(engine, gate_image, gate_checkpoints) -> None:
    run = run_selftest_in(engine, gate_image.reference, gate_checkpoints["default"], TEXT_ONLY_ARGV)
    assert run.exit_code == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.verdict.startswith("SELFTEST FAIL: prefill dual: extra_page_block_size 128 not in {2, 64}"), run.verdict


def test_the_container_runs_the_probes_module_with_its_text_only_flags() -> None:
    assert TEXT_ONLY_ARGV == (CHECKPOINT_MOUNT, "-tp", "4", *TEXT_ONLY)
    assert gate_recipes.SELFTEST_MODULE == SELFTEST_MODULE
