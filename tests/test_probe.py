"""`vllm-overlay probe` on the real upstream code: the four-arm table with a column per kernel route.

Uses the probe venv (vllm==0.30.0 with its dependencies, CPU torch) and two
synthetic DeepSeek-V4.1 checkpoints (config.json only) at TP 4, --static: the
default one (compress_ratios 0/1/2) and one whose compressed layers are all
ratio 2 (``make probe``'s two, from tests/selftest_runs.py's ``checkpoints``,
the directories tests/test_selftest_real.py runs on). The probe runs once per
checkpoint, end to end through the CLI (its four arms are four self-test
processes), and every test reads that one table. The seed's four arms are
reproduced on the decode route; the routes above 64 tokens tell the two
checkpoints apart.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers import run_cli
from tools.synthetic import DEFAULT_RECIPE

# checkpoints: written once per session, shared with test_selftest_real.py
pytest_plugins = ["tests.selftest_runs"]

PAGE_32 = "page_block_size 32 not in {64}"
DECODE_1152 = "num_heads,topk (16, 1152) not in the set"
EXTRA_PAGE_128 = "extra_page_block_size 128 not in {2, 64}"
HEADER = ["tree", "argv", "decode kernel", "prefill single", "prefill dual", "verdict", "reasons"]


def _table(probe_python, checkpoint) -> dict[tuple[str, str], dict[str, str]]:
    proc = run_cli(
        "probe", DEFAULT_RECIPE, "--python", probe_python, "--static", "--", checkpoint, "--headless", "-tp", "4"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [re.split(r"\s{2,}", row.strip(), maxsplit=6) for row in proc.stdout.strip().splitlines()]
    assert rows[0] == HEADER
    return {(row[0], row[1]): dict(zip(HEADER[2:], row[2:] + [""] * (7 - len(row)), strict=True)) for row in rows[1:]}


@pytest.fixture(scope="module")
def tables(probe_python, checkpoints) -> dict[str, dict]:
    """One `vllm-overlay probe` per checkpoint; compress_ratios 0/1/2, then 0/2/2."""
    return {"v41": _table(probe_python, checkpoints["v41"]), "ratio2": _table(probe_python, checkpoints["r2"])}


def test_four_arms_on_the_decode_route(tables):
    table = tables["v41"]
    assert sorted(table) == sorted(
        [("unpatched", "as given"), ("unpatched", "text-only"), ("patched", "as given"), ("patched", "text-only")]
    )
    arm = table[("unpatched", "as given")]
    assert arm["decode kernel"] == "FAIL" and PAGE_32 in arm["reasons"] and DECODE_1152 in arm["reasons"]
    arm = table[("unpatched", "text-only")]
    assert arm["decode kernel"] == "FAIL" and PAGE_32 in arm["reasons"] and "1152" not in arm["reasons"]
    arm = table[("patched", "as given")]
    assert (
        arm["decode kernel"] == "FAIL" and DECODE_1152 in arm["reasons"] and "page_block_size 32" not in arm["reasons"]
    )
    assert table[("patched", "text-only")]["decode kernel"] == "pass"


def test_ratio_1_layers_fail_above_64_tokens(tables):
    arm = tables["v41"][("patched", "text-only")]
    assert (arm["decode kernel"], arm["prefill single"], arm["prefill dual"]) == ("pass", "pass", "FAIL")
    assert arm["verdict"] == "SELFTEST FAIL"
    assert arm["reasons"].startswith("prefill dual: " + EXTRA_PAGE_128)


def test_ratio_2_text_only_passes_every_route(tables):
    arm = tables["ratio2"][("patched", "text-only")]
    assert arm == {
        "decode kernel": "pass",
        "prefill single": "pass",
        "prefill dual": "pass",
        "verdict": "SELFTEST PASS (static)",
        "reasons": "",
    }
    assert tables["ratio2"][("patched", "as given")]["verdict"] == "SELFTEST FAIL"


def test_probe_refuses_an_interpreter_with_another_vllm(tmp_path):
    fake = tmp_path / "site" / "vllm"
    (fake / "models" / "deepseek_v41" / "nvidia").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "models" / "deepseek_v41" / "attention.py").write_text("# not vLLM 0.30.0\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "site"} exec {__import__("sys").executable} "$@"\n')
    python.chmod(0o755)
    proc = run_cli("probe", DEFAULT_RECIPE, "--python", python, "--static", "--", str(tmp_path), "-tp", "4")
    assert proc.returncode == 2
    assert "attention.py: the installed vLLM differs from the pinned tree" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_probe_needs_the_serve_argv():
    proc = run_cli("probe", DEFAULT_RECIPE, "--static")
    assert proc.returncode == 2 and "give the rank's vllm serve argv after '--'" in proc.stderr
