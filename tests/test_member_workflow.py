"""The member workflow on the real pinned tree: member new places a header template in the
recipe's order; member edit writes a work directory; member refresh regenerates the diff, keeps
the runtime key when nothing changed and changes it when the diff did, and refuses, naming it,
an edit that a later member's read lines depend on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from builder import api
from builder.members import load_member
from builder.recipe import load_recipe
from tests.helpers import run_cli, snapshot
from tools.synthetic import DEFAULT_RECIPE, ROOT, git_diff, member_text, write_recipe

ATTENTION = "vllm/models/deepseek_v41/attention.py"
SPARSE = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
SWA = "sm120_swa_page_block_size"
SELFTEST = "sm120_decode_shape_selftest"
TODAY = "2026-12-01"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the default recipe and its overlay (comments and all)."""
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes", ignore=shutil.ignore_patterns("launch"))
    shutil.copytree(ROOT / "overlay", tmp_path / "overlay")
    return tmp_path / "recipes" / DEFAULT_RECIPE.name


def test_new_places_a_template_in_order_keeping_the_recipe_text(project):
    before = project.read_text()
    proc = run_cli("member", "new", "fix_one", "--after", SWA, "--recipe", project)
    assert proc.returncode == 0, proc.stderr
    assert load_recipe(project).members == (SWA, "fix_one", SELFTEST)
    after = project.read_text()
    # only the members list changed: the comments are kept
    assert [line for line in before.splitlines() if line.startswith("#")] == [
        line for line in after.splitlines() if line.startswith("#")
    ]
    assert after.replace("  - fix_one\n", "") == before
    template = (project.parent.parent / "overlay" / "fix_one.patch").read_text()
    assert "Upstream-Status: Pending" in template and "diff --git" not in template
    run_cli("member", "new", "fix_two", "--recipe", project)
    assert load_recipe(project).members[-1] == "fix_two"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["member", "new", SWA], "already has a member"),
        (["member", "new", "Bad-Name"], "does not match [a-z0-9_]+"),
        (["member", "new", "fix", "--after", "nope"], "--after nope: the recipe has no such member"),
        (["member", "edit", "nope", "DIR"], "the recipe has no member nope"),
        (["member", "edit", SWA, "DIR", "--file", "../escape.py"], "--file: ../escape.py: not a path inside the tree"),
        (["member", "refresh", SWA, "DIR"], "not a member work directory"),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(project, args, expected, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    args = [str(workdir) if a == "DIR" else a for a in args]
    before = snapshot(project.parent.parent)
    cache = tmp_path / "empty-cache"  # refused before any tree is opened: nothing fetched
    proc = run_cli(*args, "--recipe", project, env={"VLLM_OVERLAY_CACHE": str(cache)})
    assert proc.returncode == 2, proc.stderr
    assert not cache.exists()
    assert expected in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert snapshot(project.parent.parent) == before


def test_edit_refresh_round_trip_keeps_then_changes_the_key(project, tmp_path, vllm_wheel):
    workdir = tmp_path / "work"
    key = api.key(project)
    member_file = project.parent.parent / "overlay" / f"{SWA}.patch"
    original = member_file.read_bytes()
    proc = run_cli("member", "edit", SWA, workdir, "--recipe", project)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == [ATTENTION, SPARSE]
    files = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*") if p.is_file())
    assert files == [".vllm-overlay-member.json", ".vllm-overlay-output", ATTENTION, SPARSE]
    assert "    swa_block_size: ClassVar[int] = 64\n" in (workdir / SPARSE).read_text()

    # nothing changed: the member file is left as it was, the key stays
    proc = run_cli("member", "refresh", SWA, workdir, "--recipe", project)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("unchanged")
    assert member_file.read_bytes() == original
    assert api.key(project) == key

    # a change: the diff is regenerated, the header kept, Last-Update set, the key moves
    sparse = workdir / SPARSE
    sparse.write_text(sparse.read_text().replace("ClassVar[int] = 64", "ClassVar[int] = 128"))
    refreshed = api.member_refresh(project, SWA, workdir, today=TODAY)
    assert refreshed.changed
    text = member_file.read_text()
    header, _, diff = text.partition("\ndiff --git ")
    assert (
        header.replace(f"Last-Update: {TODAY}", "Last-Update: 2026-11-29")
        == original.decode().partition("\ndiff --git ")[0]
    )
    assert "+    swa_block_size: ClassVar[int] = 128\n" in diff
    assert api.key(project) != key
    check = run_cli("check", project)
    assert check.returncode == 0, check.stdout + check.stderr

    # and back: the same diff as at first, so the key is the first key again
    sparse.write_text(sparse.read_text().replace("ClassVar[int] = 128", "ClassVar[int] = 64"))
    assert api.member_refresh(project, SWA, workdir, today=TODAY).changed
    assert api.key(project) == key


def test_new_member_edit_refresh(project, tmp_path, vllm_wheel):
    key = api.key(project)
    api.member_new(project, "note", after=SWA, today=TODAY)
    workdir = tmp_path / "work"
    info = api.member_edit(project, "note", workdir, files=["vllm/envs.py"])
    assert "vllm/envs.py" in info["files"]
    envs = workdir / "vllm" / "envs.py"
    envs.write_bytes(envs.read_bytes() + b"# a note\n")
    # a file to create, named at edit time; a stray file and a bytecode cache are not in play
    api.member_edit(project, "note", workdir, files=["vllm/envs.py", "vllm/notes/README.txt"])
    assert not (workdir / "vllm" / "notes").exists()
    envs.write_bytes(envs.read_bytes() + b"# a note\n")
    (workdir / "vllm" / "notes").mkdir()
    (workdir / "vllm" / "notes" / "README.txt").write_bytes(b"read me\n")
    (workdir / "vllm" / "stray.py").write_bytes(b"x = 1\n")
    (workdir / "vllm" / "__pycache__").mkdir(exist_ok=True)
    (workdir / "vllm" / "__pycache__" / "envs.cpython-311.pyc").write_bytes(b"\0\1")
    result = api.member_refresh(project, "note", workdir, today=TODAY)
    assert result.changed and result.files == ["vllm/envs.py", "vllm/notes/README.txt"]
    member = load_member(project.parent.parent / "overlay" / "note.patch")
    assert [(fp.old_path, fp.path) for fp in member.files] == [
        ("vllm/envs.py", "vllm/envs.py"),
        (None, "vllm/notes/README.txt"),
    ]
    assert b"new file mode 100644" in member.path.read_bytes()
    assert api.key(project) != key
    check = run_cli("check", project)
    assert check.returncode == 0, check.stdout + check.stderr


def test_refresh_refuses_an_edit_a_later_member_reads(tmp_path, vllm_wheel):
    """A later member edits the line the first member wrote: changing that line in the first
    member's work directory is refused, naming the later member, and nothing is written."""
    project = tmp_path / "p"
    base = api.apply(DEFAULT_RECIPE).tree.read(ATTENTION)
    swa_text = (ROOT / "overlay" / f"{SWA}.patch").read_text()
    patched = base.replace(
        b"    PREFILL_CHUNK_SIZE: ClassVar[int] = 4\n",
        b"    PREFILL_CHUNK_SIZE: ClassVar[int] = 4\n"
        b"    # Tokens per page of the sliding-window KV cache. A backend whose sparse\n"
        b"    # decode kernel is instantiated for one page size only sets it here.\n"
        b"    swa_block_size: ClassVar[int] = 32\n",
    ).replace(b"            block_size=32,\n", b"            block_size=self.swa_block_size,\n")
    later = patched.replace(b"swa_block_size: ClassVar[int] = 32", b"swa_block_size: ClassVar[int] = 16")
    recipe = write_recipe(
        project, {SWA: swa_text, "smaller": member_text(git_diff({ATTENTION: patched}, {ATTENTION: later}))}
    )
    assert run_cli("check", recipe).returncode == 0
    workdir = tmp_path / "work"
    api.member_edit(recipe, SWA, workdir)
    att = workdir / ATTENTION
    att.write_bytes(
        att.read_bytes().replace(b"swa_block_size: ClassVar[int] = 32", b"swa_block_size: ClassVar[int] = 24")
    )
    before = snapshot(project)
    proc = run_cli("member", "refresh", SWA, workdir, "--recipe", recipe)
    assert proc.returncode == 2
    assert "later members read: smaller would no longer apply" in proc.stderr
    assert snapshot(project) == before
    # the lines it reads put back, an edit elsewhere is fine
    att.write_bytes(att.read_bytes().replace(b"ClassVar[int] = 24", b"ClassVar[int] = 32"))
    sparse = workdir / SPARSE
    sparse.write_bytes(sparse.read_bytes().replace(b"ClassVar[int] = 64", b"ClassVar[int] = 128"))
    proc = run_cli("member", "refresh", SWA, workdir, "--recipe", recipe)
    assert proc.returncode == 0, proc.stderr
    assert run_cli("check", recipe).returncode == 0


def test_refresh_refuses_a_member_made_from_a_source(project, tmp_path, vllm_wheel):
    workdir = tmp_path / "work"
    api.member_edit(project, SELFTEST, workdir)
    proc = run_cli("member", "refresh", SELFTEST, workdir, "--recipe", project)
    assert proc.returncode == 2
    assert "made from sm120_decode_shape_selftest.py: edit that file" in proc.stderr


def test_edit_full_writes_every_file_of_a_small_tree(tmp_path):
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "a.py").write_bytes(b"one\ntwo\nthree\n")
    (tree / "pkg" / "b.py").write_bytes(b"untouched\n")
    diff = git_diff({"pkg/a.py": b"one\ntwo\nthree\n"}, {"pkg/a.py": b"one\n2\nthree\n"})
    recipe = write_recipe(tmp_path / "p", {"fix": member_text(diff)}, vllm={"path": str(tree)})
    assert api.member_edit(recipe, "fix", tmp_path / "only")["files"] == ["pkg/a.py"]
    assert not (tmp_path / "only" / "pkg" / "b.py").exists()
    api.member_edit(recipe, "fix", tmp_path / "full", full=True)
    assert (tmp_path / "full" / "pkg" / "b.py").read_bytes() == b"untouched\n"
    assert (tmp_path / "full" / "pkg" / "a.py").read_bytes() == b"one\n2\nthree\n"
    assert not api.member_refresh(recipe, "fix", tmp_path / "full", today=TODAY).changed
    # an existing directory that is not a work directory is never replaced
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "x").write_text("keep")
    proc = run_cli("member", "edit", "fix", mine, "--recipe", recipe)
    assert proc.returncode == 2 and "not an earlier vllm-overlay output" in proc.stderr
    assert (mine / "x").read_text() == "keep"
