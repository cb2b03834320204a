"""The member workflow, as quilt and devtool do it: new, edit in a work directory, refresh.

``member new`` writes a header template and places the name in the recipe's order;
until it is refreshed its file has no diff, which only ``member edit``/``refresh``
accept (every other command refuses it, as it refuses any member without a diff).
``member edit`` writes the pinned tree with the members up to and including NAME
applied, only the files those members touch and the files asked for (``--file``, which
may name a file to create; ``--full``: every file), as an output directory
(builder.output: marker, whole or nothing).
``member refresh`` diffs the work directory against the tree with the members
before NAME applied, keeps NAME's header with Last-Update set, and refuses,
naming them, when a later member no longer applies on the result.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from builder.apply import apply_members
from builder.cache import atomic_write, read_regular
from builder.errors import InputError
from builder.members import MEMBER_LIMIT, Member, load_member, member_bytes, parse_member
from builder.output import MARKER, Destination, Writer, is_earlier_output, replacing
from builder.rebase import file_diff, member_header
from builder.recipe import MEMBER_NAME_RE, Recipe, load_recipe
from builder.sources import source_of
from builder.tree import Tree

WORKDIR_FILE = ".vllm-overlay-member.json"
TEMPLATE = """Description: {name}: one line saying what this member changes
 Why it is needed, what was checked in the pinned tree (file and line), and
 what was not.
Author: {author}
Forwarded: no
Upstream-Status: Pending
Last-Update: {today}
"""


def new_member(recipe_path: str | Path, name: str, after: str | None, today: str, author: str) -> Path:
    """Write overlay/NAME.patch (a header template, no diff yet) and place NAME in the recipe's
    members, after ``after`` (default: last)."""
    recipe = load_recipe(recipe_path)
    if not MEMBER_NAME_RE.fullmatch(name):
        raise InputError(f"member name {name!r} does not match [a-z0-9_]+", field="member new")
    if name in recipe.members:
        raise InputError(f"the recipe already has a member {name}", file=recipe.path, member=name)
    path = recipe.member_path(name)
    if path.exists() or path.is_symlink():
        raise InputError("a member file of that name exists already", file=path, member=name)
    if after is not None and after not in recipe.members:
        raise InputError(f"--after {after}: the recipe has no such member", file=recipe.path)
    text = recipe.path.read_text(encoding="utf-8")
    order = list(recipe.members)
    order.insert(order.index(after) + 1 if after else len(order), name)
    new_text = _with_members(text, order, recipe.path)
    if load_recipe_text_members(new_text, recipe.path) != order:
        raise InputError("cannot place the member in the recipe's members list", file=recipe.path)
    atomic_write(path, TEMPLATE.format(name=name, author=author, today=today).encode())
    os.chmod(path, 0o644)
    atomic_write(recipe.path, new_text.encode("utf-8"))
    return path


def load_recipe_text_members(text: str, path: Path) -> list[str]:
    data = yaml.safe_load(text)
    return list(data.get("members", [])) if isinstance(data, dict) else []


def _with_members(text: str, order: list[str], path: Path) -> str:
    """The recipe's text with its members list replaced, the rest (comments too) kept."""
    root = yaml.compose(text)
    node = next((v for k, v in root.value if k.value == "members"), None) if root is not None else None
    if node is None or not isinstance(node, yaml.SequenceNode):
        raise InputError("no members list to place the member in", file=path, field="members")
    if node.flow_style or not node.value:
        start, end = node.start_mark.index, node.end_mark.index
        return text[:start] + "[" + ", ".join(order) + "]" + text[end:]
    # a block list: one "- name" line per member, at the first item's indentation
    first = node.value[0].start_mark
    line_start = text.rfind("\n", 0, first.index) + 1
    prefix = text[line_start : first.index]  # e.g. "  - "
    last = node.value[-1].end_mark.index
    end = text.find("\n", last)
    end = len(text) if end < 0 else end
    return text[:line_start] + "\n".join(prefix + name for name in order) + text[end:]


# ---------------------------------------------------------------- edit and refresh


def check_member(recipe: Recipe, name: str) -> None:
    if name not in recipe.members:
        raise InputError(f"the recipe has no member {name}", file=recipe.path, field="members")


def _split(recipe: Recipe, name: str) -> tuple[list[Member], Member | None, list[Member]]:
    """(members before NAME, NAME or None while it has no diff yet, members after)."""
    check_member(recipe, name)
    at = recipe.members.index(name)
    before = [load_member(recipe.member_path(n), n) for n in recipe.members[:at]]
    after = [load_member(recipe.member_path(n), n) for n in recipe.members[at + 1 :]]
    path = recipe.member_path(name)
    data = member_bytes(path, name)
    this = parse_member(name, path, data) if b"diff --git " in data else None
    return before, this, after


def edit(
    recipe: Recipe, tree: Tree, name: str, out: Destination, files: list[str], full: bool, runtime_key: str
) -> dict[str, Any]:
    before, this, _ = _split(recipe, name)
    members = [*before, *([this] if this else [])]
    overlay = apply_members(tree, members)
    changed = overlay.by_path()
    wanted = set(changed) | set(files)
    check_paths(files)
    for path in files:  # a path the tree lacks is a file to create: it must lie inside the tree
        if tree.check_writable(path):
            raise InputError("not a path inside the tree (through a symlink)", path=path, field="--file")
    info = {
        "recipe": str(recipe.path.resolve()),
        "member": name,
        "vllm_sha256": recipe.vllm.sha256,
        "members_applied": [m.name for m in members],
        "full": full,
        "files": sorted(wanted),
    }
    with replacing(out) as tmp:
        writer = Writer(tmp)
        if full:
            for path, data, mode in tree.walk():
                if path not in changed:
                    writer.write(path, data, mode)
        else:
            for path in sorted(wanted - set(changed)):
                data = tree.read(path)
                if data is not None:
                    writer.write(path, data, None)
        for change in overlay.changes:
            if change.after is not None:
                writer.write(change.path, change.after, change.mode)
        writer.write(WORKDIR_FILE, (json.dumps(info, indent=2) + "\n").encode(), None)
    return info


