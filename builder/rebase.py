"""Rebase: carry the members from the pinned tree to a newer one, and say per member how.

Members are tried in recipe order on the new tree as the earlier members' new
results left it (``new``), and on the old pinned tree as the old members left it
(``old``, the merge base).  Each reads, in this order of preference:

- applies / applies with offsets: as apply places it (builder.apply), offsets folded in;
- already upstream: its reverse applies, or the new tree already holds every hunk's
  result (the evidence is named); a candidate to retire, left out of a written recipe;
- file moved: the path is gone and another file holds the hunks' context (same file
  name first, then any file with the same suffix); the member is tried there;
- carried by a three-way merge (builder.merge3): the member applied to the old tree,
  merged line by line with the new tree, its diff re-derived; edits that only touch
  an upstream change are carried and listed for review;
- conflict: the failing hunk, its expected lines against the new tree's nearest
  region, and the three-way conflict text.
"""

from __future__ import annotations

import datetime
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from builder.apply import Workspace, find_hunk
from builder.check import conflict_facts
from builder.errors import HunkFailure, InputError
from builder.members import FilePatch, Member, parse_member, split_lines
from builder.merge3 import merge, unified_hunks
from builder.tree import Tree

APPLIES, OFFSETS, MERGED, UPSTREAM, MOVED, CONFLICT = (
    "applies",
    "applies with offsets",
    "carried by a three-way merge",
    "already upstream",
    "file moved",
    "conflict",
)
_LAST_UPDATE_RE = re.compile(rb"^Last-Update:[^\n]*\n", re.MULTILINE)


@dataclass
class MemberRebase:
    name: str
    status: str
    offsets: list[dict[str, Any]] = field(default_factory=list)
    review: list[dict[str, Any]] = field(default_factory=list)  # carried edits next to upstream changes
    evidence: list[str] = field(default_factory=list)  # why it reads already upstream
    moved: list[dict[str, str]] = field(default_factory=list)  # {"from", "to"}
    conflict: dict[str, Any] | None = None
    files: list[dict[str, str]] = field(default_factory=list)  # a merged member: how each file carried
    text: bytes | None = None  # the refreshed member file (None: upstream or conflict)
    member: Member | None = None  # the refreshed member, parsed

    @property
    def written(self) -> bool:
        return self.text is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "member": self.name,
            "status": self.status,
            "offsets": self.offsets,
            "review": self.review,
            "evidence": self.evidence,
            "moved": self.moved,
            "conflict": self.conflict,
            "files": self.files,
        }


def rebase_members(old_tree: Tree, new_tree: Tree, members: tuple[Member, ...], today: str) -> list[MemberRebase]:
    old, new = Workspace(old_tree), Workspace(new_tree)
    out = []
    for member in members:
        try:
            old_result = old.try_member(member)
        except HunkFailure:
            old_result = None
        before = {fp.path: old.state(fp.path).data for fp in member.files}
        ours = None if old_result is None else {p: s.data for p, s in old_result.staged.items()}
        row = _one(member, before, ours, new, new_tree, today)
        if old_result is not None:
            old.commit(old_result)
        if row.member is not None:
            new.commit(new.try_member(row.member))  # later members meet this member's new result
        out.append(row)
    return out


