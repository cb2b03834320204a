"""Apply: members in order onto a base tree, fuzz 0, all-or-nothing, into an overlay set.

Hunks are placed as ``git apply`` places them: searched outward from the
line the hunk names (forward first), every context and removed line equal
byte for byte; a hunk at line 1 must match at the start and a hunk without
trailing context at the end of the file.  A found offset is allowed and
reported.  Work happens on an in-memory copy of the touched files only, so a
failure leaves nothing behind.

Files are kept as bytes, not split into lines: a hunk's old lines are one
byte string, found with ``bytes.find`` at a line boundary and numbered by
counting newlines, so applying costs little more than reading the file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

from builder.errors import HunkFailure, InputError
from builder.members import FilePatch, Hunk, Member, split_lines
from builder.tree import Tree


def sha256(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class HunkOffset:
    path: str
    hunk: Hunk
    offset: int  # lines: where it applied minus where its header said


@dataclass(frozen=True)
class Overlap:
    """A hunk of ``member`` reads lines that ``earlier`` wrote."""

    path: str
    hunk: Hunk
    earlier: tuple[str, ...]


# (first line, end line, member): a run of lines a member wrote; other lines are the base tree's
Owned = tuple[int, int, str]


@dataclass
class FileState:
    data: bytes | None  # None: the file is absent
    owned: tuple[Owned, ...] = ()  # sorted, disjoint
    mode: int | None = None  # set for files a member creates

    @property
    def lines(self) -> list[bytes] | None:
        return None if self.data is None else split_lines(self.data)


@dataclass
class MemberResult:
    member: Member
    offsets: list[HunkOffset] = field(default_factory=list)
    overlaps: list[Overlap] = field(default_factory=list)
    staged: dict[str, FileState] = field(default_factory=dict)

    def report(self) -> list[str]:
        """What the apply command tells of this member."""
        name = self.member.name
        lines = [f"{name}: {o.path} hunk {o.hunk.number} applied with offset {o.offset:+d} lines" for o in self.offsets]
        return [*lines, f"applied {name}"]


@dataclass(frozen=True)
class FileChange:
    path: str
    before_sha256: str | None  # None: the tree has no such file
    after: bytes | None  # None: deleted
    mode: int | None
    members: tuple[str, ...]

    @cached_property
    def after_sha256(self) -> str | None:
        return sha256(self.after)


@dataclass(frozen=True)
class OverlaySet:
    members: tuple[Member, ...]
    changes: tuple[FileChange, ...]
    results: tuple[MemberResult, ...]

    def by_path(self) -> dict[str, FileChange]:
        return {c.path: c for c in self.changes}


class Workspace:
    """The touched files of a tree, as earlier members left them."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        # the base file's sha256 (None: absent); its bytes are not kept once a member replaced them
        self.base_sha256: dict[str, str | None] = {}
        self.files: dict[str, FileState] = {}
        self.touched_by: dict[str, list[str]] = {}

    def state(self, path: str) -> FileState:
        if path not in self.files:
            data = self.tree.read(path)
            self.base_sha256[path] = None if data is None else self.tree.recorded_sha256(path) or sha256(data)
            self.files[path] = FileState(data)
        return self.files[path]

    def check_paths(self, member: Member) -> None:
        for fp in member.files:
            why = self.tree.check_writable(fp.path)
            if why:
                raise InputError(
                    f"writing through a symlink that leaves the tree ({why})",
                    file=member.path,
                    member=member.name,
                    path=fp.path,
                )

    def try_member(self, member: Member) -> MemberResult:
        """Apply ``member`` to copies of the current state; raise HunkFailure (or the tree's
        InputError), commit nothing."""
        self.check_paths(member)
        result = MemberResult(member)
        for fp in member.files:
            result.staged[fp.path] = _apply_file(fp, self.state(fp.path), member.name, result)
        return result

    def commit(self, result: MemberResult) -> None:
        for path, state in result.staged.items():
            self.files[path] = state
            self.touched_by.setdefault(path, []).append(result.member.name)

    def changes(self) -> tuple[FileChange, ...]:
        out = []
        for path, names in self.touched_by.items():
            state = self.files[path]
            out.append(FileChange(path, self.base_sha256[path], state.data, state.mode, tuple(names)))
        return tuple(out)


