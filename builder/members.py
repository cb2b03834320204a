"""Members: parse and validate ``overlay/<name>.patch`` (a DEP-3 header, then a git diff).

A strict walk reads every line of the diff as git apply would: it refuses
anything it cannot account for (unidiff silently drops lines past a hunk's
counts and ignores malformed hunk headers) and collects the hunks with the
exact bytes of their lines (line endings and missing final newlines kept).
unidiff reads the file-level facts: paths, extended headers, binary patches.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import NamedTuple

import unidiff

from builder.cache import MIB, read_regular
from builder.errors import InputError
from builder.recipe import MEMBER_NAME_RE, Recipe

MEMBER_LIMIT = 16 * MIB  # the largest member file read (the self-test's is about 0.1 MiB)
# DEP-3 fields plus the Yocto Upstream-Status and our Standalone flag.
SINGLE_FIELDS = {
    "Description",
    "Origin",
    "Author",
    "Forwarded",
    "Applied-Upstream",
    "Last-Update",
    "Upstream-Status",
    "Standalone",
}
REPEATABLE_FIELDS = {"Bug", "Reviewed-by"}
UPSTREAM_STATUS_RE = re.compile(
    r"Pending|Backport|Denied|Inactive-Upstream|Submitted \[[^\]\s][^\]]*\]|Inappropriate \[[^\]\s][^\]]*\]"
)
DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")
HEADER_FIELD_RE = re.compile(r"([A-Za-z][A-Za-z0-9-]*):[ \t]*(.*)")
_TWO_PATHS_RE = re.compile(r"a/(\S+) b/(\S+)")
HUNK_HEADER_RE = re.compile(
    r"@@ -(\d{1,9})(?:,(\d{1,9}))? \+(\d{1,9})(?:,(\d{1,9}))? @@(?: .*)?"
)  # counts past 10^9 lines are no file
# Extended header lines git writes between "diff --git" and the first hunk.
GIT_HEADER_PREFIXES = (
    "index ",
    "--- ",
    "+++ ",
    "new file mode ",
    "deleted file mode ",
    "old mode ",
    "new mode ",
    "similarity index ",
    "dissimilarity index ",
    "rename from ",
    "rename to ",
    "copy from ",
    "copy to ",
)
UNSUPPORTED_HEADERS = {"rename from ": "a rename", "copy from ": "a copy", "old mode ": "a mode change"}


class Hunk(NamedTuple):
    """One hunk: its header's numbers, its lines, and what apply asks of it, worked out once
    when the member is parsed.  Make one with hunk()."""

    number: int  # 1-based within its file
    old_start: int
    old_len: int  # the walk checks that the lines hold exactly this many old and new lines
    new_start: int
    new_len: int
    lines: tuple[tuple[str, bytes], ...]  # (" " | "-" | "+", exact bytes of the line)
    old_block: bytes  # the old lines as the file has them
    new_block: bytes
    added_runs: tuple[tuple[int, int], ...]  # runs of added lines, [first, end) from the first new line
    trailing_context: int
    old_fits_a_file: bool  # False when an old line without a newline comes before others

    @property
    def header(self) -> str:
        return hunk_header(self.old_start, self.old_len, self.new_start, self.new_len)

    @property
    def old_lines(self) -> list[bytes]:
        return [text for kind, text in self.lines if kind != "+"]

    @property
    def new_lines(self) -> list[bytes]:
        return [text for kind, text in self.lines if kind != "-"]

    def reversed(self) -> Hunk:
        swap = {" ": " ", "-": "+", "+": "-"}
        return hunk(
            self.number,
            self.new_start,
            self.new_len,
            self.old_start,
            self.old_len,
            tuple((swap[k], t) for k, t in self.lines),
        )


def hunk_header(old_start: int, old_len: int, new_start: int, new_len: int) -> str:
    """Both counts always written, no section text: as reports show it and the key hashes it."""
    return f"@@ -{old_start},{old_len} +{new_start},{new_len} @@"


def hunk(
    number: int, old_start: int, old_len: int, new_start: int, new_len: int, lines: tuple[tuple[str, bytes], ...]
) -> Hunk:
    old: list[bytes] = []
    new: list[bytes] = []
    runs: list[tuple[int, int]] = []
    trailing = 0
    for kind, text in lines:
        trailing = trailing + 1 if kind == " " else 0
        if kind != "+":
            old.append(text)
        if kind != "-":
            if kind == "+":
                at = len(new)
                if runs and runs[-1][1] == at:
                    runs[-1] = (runs[-1][0], at + 1)
                else:
                    runs.append((at, at + 1))
            new.append(text)
    old_block = b"".join(old)
    # A line holds at most one newline, at its end: all but the last old line must have one.
    ended = old_block.count(b"\n")
    fits = ended == len(old) or (ended == len(old) - 1 and not old[-1].endswith(b"\n"))
    return Hunk(
        number, old_start, old_len, new_start, new_len, lines, old_block, b"".join(new), tuple(runs), trailing, fits
    )


class FilePatch(NamedTuple):
    old_path: str | None  # None: a new file
    new_path: str | None  # None: a deletion
    new_mode: str | None
    hunks: tuple[Hunk, ...]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path  # type: ignore[return-value]

    def reversed(self) -> FilePatch:
        return FilePatch(self.new_path, self.old_path, None, tuple(h.reversed() for h in self.hunks))


class Member(NamedTuple):
    name: str
    path: Path
    fields: dict[str, list[str]]  # the header: DEP-3 fields and ours
    files: tuple[FilePatch, ...]
    digest: str  # sha256 of the normalized diff (see _normalize): the member's identity in the runtime key

    @property
    def standalone(self) -> bool:
        return self.fields.get("Standalone", ["no"])[0] == "yes"

    @property
    def upstream_status(self) -> str:
        return self.fields["Upstream-Status"][0]

    def reversed(self) -> Member:
        return Member(self.name, self.path, self.fields, tuple(f.reversed() for f in self.files), self.digest)


def split_lines(data: bytes) -> list[bytes]:
    """Split on "\n" only, keeping it: a "\r" is part of a line, as in git."""
    if b"\r" not in data:
        return data.splitlines(keepends=True)  # the fast path: bytes break only at \n and \r
    parts = data.split(b"\n")
    lines = [part + b"\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def load_member(path: Path, name: str | None = None, data: bytes | None = None) -> Member:
    """Parse ``path``; ``name`` (from the recipe) must match ``[a-z0-9_]+`` and the file name.
    ``data``: the file's bytes, when the caller has read them (a recipe has checked its
    members' names, and so their file names)."""
    file_name = path.name
    stem = file_name[: -len(".patch")] if file_name.endswith(".patch") else file_name
    name = name if name is not None else stem
    if data is None:
        data = member_bytes(path, name)
    if os.path.exists(f"{str(path)[: -len('.patch')]}.py"):  # made from that source: it must agree
        from builder.sources import check_generated

        check_generated(path, name, data)
    return parse_member(name, path, data)


