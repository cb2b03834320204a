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

import random

import pytest

from builder.apply import FileState, HunkFailure, MemberResult, _apply_file, find_hunk
from builder.members import FilePatch, Hunk
from builder.members import hunk as make_hunk

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
    ends = [i for i, (kind, text) in enumerate(body) if not text.endswith(b"\n")]
    if ends and body[ends[0]][0] == " " and any(k == "+" for k, _ in body[ends[0] :]):
        # "\ No newline" context followed by added lines: git writes it as removed and re-added last
        body[ends[0]] = ("-", body[ends[0]][1])
        body.append(("+", body[ends[0]][1]))
    old_len = sum(k != "+" for k, _ in body)
    new_len = sum(k != "-" for k, _ in body)
    # a pure insertion goes at the start (one at the end would run into a last line without newline)
    old_start = rng.choice([1, rng.randrange(2, 20), rng.randrange(2, 20)]) if old_len else rng.choice([0, 1])
    new_start = max(old_start + rng.randrange(-6, 7), 0)
    return make_hunk(number, old_start, old_len, new_start, new_len, tuple(body))


@pytest.mark.parametrize("seed", range(4))
def test_byte_level_apply_agrees_with_the_line_model(seed):
    rng = random.Random(seed)
    placed = failed = offset = overlapped = 0
    for _ in range(3000):
        lines = random_file(rng)
        owners: list[str | None] = [None] * len(lines)
        state = FileState(b"".join(lines))
        for member in ("m1", "m2", "m3"):
            hunks = [random_hunk(rng, lines, n) for n in range(1, rng.randrange(2, 5))]
            expected = model_apply(lines, owners, hunks, member)
            result = MemberResult(member=None)  # type: ignore[arg-type]
            try:
                got = _apply_file(FilePatch("f", "f", None, tuple(hunks)), state, member, result)
            except HunkFailure:
                assert expected is None, (lines, hunks)
                failed += 1
                continue
            assert expected is not None, (lines, hunks)
            lines, owners, offsets, overlaps = expected
            assert got.data == b"".join(lines), (hunks,)
            assert [(o.hunk.number, o.offset) for o in result.offsets] == offsets
            assert [(o.hunk.number, o.earlier) for o in result.overlaps] == overlaps
            assert owners_of(got, len(lines)) == owners
            placed += 1
            offset += bool(offsets)
            overlapped += bool(overlaps)
            state = got
    # the random cases reach every branch that matters, not just the easy one
    assert min(placed, failed, offset, overlapped) > 100, (placed, failed, offset, overlapped)


def test_a_match_must_start_at_a_line_boundary_and_a_last_line_without_newline_ends_the_file():
    block = make_hunk(1, 3, 2, 3, 2, ((" ", b"a\n"), (" ", b"b\n")))
    assert find_hunk(b"xa\nb\nz\nz\n", block, 2) is None  # "a\nb\n" occurs, but not at a line start
    assert find_hunk(b"z\nxa\nb\na\nb\nz\n", block, 0) == (3, 7)
    tail = make_hunk(1, 3, 1, 3, 1, ((" ", b"b"),))  # context "b" with no newline: only the file's end
    assert find_hunk(b"b\nb\nb", tail, 0) == (2, 4)
    assert find_hunk(b"b\nb\nbc", tail, 0) is None
