"""Members made from a source file (builder/sources.py): the self-test's .patch is generated
from overlay/sm120_decode_shape_selftest.py, and every command refuses one that disagrees.

Everything here works on copies of HEAD's overlay/ in a temporary directory (another
change may be under way in the working tree), with a cache of its own; `key` reads no
tree, so nothing here needs the wheel or the network.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from builder.members import parse_member
from builder.sources import generate, split_generated
from tests.helpers import run_cli, snapshot
from tools.synthetic import ROOT, git_diff, member_text, write_recipe

NAME = "sm120_decode_shape_selftest"
OTHER = "sm120_swa_page_block_size"
TREE_PATH = "vllm/models/deepseek_v41/nvidia/sm120_decode_shape_selftest.py"
STALE = "{patch}: member {name}: out of date with {source}; run make members"


def _head(path: str) -> bytes:
    return subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True, check=True).stdout


@pytest.fixture(scope="module")
def head_files() -> dict[str, bytes]:
    return {f"{n}{ext}": _head(f"overlay/{n}{ext}") for n, ext in ((NAME, ".patch"), (NAME, ".py"), (OTHER, ".patch"))}


@pytest.fixture
def work(tmp_path: Path, head_files: dict[str, bytes]) -> Path:
    """A recipe with HEAD's two members, its overlay/ a copy of HEAD's (the self-test's source too)."""
    directory = tmp_path / "work"
    write_recipe(directory, {OTHER: head_files[f"{OTHER}.patch"].decode(), NAME: head_files[f"{NAME}.patch"].decode()})
    (directory / "overlay" / f"{NAME}.py").write_bytes(head_files[f"{NAME}.py"])
    return directory


def _cli(work: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=work, env={"VLLM_OVERLAY_CACHE": str(work.parent / "cache")})


def _key(work: Path) -> str:
    proc = _cli(work, "key", "recipe.yaml")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _paths(work: Path, name: str = NAME) -> tuple[Path, Path]:
    overlay = (work / "overlay").resolve()
    return overlay / f"{name}.patch", overlay / f"{name}.py"


def test_generator_reproduces_heads_member(work: Path, head_files: dict[str, bytes]):
    patch, source = _paths(work)
    data = patch.read_bytes()
    header, tree_path = split_generated(data, "test")
    assert tree_path == TREE_PATH
    assert generate(header, tree_path, source.read_bytes()) == data == head_files[f"{NAME}.patch"]
    before = snapshot(work)
    proc = _cli(work, "members", "recipe.yaml", "--check")
    assert (proc.returncode, proc.stdout) == (0, f"{NAME}: up to date\n"), proc.stderr
    proc = _cli(work, "members", "recipe.yaml")
    assert (proc.returncode, proc.stdout) == (0, f"{NAME}: up to date\n"), proc.stderr
    assert snapshot(work) == before


@pytest.mark.parametrize(
    "source",
    [b"x = 1\n", b"x = 1", b"a\nb\n", b"a\nb", b"a\r\nb\r\n", b"\n", b"\n\n", "caf\u00e9\n".encode()],
    ids=["one-line", "one-line-no-newline", "two-lines", "two-lines-no-newline", "crlf", "blank", "blanks", "utf8"],
)
def test_generate_is_gits_diff(source: bytes):
    header = b"Description: d\nAuthor: a <a@example.invalid>\nUpstream-Status: Pending\n\n"
    made = generate(header, "pkg/new_module.py", source)
    assert made == header + git_diff({}, {"pkg/new_module.py": source}).encode("utf-8", "surrogateescape")
    member = parse_member("m", Path("m.patch"), made)
    assert member.files[0].old_path is None
    assert member.files[0].hunks[0].new_block == source


def test_generate_refuses_an_empty_source():
    with pytest.raises(ValueError):
        generate(b"", "a.py", b"")


def test_a_changed_source_is_refused_then_regenerated(work: Path):
    patch, source = _paths(work)
    key_before = _key(work)
    source.write_bytes(source.read_bytes() + b"# one more line\n")
    before, cache_before = snapshot(work), snapshot(work.parent / "cache")
    proc = _cli(work, "key", "recipe.yaml")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["vllm-overlay: " + STALE.format(patch=patch, name=NAME, source=source)]
    assert snapshot(work) == before and snapshot(work.parent / "cache") == cache_before

    proc = _cli(work, "members", "recipe.yaml", "--check")
    assert (proc.returncode, proc.stdout) == (1, f"{NAME}: out of date with {NAME}.py\n")
    assert snapshot(work) == before

    mode = patch.stat().st_mode
    proc = _cli(work, "members", "recipe.yaml")
    assert (proc.returncode, proc.stdout) == (0, f"{NAME}: regenerated\n"), proc.stderr
    assert patch.read_bytes().endswith(b"\n+# one more line\n")
    assert patch.stat().st_mode == mode  # the temp file's 0600 is not left on it
    assert [p.name for p in patch.parent.iterdir() if p.name.startswith(".")] == []
    key_after = _key(work)
    assert key_after != key_before
    proc = _cli(work, "members", "recipe.yaml", "--check")
    assert (proc.returncode, proc.stdout) == (0, f"{NAME}: up to date\n")


def test_header_edits_survive_regeneration(work: Path):
    patch, source = _paths(work)
    data = patch.read_bytes()
    edited = data.replace(b"Upstream-Status: ", b"Bug: https://example.invalid/1\nUpstream-Status: ", 1)
    assert edited != data
    patch.write_bytes(edited)
    assert _key(work)  # a header edit alone keeps it up to date
    source.write_bytes(b"print('replaced')\n")
    assert _cli(work, "members", "recipe.yaml").returncode == 0
    header, _ = split_generated(edited, "test")
    assert patch.read_bytes() == generate(header, TREE_PATH, b"print('replaced')\n")
    assert patch.read_bytes().startswith(header)
    assert b"Bug: https://example.invalid/1\n" in patch.read_bytes()
    _key(work)


def test_a_source_without_a_final_newline(work: Path):
    patch, source = _paths(work)
    source.write_bytes(b"import sys\nsys.exit(0)")
    assert _cli(work, "members", "recipe.yaml").returncode == 0
    assert patch.read_bytes().endswith(b"+import sys\n+sys.exit(0)\n\\ No newline at end of file\n")
    assert b"@@ -0,0 +1,2 @@\n" in patch.read_bytes()
    _key(work)
    member = parse_member(NAME, patch, patch.read_bytes())
    assert member.files[0].hunks[0].new_block == b"import sys\nsys.exit(0)"


def test_an_empty_source_is_refused(work: Path):
    patch, source = _paths(work)
    source.write_bytes(b"")
    before = snapshot(work)
    for args in (["key", "recipe.yaml"], ["members", "recipe.yaml"], ["members", "recipe.yaml", "--check"]):
        proc = _cli(work, *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1 and "is empty" in proc.stderr
    assert snapshot(work) == before


def test_a_source_beside_a_member_that_is_not_one_new_file(work: Path):
    patch, source = _paths(work, OTHER)
    source.write_bytes(b"x = 1\n")
    # HEAD's other member patches two files; then one file, not new
    one_file = git_diff({"vllm/x.py": b"a\n"}, {"vllm/x.py": b"b\n"})
    cases = [
        (None, "but it has 2 'diff --git' lines"),
        (member_text(one_file), "but its diff of vllm/x.py is not a new file"),
    ]
    for text, why in cases:
        if text is not None:
            patch.write_text(text)
        before = snapshot(work)
        for args in (["key", "recipe.yaml"], ["members", "recipe.yaml"], ["members", "recipe.yaml", "--check"]):
            proc = _cli(work, *args)
            assert proc.returncode == 2, proc.stderr
            [line] = proc.stderr.splitlines()
            made = f"made from {source}, so its diff must be a single new-file diff"
            assert line.startswith(f"vllm-overlay: {patch}: member {OTHER}: {made}, {why}")
        assert snapshot(work) == before


def test_a_header_the_source_cannot_mend_is_refused_before_writing(work: Path):
    patch, source = _paths(work)
    patch.write_bytes(patch.read_bytes().replace(b"Upstream-Status: ", b"Status: ", 1))
    source.write_bytes(b"x = 1\n")
    before = snapshot(work)
    proc = _cli(work, "members", "recipe.yaml")
    assert proc.returncode == 2 and "unknown field 'Status'" in proc.stderr
    assert snapshot(work) == before


def test_a_recipe_without_generated_members(work: Path):
    os.unlink(_paths(work)[1])
    proc = _cli(work, "members", "recipe.yaml", "--check")
    assert (proc.returncode, proc.stdout) == (0, "")
    assert "no member" in proc.stderr
