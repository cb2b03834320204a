"""Apply: members in order onto a base tree, fuzz 0, all-or-nothing, into an overlay set.

Hunks are placed as ``git apply`` places them: searched outward from the
line the hunk names (forward first), every context and removed line equal
byte for byte; a hunk at line 1 must match at the start and a hunk without
trailing context at the end of the file.  A found offset is allowed and
reported.  Work happens on an in-memory copy of the touched files only, so a
failure leaves nothing behind.

Files are kept as bytes, not split into lines: a hunk's old lines are one
byte string, found with ``bytes.find`` at a line boundary and numbered by
counting newlines, so applying costs little more than reading the file.  The
hunks of a file patch work on the file in parts around where the hunk before
ended (``_Image``): a hunk's line is reached by counting newlines from there,
its search widens outward from that line only until the nearest match is
certain, and the parts are joined once, after the last hunk; the runs of lines
earlier members wrote are kept split at the same place (``_Runs``).  So placing
costs the file's size, the hunks' size and the distances searched: linear in
the number of hunks, not quadratic.
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
    image = _Image(state.data or b"")
    runs = _Runs(state.owned)
    for hunk in fp.hunks:
        anchor = max(hunk.new_start - 1, 0)
        found = _place(image, hunk, anchor)
        if found is None:
            lines = split_lines(image.joined())
            raise HunkFailure(path, hunk, _mismatch(lines, hunk.old_lines, anchor), at=anchor)
        line, start = found
        if line != anchor:
            result.offsets.append(HunkOffset(path, hunk, line - anchor))
        earlier = runs.replace(line, hunk, member)
        if earlier:
            result.overlaps.append(Overlap(path, hunk, earlier))
        image.replace(start, len(hunk.old_block), hunk.new_block, line)
    data = image.joined()
    if fp.new_path is None:
        if data:
            raise HunkFailure(path, None, f"a deletion, but {len(split_lines(data))} lines would remain")
        return FileState(None)
    mode = int(fp.new_mode, 8) & 0o777 if fp.new_mode else state.mode
    return FileState(data, runs.owned(), mode)


# The first window a search looks at on each side of the anchor, in bytes, and the bytes a
# line is guessed to take when counting lines to a place (both double from there); tests
# make them tiny so that the windows' edges are crossed on small files.
_WINDOW = 512
_LINE_GUESS = 64


class _Image:
    """A file while a file patch's hunks are applied to it, one after the other.

    The image is ``left`` + ``pend[pat:]`` + ``data[cur:]``: ``left`` is what lies before the
    place the last hunk ended (the gap), ``data`` the file as the hunks found it and ``pend``
    bytes a hunk placed before the gap moved back out of ``left``.  Hunks usually come in file
    order, so moving the gap costs the distance it moves, and nothing is joined until the end.
    Every look-up (a line's start, a match near a line, a position's line) counts newlines
    outward from the gap or the start of the file, at C speed, and copies at most the window
    it searches when that window straddles two parts.
    """

    __slots__ = ("left", "lines", "phantom", "pend", "pat", "data", "cur", "size")

    def __init__(self, data: bytes) -> None:
        self.left = bytearray()
        self.lines = 0  # newlines in left
        # Lines numbered at and past the gap beyond its newlines.  git numbers the lines of its
        # image, and keeps a last line without newline a line of its own when lines are inserted
        # after it (a hunk without old lines, pinned to the end): the lines after it are
        # numbered one more than the newlines before them.  Only then is this not 0, with the
        # gap at the end; it lasts while hunks land there, and a hunk placed before it or whose
        # new lines end without newline ends it, as apply did before it worked in parts.
        self.phantom = 0
        self.pend = b""
        self.pat = 0
        self.data = data
        self.cur = 0
        self.size = len(data)

    def joined(self) -> bytes:
        return b"".join((self.left, memoryview(self.pend)[self.pat :], memoryview(self.data)[self.cur :]))

    def _parts(self, lo: int, hi: int) -> list[tuple[bytes | bytearray, int, int, int]]:
        """(buffer, start, end, image position of start) for the parts of image[lo:hi], in order."""
        out: list[tuple[bytes | bytearray, int, int, int]] = []
        gap = len(self.left)
        if lo < gap:
            out.append((self.left, lo, min(hi, gap), lo))
        tail = gap + len(self.pend) - self.pat  # where data[cur:] begins in the image
        if lo < tail and hi > gap:
            at = max(lo, gap)
            out.append((self.pend, at - gap + self.pat, min(hi, tail) - gap + self.pat, at))
        if hi > tail:
            at = max(lo, tail)
            out.append((self.data, at - tail + self.cur, hi - tail + self.cur, at))
        return out

    def view(self, lo: int, hi: int) -> tuple[bytes | bytearray, int]:
        """(buffer, shift): buffer[i + shift] is image[i] for lo <= i < hi; a copy only when the
        range straddles two parts."""
        parts = self._parts(lo, hi)
        if len(parts) == 1:
            buf, start, _, at = parts[0]
            return buf, start - at
        return b"".join(buf[start:end] for buf, start, end, _ in parts), -lo

    def count(self, lo: int, hi: int) -> int:
        """Newlines in image[lo:hi]."""
        return sum(buf.count(b"\n", start, end) for buf, start, end, _ in self._parts(lo, hi))

    def byte(self, pos: int) -> int:
        buf, shift = self.view(pos, pos + 1)
        return buf[pos + shift]

    def equals(self, pos: int, old: bytes) -> bool:
        """image[pos:pos + len(old)] == old"""
        if pos + len(old) > self.size:
            return False
        buf, shift = self.view(pos, pos + len(old))
        return buf.startswith(old, pos + shift)

    def line_at(self, pos: int) -> int:
        """The line ``pos`` starts, when it starts one: the newlines before it (and ``phantom``
        at or past the gap)."""
        gap = len(self.left)
        if pos >= gap:
            return self.lines + self.phantom + self.count(gap, pos)
        return self.lines - self.count(pos, gap)

    def _newline_after(self, pos: int) -> int:
        for buf, start, end, at in self._parts(pos, self.size):
            found = buf.find(b"\n", start, end)
            if found >= 0:
                return found - start + at
        return -1

    def _newline_before(self, pos: int) -> int:
        for buf, start, end, at in reversed(self._parts(0, pos)):
            found = buf.rfind(b"\n", start, end)
            if found >= 0:
                return found - start + at
        return -1

    def _nth_newline(self, pos: int, k: int) -> int:
        """The k-th newline (k >= 1) at or after ``pos``; -1 if there are fewer.  Galloping
        counts find the stretch that holds it, halving narrows it down: the cost is that of
        the distance, at C speed."""
        lo, step = pos, max(_LINE_GUESS * k, 1)
        while True:
            hi = min(lo + step, self.size)
            seen = self.count(lo, hi)
            if seen >= k:
                break
            if hi == self.size:
                return -1
            k, lo, step = k - seen, hi, step * 2
        while k > 8:  # the k-th newline from lo is in [lo, hi)
            mid = (lo + hi) // 2
            seen = self.count(lo, mid)
            if seen >= k:
                hi = mid
            else:
                k, lo = k - seen, mid
        while True:
            found = self._newline_after(lo)
            k -= 1
            if k == 0:
                return found
            lo = found + 1

    def _nth_newline_before(self, pos: int, k: int) -> int:
        """The k-th newline (k >= 1) before ``pos``, going backward; -1 if there are fewer."""
        hi, step = pos, max(_LINE_GUESS * k, 1)
        while True:
            lo = max(hi - step, 0)
            seen = self.count(lo, hi)
            if seen >= k:
                break
            if lo == 0:
                return -1
            k, hi, step = k - seen, lo, step * 2
        while k > 8:  # the k-th newline before hi is in [lo, hi)
            mid = (lo + hi) // 2
            seen = self.count(mid, hi)
            if seen >= k:
                lo = mid
            else:
                k, hi = k - seen, mid
        while True:
            found = self._newline_before(hi)
            k -= 1
            if k == 0:
                return found
            hi = found

    def line_start(self, line: int) -> int | None:
        """Where ``line`` starts (after the file's line-th newline); None if the file has fewer."""
        if line == 0:
            return 0
        if line > self.lines + self.phantom:
            found = self._nth_newline(len(self.left), line - self.lines - self.phantom)
            return None if found < 0 else found + 1
        if line > self.lines:
            return None  # a number only the lines at the gap, the end, have (see phantom)
        if line < self.lines - line:
            return self._nth_newline(0, line) + 1
        return self._nth_newline_before(len(self.left), self.lines - line + 1) + 1

    def _at_or_after(self, pos: int) -> int:
        """The first line start at or after ``pos`` (the file's size if none)."""
        if pos >= self.size:
            return self.size
        if pos <= 0 or self.byte(pos - 1) == 10:
            return max(pos, 0)
        found = self._newline_after(pos)
        return self.size if found < 0 else found + 1

    def _at_or_before(self, pos: int) -> int:
        return 0 if pos <= 0 else self._newline_before(pos) + 1

    def first_match(self, old: bytes, lo: int, hi: int) -> int:
        """The first start in [lo, hi), at a line boundary, where ``old`` occurs; -1 if none."""
        end = min(hi - 1 + len(old), self.size)
        if end - lo < len(old):
            return -1
        buf, shift = self.view(max(lo - 1, 0), end)
        found = buf.find(old, lo + shift, end + shift)
        while found >= 0 and found != shift and buf[found - 1] != 10:
            found = buf.find(old, found + 1, end + shift)
        return found if found < 0 else found - shift

    def last_match(self, old: bytes, lo: int, hi: int) -> int:
        """The last start in [lo, hi), at a line boundary, where ``old`` occurs; -1 if none."""
        end = min(hi - 1 + len(old), self.size)
        if end - lo < len(old):
            return -1
        buf, shift = self.view(max(lo - 1, 0), end)
        found = buf.rfind(old, lo + shift, end + shift)
        while found >= 0 and found != shift and buf[found - 1] != 10:
            found = buf.rfind(old, lo + shift, found - 1 + len(old))
        return found if found < 0 else found - shift

    def nearest(self, old: bytes, anchor: int, start: int | None) -> tuple[int, int] | None:
        """(line, position) of the match of ``old`` nearest to line ``anchor`` (which starts at
        ``start``; None: past the end), forward first on a tie.  Windows on either side grow
        by doubling until one side's nearest match is known to beat anything the other side
        could still hold: the cost is that of the distance searched."""
        size = self.size
        ahead = behind = size if start is None else start  # searched: starts in [behind, ahead)
        lines_ahead = lines_behind = 0  # whole lines searched on each side
        forward: tuple[int, int] | None = None  # (distance in lines, position)
        backward: tuple[int, int] | None = None
        step = max(_WINDOW, len(old))
        while True:
            more_ahead = forward is None and ahead < size and (backward is None or lines_ahead <= backward[0])
            more_behind = backward is None and behind > 0 and (forward is None or lines_behind < forward[0] - 1)
            if not (more_ahead or more_behind):
                break
            if more_ahead:
                edge = self._at_or_after(ahead + step)
                found = self.first_match(old, ahead, edge)
                if found >= 0:
                    forward = (self.count(ahead, found) + lines_ahead, found)
                lines_ahead += self.count(ahead, edge)
                ahead = edge
            if more_behind:
                edge = self._at_or_before(behind - step)
                found = self.last_match(old, edge, behind)
                if found >= 0:
                    backward = (self.count(found, behind) + lines_behind, found)
                lines_behind += self.count(edge, behind)
                behind = edge
            step *= 2
        if forward is not None and (backward is None or forward[0] <= backward[0]):
            return anchor + forward[0], forward[1]
        if backward is None:
            return None
        return (anchor - backward[0] if start is not None else self.line_at(backward[1])), backward[1]

    def next_match_at(self, old: bytes, line: int) -> int:
        """Where ``old`` matches at ``line``, when its first match after the gap is there, or -1.
        The usual case, in two searches: the first match is looked for only as far as ``line``
        would lie if lines were 4 times longer than the file's lines so far and ``old``'s (or 64
        bytes), so that a miss costs in proportion to the lines to ``line`` too."""
        ahead = line - self.lines - self.phantom
        left, data, cur = self.left, self.data, self.cur
        if ahead < 0 or self.pat < len(self.pend):
            return -1
        per_line = max(64, len(old) // old.count(b"\n"), len(left) // max(self.lines, 1))
        end = min(cur + (ahead + 1) * 4 * per_line + len(old), len(data))
        found = data.find(old, cur, end)
        while found >= 0 and (data[found - 1] != 10 if found > cur else left and left[-1] != 10):
            found = data.find(old, found + 1, end)
        if found < 0 or data.count(b"\n", cur, found) != ahead:
            return -1
        return len(left) + found - cur

    def replace(self, start: int, length: int, new: bytes, line: int) -> None:
        """image[start:start + length] = new, the gap moved to start (usually forward); ``line``
        is the line the hunk was placed at, so the newlines before start need no counting."""
        gap = len(self.left)
        # its line is the newlines before it, but past the gap and after a last line without one
        newlines = (
            line - (self.phantom if start >= gap else 0) - (not length and start > 0 and self.byte(start - 1) != 10)
        )
        self.phantom = line - newlines if not new or new.endswith(b"\n") else 0
        if start < gap:  # placed before the last hunk's end: the bytes after it go back out of left
            self.pend, self.pat = b"".join((self.left[start:], memoryview(self.pend)[self.pat :])), 0
            del self.left[start:]
            gap = start
        keep, skip = start - gap, length  # bytes after the gap: kept up to start, then the old lines
        if self.pend:
            take = min(keep, len(self.pend) - self.pat)
            if take:
                self.left += memoryview(self.pend)[self.pat : self.pat + take]
            drop = min(skip, len(self.pend) - self.pat - take)
            self.pat += take + drop
            keep, skip = keep - take, skip - drop
            if self.pat == len(self.pend):
                self.pend, self.pat = b"", 0
        if keep:
            self.left += memoryview(self.data)[self.cur : self.cur + keep]
        self.cur += keep + skip
        self.left += new
        self.lines = newlines + new.count(b"\n")
        self.size += len(new) - length


def _pinned(hunk: Hunk) -> tuple[bool, bool]:
    """(must match at the start of the file, must match at its end), as git apply rules: a hunk
    at line 1, and one without trailing context or whose last line has no newline."""
    old = hunk.old_block
    return hunk.old_start <= 1, hunk.trailing_context == 0 or (bool(old) and not old.endswith(b"\n"))


def _place(image: _Image, hunk: Hunk, anchor: int) -> tuple[int, int] | None:
    """(line, byte offset) where the hunk's old lines match exactly in ``image``, or None.

    The place git apply picks: the match nearest to ``anchor`` (0-based line),
    forward first on a tie.  Only a line boundary counts as a start, and a last
    line without a newline can only be the file's last line.
    """
    old = hunk.old_block
    if not hunk.old_fits_a_file:
        return None
    size = image.size
    match_beginning, match_end = _pinned(hunk)
    if match_beginning:
        fits = image.equals(0, old) and (size == len(old) if match_end else old.endswith(b"\n") or len(old) == size)
        return (0, 0) if fits else None
    if match_end:
        start = size - len(old)
        if start < 0 or not image.equals(start, old) or (start and old and image.byte(start - 1) != 10):
            return None
        return image.line_at(start) + (not old and bool(size) and image.byte(size - 1) != 10), start
    # every match is line-aligned and ends with a newline: the nearest one to the anchor's line
    start = image.next_match_at(old, anchor)
    if start >= 0:
        return anchor, start  # distance 0: nothing can be nearer (the usual case)
    start = image.line_start(anchor)
    if start is not None and image.equals(start, old):
        return anchor, start
    return image.nearest(old, anchor, start)


def find_hunk(data: bytes, hunk: Hunk, anchor: int) -> tuple[int, int] | None:
    """(line, byte offset) where the hunk's old lines match in ``data``, as apply places it."""
    return _place(_Image(data), hunk, anchor)


class _Runs:
    """The runs of member-written lines of a file while a file patch's hunks are applied.

    ``low`` holds the runs before the last replaced place, in the file's current line numbers;
    ``high`` the runs after it, nearest last, each stored minus ``shift`` (the lines the hunks
    so far added, net): a hunk moves only the runs between it and the hunk before, so hunks in file
    order cost their own size, however many runs the file has.
    """

    def __init__(self, owned: tuple[Owned, ...]) -> None:
        self.low: list[Owned] = []
        self.high: list[Owned] = list(reversed(owned))
        self.shift = 0

    def owned(self) -> tuple[Owned, ...]:
        shift = self.shift
        return (*self.low, *((first + shift, stop + shift, who) for first, stop, who in reversed(self.high)))

    def replace(self, line: int, hunk: Hunk, member: str) -> tuple[str, ...]:
        """Record ``hunk`` replacing its old lines at ``line``; the earlier members whose lines
        it read (context it kept or lines it removed)."""
        low, high, shift = self.low, self.high, self.shift
        while low and low[-1][1] > line:
            first, stop, who = low.pop()
            high.append((first - shift, stop - shift, who))
        while high and high[-1][1] + shift <= line:
            first, stop, who = high.pop()
            low.append((first + shift, stop + shift, who))
        end = line + hunk.old_len
        moved = hunk.new_len - hunk.old_len
        inside: list[Owned] = []  # the parts of runs within the replaced lines
        after: Owned | None = None  # the part past the replaced lines of the last run read, if any
        while high and high[-1][0] + shift < end:
            first, stop, who = high.pop()
            first, stop = first + shift, stop + shift
            if first < line:
                low.append((first, line, who))
            inside.append((max(first, line), min(stop, end), who))
            if stop > end:
                after = (max(first, end) + moved, stop + moved, who)
        self.shift = shift = shift + moved
        if after is not None:
            high.append((after[0] - shift, after[1] - shift, after[2]))
        if not inside:  # it reads no member's lines: only its own added lines are new runs
            for first, stop in hunk.added_runs:
                low.append((line + first, line + stop, member))
            return ()
        at = 0  # the first run of inside that may hold the old line looked up

        def owner(old_line: int) -> str | None:
            nonlocal at
            while at < len(inside) and inside[at][1] <= old_line:
                at += 1
            return inside[at][2] if at < len(inside) and inside[at][0] <= old_line else None

        old_at = new_at = line
        for kind, _ in hunk.lines:
            if kind == "-":
                old_at += 1
                continue
            who = member if kind == "+" else owner(old_at)
            if kind == " ":
                old_at += 1
            if who is not None:
                if low and low[-1][1] == new_at and low[-1][2] == who and low[-1][0] >= line:
                    low[-1] = (low[-1][0], new_at + 1, who)
                else:
                    low.append((new_at, new_at + 1, who))
            new_at += 1
        return tuple(sorted({who for _, _, who in inside if who != member}))


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
