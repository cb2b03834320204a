"""Workers: ``apply --out`` with the recipe's members split across processes.

Members that touch no file in common are independent.  They fall into groups
joined by the files they name, and each worker process takes some groups: it
parses its members, applies them in recipe order onto its own copy of the
files they touch, hashes the results and writes them into the output's
temporary directory.  This process gathers what each worker did (digests,
manifest rows, offset reports, parse-memo entries) and finishes as a single
run does: runtime key, manifest.json, the rename into place.  Parsing and
applying are CPU work in Python: a second core takes a quarter (members
parsed before) to a third (a first run) off a large recipe's time.

A worker's outcome is plain data (marshal), its error one line: of the
workers' first errors, the one a single run meets first wins (a member that
does not parse before one that does not apply, then recipe order), so the
output and the message are the same whatever the number of workers, and a
failure leaves nothing.  One worker runs in this process: for a few members,
on one core, with VLLM_OVERLAY_JOBS=1, or where there is no fork().
"""

from __future__ import annotations

import fcntl
import json
import marshal
import os
import signal
import struct
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from builder.apply import ApplyError, apply_members
from builder.errors import InputError
from builder.key import key_of_digests
from builder.members import ParseMemo, load_member, read_file
from builder.output import (
    MANIFEST,
    EncodedRow,
    Writer,
    file_row,
    manifest_bytes,
    manifest_of_rows,
    member_row,
    replacing,
    write_changes,
)
from builder.recipe import Recipe
from builder.tree import Tree

MEMBERS_PER_WORKER = 32  # below this a fork costs more than the worker saves
MAX_WORKERS = 8
PIPE_BYTES = 1 << 20  # a worker's outcome fits without waiting for this process to read it

# Where a first error was met, in the order a single run meets them.
PARSE, APPLY = 0, 1


class Applied(NamedTuple):
    key: str
    reports: list[str]  # per member, in recipe order: its offsets, then "applied NAME"
    files: int  # touched files, deletions included


