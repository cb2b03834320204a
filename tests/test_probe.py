"""`vllm-overlay probe` on the real upstream code: the four-arm table of issue 3.

Uses the probe venv (vllm==0.30.0 with its dependencies, CPU torch) and a
synthetic DeepSeek-V4.1 checkpoint (config.json only) at TP 4, --static.
"""

from __future__ import annotations

import pytest

from tests.checkpoints import write_v41_checkpoint
from tests.helpers import DEFAULT_RECIPE, run_cli

PAGE_32 = "page_block_size 32, kernel needs 64"
WIDTH_1152 = "(16, 1152) not in the decode dispatch set"


@pytest.fixture(scope="module")
def table(probe_python, tmp_path_factory) -> dict[tuple[str, str], tuple[str, str]]:
    checkpoint = write_v41_checkpoint(tmp_path_factory.mktemp("ckpt") / "v41")
    proc = run_cli("probe", DEFAULT_RECIPE, "--python", probe_python, "--static", "--", checkpoint, "--headless", "-tp", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = proc.stdout.strip().splitlines()
    assert rows[0].split() == ["tree", "argv", "verdict", "reasons"]
    parsed = {}
    for row in rows[1:]:
        tree, rest = row.split(None, 1)
        argv = "as given" if rest.startswith("as given") else "text-only"
        verdict_and_reasons = rest[len(argv):].strip()
        verdict = "SELFTEST PASS (static)" if verdict_and_reasons.startswith("SELFTEST PASS (static)") else verdict_and_reasons.split("  ")[0]
        parsed[(tree, argv)] = (verdict, verdict_and_reasons[len(verdict):].strip())
    return parsed


def test_four_arms_exactly(table):
    assert sorted(table) == sorted([("unpatched", "as given"), ("unpatched", "text-only"), ("patched", "as given"), ("patched", "text-only")])
    verdict, reasons = table[("unpatched", "as given")]
    assert verdict == "SELFTEST FAIL" and PAGE_32 in reasons and WIDTH_1152 in reasons
    verdict, reasons = table[("unpatched", "text-only")]
    assert verdict == "SELFTEST FAIL" and PAGE_32 in reasons and "1152" not in reasons
    verdict, reasons = table[("patched", "as given")]
    assert verdict == "SELFTEST FAIL" and WIDTH_1152 in reasons and "page_block_size" not in reasons
    assert table[("patched", "text-only")] == ("SELFTEST PASS (static)", "")


def test_probe_refuses_an_interpreter_with_another_vllm(tmp_path):
    fake = tmp_path / "site" / "vllm"
    (fake / "models" / "deepseek_v41" / "nvidia").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "models" / "deepseek_v41" / "attention.py").write_text("# not vLLM 0.30.0\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {__import__('sys').executable} \"$@\"\n")
    python.chmod(0o755)
    proc = run_cli("probe", DEFAULT_RECIPE, "--python", python, "--static", "--", str(tmp_path), "-tp", "4")
    assert proc.returncode == 2
    assert "attention.py: the installed vLLM differs from the pinned tree" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_probe_needs_the_serve_argv():
    proc = run_cli("probe", DEFAULT_RECIPE, "--static")
    assert proc.returncode == 2 and "give the rank's vllm serve argv after '--'" in proc.stderr