def member_bytes(path: Path, name: str) -> bytes:
    """The bytes of member ``name``'s file, once its name and file name are checked."""
    file_name = path.name
    if not MEMBER_NAME_RE.fullmatch(name):
        raise InputError(f"member name {name!r} does not match [a-z0-9_]+", file=path)
    if file_name != f"{name}.patch":
        raise InputError(f"file name must be {name}.patch", file=path, member=name)
    try:
        return read_regular(path, MEMBER_LIMIT, "a member")
    except InputError as exc:
        raise exc.located(member=name) from None
    except FileNotFoundError:
        raise InputError("no such member file", file=path, member=name) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", file=path, member=name) from None


def parse_member(name: str, path: Path, data: bytes) -> Member:
    """Parse a member's bytes; an InputError names its file, the member and the line."""
    try:
        fields, files, digest = _parse(data)
    except InputError as exc:
        raise exc.located(file=path, member=name) from None
    patches = tuple(FilePatch(old, new, mode, hunks) for old, new, mode, hunks in files)
    return Member(name, path, fields, patches, digest)


def _parse(data: bytes) -> tuple[dict[str, list[str]], tuple[tuple, ...], str]:
    """(header fields, file patches as tuples, digest of the normalized diff)."""
    # Lines stay bytes: hunk lines are kept exactly; only the few structural lines are decoded.
    lines = split_lines(data)
    start = next((i for i, line in enumerate(lines) if line.startswith(b"diff --git ")), None)
    if start is None:
        raise InputError("no git-style diff (no line starts with 'diff --git ')")
    fields = _parse_header([_text(line) for line in lines[:start]])
    hunks, file_headers = _walk(lines, start)
    files = _file_patches(file_headers, hunks)
    return fields, files, hashlib.sha256(_normalize(files)).hexdigest()