def worker_count(members: int) -> int:
    """One per core, at most one per MEMBERS_PER_WORKER members; VLLM_OVERLAY_JOBS overrides."""
    forced = os.environ.get("VLLM_OVERLAY_JOBS", "").strip()
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise InputError(f"VLLM_OVERLAY_JOBS: expected a whole number of at least 1, got {forced!r}")
        jobs = int(forced)
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        jobs = min(cores, MAX_WORKERS, members // MEMBERS_PER_WORKER)
    return max(jobs, 1) if hasattr(os, "fork") else 1


def _diff_lines(data: bytes) -> list[bytes]:
    """The lines of ``data`` that start with "diff --git ", without their line end.  Found
    with bytes.find: a multi-line regex over every member cost four times as much."""
    starts = [0] if data.startswith(b"diff --git ") else []
    at = data.find(b"\ndiff --git ")
    while at >= 0:
        starts.append(at + 1)
        at = data.find(b"\ndiff --git ", at + 1)
    lines = []
    for start in starts:
        end = data.find(b"\n", start)
        lines.append(data[start : end if end >= 0 else len(data)].rstrip(b"\r"))
    return lines


def member_groups(datas: list[bytes | None]) -> list[list[int]]:
    """Member indexes in groups, each ascending, where members naming a file in common share
    a group; the heaviest group (bytes to parse) first.  A member's files are its "diff
    --git" lines (the parser checks that each names its one path); an unreadable member
    (None) has none and fails in its group as it would alone."""
    root = list(range(len(datas)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    first_with: dict[bytes, int] = {}
    for i, data in enumerate(datas):
        for line in _diff_lines(data or b""):
            root[find(i)] = find(first_with.setdefault(line, i))
    groups: dict[int, list[int]] = {}
    for i in range(len(datas)):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda group: -_weight(datas, group))


def partition(datas: list[bytes | None], jobs: int) -> list[list[int]]:
    """The member groups dealt to at most ``jobs`` workers, about equal in bytes to parse:
    each, heaviest first, to the least loaded so far.  Each worker's indexes ascending."""
    shards: list[list[int]] = [[] for _ in range(max(jobs, 1))]
    loads = [0] * len(shards)
    for group in member_groups(datas):
        lightest = loads.index(min(loads))
        shards[lightest] += group
        loads[lightest] += _weight(datas, group)
    return [sorted(shard) for shard in shards if shard]


def _weight(datas: list[bytes | None], group: list[int]) -> int:
    return sum(len(datas[i] or b"") + 1 for i in group)


def apply_to_dir(recipe: Recipe, tree: Tree, memo: ParseMemo, out: Path, jobs: int | None = None) -> Applied:
    """The recipe's members applied onto ``tree``, written to ``out`` as touched files plus
    manifest.json (replacing an earlier output whole), or an InputError and nothing written."""
    names = recipe.members
    folder = str(recipe.overlay_dir)  # str, not Path: pathlib's join was a third of reading 500
    datas = [_bytes_or_none(f"{folder}/{name}.patch") for name in names]
    shards = partition(datas, worker_count(len(names)) if jobs is None else jobs) or [[]]  # [[]]: no members
    with replacing(out) as tmp:

        def work(indexes: list[int]) -> dict[str, Any]:
            return _work(recipe, tree, memo, indexes, datas, tmp)

        outcomes = _run(work, shards)
        errors = [o["error"] for o in outcomes if o["error"]]
        if errors:
            raise InputError(min(errors)[2])
        for outcome in outcomes:  # this process's own share too: its memo part is sealed already
            memo.merge(outcome["memo"], outcome["bulk"])
        members = sorted(m for o in outcomes for m in o["members"])
        files = [EncodedRow(row) for _, row in sorted(f for o in outcomes for f in o["files"])]
        key = key_of_digests(recipe, ((name, digest) for _, name, digest, _ in members))
        data = manifest_of_rows(recipe, key, [EncodedRow(row) for *_, row in members], files)
        Writer(tmp).write(MANIFEST, manifest_bytes(data), None)
    reports = [line for _, lines in sorted(r for o in outcomes for r in o["reports"]) for line in lines]
    return Applied(key, reports, len(files))


def _bytes_or_none(path: str) -> bytes | None:
    """A member file's bytes (the recipe has checked its name), or None when it cannot be
    read: then its worker reads it again and reports why, in its place."""
    try:
        return read_file(path)
    except OSError:
        return None


def _work(
    recipe: Recipe, tree: Tree, memo: ParseMemo, indexes: list[int], datas: list[bytes | None], tmp: Path
) -> dict[str, Any]:
    """One worker's share, as plain data: its members parsed, applied and written, or its
    first error as (PARSE or APPLY, recipe index, message)."""
    members = []
    for i in indexes:
        name = recipe.members[i]
        try:
            members.append(load_member(recipe.member_path(name), name, memo, datas[i]))
        except InputError as exc:
            return {"error": (PARSE, i, str(exc))}
    try:
        overlay = apply_members(tree, members)
    except ApplyError as exc:
        return {"error": (APPLY, indexes[exc.index], str(exc))}
    write_changes(Writer(tmp), overlay.changes)
    index_of = {m.name: i for i, m in zip(indexes, members)}
    member_of = {m.name: m for m in members}
    files = []
    for change in overlay.changes:  # ordered as one run orders them: by first toucher, then its file order
        first = member_of[change.members[0]]
        place = next(n for n, fp in enumerate(first.files) if fp.path == change.path)
        files.append(((index_of[first.name], place), json.dumps(file_row(change))))
    remembered, parsed = memo.export()
    return {  # the manifest's rows encoded here, in parallel, not after by this process
        "error": None,
        "members": [(i, m.name, m.digest, json.dumps(member_row(m))) for i, m in zip(indexes, members)],
        "files": files,
        "reports": [(index_of[r.member.name], r.report()) for r in overlay.results],
        "memo": remembered,
        "bulk": parsed,  # the memo entries parsed anew, marshalled: sent apart (see _send)
    }


def _run(work: Callable[[list[int]], dict[str, Any]], shards: list[list[int]]) -> list[dict[str, Any]]:
    """``work`` of every shard, the first here and each other in a forked child; outcomes in
    shard order.  Whatever happens here, no child outlives this call (they write into a
    directory the caller removes on failure)."""
    children: list[tuple[int, int]] = []
    try:
        for shard in shards[1:]:
            children.append(_fork(work, shard))
        outcomes = [work(shards[0])]
        while children:
            pid, fd = children.pop(0)
            outcomes.append(_collect(pid, fd))
        return outcomes
    finally:
        for pid, fd in children:
            os.close(fd)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _fork(work: Callable[[list[int]], dict[str, Any]], shard: list[int]) -> tuple[int, int]:
    read_end, write_end = os.pipe()
    try:
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (OSError, AttributeError):
        pass  # a smaller pipe only makes the child wait for the read
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        raise
    if pid == 0:  # the child: never returns into the caller's code (its clean-up is the parent's)
        status = 1
        try:
            os.close(read_end)
            try:
                outcome = work(shard)
            except BaseException:
                outcome = {"crash": traceback.format_exc()}
            _send(write_end, outcome)
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    return pid, read_end


# An outcome on the pipe: the sizes of its two frames, its fields marshalled, its bulk bytes.
_SIZES = struct.Struct("<QQ")


def _send(fd: int, outcome: dict[str, Any]) -> None:
    """The bulk (a memo part, the largest field) goes apart: marshalled with the rest, it
    would be copied in and out once more."""
    bulk = outcome.pop("bulk", b"")
    head = marshal.dumps(outcome)
    for piece in (_SIZES.pack(len(head), len(bulk)), head, bulk):
        view = memoryview(piece)
        while view:
            view = view[os.write(fd, view) :]


def _collect(pid: int, fd: int) -> dict[str, Any]:
    try:
        try:
            head_size, bulk_size = _SIZES.unpack(_read_exactly(fd, _SIZES.size))
            outcome = marshal.loads(_read_exactly(fd, head_size))
            outcome["bulk"] = _read_exactly(fd, bulk_size)
        except (EOFError, ValueError, TypeError):
            outcome = None
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    if outcome is None:
        raise RuntimeError(f"a worker process ended without its outcome (wait status {status})")
    if "crash" in outcome:
        raise RuntimeError(f"a worker process failed:\n{outcome['crash']}")
    return outcome


def _read_exactly(fd: int, size: int) -> bytearray:
    """``size`` bytes, read into one buffer of that size (no chunks to join)."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    while view:
        got = os.readv(fd, [view])
        if not got:
            raise EOFError("the pipe closed early")
        view = view[got:]
    return buffer
