"""The style gate: ruff's lint and format checks, as configured in pyproject.toml, over
builder/, bench/, tests/, tools/, the self-test's source and the image's checks script."""

from __future__ import annotations

import subprocess
import sys

from tools.synthetic import ROOT


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_lint_is_clean():
    proc = _ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_is_clean():
    proc = _ruff("format", "--no-cache", "--check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_gate_covers_what_the_issue_names():
    """The files ruff sees: a narrowed `include` would pass the two tests above vacuously."""
    proc = _ruff("check", "--no-cache", "--show-files", ".")
    seen = {line.removeprefix(str(ROOT) + "/") for line in proc.stdout.splitlines()}
    for expected in (
        "builder/api.py",
        "bench/run.py",
        "tests/test_style.py",
        "tools/synthetic.py",
        "overlay/sm120_decode_shape_selftest.py",
        "images/image_checks.py",
    ):
        assert expected in seen, sorted(seen)[:20]
    assert not any(path.startswith("tests/bad_inputs/") for path in seen)
