"""Differential tests: our apply against `git apply`, on files of the real vLLM 0.30.0 wheel."""

from __future__ import annotations

import random
import re
import subprocess
from pathlib import Path

import pytest

from builder.apply import apply_members
from builder.errors import InputError
from builder.members import load_member
from builder.tree import WheelTree
from tools.synthetic import git_diff, member_text

ATTENTION = "vllm/models/deepseek_v41/attention.py"
SPARSE = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
CONFIG = "vllm/transformers_utils/configs/deepseek_v41.py"
SWA = "vllm/v1/attention/backends/mla/sparse_swa.py"


def lines_of(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


def edit(data: bytes, changes: dict[int, bytes | None], inserts: dict[int, bytes] | None = None) -> bytes:
    """Replace (or drop, with None) 0-based lines, and insert before given lines."""
    out = []
    for i, line in enumerate(lines_of(data)):
        out.append((inserts or {}).get(i, b""))
        if i in changes:
            out.append(changes[i] or b"")
        else:
            out.append(line)
    return b"".join(out)


def write_members(tmp: Path, diffs: list[str]) -> list:
    members = []
    for i, diff in enumerate(diffs):
        path = tmp / "overlay" / f"m{i}.patch"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(member_text(diff).encode("utf-8", "surrogateescape"))
        members.append(load_member(path))
    return members


def git_apply(tmp: Path, wheel_zip, members, touched: set[str]) -> tuple[dict[str, bytes | None], list[str]]:
    """Unpack the touched files, run `git apply -v` member by member; return files and git's offset lines."""
    tree = tmp / "git-tree"
    for name in touched:
        if name in wheel_zip.namelist():
            wheel_zip.extract(name, tree)
    tree.mkdir(exist_ok=True)
    offsets = []
    for m in members:
        proc = subprocess.run(["git", "apply", "-v", str(m.path)], cwd=tree, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        offsets += re.findall(r"Hunk #(\d+) succeeded at \d+ \(offset (-?\d+) lines?\)", proc.stderr)
    return {p: (tree / p).read_bytes() if (tree / p).exists() else None for p in touched}, offsets


def assert_same_as_git(tmp: Path, wheel_zip, vllm_wheel: Path, diffs: list[str]) -> None:
    members = write_members(tmp, diffs)
    overlay = apply_members(WheelTree(vllm_wheel), members)
    touched = {c.path for c in overlay.changes}
    expected, git_offsets = git_apply(tmp, wheel_zip, members, touched)
    ours = {c.path: c.after for c in overlay.changes}
    assert ours.keys() == expected.keys()
    for path in touched:
        assert ours[path] == expected[path], f"{path} differs from git apply"
    our_offsets = [(str(o.hunk.number), str(o.offset)) for r in overlay.results for o in r.offsets]
    assert sorted(our_offsets) == sorted(git_offsets)


def test_several_hunks_in_two_files(tmp_path, wheel_zip, vllm_wheel):
    att, sp = wheel_zip.read(ATTENTION), wheel_zip.read(SPARSE)
    att2 = edit(
        att,
        {469: b"            block_size=self.swa_block_size,\n", 20: None},
        {180: b"    swa_block_size: ClassVar[int] = 32\n"},
    )
    sp2 = edit(
        sp,
        {69: b"_SPARSE_MLA_SUPPORTED_Q_HEADS = (8, 16, 32, 64, 128)  # checked\n"},
        {545: b"    swa_block_size = 64\n"},
    )
    assert_same_as_git(
        tmp_path, wheel_zip, vllm_wheel, [git_diff({ATTENTION: att, SPARSE: sp}, {ATTENTION: att2, SPARSE: sp2})]
    )


def test_new_file_and_deletion(tmp_path, wheel_zip, vllm_wheel):
    cfg = wheel_zip.read(CONFIG)
    new = "vllm/models/deepseek_v41/nvidia/added_module.py"
    diff = git_diff({CONFIG: cfg, new: None}, {CONFIG: None, new: b"# new\nVALUE = 1\n"})
    assert "deleted file mode" in diff and "new file mode" in diff
    assert_same_as_git(tmp_path, wheel_zip, vllm_wheel, [diff])


def test_offsets_are_found_and_reported_like_git(tmp_path, wheel_zip, vllm_wheel):
    att = wheel_zip.read(ATTENTION)
    # The diff is made against a copy with 7 lines fewer near the top, so every hunk is 7 lines off.
    shorter = edit(att, {i: None for i in range(40, 47)})
    changed = edit(shorter, {300: b"    # changed\n", 460: b"            block_size=64,\n"})
    diff = git_diff({ATTENTION: shorter}, {ATTENTION: changed})
    members = write_members(tmp_path / "probe", [diff])
    overlay = apply_members(WheelTree(vllm_wheel), members)
    assert [o.offset for o in overlay.results[0].offsets] == [7, 7]
    assert_same_as_git(tmp_path, wheel_zip, vllm_wheel, [diff])


def test_no_newline_at_end_of_file_both_ways(tmp_path, wheel_zip, vllm_wheel):
    swa = wheel_zip.read(SWA)
    no_eol = swa.rstrip(b"\n")
    first = git_diff({SWA: swa}, {SWA: no_eol + b"\n# tail"})
    second = git_diff({SWA: no_eol + b"\n# tail"}, {SWA: no_eol + b"\n# tail\n# fixed\n"})
    assert "\\ No newline at end of file" in first and "\\ No newline at end of file" in second
    assert_same_as_git(tmp_path, wheel_zip, vllm_wheel, [first, second])


def test_crlf_lines_are_kept_and_matched(tmp_path, wheel_zip, vllm_wheel):
    att = wheel_zip.read(ATTENTION)
    crlf = edit(att, {i: lines_of(att)[i].replace(b"\n", b"\r\n") for i in range(100, 110)})
    later = edit(crlf, {104: b"# edited between CRLF lines\r\n"})
    new = "vllm/crlf_only.txt"
    diffs = [
        git_diff({ATTENTION: att, new: None}, {ATTENTION: crlf, new: b"a\r\nb\r\n"}),
        git_diff({ATTENTION: crlf}, {ATTENTION: later}),
    ]
    assert "\r\n" in diffs[1]
    assert_same_as_git(tmp_path, wheel_zip, vllm_wheel, diffs)


def test_crlf_context_does_not_match_lf_file(tmp_path, wheel_zip, vllm_wheel):
    att = wheel_zip.read(ATTENTION)
    crlf = edit(att, {i: lines_of(att)[i].replace(b"\n", b"\r\n") for i in range(100, 110)})
    diff = git_diff({ATTENTION: crlf}, {ATTENTION: edit(crlf, {104: b"x\r\n"})})
    members = write_members(tmp_path, [diff])
    with pytest.raises(InputError, match=r"m0: .*attention.py: hunk 1 .* does not apply at line 102"):
        apply_members(WheelTree(vllm_wheel), members)
    git = subprocess.run(["git", "apply", "--check", str(members[0].path)], cwd=tmp_path, capture_output=True)
    assert git.returncode != 0


@pytest.mark.parametrize("seed", range(12))
def test_random_edits_match_git(seed, tmp_path, wheel_zip, vllm_wheel):
    rng = random.Random(seed)
    candidates = sorted(n for n in wheel_zip.namelist() if n.endswith(".py") and wheel_zip.getinfo(n).file_size > 2000)
    before, after = {}, {}
    for path in rng.sample(candidates, 3):
        data = wheel_zip.read(path)
        n = len(lines_of(data))
        changes = {
            rng.randrange(n): (None if rng.random() < 0.3 else f"# edit {seed}\n".encode())
            for _ in range(rng.randint(1, 6))
        }
        inserts = {rng.randrange(n): b"# inserted\n" for _ in range(rng.randint(0, 3))}
        before[path], after[path] = data, edit(data, changes, inserts)
    diff = git_diff(before, after)
    assert_same_as_git(tmp_path, wheel_zip, vllm_wheel, [diff])


def test_failed_member_changes_nothing_and_names_hunk(tmp_path, wheel_zip, vllm_wheel):
    att = wheel_zip.read(ATTENTION)
    good = git_diff({ATTENTION: att}, {ATTENTION: edit(att, {10: b"# ok\n"})})
    bad = git_diff({ATTENTION: edit(att, {600: b"not in the tree\n"})}, {ATTENTION: edit(att, {600: b"changed\n"})})
    members = write_members(tmp_path, [good, bad])
    with pytest.raises(InputError) as info:
        apply_members(WheelTree(vllm_wheel), members)
    assert "member m1" in str(info.value) and "hunk 1 (@@ -598,7 +598,7 @@)" in str(info.value)
    assert "expected 'not in the tree\\n'" in str(info.value)