def apply_members(tree: Tree, members: list[Member] | tuple[Member, ...]) -> OverlaySet:
    """Every member in order, or an InputError naming the member, file and hunk that failed."""
    work = Workspace(tree)
    results = []
    for member in members:
        try:
            result = work.try_member(member)
        except InputError as exc:  # a hunk that does not apply, or the tree's own (a corrupt entry)
            raise exc.located(file=member.path, member=member.name) from None
        work.commit(result)
        results.append(result)
    return OverlaySet(tuple(members), work.changes(), tuple(results))


def _apply_file(fp: FilePatch, state: FileState, member: str, result: MemberResult) -> FileState:
    path = fp.path
    if fp.old_path is None and state.data is not None:
        raise HunkFailure(path, None, "a new file, but the tree already has it")
    if fp.old_path is not None and state.data is None:
        raise HunkFailure(path, None, "the tree has no such file")
    data = state.data or b""
    owned = state.owned
    # The patched file is built up as pieces: everything before ``cursor`` in ``data`` has
    # become ``pieces``.  A hunk found right at its line after the hunk before it (the usual
    # case) needs no copy of the file; any other search first joins the pieces into ``data``.
    pieces: list[bytes | memoryview] = []
    cursor = 0
    known = (0, 0)  # a line start, as (line in the patched file, byte offset in data)
    for hunk in fp.hunks:
        anchor = max(hunk.new_start - 1, 0)
        found = _right_after(data, hunk, anchor, known) if pieces and known[1] == cursor else None
        if found is None:
            if pieces:
                offset = sum(map(len, pieces)) - cursor
                data = b"".join((*pieces, memoryview(data)[cursor:]))
                known = (known[0], known[1] + offset) if known[1] >= cursor else (0, 0)
                pieces, cursor = [], 0
            found = find_hunk(data, hunk, anchor, known)
        if found is None:
            raise HunkFailure(path, hunk, _mismatch(split_lines(data), hunk.old_lines, anchor), at=anchor)
        line, start = found
        if line != anchor:
            result.offsets.append(HunkOffset(path, hunk, line - anchor))
        owned, earlier = _reown(owned, line, hunk, member)
        if earlier:
            result.overlaps.append(Overlap(path, hunk, earlier))
        pieces += (memoryview(data)[cursor:start], hunk.new_block)
        cursor = start + len(hunk.old_block)
        # the byte after the new lines starts a line, unless they end without a newline
        known = (line + hunk.new_len, cursor) if not hunk.new_block or hunk.new_block.endswith(b"\n") else (0, -1)
    if pieces:
        data = b"".join((*pieces, memoryview(data)[cursor:]))
    if fp.new_path is None:
        if data:
            raise HunkFailure(path, None, f"a deletion, but {len(split_lines(data))} lines would remain")
        return FileState(None)
    mode = int(fp.new_mode, 8) & 0o777 if fp.new_mode else state.mode
    return FileState(data, owned, mode)


def _right_after(data: bytes, hunk: Hunk, anchor: int, known: tuple[int, int]) -> tuple[int, int] | None:
    """The hunk's match exactly at ``anchor``, looked for only after ``known`` (the end of the
    hunk before it); None when it is not there, or when the hunk is one that must be placed
    at the start or the end of the file: then the whole file is searched."""
    old = hunk.old_block
    if not hunk.old_fits_a_file or any(_pinned(hunk)):
        return None
    line, at = known
    pos = data.find(old, at)
    while pos > at and data[pos - 1] != 10:
        pos = data.find(old, pos + 1)
    if pos >= 0 and line + data.count(b"\n", at, pos) == anchor:
        return anchor, pos  # distance 0: nothing can be nearer
    return None


def _pinned(hunk: Hunk) -> tuple[bool, bool]:
    """(must match at the start of the file, must match at its end), as git apply rules: a hunk
    at line 1, and one without trailing context or whose last line has no newline."""
    old = hunk.old_block
    return hunk.old_start <= 1, hunk.trailing_context == 0 or (bool(old) and not old.endswith(b"\n"))


