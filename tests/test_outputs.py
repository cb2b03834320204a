"""Outputs never replace what this tool did not write (issue 12, data loss).

An earlier output is told by the marker `.vllm-overlay-output`, never by a file
name; a destination holding or inside the recipe, the overlay or the cache is
refused; writers refuse paths outside the destination and colliding paths; a
disk that refuses a write is one line, exit 3, nothing left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from builder.errors import InputError
from builder.output import MARKER, Destination, Writer, replacing
from tests.helpers import snapshot
from tools.synthetic import ROOT, git_diff, member_text, write_recipe

NEW = "vllm/overlay_test_new.py"


def _recipe(directory: Path) -> Path:
    """A recipe whose one member adds a file, on a small local tree (no wheel needed)."""
    tree = directory / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("x = 1\n")
    return write_recipe(
        directory, {"add": member_text(git_diff({NEW: None}, {NEW: b"y = 2\n"}))}, vllm={"path": str(tree)}
    )


def _apply(cwd: Path, *args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_OVERLAY_CACHE=str(cache), PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "builder", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def project(tmp_path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    _recipe(project)
    return project


def _one_line(proc: subprocess.CompletedProcess, code: int, text: str) -> None:
    """Exit ``code`` and one error line (progress lines, such as "applied NAME", may come
    before it), which says ``text``; no traceback."""
    assert proc.returncode == code, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("vllm-overlay: ")]
    assert len(errors) == 1 and errors == proc.stderr.splitlines()[-1:], proc.stderr
    assert text in errors[0] and "Traceback" not in proc.stderr


def test_a_project_with_a_manifest_json_is_not_an_earlier_output(project, tmp_path):
    """The reported data loss: `apply recipe.yaml --out "$PWD"` in a project holding a
    manifest.json deleted the recipe, the overlay and everything else."""
    (project / "manifest.json").write_text("{}")
    (project / ".git").mkdir()
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    before = snapshot(project)
    for out in (str(project), "."):
        proc = _apply(project, "apply", "recipe.yaml", "--out", out, cache=tmp_path / "cache")
        _one_line(proc, 2, "holds the recipe")
    assert snapshot(project) == before


def test_a_directory_with_a_manifest_but_no_marker_is_refused(project, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text("{}")
    (other / "notes.txt").write_text("mine")
    before = snapshot(other)
    for command in (["apply", "recipe.yaml", "--out", str(other)], ["apply", "recipe.yaml", "--full-tree", str(other)]):
        proc = _apply(project, *command, cache=tmp_path / "cache")
        _one_line(proc, 2, f"no {MARKER}")
    assert snapshot(other) == before


@pytest.mark.parametrize("where", ["overlay", "overlay/inside", "cache", "cache/inside"])
def test_the_overlay_and_the_cache_are_never_outputs(project, tmp_path, where):
    cache = project / "cache"
    cache.mkdir()
    before = snapshot(project)
    proc = _apply(project, "apply", "recipe.yaml", "--out", str(project / where), cache=cache)
    what = where.split("/")[0]
    _one_line(proc, 2, f"the {what} (")
    assert snapshot(project) == before


def test_an_earlier_output_is_replaced_and_its_marker_names_the_command(project, tmp_path):
    out = tmp_path / "out"
    first = _apply(project, "apply", "recipe.yaml", "--out", str(out), cache=tmp_path / "cache")
    assert first.returncode == 0, first.stderr
    marker = json.loads((out / MARKER).read_text())
    assert marker["command"] == "apply --out" and marker["runtime_key"] == first.stdout.strip()
    (out / "stale.txt").write_text("x")
    again = _apply(project, "apply", "recipe.yaml", "--out", str(out), cache=tmp_path / "cache")
    assert again.returncode == 0, again.stderr
    assert not (out / "stale.txt").exists() and (out / NEW).read_text() == "y = 2\n"


def test_empty_out_path_a_file_and_a_path_through_a_file_are_one_line(project, tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("keep")
    cases = [("", "--out: an empty path"), (str(afile), "is not a directory"), (str(afile / "x"), "a-file/x")]
    for out, text in cases:
        proc = _apply(project, "apply", "recipe.yaml", "--out", out, cache=tmp_path / "cache")
        _one_line(proc, 2, text)
    assert afile.read_text() == "keep"
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp directory left


def _destination(path: Path) -> Destination:
    return Destination(path, "test", "rk-test")


@pytest.mark.parametrize("bad", ["../escape.py", "/etc/passwd", "a/../../b", "a//b", "./a", "a\0b"])
def test_the_writer_refuses_paths_outside_its_directory(tmp_path, bad):
    with pytest.raises(InputError, match="outside the output directory"):
        with replacing(_destination(tmp_path / "out")) as tmp:
            Writer(tmp).write(bad, b"x", None)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing left, no escape


def test_colliding_output_paths_are_one_line(tmp_path):
    for first, second in (("x", "x/y.py"), ("x/y.py", "x")):
        with pytest.raises(InputError, match="collides with another output path"):
            with replacing(_destination(tmp_path / "out")) as tmp:
                writer = Writer(tmp)
                writer.write(first, b"1", None)
                writer.write(second, b"2", None)
        assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line_exit_3_and_leaves_nothing(project, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        with open(mount / "filler", "wb", buffering=0) as filler:  # fill it: any later write fails
            try:
                while True:
                    filler.write(b"\0" * 4096)
            except OSError:
                pass
        proc = _apply(project, "apply", "recipe.yaml", "--full-tree", str(mount / "out"), cache=tmp_path / "cache")
        _one_line(proc, 3, "No space left on device")
        assert sorted(p.name for p in mount.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_two_runs_racing_for_one_output_leave_one_whole_output(project, tmp_path):
    out = tmp_path / "out"
    results: list[subprocess.CompletedProcess] = []

    def run() -> None:
        results.append(_apply(project, "apply", "recipe.yaml", "--full-tree", str(out), cache=tmp_path / "cache"))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.returncode for r in results] == [0, 0, 0, 0], [r.stderr for r in results]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp dirs left
    assert (out / NEW).read_text() == "y = 2\n" and (out / "vllm" / "__init__.py").read_text() == "x = 1\n"
    assert json.loads((out / MARKER).read_text())["command"] == "apply --full-tree"