def _one(
    member: Member,
    base: dict[str, bytes | None],
    ours: dict[str, bytes | None] | None,
    new: Workspace,
    new_tree: Tree,
    today: str,
) -> MemberRebase:
    data = member.path.read_bytes()
    header = member_header(data, today)
    try:
        result = new.try_member(member)
    except HunkFailure as failure:
        first_failure = failure
    else:
        offsets = [
            {"file": o.path, "hunk": o.hunk.number, "header": o.hunk.header, "offset": o.offset} for o in result.offsets
        ]
        if not offsets:  # the diff is the same: only the header changes
            text = header + data[len(member_header(data, None)) :]
        else:
            text = header + b"".join(
                file_diff(fp.path, new.state(fp.path).data, result.staged[fp.path].data, fp.new_mode)
                for fp in member.files
            )
        return _row(member, OFFSETS if offsets else APPLIES, text, offsets=offsets)

    evidence = _upstream_evidence(member, new)
    if evidence:
        return MemberRebase(member.name, UPSTREAM, evidence=evidence)

    moved: list[dict[str, str]] = []
    targets: dict[str, str] = {}
    for fp in member.files:
        target = fp.path
        if fp.old_path is not None and new.state(fp.path).data is None:
            found = _moved_to(fp, new_tree, new)
            if found is not None:
                moved.append({"from": fp.path, "to": found})
                target = found
        targets[fp.path] = target
    if moved:  # tried as it is at the new path first (it may simply apply there)
        relocated = _relocated(member, targets)
        try:
            result = new.try_member(relocated)
        except HunkFailure:
            pass
        else:
            offsets = [
                {"file": o.path, "hunk": o.hunk.number, "header": o.hunk.header, "offset": o.offset}
                for o in result.offsets
            ]
            text = header + b"".join(
                file_diff(
                    targets[fp.path],
                    new.state(targets[fp.path]).data,
                    result.staged[targets[fp.path]].data,
                    fp.new_mode,
                )
                for fp in member.files
            )
            return _row(member, MOVED, text, offsets=offsets, moved=moved)

    conflict = conflict_facts(new, first_failure, found_at_nearest=True)
    if ours is None:
        conflict["three_way"] = "the member does not apply to the old pinned tree either: no merge base"
        return MemberRebase(member.name, CONFLICT, moved=moved, conflict=conflict)
    diffs, review, texts, files, same_all = [], [], [], [], True
    for fp in member.files:
        target = targets[fp.path]
        files.append({"file": target, "how": _file_alone(member, fp, target, new)})
        theirs = new.state(target).data
        if base[fp.path] is None or theirs is None or ours[fp.path] is None:
            texts.append(f"{target}: a new file or a deletion meets a tree that disagrees: no line merge")
            continue
        merged = merge(split_lines(base[fp.path]), split_lines(ours[fp.path]), split_lines(theirs))
        texts.extend(f"{target}: from old line {c.base_line}:\n{c.text}" for c in merged.conflicts)
        review.extend(
            {
                "file": target,
                "line": r.line,
                "lines": list(r.text),
                "upstream_changed_line": r.upstream_line,
                "upstream_now": list(r.upstream_text),
            }
            for r in merged.reviews
        )
        result_bytes = b"".join(merged.lines)
        same_all = same_all and result_bytes == theirs
        diffs.append(file_diff(target, theirs, result_bytes, fp.new_mode))
    if texts:
        conflict["three_way"] = "\n".join(texts)
        return MemberRebase(member.name, CONFLICT, moved=moved, conflict=conflict)
    if same_all:
        return MemberRebase(
            member.name,
            UPSTREAM,
            evidence=["a three-way merge with the new tree changes nothing: the new tree already holds its result"],
        )
    return _row(member, MOVED if moved else MERGED, header + b"".join(diffs), review=review, moved=moved, files=files)


def _file_alone(member: Member, fp: FilePatch, target: str, new: Workspace) -> str:
    """How one file of a member that needed a merge fares on its own: for the report."""
    alone = _relocated(member._replace(files=(fp,)), {fp.path: target})
    try:
        result = new.try_member(alone)
    except HunkFailure:
        return "three-way merge"
    shifts = sorted({o.offset for o in result.offsets})
    return "applies" + (f" with offset {', '.join(f'{o:+d}' for o in shifts)} lines" if shifts else "")


def _row(member: Member, status: str, text: bytes, **facts: Any) -> MemberRebase:
    """A member that carries: its refreshed file, parsed (the derived diff is checked here)."""
    parsed = parse_member(member.name, member.path, text)
    return MemberRebase(member.name, status, text=text, member=parsed, **facts)


def _relocated(member: Member, targets: dict[str, str]) -> Member:
    files = tuple(
        FilePatch(
            None if fp.old_path is None else targets[fp.path],
            None if fp.new_path is None else targets[fp.path],
            fp.new_mode,
            fp.hunks,
        )
        for fp in member.files
    )
    return member._replace(files=files)


def _upstream_evidence(member: Member, new: Workspace) -> list[str]:
    """Why the new tree already holds ``member`` (empty: it does not)."""
    try:
        new.try_member(member.reversed())
    except HunkFailure:
        pass
    else:
        where = []
        for fp in member.files:
            data = new.state(fp.path).data
            for h in fp.hunks:
                at = None if data is None else find_hunk(data, h.reversed(), max(h.new_start - 1, 0))
                where.append(f"{fp.path} hunk {h.number}" + ("" if at is None else f" at line {at[0] + 1}"))
        return [f"its reverse applies to the new tree: {', '.join(where)}"]
    evidence = []
    for fp in member.files:
        data = new.state(fp.path).data
        if fp.new_path is None:
            if data is not None:
                return []
            evidence.append(f"{fp.path}: deleted in the new tree")
            continue
        if data is None:
            return []
        for h in fp.hunks:
            if not h.new_block.strip():
                continue
            at = find_hunk(data, h.reversed(), max(h.new_start - 1, 0))
            if at is None:
                return []
            evidence.append(f"{fp.path}: hunk {h.number}'s result is at line {at[0] + 1} of the new tree")
    return evidence


def _moved_to(fp: FilePatch, tree: Tree, new: Workspace) -> str | None:
    """Another file of ``tree`` holding the hunks' context: one with the same file name first,
    then any with the same suffix; the one where most hunks' old lines are found."""
    paths = tree.paths()
    name = posixpath.basename(fp.path)
    suffix = posixpath.splitext(name)[1]
    for candidates in (
        [p for p in paths if posixpath.basename(p) == name and p != fp.path],
        [p for p in paths if p.endswith(suffix) and posixpath.basename(p) != name],
    ):
        best: tuple[int, int, str] | None = None
        for path in candidates:
            data = new.state(path).data if path in new.files else tree.read(path)
            if not data:
                continue
            found = sum(1 for h in fp.hunks if h.old_block and h.old_block in data)
            context = sum(1 for h in fp.hunks for k, t in h.lines if k == " " and t.strip() and t in data)
            score = (found, context, path)
            if (found or context > 2) and (best is None or score[:2] > best[:2]):
                best = score
        if best is not None:
            return best[2]
    return None