def find_hunk(data: bytes, hunk: Hunk, anchor: int, known: tuple[int, int] = (0, 0)) -> tuple[int, int] | None:
    """(line, byte offset) where the hunk's old lines match exactly, or None.

    The place git apply picks: the match nearest to ``anchor`` (0-based line),
    forward first on a tie.  Only a line boundary counts as a start, and a last
    line without a newline can only be the file's last line.  ``known`` is a
    line start whose line number is known, so counting can start there.
    """
    old = hunk.old_block
    if not hunk.old_fits_a_file:
        return None
    match_beginning, match_end = _pinned(hunk)
    if match_beginning:
        fits = data == old if match_end else data.startswith(old) and (old.endswith(b"\n") or len(old) == len(data))
        return (0, 0) if fits else None
    if match_end:
        start = len(data) - len(old)
        if not data.endswith(old) or (start and old and data[start - 1] != 10):
            return None
        line, counted = known if known[1] <= start else (0, 0)
        return line + data.count(b"\n", counted, start) + (not old and not data.endswith(b"\n") and bool(data)), start
    # every match is line-aligned and ends with a newline: walk them in order, counting lines
    line = counted = 0
    behind: tuple[int, int] | None = None  # the last match before the anchor
    pos = data.find(old)
    while pos >= 0:
        if pos == 0 or data[pos - 1] == 10:
            if counted < known[1] <= pos:
                line, counted = known
            line += data.count(b"\n", counted, pos)
            counted = pos
            if line >= anchor:
                if behind is None or line - anchor <= anchor - behind[0]:
                    return line, pos
                return behind
            behind = (line, pos)
        pos = data.find(old, pos + 1)
    return behind


def _reown(owned: tuple[Owned, ...], line: int, hunk: Hunk, member: str) -> tuple[tuple[Owned, ...], tuple[str, ...]]:
    """The runs of member-written lines once ``hunk`` has replaced its old lines at ``line``,
    and the earlier members whose lines it read (context it kept or lines it removed)."""
    end = line + hunk.old_len
    shift = hunk.new_len - hunk.old_len
    before: list[Owned] = []
    after: list[Owned] = []
    inside: list[Owned] = []  # the parts of runs within the replaced lines
    for first, stop, who in owned:
        if first < line:
            before.append((first, min(stop, line), who))
        if stop > end:
            after.append((max(first, end) + shift, stop + shift, who))
        if first < end and stop > line:
            inside.append((max(first, line), min(stop, end), who))

    if not inside:  # it reads no member's lines: only its own added lines are new runs
        return (*before, *((line + first, line + stop, member) for first, stop in hunk.added_runs), *after), ()

    def owner(at: int) -> str | None:
        return next((who for first, stop, who in inside if first <= at < stop), None)

    earlier = {who for _, _, who in inside if who != member}
    region: list[Owned] = []
    old_at = new_at = line
    for kind, _ in hunk.lines:
        if kind == "-":
            old_at += 1
            continue
        who = member if kind == "+" else owner(old_at)
        if kind == " ":
            old_at += 1
        if who is not None:
            if region and region[-1][1] == new_at and region[-1][2] == who:
                region[-1] = (region[-1][0], new_at + 1, who)
            else:
                region.append((new_at, new_at + 1, who))
        new_at += 1
    return (*before, *region, *after), tuple(sorted(earlier))


def nearest_partial_match(lines: list[bytes], old: list[bytes], anchor: int) -> tuple[int, int] | None:
    """(position, lines equal) of the place that matches most of ``old``, nearest ``anchor`` on ties."""
    n = len(old)
    best: tuple[int, int, int] | None = None  # (-equal, distance, pos)
    for pos in range(0, max(len(lines) - n, 0) + 1):
        equal = sum(1 for a, b in zip(lines[pos : pos + n], old, strict=False) if a == b)
        if equal == 0:
            continue
        key = (-equal, abs(pos - anchor), pos)
        if best is None or key < best:
            best = key
    return None if best is None else (best[2], -best[0])


def _mismatch(lines: list[bytes], old: list[bytes], anchor: int) -> str:
    """One line: the first expected line that differs from what the tree has at the hunk's place."""
    have = lines[anchor : anchor + len(old)]
    for i, want in enumerate(old):
        got = have[i] if i < len(have) else None
        if got != want:
            found = "end of file" if got is None else repr(got.decode("utf-8", "replace"))
            return (
                f"does not apply at line {anchor + i + 1}: expected {want.decode('utf-8', 'replace')!r}, found {found}"
            )
    return (
        f"does not apply at line {anchor + 1}: its context is there but not at the start or end of the file"
        " as the hunk requires"
    )
