"""Overlay check: say of each member whether it applies to the unpatched pinned tree, and how.

Members are tried in recipe order, each on the tree as the members before it
left it.  A member that fails is tried in reverse (as quilt does), so
"already applied" (a candidate to retire) is told apart from a conflict.
Standalone members are also tried alone on the unpatched tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from builder.apply import MemberResult, Workspace, nearest_partial_match
from builder.errors import HunkFailure
from builder.members import Member
from builder.tree import Tree

APPLIED, OFFSETS, ALREADY, CONFLICT = "applied", "applied with offsets", "already applied", "conflict"


@dataclass
class MemberCheck:
    name: str
    status: str
    offsets: list[dict[str, Any]] = field(default_factory=list)
    conflict: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status in (APPLIED, OFFSETS)


@dataclass
class CheckReport:
    members: list[MemberCheck]
    standalone: list[MemberCheck]
    shared_files: list[dict[str, Any]]
    lock: str | None = None  # why the recipe's lock no longer matches it (builder.lock.lock_report)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.members + self.standalone) and self.lock is None

    def to_json(self) -> dict[str, Any]:
        def one(c: MemberCheck) -> dict[str, Any]:
            return {"member": c.name, "status": c.status, "offsets": c.offsets, "conflict": c.conflict}

        return {
            "ok": self.ok,
            "members": [one(c) for c in self.members],
            "standalone": [one(c) for c in self.standalone],
            "shared_files": self.shared_files,
            "lock": self.lock,
        }


def check_overlay(tree: Tree, members: tuple[Member, ...]) -> CheckReport:
    work = Workspace(tree)
    checks = []
    results: list[MemberResult] = []
    for member in members:
        check, result = _check_one(work, member)
        checks.append(check)
        if result is not None:
            work.commit(result)
            results.append(result)
    standalone = []
    for member in members:
        if member.standalone:
            check, _ = _check_one(Workspace(tree), member)
            standalone.append(check)
    return CheckReport(checks, standalone, _shared_files(work, results))


def _check_one(work: Workspace, member: Member) -> tuple[MemberCheck, MemberResult | None]:
    try:
        result = work.try_member(member)
    except HunkFailure as failure:
        try:
            work.try_member(member.reversed())
        except HunkFailure:
            return MemberCheck(member.name, CONFLICT, conflict=conflict_facts(work, failure)), None
        return MemberCheck(member.name, ALREADY), None
    offsets = [
        {"file": o.path, "hunk": o.hunk.number, "header": o.hunk.header, "offset": o.offset} for o in result.offsets
    ]
    return MemberCheck(member.name, OFFSETS if offsets else APPLIED, offsets=offsets), result


def conflict_facts(work: Workspace, failure: HunkFailure, found_at_nearest: bool = False) -> dict[str, Any]:
    """The hunk that failed, its expected lines against the tree's lines where it was looked for
    (or, with ``found_at_nearest``, at the nearest partial match), and that nearest match."""
    out: dict[str, Any] = {"file": failure.path, "reason": failure.reason}
    hunk = failure.patch_hunk
    if hunk is None:
        return out
    lines = work.state(failure.path).lines or []
    expected = hunk.old_lines
    near = nearest_partial_match(lines, expected, failure.at)
    where = near[0] if near is not None and found_at_nearest else failure.at
    out.update(
        hunk=hunk.number,
        header=hunk.header,
        line=failure.at + 1,
        expected=[_text(b) for b in expected],
        found=[_text(b) for b in lines[where : where + len(expected)]],
    )
    if near is not None:
        out["nearest"] = {"line": near[0] + 1, "equal_lines": near[1], "of": len(expected)}
    elif found_at_nearest:
        out["nearest"] = {"line": where + 1, "equal_lines": 0, "of": len(expected)}
    return out


def _text(line: bytes) -> str:
    return line.decode("utf-8", "replace")


def _shared_files(work: Workspace, results: list[MemberResult]) -> list[dict[str, Any]]:
    shared = []
    for path, names in work.touched_by.items():
        if len(names) < 2:
            continue
        overlaps = [
            {"member": r.member.name, "hunk": o.hunk.number, "header": o.hunk.header, "reads_lines_of": list(o.earlier)}
            for r in results
            for o in r.overlaps
            if o.path == path
        ]
        shared.append({"file": path, "members": names, "overlapping_hunks": overlaps})
    return shared


def render_table(report: CheckReport) -> str:
    rows = [("member", "result", "details")]
    for label, checks in (("", report.members), (" (standalone)", report.standalone)):
        for c in checks:
            rows.append((c.name + label, c.status, _details(c)))
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    out = [f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}".rstrip() for r in rows]
    for c in report.members + report.standalone:
        if c.conflict and "expected" in c.conflict:
            out.append("")
            conflict = c.conflict
            out.append(
                f"{c.name}: conflict in {conflict['file']} hunk {conflict['hunk']} {conflict['header']}"
                f" at line {conflict['line']}"
            )
            for want, got in _pairs(c.conflict["expected"], c.conflict["found"]):
                mark = " " if want == got else "!"
                out.append(f"  {mark} expected: {want.rstrip()!r:<60} tree has: {got.rstrip()!r}")
            near = c.conflict.get("nearest")
            out.append(
                f"  nearest match: line {near['line']} ({near['equal_lines']} of {near['of']} lines equal)"
                if near
                else "  nearest match: none (no expected line occurs in the file)"
            )
    for shared in report.shared_files:
        out.append("")
        overlaps = shared["overlapping_hunks"]
        verdict = (
            "; ".join(
                f"{o['member']} hunk {o['hunk']} reads lines written by {', '.join(o['reads_lines_of'])}"
                for o in overlaps
            )
            if overlaps
            else "hunks do not overlap"
        )
        out.append(f"shared file {shared['file']}: {', '.join(shared['members'])}: {verdict}")
    out.append("")
    members_ok = all(c.ok for c in report.members + report.standalone)
    out.append("overlay check: OK" if members_ok else "overlay check: FAILED")
    if report.lock:  # the members may all apply: the one line says what else failed
        out.append(f"stale lock: {report.lock}")
    return "\n".join(out)


def _details(c: MemberCheck) -> str:
    if c.status == OFFSETS:
        return ", ".join(f"{o['file']} hunk {o['hunk']} {o['offset']:+d} lines" for o in c.offsets)
    if c.status == ALREADY:
        return "its reverse applies cleanly: a candidate to retire"
    if c.conflict:
        return f"{c.conflict['file']}: {c.conflict['reason']}"
    return ""


def _pairs(expected: list[str], found: list[str]) -> list[tuple[str, str]]:
    return [(w, found[i] if i < len(found) else "<end of file>") for i, w in enumerate(expected)]
