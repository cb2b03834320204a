"""The parse memo: a member parsed once is not parsed again, and a memo never changes a result."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from builder import members as M
from builder.members import MemberError, ParseMemo, load_recipe_members
from builder.recipe import load_recipe
from tests.helpers import run_cli
from tools.synthetic import DEFAULT_RECIPE, member_text, write_recipe

CRLF_AND_NO_NEWLINE = member_text(
    "diff --git a/vllm/x.py b/vllm/x.py\n"
    "new file mode 100644\n"
    "--- /dev/null\n"
    "+++ b/vllm/x.py\n"
    "@@ -0,0 +1,2 @@\n"
    "+a = 1\r\n"
    "+b = 2\n"
    "\\ No newline at end of file\n"
)


def facts(members) -> list:
    return [(m.name, m.fields, m.files, m.digest) for m in members]


@pytest.fixture
def parses(monkeypatch):
    """How many members were parsed rather than taken from the memo."""
    count = {"n": 0}
    real = M._parse

    def counting(*args):
        count["n"] += 1
        return real(*args)

    monkeypatch.setattr(M, "_parse", counting)
    return count


def load_and_save(recipe, memo_file):
    """One run that parsed cleanly: its members, and the memo it leaves."""
    memo = ParseMemo(memo_file)
    members = load_recipe_members(recipe, memo)
    memo.save()
    return members


def remembered_crlf_member(tmp_path):
    """A recipe of one member that a run has parsed and remembered: (recipe, memo, member file)."""
    recipe_path = write_recipe(tmp_path, {"crlf_tail": CRLF_AND_NO_NEWLINE})
    memo_file = tmp_path / "members.marshal"
    load_and_save(load_recipe(recipe_path), memo_file)
    return recipe_path, memo_file, tmp_path / "overlay" / "crlf_tail.patch"


def recipes(tmp_path):
    """The default recipe's two real members, and one with CRLF and no final newline."""
    return [load_recipe(DEFAULT_RECIPE), load_recipe(write_recipe(tmp_path, {"crlf_tail": CRLF_AND_NO_NEWLINE}))]


def test_a_remembered_member_is_what_parsing_gives(tmp_path, parses):
    memo_file = tmp_path / "cache" / "members.marshal"
    for recipe in recipes(tmp_path):
        fresh = load_recipe_members(recipe)
        first = ParseMemo(memo_file)
        assert facts(load_recipe_members(recipe, first)) == facts(fresh)
        first.save()
        parses["n"] = 0
        again = load_recipe_members(recipe, ParseMemo(memo_file))
        assert parses["n"] == 0  # all from the memo
        assert facts(again) == facts(fresh)
        assert [m.path for m in again] == [m.path for m in fresh]


def test_a_run_that_parsed_nothing_new_writes_nothing(tmp_path):
    memo_file = tmp_path / "members.marshal"
    recipe = load_recipe(DEFAULT_RECIPE)
    load_and_save(recipe, memo_file)
    stamp = memo_file.stat().st_mtime_ns
    second = ParseMemo(memo_file)
    load_recipe_members(recipe, second)
    second.save()
    assert memo_file.stat().st_mtime_ns == stamp


def test_a_changed_member_is_parsed_again(tmp_path, parses):
    recipe_path, memo_file, member_file = remembered_crlf_member(tmp_path)
    member_file.write_bytes(member_file.read_bytes().replace(b"+b = 2", b"+b = 3"))
    parses["n"] = 0
    (changed,) = load_recipe_members(load_recipe(recipe_path), ParseMemo(memo_file))
    assert parses["n"] == 1
    assert changed.files[0].hunks[0].lines[1] == ("+", b"b = 3")


def test_a_member_made_bad_is_refused_after_a_good_run(tmp_path):
    recipe_path, memo_file, member_file = remembered_crlf_member(tmp_path)
    member_file.write_bytes(member_file.read_bytes().replace(b"@@ -0,0 +1,2 @@", b"@@ -0,0 +1,3 @@"))
    with pytest.raises(MemberError, match="hunk 1 of vllm/x.py is shorter than its header says"):
        load_recipe_members(load_recipe(recipe_path), ParseMemo(memo_file))


