"""Apply: members in order onto a base tree, fuzz 0, all-or-nothing, into an overlay set.

Hunks are placed as ``git apply`` places them: searched outward from the
line the hunk names (forward first), every context and removed line equal
byte for byte; a hunk at line 1 must match at the start and a hunk without
trailing context at the end of the file.  A found offset is allowed and
reported.  Work happens on an in-memory copy of the touched files only, so a
failure leaves nothing behind.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

from builder.errors import InputError
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


@dataclass
class FileState:
    lines: list[bytes] | None  # None: the file is absent
    owners: list[str | None]  # per line, the member that wrote it (None: the base tree)
    mode: int | None = None  # set for files a member creates


@dataclass
class MemberResult:
    member: Member
    offsets: list[HunkOffset] = field(default_factory=list)
    overlaps: list[Overlap] = field(default_factory=list)
    staged: dict[str, FileState] = field(default_factory=dict)


class HunkFailure(Exception):
    """A file patch does not apply; carries what a conflict report needs."""

    def __init__(self, path: str, hunk: Hunk | None, reason: str, at: int = 0) -> None:
        super().__init__(reason)
        self.path, self.hunk, self.reason, self.at = path, hunk, reason, at

    def describe(self) -> str:
        where = f"hunk {self.hunk.number} ({self.hunk.header})" if self.hunk else "file"
        return f"{self.path}: {where}: {self.reason}"


@dataclass(frozen=True)
class FileChange:
    path: str
    before: bytes | None
    after: bytes | None
    mode: int | None
    members: tuple[str, ...]

    @cached_property
    def before_sha256(self) -> str | None:
        return sha256(self.before)

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
        self.base: dict[str, bytes | None] = {}
        self.files: dict[str, FileState] = {}
        self.touched_by: dict[str, list[str]] = {}

    def state(self, path: str) -> FileState:
        if path not in self.files:
            data = self.tree.read(path)
            self.base[path] = data
            lines = None if data is None else split_lines(data)
            self.files[path] = FileState(lines, [None] * len(lines or ()))
        return self.files[path]

    def check_paths(self, member: Member) -> None:
        for fp in member.files:
            why = self.tree.check_writable(fp.path)
            if why:
                raise InputError(f"{member.path}: member {member.name}: {fp.path}: writing through a symlink that leaves the tree ({why})")

    def try_member(self, member: Member) -> MemberResult:
        """Apply ``member`` to copies of the current state; raise HunkFailure, commit nothing."""
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
            after = None if state.lines is None else b"".join(state.lines)
            out.append(FileChange(path, self.base[path], after, state.mode, tuple(names)))
        return tuple(out)


def apply_members(tree: Tree, members: list[Member] | tuple[Member, ...]) -> OverlaySet:
    """Every member in order, or an InputError naming the member, file and hunk that failed."""
    work = Workspace(tree)
    results = []
    for member in members:
        try:
            result = work.try_member(member)
        except HunkFailure as failure:
            raise InputError(f"{member.path}: member {member.name}: {failure.describe()}") from None
        work.commit(result)
        results.append(result)
    return OverlaySet(tuple(members), work.changes(), tuple(results))


def _apply_file(fp: FilePatch, state: FileState, member: str, result: MemberResult) -> FileState:
    path = fp.path
    if fp.old_path is None and state.lines is not None:
        raise HunkFailure(path, None, "a new file, but the tree already has it")
    if fp.old_path is not None and state.lines is None:
        raise HunkFailure(path, None, "the tree has no such file")
    lines = list(state.lines or ())
    owners = list(state.owners)
    for hunk in fp.hunks:
        old = hunk.old_lines
        anchor = max(hunk.new_start - 1, 0)
        pos = find_hunk(lines, old, anchor, hunk)
        if pos is None:
            raise HunkFailure(path, hunk, _mismatch(lines, old, anchor), at=anchor)
        if pos != anchor:
            result.offsets.append(HunkOffset(path, hunk, pos - anchor))
        consumed = owners[pos : pos + len(old)]
        earlier = sorted({o for o in consumed if o is not None and o != member})
        if earlier:
            result.overlaps.append(Overlap(path, hunk, tuple(earlier)))
        new_owners: list[str | None] = []
        taken = iter(consumed)
        for kind, _ in hunk.lines:
            if kind == " ":
                new_owners.append(next(taken))
            elif kind == "-":
                next(taken)
            else:
                new_owners.append(member)
        lines[pos : pos + len(old)] = hunk.new_lines
        owners[pos : pos + len(old)] = new_owners
    if fp.new_path is None:
        if lines:
            raise HunkFailure(path, None, f"a deletion, but {len(lines)} lines would remain")
        return FileState(None, [], None)
    mode = int(fp.new_mode, 8) & 0o777 if fp.new_mode else state.mode
    return FileState(lines, owners, mode)


def find_hunk(lines: list[bytes], old: list[bytes], anchor: int, hunk: Hunk) -> int | None:
    """Where ``old`` matches exactly: nearest to ``anchor``, forward first, as git apply searches."""
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
    if lines[anchor : anchor + n] == old:
        return anchor
    first = old[0] if old else None
    for distance in range(1, max(anchor, last - anchor) + 1):
        for pos in (anchor + distance, anchor - distance):
            if 0 <= pos <= last and lines[pos] == first and lines[pos : pos + n] == old:
                return pos
    return None


def nearest_partial_match(lines: list[bytes], old: list[bytes], anchor: int) -> tuple[int, int] | None:
    """(position, lines equal) of the place that matches most of ``old``, nearest ``anchor`` on ties."""
    n = len(old)
    best: tuple[int, int, int] | None = None  # (-equal, distance, pos)
    for pos in range(0, max(len(lines) - n, 0) + 1):
        equal = sum(1 for a, b in zip(lines[pos : pos + n], old) if a == b)
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
            return f"does not apply at line {anchor + i + 1}: expected {want.decode('utf-8', 'replace')!r}, found {found}"
    return f"does not apply at line {anchor + 1}: its context is there but not at the start or end of the file as the hunk requires"
