"""The byte-level apply against a line-by-line model of git apply's placement.

builder.apply keeps files as bytes and finds a hunk with ``bytes.find``; the
model below keeps a list of lines and an owner per line and searches outward
from the anchor line as git apply does (apply.c: match_fragment and
find_pos).  On random files built from a few repeated lines (so that a hunk
often matches in several places), CRLF and missing final newlines included,
both must agree on where every hunk lands, on the result, on the offsets and
on which earlier members a hunk reads.  The differential tests against real
``git apply`` (test_apply_real.py) anchor the model itself.
"""

from __future__ import annotations

import collections
import functools
import random
import re
import subprocess
from pathlib import Path

import pytest

from builder import apply
from builder.apply import FileState, HunkFailure, MemberResult, _apply_file, apply_members, find_hunk
from builder.members import FilePatch, Hunk, load_member
from builder.members import hunk as make_hunk
from builder.tree import DirTree
from tools.synthetic import MANY_HUNKS_FILE, many_hunks, member_text

ALPHABET = [b"a\n", b"b\n", b"\n", b"a\r\n", b"    x = 1\n", b"b"]


def model_find(lines: list[bytes], old: list[bytes], anchor: int, hunk: Hunk) -> int | None:
    """git apply's search: exact match nearest to the anchor line, forward first."""
    n, size = len(old), len(lines)
    if n > size:
        return None
    match_beginning = hunk.old_start <= 1
    match_end = hunk.trailing_context == 0
    if match_beginning or match_end:
        pos = 0 if match_beginning else size - n
        if match_end and pos + n != size:
            return None
        return pos if lines[pos : pos + n] == old else None
    last = size - n
    anchor = min(anchor, last)
    for distance in range(0, max(anchor, last - anchor) + 1):
        for pos in (anchor + distance, anchor - distance):
            if 0 <= pos <= last and lines[pos : pos + n] == old:
                return pos
    return None


def model_apply(lines: list[bytes], owners: list[str | None], hunks: list[Hunk], member: str):
    """(lines, owners, [(hunk, offset)], [(hunk, earlier members)]) or None when a hunk fails."""
    lines, owners, offsets, overlaps = list(lines), list(owners), [], []
    for hunk in hunks:
        old = hunk.old_lines
        anchor = max(hunk.new_start - 1, 0)
        pos = model_find(lines, old, anchor, hunk)
        if pos is None:
            return None
        if pos != anchor:
            offsets.append((hunk.number, pos - anchor))
        consumed = owners[pos : pos + len(old)]
        earlier = tuple(sorted({o for o in consumed if o is not None and o != member}))
        if earlier:
            overlaps.append((hunk.number, earlier))
        taken = iter(consumed)
        new_owners = []
        for kind, _ in hunk.lines:
            if kind == " ":
                new_owners.append(next(taken))
            elif kind == "-":
                next(taken)
            else:
                new_owners.append(member)
        lines[pos : pos + len(old)] = hunk.new_lines
        owners[pos : pos + len(old)] = new_owners
    return lines, owners, offsets, overlaps


def owners_of(state: FileState, count: int) -> list[str | None]:
    per_line: list[str | None] = [None] * count
    for first, stop, who in state.owned:
        for at in range(first, stop):
            assert per_line[at] is None, "owned runs overlap"
            per_line[at] = who
    return per_line


def random_file(rng: random.Random) -> list[bytes]:
    lines = [rng.choice(ALPHABET[:-1]) for _ in range(rng.randrange(0, 14))]
    if lines and lines[-1] != b"\n" and rng.random() < 0.2:
        lines[-1] = lines[-1].rstrip(b"\n")  # no newline at end of file
    return lines


def engine_agrees_with_model(state: FileState, lines: list[bytes], owners: list, hunks: list[Hunk], member: str):
    """Apply ``hunks`` to ``state`` with the engine and to ``lines`` with the line model, and
    assert they agree: both refuse (None), or the same bytes, offsets, overlaps and line
    owners ((new state, lines, owners, offsets, overlaps))."""
    expected = model_apply(lines, owners, hunks, member)
    result = MemberResult(member=None)  # type: ignore[arg-type]
    try:
        got = _apply_file(FilePatch("f", "f", None, tuple(hunks)), state, member, result)
    except HunkFailure:
        assert expected is None, (lines, hunks)
        return None
    assert expected is not None, (lines, hunks)
    lines, owners, offsets, overlaps = expected
    assert got.data == b"".join(lines), (hunks,)
    assert [(o.hunk.number, o.offset) for o in result.offsets] == offsets
    assert [(o.hunk.number, o.earlier) for o in result.overlaps] == overlaps
    assert owners_of(got, len(lines)) == owners
    return got, lines, owners, offsets, overlaps


