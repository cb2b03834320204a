"""Line-by-line three-way merge, and a unified diff writer, for carrying members to a new pin.

``git merge-file`` calls two changes a conflict when they touch (upstream changed
the line right after the member's own).  Here edits conflict only when they share
base lines (or insert at the same place, or one inserts inside the other's
range); edits that only touch are both carried, and each such member edit is
reported for review.  An edit both sides made identically is taken once.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

Lines = list[bytes]


@dataclass(frozen=True)
class Edit:
    start: int  # base lines [start, end) are replaced by ``lines``
    end: int
    lines: tuple[bytes, ...]


@dataclass(frozen=True)
class Review:
    line: int  # 1-based line of the merged file where the member's edit lands
    text: tuple[str, ...]  # the member's lines there
    upstream_line: int  # 1-based base line upstream changed next to it
    upstream_text: tuple[str, ...]  # what upstream made of it


@dataclass(frozen=True)
class Conflict:
    base_line: int  # 1-based first base line of the region
    text: str  # diff3-style conflict text


@dataclass
class Merged:
    lines: Lines
    conflicts: list[Conflict] = field(default_factory=list)
    reviews: list[Review] = field(default_factory=list)
    same: int = 0  # member edits upstream made identically

    @property
    def clean(self) -> bool:
        return not self.conflicts


def edits(base: Lines, other: Lines) -> list[Edit]:
    matcher = difflib.SequenceMatcher(None, base, other, autojunk=False)
    return [Edit(i1, i2, tuple(other[j1:j2])) for op, i1, i2, j1, j2 in matcher.get_opcodes() if op != "equal"]


def _overlap(a: Edit, b: Edit) -> bool:
    if a.start < a.end and b.start < b.end:
        return a.start < b.end and b.start < a.end
    if a.start == a.end and b.start == b.end:
        return a.start == b.start
    insert, other = (a, b) if a.start == a.end else (b, a)
    return other.start < insert.start < other.end


def _touch(a: Edit, b: Edit) -> bool:
    return a.end == b.start or b.end == a.start


def _apply(base: Lines, start: int, end: int, side: list[Edit]) -> Lines:
    out: Lines = []
    at = start
    for e in side:
        out.extend(base[at : e.start])
        out.extend(e.lines)
        at = e.end
    out.extend(base[at:end])
    return out


def _text(lines: Lines) -> str:
    text = "".join(line.decode("utf-8", "replace") for line in lines)
    return text if not text or text.endswith("\n") else text + "\n"


def merge(base: Lines, ours: Lines, theirs: Lines) -> Merged:
    """Merge ``ours`` (the member on the old pin) and ``theirs`` (the new pin), both from ``base``."""
    mine, up = edits(base, ours), edits(base, theirs)
    # groups: connected components of overlapping edits, in base order
    tagged = sorted([(e.start, e.end, 0, e) for e in mine] + [(e.start, e.end, 1, e) for e in up], key=lambda t: t[:3])
    groups: list[list[tuple[int, Edit]]] = []
    for _, _, side, e in tagged:
        if groups and any(_overlap(e, other) for _, other in groups[-1]):
            groups[-1].append((side, e))
        else:
            groups.append([(side, e)])
    merged = Merged([])
    at = 0
    for group in groups:
        start = min(e.start for _, e in group)
        end = max(e.end for _, e in group)
        merged.lines.extend(base[at:start])
        ours_part = _apply(base, start, end, [e for s, e in group if s == 0])
        theirs_part = _apply(base, start, end, [e for s, e in group if s == 1])
        sides = {s for s, _ in group}
        if sides == {0}:
            for e in (e for _, e in group):
                near = [u for u in up if _touch(e, u)]
                if near:
                    first = min(near, key=lambda u: u.start)
                    merged.reviews.append(
                        Review(
                            len(merged.lines) + 1 + (e.start - start),
                            tuple(_text(list(e.lines)).splitlines()),
                            first.start + 1,
                            tuple(_text(list(first.lines)).splitlines()),
                        )
                    )
            merged.lines.extend(ours_part)
        elif sides == {1}:
            merged.lines.extend(theirs_part)
        elif ours_part == theirs_part:
            merged.same += sum(1 for s, _ in group if s == 0)
            merged.lines.extend(theirs_part)
        else:
            text = (
                "<<<<<<< member (old pin + member)\n"
                + _text(ours_part)
                + "||||||| base (old pin)\n"
                + _text(base[start:end])
                + "=======\n"
                + _text(theirs_part)
                + ">>>>>>> new pin\n"
            )
            merged.conflicts.append(Conflict(start + 1, text))
            merged.lines.extend(theirs_part)
        at = end
    merged.lines.extend(base[at:])
    return merged


def unified_hunks(old: Lines, new: Lines, context: int = 3) -> list[bytes]:
    """The hunks of the diff from ``old`` to ``new`` as git writes them (header counts always
    given, ``\\ No newline at end of file`` after a last line without one)."""
    out = []
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for group in matcher.get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        old_len, new_len = i2 - i1, j2 - j1
        header = f"@@ -{i1 + (old_len > 0)},{old_len} +{j1 + (new_len > 0)},{new_len} @@".encode()
        header += _section(old, i1) + b"\n"
        body = [header]
        for op, a1, a2, b1, b2 in group:
            if op == "equal":
                body.extend(_line(b" ", x) for x in old[a1:a2])
                continue
            body.extend(_line(b"-", x) for x in old[a1:a2])
            body.extend(_line(b"+", x) for x in new[b1:b2])
        out.append(b"".join(body))
    return out


def _section(old: Lines, start: int) -> bytes:
    """git's default hunk section text: the nearest line above the hunk that starts with a
    letter, ``_`` or ``$`` (e.g. the enclosing class), cut at 80 bytes."""
    for line in reversed(old[max(start - 1000, 0) : start]):
        if line[:1].isalpha() or line[:1] in (b"_", b"$"):
            return b" " + line.rstrip(b"\r\n")[:80].rstrip()
    return b""


def _line(kind: bytes, text: bytes) -> bytes:
    return kind + text if text.endswith(b"\n") else kind + text + b"\n\\ No newline at end of file\n"
