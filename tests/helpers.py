"""Test helpers: run the CLI, snapshot a directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tools.synthetic import ROOT


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "builder", *map(str, args)],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
    )


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file below ``directory`` with its bytes, to show a failed run wrote nothing."""
    return {
        str(p.relative_to(directory)): (p.read_bytes() if p.is_file() and not p.is_symlink() else b"<link or dir>")
        for p in sorted(directory.rglob("*"))
    }
