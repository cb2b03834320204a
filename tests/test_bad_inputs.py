"""The corpus of bad inputs: each gives one clear line, exit code 2, and writes nothing.

Each directory under tests/bad_inputs/ holds a recipe.yaml (most pin the real
vLLM 0.30.0 wheel), its overlay/ members, sometimes a local tree or wheel, and
`expected`: text the one-line error must contain, and `against-tree` when the
input is only bad against the tree (so `key`, which never opens it, accepts it),
or `apply-only` for a member that conflicts with the tree (apply refuses it as
bad input; `check` reports it as a failed check, exit 1).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import run_cli, snapshot

CORPUS = Path(__file__).parent / "bad_inputs"
CASES = sorted(p.name for p in CORPUS.iterdir() if p.is_dir())


def test_corpus_is_large_enough():
    assert len(CASES) >= 20


def _combinations():
    # `key` reads only the recipe and members; a case marked against-tree is bad only against the tree.
    for case in CASES:
        if (CORPUS / case / "apply-only").exists():
            commands = ["apply"]  # a conflict: `check` reports it with exit 1 (tests/test_check.py)
        elif (CORPUS / case / "against-tree").exists():
            commands = ["apply", "check"]
        else:
            commands = ["apply", "check", "key"]
        for command in commands:
            yield case, command, "1"
            if command == "apply":  # the same refusal when its members are split across processes
                yield case, command, "2"


@pytest.mark.parametrize(("case", "command", "jobs"), list(_combinations()))
def test_bad_input(case: str, command: str, jobs: str, tmp_path: Path, isolated_cache: Path):
    work = tmp_path / case
    shutil.copytree(CORPUS / case, work, symlinks=True)
    expected = (work / "expected").read_text().strip()
    before_work, before_cache = snapshot(work), snapshot(isolated_cache)
    args = [command, "recipe.yaml"] + (["--out", "out"] if command == "apply" else [])
    proc = run_cli(*args, cwd=work, env={"VLLM_OVERLAY_CACHE": str(isolated_cache), "VLLM_OVERLAY_JOBS": jobs})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert snapshot(work) == before_work  # no output directory, nothing changed
    assert snapshot(isolated_cache) == before_cache