def _text(line: bytes) -> str:
    return line.decode("utf-8", "surrogateescape")


def _parse_header(lines: list[str]) -> dict[str, list[str]]:
    fields: dict[str, list[str]] = {}
    last: str | None = None
    for number, raw in enumerate(lines, start=1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            last = None
            continue
        if line[0] in " \t":
            if last is None:
                raise InputError("header: continuation line with no field before it", line=number)
            fields[last][-1] += "\n" + line.strip()
            continue
        match = HEADER_FIELD_RE.fullmatch(line)
        if not match:
            raise InputError(f"header: expected 'Field: value', got {line[:60]!r}", line=number)
        name, value = match.group(1), match.group(2).strip()
        if name not in SINGLE_FIELDS and name not in REPEATABLE_FIELDS:
            raise InputError(f"header: unknown field {name!r}", line=number)
        if name in SINGLE_FIELDS and name in fields:
            raise InputError(f"header: field {name!r} given twice", line=number)
        fields.setdefault(name, []).append(value)
        last = name
    _check_fields(fields)
    return fields


def _check_fields(fields: dict[str, list[str]]) -> None:
    if not fields.get("Description", [""])[0].strip():
        raise InputError("header: missing Description")
    if "Origin" not in fields and "Author" not in fields:
        raise InputError("header: needs an Origin or an Author field")
    status = fields.get("Upstream-Status")
    if status is None:
        raise InputError("header: missing Upstream-Status")
    if not UPSTREAM_STATUS_RE.fullmatch(status[0]):
        raise InputError(
            f"header: malformed Upstream-Status {status[0]!r} (expected Pending, Submitted [where], "
            "Backport, Denied, Inactive-Upstream or Inappropriate [reason])"
        )
    if "Last-Update" in fields and not DATE_RE.fullmatch(fields["Last-Update"][0]):
        raise InputError(f"header: malformed Last-Update {fields['Last-Update'][0]!r} (expected YYYY-MM-DD)")
    if "Standalone" in fields and fields["Standalone"][0] not in ("yes", "no"):
        raise InputError(f"header: Standalone must be 'yes' or 'no', got {fields['Standalone'][0]!r}")
    for name, values in fields.items():
        if any(not value.strip() for value in values):
            raise InputError(f"header: field {name!r} is empty")


def _walk(lines: list[bytes], start: int) -> tuple[list[list[tuple]], list[str]]:
    """Walk the diff as git apply would, refuse every line it would not account for, and
    collect each file's hunks, as the fields of a Hunk, with the exact bytes of their lines.
    Also returns the file-level lines (everything outside the hunks): what unidiff reads."""
    in_hunk = False  # after a hunk's body, until the next hunk or file
    file_label = "?"
    hunk_no = 0
    files: list[list[tuple]] = []  # per file: (number, old start, old count, new start, new count, lines)
    file_headers: list[str] = []
    body: list[tuple[str, bytes]] = []
    index, count = start, len(lines)
    while index < count:
        raw = lines[index]
        index += 1
        if in_hunk and raw.startswith(b"\\"):
            _no_newline(body)
            continue
        text = _text(raw)
        line = text.rstrip("\n")
        if line.endswith("\r"):
            line = line[:-1]
        if line.startswith("diff --git "):
            in_hunk = False
            hunk_no = 0
            file_label = _git_line_path(line, index)
            files.append([])
            file_headers.append(line + "\n")  # without a "\r": unidiff would keep it in paths
            continue
        if line.startswith("@@"):
            match = HUNK_HEADER_RE.fullmatch(line)
            if not match:
                raise InputError(f"malformed hunk header {line[:80]!r}", line=index)
            # a count left out of the header is 1, as in "@@ -0,0 +1 @@"
            old_start, old_count, new_start, new_count = match.groups()
            old_start, new_start = int(old_start), int(new_start)
            old_left, new_left = int(old_count) if old_count else 1, int(new_count) if new_count else 1
            if old_left == new_left == 0:
                raise InputError(f"hunk header {line!r} has no lines", line=index)
            in_hunk = True
            hunk_no += 1
            body = []
            files[-1].append((hunk_no, old_start, old_left, new_start, new_left, body))
            # the body: exactly as many lines as the header counts
            while old_left or new_left:
                if index >= count:
                    raise InputError(f"hunk {hunk_no} of {file_label} is shorter than its header says", line=count)
                raw = lines[index]
                index += 1
                kind = raw[:1]
                if kind == b" ":
                    body.append((" ", raw[1:]))
                    old_left -= 1
                    new_left -= 1
                elif kind == b"-":
                    body.append(("-", raw[1:]))
                    old_left -= 1
                elif kind == b"+":
                    body.append(("+", raw[1:]))
                    new_left -= 1
                elif raw == b"\n":  # an empty line is an empty context line, as git reads it
                    body.append((" ", raw))
                    old_left -= 1
                    new_left -= 1
                elif kind == b"\\":
                    _no_newline(body)
                    continue
                else:
                    raise InputError(f"hunk {hunk_no} of {file_label} is shorter than its header says", line=index)
                if old_left < 0 or new_left < 0:
                    raise InputError(f"hunk {hunk_no} of {file_label} has more lines than its header says", line=index)
            continue
        if in_hunk:
            raise InputError(f"hunk {hunk_no} of {file_label} has more lines than its header says", line=index)
        if line.startswith(("--- ", "+++ ")):
            side = "a/" if line[0] == "-" else "b/"
            named = line[4:].split("\t")[0]
            if named not in (side + file_label, "/dev/null"):
                expected = f"expected {side}{file_label} or /dev/null"
                raise InputError(f"{line[:4]}{named!r} does not match the 'diff --git' line ({expected})", line=index)
            file_headers.append(line + "\n")  # without a "\r": unidiff would keep it in paths
            continue
        if line.startswith("GIT binary patch") or line.startswith("Binary files "):
            raise InputError("binary diffs are not supported", line=index, path=file_label)
        for prefix, what in UNSUPPORTED_HEADERS.items():
            if line.startswith(prefix):
                raise InputError(
                    f"{what} is not supported (write a deletion and a new file)", line=index, path=file_label
                )
        if not line.startswith(GIT_HEADER_PREFIXES):
            raise InputError(f"unexpected line in the header of {file_label}: {line[:60]!r}", line=index)
        file_headers.append(line + "\n")  # without a "\r": unidiff would keep it in paths
    return [[hunk(*spec[:5], tuple(spec[5])) for spec in hunks] for hunks in files], file_headers


def _no_newline(body: list[tuple[str, bytes]]) -> None:
    """``\\ No newline at end of file``: the line before it has no line ending."""
    if body:
        kind, text = body[-1]
        body[-1] = (kind, text[:-1] if text.endswith(b"\n") else text)


def _git_line_path(line: str, index: int) -> str:
    """The one path a "diff --git a/P b/P" line (line ``index``) names (renames and copies are refused)."""
    rest = line[len("diff --git ") :]
    half = (len(rest) - 1) // 2
    old, new = rest[:half], rest[half + 1 :]
    if rest[half : half + 1] == " " and old.startswith("a/") and new.startswith("b/") and old[2:] == new[2:]:
        return old[2:]  # the usual line (its halves then cannot read as a rename below)
    match = _TWO_PATHS_RE.fullmatch(rest)
    if match and match.group(1) != match.group(2):
        raise InputError(
            "renames and copies are not supported (write a deletion and a new file)",
            line=index,
            path=f"{match.group(1)} -> {match.group(2)}",
        )
    if rest[half : half + 1] != " " or not old.startswith("a/") or not new.startswith("b/") or old[2:] != new[2:]:
        raise InputError(f"expected 'diff --git a/PATH b/PATH' naming one path, got {line[:80]!r}", line=index)
    return old[2:]


def _tree_path(raw: str, prefix: str) -> str | None:
    if raw == "/dev/null":
        return None
    if "\0" in raw:
        raise InputError(f"path {raw!r} contains a NUL byte")
    if not raw.startswith(prefix):
        raise InputError(f"path {raw!r} lacks the git prefix {prefix!r}")
    path = raw[len(prefix) :]
    wrapped = f"/{path}/"  # a part that is "", "." or "..", at either end too
    if not path or "//" in wrapped or "/./" in wrapped or "/../" in wrapped or "\\" in path:
        raise InputError(f"path {path!r} is outside the tree (absolute, '..', or empty parts)")
    if "/.git/" in wrapped.lower():  # git's own files, on any file system's idea of case
        raise InputError(f"path {path!r} is inside a .git directory")
    return path


def _file_patches(file_headers: list[str], hunks: list[list[tuple]]) -> tuple[tuple, ...]:
    """File-level facts from unidiff (paths, extended headers); hunks from the strict walk."""
    try:
        patch_set = unidiff.PatchSet(file_headers, metadata_only=True)
    except unidiff.UnidiffParseError as exc:
        raise InputError(f"malformed diff: {exc}") from None
    files: list[tuple] = []
    seen: set[str] = set()
    if len(patch_set) != len(hunks):
        raise InputError(f"unidiff read {len(patch_set)} file patches where the diff has {len(hunks)}")
    for patched, file_hunks in zip(patch_set, hunks, strict=True):
        info = [str(line) for line in patched.patch_info]
        new_mode = next((i.split()[-1] for i in info if i.startswith("new file mode ")), None)
        # every form a mode takes in a git diff: a new or deleted file's, and an index line's
        modes = [i.split()[-1] for i in info if i.startswith(("new file mode ", "deleted file mode "))]
        modes += [i.split()[2] for i in info if i.startswith("index ") and len(i.split()) == 3]
        for mode in modes:
            if mode not in ("100644", "100755"):
                raise InputError(
                    f"file mode {mode} is not supported (symlinks and submodules are refused)", path=patched.path
                )
        old_path = _tree_path(patched.source_file, "a/")
        new_path = _tree_path(patched.target_file, "b/")
        if old_path is None and new_path is None:
            raise InputError("a file patch has /dev/null on both sides")
        if old_path and new_path and old_path != new_path:
            raise InputError(f"{old_path} -> {new_path}: renames are not supported")
        path = new_path or old_path
        diff_line = info[0].strip() if info else ""
        if diff_line != f"diff --git a/{path} b/{path}":
            raise InputError(f"'diff --git' line does not name the same path: {diff_line[:80]!r}", path=path)
        if path in seen:
            raise InputError(f"{path} is patched twice in one member")
        seen.add(path)
        if not file_hunks:
            raise InputError("no hunks", path=path)
        files.append((old_path, new_path, new_mode, tuple(file_hunks)))
    return tuple(files)


def _normalize(files: tuple[tuple, ...]) -> bytes:
    """The diff re-rendered canonically: no header prose, timestamps, index lines or section text."""
    out: list[bytes] = []
    for old_path, new_path, new_mode, hunks in files:
        if new_mode:
            out.append(f"new file mode {new_mode}\n".encode())
        out.append(f"--- {'a/' + old_path if old_path else '/dev/null'}\n".encode("utf-8", "surrogateescape"))
        out.append(f"+++ {'b/' + new_path if new_path else '/dev/null'}\n".encode("utf-8", "surrogateescape"))
        for _, old_start, old_len, new_start, new_len, lines, *_ in hunks:
            out.append(hunk_header(old_start, old_len, new_start, new_len).encode() + b"\n")
            body = b"".join([_KIND_BYTES[kind] + text for kind, text in lines])
            if body.count(b"\n") == len(lines):  # every line ends with a newline: the usual case
                out.append(body)
                continue
            for kind, text in lines:
                out.append(_KIND_BYTES[kind] + text)
                if not text.endswith(b"\n"):
                    out.append(b"\n\\ No newline at end of file\n")
    return b"".join(out)


_KIND_BYTES = {" ": b" ", "-": b"-", "+": b"+"}


def load_recipe_members(recipe: Recipe) -> tuple[Member, ...]:
    """The recipe's members, in its order, each parsed and validated."""
    return tuple(load_member(recipe.member_path(name), name) for name in recipe.members)