OUTCOMES = ("placed", "failed", "offset", "overlapped")


def three_members_agree(lines: list[bytes], make_hunks, counts: collections.Counter) -> None:
    """Three members in turn on ``lines``, each with the hunks ``make_hunks`` draws for the
    file as the members before left it; the engine must agree with the line model on each.
    ``counts`` adds how they ended (OUTCOMES), so a test can show every branch was reached."""
    owners: list[str | None] = [None] * len(lines)
    state = FileState(b"".join(lines))
    for member in ("m1", "m2", "m3"):
        agreed = engine_agrees_with_model(state, lines, owners, make_hunks(lines), member)
        if agreed is None:
            counts["failed"] += 1
            continue
        state, lines, owners, offsets, overlaps = agreed
        counts["placed"] += 1
        counts["offset"] += bool(offsets)
        counts["overlapped"] += bool(overlaps)


def as_git_writes_it(body: list[tuple[str, bytes]]) -> tuple[int, int]:
    """Rewrite ``body`` as git writes it, and give its old and new lengths: a "\\ No newline"
    context line followed by added lines is written as removed and re-added last."""
    ends = [i for i, (kind, text) in enumerate(body) if not text.endswith(b"\n")]
    if ends and body[ends[0]][0] == " " and any(k == "+" for k, _ in body[ends[0] :]):
        body[ends[0]] = ("-", body[ends[0]][1])
        body.append(("+", body[ends[0]][1]))
    return sum(k != "+" for k, _ in body), sum(k != "-" for k, _ in body)


def random_hunk(rng: random.Random, lines: list[bytes], number: int) -> Hunk:
    """Old lines mostly taken from the file (so they match, perhaps in several places).

    Only hunks a diff can express: a line without a newline is the last of its side."""
    if lines and rng.random() < 0.85:
        start = rng.randrange(0, len(lines))
        old = lines[start : start + rng.randrange(0, 5)]
    else:
        old = [rng.choice(ALPHABET) for _ in range(rng.randrange(0, 4))]
    body: list[tuple[str, bytes]] = []
    for i, text in enumerate(old):
        # mostly context at the end, as diffs have: a hunk without it must match at the end
        body.append((" " if i == len(old) - 1 and rng.random() < 0.8 else rng.choice(" -"), text))
        if rng.random() < 0.3:
            body.append(("+", rng.choice(ALPHABET[:-1])))
    if not body or rng.random() < 0.3:
        body.insert(rng.randrange(0, len(body) + 1), ("+", rng.choice(ALPHABET[:-1])))
    old_len, new_len = as_git_writes_it(body)
    # a pure insertion goes at the start (one at the end would run into a last line without newline)
    old_start = rng.choice([1, rng.randrange(2, 20), rng.randrange(2, 20)]) if old_len else rng.choice([0, 1])
    new_start = max(old_start + rng.randrange(-6, 7), 0)
    return make_hunk(number, old_start, old_len, new_start, new_len, tuple(body))


@pytest.mark.parametrize("seed", range(4))
def test_byte_level_apply_agrees_with_the_line_model(seed):
    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    for _ in range(3000):
        three_members_agree(
            random_file(rng), lambda lines: [random_hunk(rng, lines, n) for n in range(1, rng.randrange(2, 5))], counts
        )
    # the random cases reach every branch that matters, not just the easy one
    assert min(counts[k] for k in OUTCOMES) > 100, counts


def test_a_match_must_start_at_a_line_boundary_and_a_last_line_without_newline_ends_the_file():
    block = make_hunk(1, 3, 2, 3, 2, ((" ", b"a\n"), (" ", b"b\n")))
    assert find_hunk(b"xa\nb\nz\nz\n", block, 2) is None  # "a\nb\n" occurs, but not at a line start
    assert find_hunk(b"z\nxa\nb\na\nb\nz\n", block, 0) == (3, 7)
    tail = make_hunk(1, 3, 1, 3, 1, ((" ", b"b"),))  # context "b" with no newline: only the file's end
    assert find_hunk(b"b\nb\nb", tail, 0) == (2, 4)
    assert find_hunk(b"b\nb\nbc", tail, 0) is None