@dataclass(frozen=True)
class Refreshed:
    name: str
    path: Path
    changed: bool  # False: the work directory holds the member's result already; nothing written
    files: list[str]


def refresh(recipe: Recipe, tree: Tree, name: str, workdir: Path, today: str) -> Refreshed:
    info = check_workdir(workdir, recipe, name)
    member_path = recipe.member_path(name)
    if os.path.exists(source_of(member_path)):
        raise InputError(
            f"made from {Path(source_of(member_path)).name}: edit that file and run 'vllm-overlay members'",
            file=member_path,
            member=name,
        )
    before, this, after = _split(recipe, name)
    base = apply_members(tree, before).by_path()

    def base_data(path: str) -> bytes | None:
        return base[path].after if path in base else tree.read(path)

    # the files in play: NAME's own, those the work directory was made with (touched by the
    # members or named with --file), and with --full any file; never a cache an editor or a run
    # left (__pycache__)
    present = _workdir_files(workdir)
    scope = list(dict.fromkeys([*(fp.path for fp in this.files)] if this else []))
    extra = set(info["files"]) | (present if info.get("full") else set())
    scope += sorted(p for p in extra if p not in scope)
    diffs, touched = [], []
    for path in scope:
        old = base_data(path)
        new = _read(workdir, path) if path in present else None
        if new == old:
            continue
        diffs.append(file_diff(path, old, new, _new_mode(workdir, path)))
        touched.append(path)
    if not diffs:
        raise InputError(
            "the work directory changes nothing against the members before it: the member would have no diff",
            file=workdir,
            member=name,
        )
    data = member_bytes(member_path, name)
    header = member_header(data, today) if b"diff --git " in data else _template_header(data, today)
    text = header + b"".join(diffs)
    refreshed = parse_member(name, member_path, text)
    if this is not None and refreshed.digest == this.digest:
        return Refreshed(name, member_path, False, touched)
    blocked = _later_blocked(tree, [*before, refreshed], after)
    if blocked:
        raise InputError(
            f"the edit changes lines that later members read: {', '.join(blocked)} would no longer apply;"
            " refresh those after, or change them first",
            file=member_path,
            member=name,
        )
    mode = os.stat(member_path).st_mode & 0o7777
    atomic_write(member_path, text)
    os.chmod(member_path, mode)
    return Refreshed(name, member_path, True, touched)


def _later_blocked(tree: Tree, applied: list[Member], later: list[Member]) -> list[str]:
    """The later members that no longer apply, each tried on what the ones before it left."""
    blocked = []
    kept = list(applied)
    for member in later:
        try:
            apply_members(tree, [*kept, member])
        except InputError:
            blocked.append(member.name)
            continue
        kept.append(member)
    return blocked


def _new_mode(workdir: Path, path: str) -> str:
    """The mode a new file gets in a refreshed diff: the work directory's executable bit."""
    full = workdir / path
    return "100755" if full.is_file() and os.stat(full).st_mode & 0o111 else "100644"


def _template_header(data: bytes, today: str) -> bytes:
    head = member_header(data, today)
    return head if head.endswith(b"\n\n") else head.rstrip(b"\n") + b"\n\n"


def check_workdir(workdir: Path, recipe: Recipe, name: str) -> dict[str, Any]:
    if not is_earlier_output(workdir):
        raise InputError(f"not a member work directory (no {MARKER}); make one with member edit", file=workdir)
    try:
        info = json.loads(read_regular(workdir / WORKDIR_FILE, 1 << 20, "a work directory's record"))
    except (OSError, ValueError) as exc:
        raise InputError(f"not a member work directory ({WORKDIR_FILE}: {exc})", file=workdir) from None
    if info.get("member") != name:
        raise InputError(f"this work directory was made for member {info.get('member')}, not {name}", file=workdir)
    if info.get("vllm_sha256") != recipe.vllm.sha256:
        raise InputError("this work directory was made from another vLLM pin; make it again", file=workdir)
    return info


def check_paths(files: list[str]) -> None:
    """``--file`` paths: relative, inside the tree (checked before any tree is opened)."""
    for path in files:
        parts = path.split("/")
        if not path or path.startswith("/") or "\0" in path or {"", ".", ".."} & set(parts):
            raise InputError("not a path inside the tree", path=path, field="--file")


def _workdir_files(workdir: Path) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(workdir):
        dirnames[:] = [d for d in dirnames if d not in (".git", "__pycache__")]
        for file in filenames:
            full = Path(dirpath, file)
            rel = full.relative_to(workdir).as_posix()
            if rel in (MARKER, WORKDIR_FILE) or full.is_symlink() or not full.is_file():
                continue
            out.add(rel)
    return out


def _read(workdir: Path, path: str) -> bytes:
    return read_regular(workdir / path, MEMBER_LIMIT * 4, "a work directory file")