def test_an_unreadable_memo_is_ignored_and_replaced(tmp_path, parses):
    memo_file = tmp_path / "members.marshal"
    memo_file.write_bytes(b"\x00 not marshal")
    recipe = load_recipe(DEFAULT_RECIPE)
    memo = ParseMemo(memo_file)
    assert facts(load_recipe_members(recipe, memo)) == facts(load_recipe_members(recipe))
    memo.save()
    parses["n"] = 0
    load_recipe_members(recipe, ParseMemo(memo_file))
    assert parses["n"] == 0


def test_a_changed_parser_does_not_read_old_entries(tmp_path, parses, monkeypatch):
    memo_file = tmp_path / "members.marshal"
    recipe = load_recipe(DEFAULT_RECIPE)
    load_and_save(recipe, memo_file)
    monkeypatch.setattr(M, "_PARSER_ID", [b"another parser"])
    parses["n"] = 0
    load_recipe_members(recipe, ParseMemo(memo_file))
    assert parses["n"] == len(recipe.members)


def test_each_recipe_has_its_own_memo_holding_its_last_runs_members(tmp_path, parses):
    default, crlf = recipes(tmp_path)
    files = {ParseMemo.for_recipe(r, tmp_path / "cache").path for r in (default, crlf)}
    assert len(files) == 2 and all(f.parent == tmp_path / "cache" / "members" for f in files)
    for recipe in (default, crlf):
        memo = ParseMemo.for_recipe(recipe, tmp_path / "cache")
        load_recipe_members(recipe, memo)
        memo.save()
    parses["n"] = 0
    for recipe in (default, crlf):
        load_recipe_members(recipe, ParseMemo.for_recipe(recipe, tmp_path / "cache"))
    assert parses["n"] == 0
    # a run keeps exactly the members it used: a member the recipe dropped is not read again
    memo = ParseMemo.for_recipe(default, tmp_path / "cache")
    assert len(memo._entries()) == len(default.members)


def test_memos_not_rewritten_for_a_month_are_removed(tmp_path):
    default, crlf = recipes(tmp_path)
    old = ParseMemo.for_recipe(default, tmp_path / "cache")
    load_recipe_members(default, old)
    old.save()
    month_ago = time.time() - 31 * 86400
    os.utime(old.path, (month_ago, month_ago))
    fresh = ParseMemo.for_recipe(crlf, tmp_path / "cache")
    load_recipe_members(crlf, fresh)
    fresh.save()
    assert fresh.path.is_file() and not old.path.exists()


def test_the_command_saves_the_memo_only_when_it_succeeds(tmp_path, isolated_cache):
    cache = isolated_cache
    env = {"VLLM_OVERLAY_CACHE": str(cache)}
    recipe_path = write_recipe(tmp_path / "good", {"crlf_tail": CRLF_AND_NO_NEWLINE})
    assert run_cli("key", recipe_path, env=env).returncode == 0
    assert len(list((cache / "members").glob("*.marshal"))) == 1
    shutil.rmtree(cache / "members")
    # parses cleanly, then does not apply (the file it creates is in the tree already): exit 2, no memo
    exists = member_text(
        "diff --git a/vllm/__init__.py b/vllm/__init__.py\n"
        "new file mode 100644\n"
        "--- /dev/null\n"
        "+++ b/vllm/__init__.py\n"
        "@@ -0,0 +1 @@\n"
        "+x = 1\n"
    )
    proc = run_cli("apply", write_recipe(tmp_path / "bad", {"exists": exists}), "--out", tmp_path / "out", env=env)
    assert proc.returncode == 2, proc.stderr
    assert "a new file, but the tree already has it" in proc.stderr
    assert not (cache / "members").exists()