def test_lines_inserted_after_a_last_line_without_newline_are_numbered_as_git_does(tmp_path):
    """git keeps such a last line a line of its own when lines are inserted after it (by a
    hunk without old lines, pinned to the end): the lines after it are numbered one more than
    the newlines before them, so each further insertion there is one more line off.  git diff
    writes no such hunks, but apply places them as git apply does."""
    (tmp_path / "f").write_bytes(b"a\nb")
    (tmp_path / "p.patch").write_text("diff --git a/f b/f\n--- a/f\n+++ b/f\n" + "@@ -3,0 +3,1 @@\n+c\n" * 3)
    proc = subprocess.run(["git", "apply", "-v", "p.patch"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    theirs = re.findall(r"Hunk #(\d+) succeeded at \d+ \(offset (-?\d+) lines?\)", proc.stderr)
    hunks = tuple(make_hunk(number, 3, 0, 3, 1, (("+", b"c\n"),)) for number in (1, 2, 3))
    result = MemberResult(member=None)  # type: ignore[arg-type]
    got = _apply_file(FilePatch("f", "f", None, hunks), FileState(b"a\nb"), "m", result)
    assert got.data == (tmp_path / "f").read_bytes() == b"a\nbc\nc\nc\n"
    assert [(str(o.hunk.number), str(o.offset)) for o in result.offsets] == theirs == [("2", "1"), ("3", "2")]


def random_long_file(rng: random.Random) -> list[bytes]:
    """Up to 300 lines, most from the alphabet (so hunks match in many places), some rarer."""
    lines = [
        rng.choice(ALPHABET[:-1]) if rng.random() < 0.7 else b"u%d\n" % rng.randrange(50)
        for _ in range(rng.randrange(0, 300))
    ]
    if lines and lines[-1] != b"\n" and rng.random() < 0.2:
        lines[-1] = lines[-1].rstrip(b"\n")
    return lines


def hunk_in_order(rng: random.Random, lines: list[bytes], number: int, at: int) -> tuple[Hunk, int]:
    """A hunk as diffs have them: mostly at or after ``at`` (where the one before it ended),
    with trailing context, its header's lines a little or a lot off; and the next ``at``."""
    if lines and rng.random() < 0.98:
        start = min(at, len(lines) - 1) if rng.random() < 0.8 else rng.randrange(0, len(lines))
        old = lines[start : start + rng.randrange(1, 6)]
    else:
        start = rng.randrange(0, 30)
        old = [rng.choice(ALPHABET) for _ in range(rng.randrange(0, 4))]
    body: list[tuple[str, bytes]] = []
    for i, text in enumerate(old):
        body.append((" " if i == len(old) - 1 and rng.random() < 0.98 else rng.choice(" -"), text))
        if rng.random() < (0.3 if i < len(old) - 1 else 0.02):  # an added last line: pinned to the end
            body.append(("+", rng.choice(ALPHABET[:-1])))
    if not body or rng.random() < 0.3:
        body.insert(rng.randrange(0, max(len(body), 1)), ("+", rng.choice(ALPHABET[:-1])))
    old_len, new_len = as_git_writes_it(body)
    old_start = (start + 1 if rng.random() < 0.95 else rng.randrange(1, 40)) if old_len else rng.choice([0, 1])
    if old_start == 1 and old_len and rng.random() < 0.7:
        old_start = 2  # mostly not pinned to the start, so that the search is what is tested
    new_start = max(old_start + rng.choice([0, 0, 0, rng.randrange(-8, 9), rng.randrange(-40, 41)]), 0)
    return make_hunk(number, old_start, old_len, new_start, new_len, tuple(body)), start + len(old) + rng.randrange(12)


@pytest.mark.parametrize("seed", range(3))
def test_many_hunks_in_order_on_longer_files_agree_with_the_line_model(seed, monkeypatch):
    """The search's windows and the file's parts (before the last hunk's end, after it, and
    what a hunk placed further back moved out) on files long enough to cross them: windows
    of a byte or two, or of the real size, so that every edge is crossed somewhere."""
    rng = random.Random(seed)

    def hunks_in_order(lines: list[bytes]) -> list[Hunk]:
        hunks, at = [], 0
        for number in range(1, rng.randrange(2, rng.choice([4, 8, 20]))):
            hunk, at = hunk_in_order(rng, lines, number, at)
            hunks.append(hunk)
        return hunks

    counts: collections.Counter = collections.Counter()
    for _ in range(700):
        monkeypatch.setattr(apply, "_WINDOW", rng.choice([1, 2, 7, 512]))
        monkeypatch.setattr(apply, "_LINE_GUESS", rng.choice([1, 3, 64]))
        three_members_agree(random_long_file(rng), hunks_in_order, counts)
    assert min(counts[k] for k in OUTCOMES) > 100, counts


BIG = MANY_HUNKS_FILE
many_hunks = functools.cache(many_hunks)  # both parametrizations and the work test share them


def tree_and_members(tmp: Path, count: int, touched: bool) -> tuple[DirTree, list, bytes]:
    base, diffs = many_hunks(count, touched)
    (tmp / "tree" / "pkg").mkdir(parents=True)
    (tmp / "tree" / BIG).write_bytes(base)
    members = []
    for i, diff in enumerate(diffs):
        path = tmp / "overlay" / f"m{i}.patch"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(member_text(diff))
        members.append(load_member(path))
    return DirTree(tmp / "tree"), members, base


@pytest.mark.parametrize("touched", [False, True], ids=["fresh", "after-an-earlier-member"])
def test_eight_thousand_hunks_in_one_file_apply_as_git_apply_does(tmp_path, touched):
    tree, members, base = tree_and_members(tmp_path, 8000, touched)
    overlay = apply_members(tree, members)
    ours = [[(str(o.hunk.number), str(o.offset)) for o in r.offsets] for r in overlay.results]
    assert len(ours[-1]) == 8000 if touched else 0 < len(ours[-1]) < 8000
    work = tmp_path / "git"
    (work / "pkg").mkdir(parents=True)
    (work / BIG).write_bytes(base)
    theirs = []
    for member in members:  # git apply, member by member, on a copy of the file
        proc = subprocess.run(["git", "apply", "-v", str(member.path)], cwd=work, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        theirs.append(re.findall(r"Hunk #(\d+) succeeded at \d+ \(offset (-?\d+) lines?\)", proc.stderr))
    assert overlay.by_path()[BIG].after == (work / BIG).read_bytes()
    assert ours == theirs
    # which earlier lines each hunk read, and who owns each line: as the line model has them
    lines, owners = base.splitlines(keepends=True), [None] * base.count(b"\n")
    for member, result in zip(members, overlay.results, strict=True):
        expected = model_apply(lines, owners, list(member.files[0].hunks), member.name)
        assert expected is not None
        lines, owners, _, overlaps = expected
        assert [(o.hunk.number, o.earlier) for o in result.overlaps] == overlaps
        assert owners_of(result.staged[BIG], len(lines)) == owners
    assert len(overlaps) == (8000 // 20 if touched else 0)


def test_the_work_of_placing_hunks_grows_with_their_number_not_its_square(tmp_path, monkeypatch):
    """Not a timing: the byte-level look-ups placing makes (each goes through _Image._parts)
    and the bytes they span (newlines counted, windows searched or compared), for 1,000 and
    8,000 hunks in one file.  Eight times as many hunks make about eight times the work;
    searching or counting lines from the start of the file for each hunk would make 64."""
    seen: collections.Counter = collections.Counter()
    parts, count, view = apply._Image._parts, apply._Image.count, apply._Image.view

    def counted_parts(self, lo, hi):
        seen["look-ups"] += 1
        return parts(self, lo, hi)

    def counted_count(self, lo, hi):
        seen["bytes"] += hi - lo
        return count(self, lo, hi)

    def counted_view(self, lo, hi):
        seen["bytes"] += hi - lo
        return view(self, lo, hi)

    monkeypatch.setattr(apply._Image, "_parts", counted_parts)
    monkeypatch.setattr(apply._Image, "count", counted_count)
    monkeypatch.setattr(apply._Image, "view", counted_view)
    for touched in (False, True):
        work = {}
        for hunks in (1000, 8000):
            tree, members, _ = tree_and_members(tmp_path / f"{touched}-{hunks}", hunks, touched)
            seen.clear()
            apply_members(tree, members)
            work[hunks] = dict(seen)
        for what in ("look-ups", "bytes"):
            assert work[8000][what] <= 9 * work[1000][what], (touched, work)
