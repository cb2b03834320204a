"""Overlay check on the real vLLM 0.30.0 wheel: statuses, conflict details, standalone, shared files."""

from __future__ import annotations

import json

from tests.helpers import run_cli
from tools.synthetic import git_diff, member_text, write_recipe

ATT = "vllm/models/deepseek_v41/attention.py"


def lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


def replaced(data: bytes, index: int, new: bytes) -> bytes:
    out = lines(data)
    out[index] = new
    return b"".join(out)


def check(tmp_path, members: dict[str, str], order=None, json_out=True):
    recipe = write_recipe(tmp_path, members, order)
    proc = run_cli("check", recipe, *(["--json"] if json_out else []))
    return proc, (json.loads(proc.stdout) if json_out and proc.stdout.startswith("{") else None)


def test_clean_offsets_shared_file_without_overlap(tmp_path, wheel_zip):
    att = wheel_zip.read(ATT)
    first = git_diff({ATT: att}, {ATT: replaced(att, 469, b"            block_size=self.swa_block_size,\n")})
    # made against a copy missing 3 lines near the top: applies 3 lines further down
    shifted = b"".join(lines(att)[:30] + lines(att)[33:])
    second = git_diff({ATT: shifted}, {ATT: replaced(shifted, 200, b"# second member\n")})
    proc, report = check(tmp_path, {"first": member_text(first), "second": member_text(second)})
    assert proc.returncode == 0, proc.stderr
    assert [m["status"] for m in report["members"]] == ["applied", "applied with offsets"]
    assert report["members"][1]["offsets"] == [{"file": ATT, "hunk": 1, "header": "@@ -198,7 +198,7 @@", "offset": 3}]
    assert report["shared_files"] == [{"file": ATT, "members": ["first", "second"], "overlapping_hunks": []}]
    table = run_cli("check", tmp_path / "recipe.yaml").stdout
    assert "second  applied with offsets" in table and f"{ATT} hunk 1 +3 lines" in table
    assert f"shared file {ATT}: first, second: hunks do not overlap" in table


def test_overlapping_hunks_are_named(tmp_path, wheel_zip):
    att = wheel_zip.read(ATT)
    after_first = replaced(att, 469, b"            block_size=self.swa_block_size,\n")
    first = git_diff({ATT: att}, {ATT: after_first})
    second = git_diff({ATT: after_first}, {ATT: replaced(after_first, 471, b"            packed_page_alignment=64,\n")})
    proc, report = check(tmp_path, {"first": member_text(first), "second": member_text(second)})
    assert proc.returncode == 0
    assert report["shared_files"][0]["overlapping_hunks"] == [
        {"member": "second", "hunk": 1, "header": "@@ -469,7 +469,7 @@", "reads_lines_of": ["first"]}
    ]


def test_already_applied_is_told_from_conflict(tmp_path, wheel_zip):
    att = wheel_zip.read(ATT)
    fix = git_diff({ATT: att}, {ATT: replaced(att, 469, b"            block_size=64,\n")})
    other = replaced(att, 300, b"    this line is not in vLLM 0.30.0\n")
    conflict = git_diff({ATT: other}, {ATT: replaced(other, 301, b"    # edit\n")})
    proc, report = check(
        tmp_path, {"fix": member_text(fix), "fix_again": member_text(fix), "clash": member_text(conflict)}
    )
    assert proc.returncode == 1
    statuses = {m["member"]: m["status"] for m in report["members"]}
    assert statuses == {"fix": "applied", "fix_again": "already applied", "clash": "conflict"}
    c = report["members"][2]["conflict"]
    assert (c["file"], c["hunk"], c["header"], c["line"]) == (ATT, 1, "@@ -299,7 +299,7 @@", 299)
    assert c["expected"][2] == "    this line is not in vLLM 0.30.0\n"
    assert c["found"][2] == lines(att)[300].decode()
    assert c["nearest"] == {"line": 299, "equal_lines": 6, "of": 7}
    table = run_cli("check", tmp_path / "recipe.yaml")
    assert table.returncode == 1
    assert "fix_again  already applied" in table.stdout and "candidate to retire" in table.stdout
    assert "nearest match: line 299 (6 of 7 lines equal)" in table.stdout
    assert table.stdout.rstrip().endswith("overlay check: FAILED")


def test_standalone_member_is_also_tried_alone(tmp_path, wheel_zip):
    att = wheel_zip.read(ATT)
    after_base = replaced(att, 469, b"            block_size=self.swa_block_size,\n")
    base = git_diff({ATT: att}, {ATT: after_base})
    dependent = git_diff(
        {ATT: after_base},
        {ATT: replaced(after_base, 469, b"            block_size=self.swa_block_size,  # 64 on SM120\n")},
    )
    new_file = git_diff({"vllm/standalone_new.py": None}, {"vllm/standalone_new.py": b"OK = True\n"})
    members = {
        "base": member_text(base),
        "dependent": member_text(dependent, extra="Standalone: yes\n"),
        "independent": member_text(new_file, extra="Standalone: yes\n"),
    }
    proc, report = check(tmp_path, members)
    assert [m["status"] for m in report["members"]] == ["applied", "applied", "applied"]
    assert [(m["member"], m["status"]) for m in report["standalone"]] == [
        ("dependent", "conflict"),
        ("independent", "applied"),
    ]
    assert proc.returncode == 1


def test_default_recipe_checks_clean_on_the_real_tree():
    from tools.synthetic import DEFAULT_RECIPE

    proc = run_cli("check", DEFAULT_RECIPE, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert [(m["member"], m["status"]) for m in report["members"]] == [
        ("sm120_swa_page_block_size", "applied"),
        ("sm120_decode_shape_selftest", "applied"),
    ]
    assert [(m["member"], m["status"]) for m in report["standalone"]] == [("sm120_decode_shape_selftest", "applied")]