def member_header(data: bytes, today: str | None) -> bytes:
    """The member's bytes before its diff; with ``today``, its Last-Update set to it."""
    at = data.find(b"\ndiff --git ")
    head = data[: at + 1] if at >= 0 else data
    if today is None:
        return head
    line = f"Last-Update: {today}\n".encode()
    if _LAST_UPDATE_RE.search(head):
        return _LAST_UPDATE_RE.sub(lambda _: line, head, count=1)
    body = head.rstrip(b"\n")
    return body + b"\n" + line + head[len(body) + 1 :]


def file_diff(path: str, before: bytes | None, after: bytes | None, new_mode: str | None) -> bytes:
    """One file's git diff, from the new tree's bytes to the member's result there."""
    p = path.encode("utf-8", "surrogateescape")
    out = [b"diff --git a/%s b/%s\n" % (p, p)]
    if before is None:
        out.append(f"new file mode {new_mode or '100644'}\n".encode())
        out.append(b"--- /dev/null\n+++ b/%s\n" % p)
    elif after is None:
        out.append(b"deleted file mode 100644\n--- a/%s\n+++ /dev/null\n" % p)
    else:
        out.append(b"--- a/%s\n+++ b/%s\n" % (p, p))
    out.extend(unified_hunks(split_lines(before or b""), split_lines(after or b"")))
    return b"".join(out)


def today_utc() -> str:
    return datetime.datetime.now(datetime.UTC).date().isoformat()


# ---------------------------------------------------------------- the report


def render_report(rows: list[MemberRebase], old_label: str, new_label: str) -> str:
    table = [("member", "result", "details")]
    for r in rows:
        table.append((r.name, r.status, _details(r)))
    width = [max(len(t[i]) for t in table) for i in range(2)]
    out = [f"rebase {old_label} -> {new_label}", ""]
    out += [f"{t[0]:<{width[0]}}  {t[1]:<{width[1]}}  {t[2]}".rstrip() for t in table]
    for r in rows:
        for item in r.review:
            out.append("")
            out.append(
                f"{r.name}: review {item['file']}:{item['line']}: carried next to an upstream change"
                f" (old line {item['upstream_changed_line']} changed upstream)"
            )
            out.extend(f"  member: {line}" for line in item["lines"])
            out.extend(f"  upstream next to it now: {line}" for line in item["upstream_now"])
        for line in r.evidence:
            out.append(f"{r.name}: already upstream: {line}")
        if r.conflict:
            c = r.conflict
            out.append("")
            if "hunk" in c:
                out.append(f"{r.name}: conflict in {c['file']} hunk {c['hunk']} {c['header']}: {c['reason']}")
                near = c["nearest"]
                out.append(f"  nearest region: line {near['line']} ({near['equal_lines']} of {near['of']} lines equal)")
                for i, want in enumerate(c["expected"]):
                    got = c["found"][i] if i < len(c["found"]) else "<end of file>"
                    mark = " " if want == got else "!"
                    out.append(f"  {mark} expected: {want.rstrip()!r:<60} new tree: {got.rstrip()!r}")
            else:
                out.append(f"{r.name}: conflict in {c['file']}: {c['reason']}")
            if c.get("three_way"):
                out.append("  three-way:")
                out.extend(f"    {line}" for line in c["three_way"].splitlines())
    conflicts = [r.name for r in rows if r.status == CONFLICT]
    upstream = [r.name for r in rows if r.status == UPSTREAM]
    carried = len(rows) - len(conflicts) - len(upstream)
    summary = f"rebase: {carried} of {len(rows)} members carried"
    summary += f"; already upstream: {', '.join(upstream)}" if upstream else ""
    summary += f"; conflicts: {', '.join(conflicts)}" if conflicts else ""
    out += ["", summary]
    return "\n".join(out)


def _details(r: MemberRebase) -> str:
    parts = []
    if r.moved:
        parts.append(", ".join(f"{m['from']} -> {m['to']}" for m in r.moved))
    if r.offsets:
        parts.append(", ".join(f"{o['file']} hunk {o['hunk']} {o['offset']:+d} lines" for o in r.offsets))
    if r.files:
        parts.append(", ".join(f"{posixpath.basename(f['file'])}: {f['how']}" for f in r.files))
    if r.review:
        parts.append(f"{len(r.review)} edit(s) next to upstream changes: review")
    if r.status == UPSTREAM:
        parts.append("a candidate to retire")
    if r.conflict:
        c = r.conflict
        parts.append(f"{c['file']}" + (f" hunk {c['hunk']}" if "hunk" in c else "") + f": {c['reason']}")
    return "; ".join(parts)


def check_today(today: str) -> str:
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", today):
        raise InputError(f"expected YYYY-MM-DD, got {today!r}", field="Last-Update")
    return today
