"""Members made from a source file, as gbp-pq makes patches from commits.

The rule: a member ``overlay/<name>.patch`` with a sibling ``overlay/<name>.py``
is generated.  Its body is a single new-file diff, of the path its own
``diff --git`` line names, whose content is ``<name>.py``; its header (the text
before that line) is the maintainer's and is kept as it is.  The ``.patch``
stays the shipped unit (its runtime key is computed from it as from any
member); ``vllm-overlay members`` writes it from the source, and loading a
member refuses one that disagrees with its source (``check_generated``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import NamedTuple

from builder.cache import atomic_write, read_regular
from builder.errors import InputError
from builder.members import MEMBER_LIMIT, _git_line_path, member_bytes, parse_member, split_lines
from builder.recipe import Recipe

SOURCE_SUFFIX = ".py"
_NO_NEWLINE = b"\\ No newline at end of file\n"


def source_of(patch: Path | str) -> str:
    """The source file a member ``<dir>/<name>.patch`` would be made from: ``<dir>/<name>.py``."""
    text = str(patch)
    return (text[: -len(".patch")] if text.endswith(".patch") else text) + SOURCE_SUFFIX


def blob_id(data: bytes) -> str:
    """git's object name for ``data`` as a blob (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def generate(header: bytes, tree_path: str, source: bytes) -> bytes:
    """The member's bytes: ``header`` unchanged, then the new-file diff of ``tree_path`` with
    content ``source``, exactly as ``git diff`` writes it."""
    if not source:
        raise ValueError("an empty source makes no hunk")
    path = tree_path.encode("utf-8", "surrogateescape")
    lines = split_lines(source)
    count = b"%d" % len(lines) if len(lines) != 1 else b""  # git leaves out a count of 1
    out = [
        header,
        b"diff --git a/%s b/%s\n" % (path, path),
        b"new file mode 100644\n",
        b"index 0000000..%s\n" % blob_id(source)[:7].encode(),
        b"--- /dev/null\n",
        b"+++ b/%s\n" % path,
        b"@@ -0,0 +1" + (b"," + count if count else b"") + b" @@\n",
    ]
    out.extend(b"+" + line for line in lines)
    if not lines[-1].endswith(b"\n"):
        out.append(b"\n" + _NO_NEWLINE)
    return b"".join(out)


def split_generated(data: bytes, source: str = SOURCE_SUFFIX) -> tuple[bytes, str]:
    """A generated member's header (its bytes before the ``diff --git`` line) and the path its
    single new-file diff names; InputError when its diff is not one new-file diff.
    ``source``: the file beside it, for the message."""
    lines = split_lines(data)
    starts = [i for i, line in enumerate(lines) if line.startswith(b"diff --git ")]
    why = f"made from {source}, so its diff must be a single new-file diff"
    if len(starts) != 1:
        raise InputError(f"{why}, but it has {len(starts)} 'diff --git' lines")
    start = starts[0]
    line = lines[start].decode("utf-8", "surrogateescape").rstrip("\r\n")
    path = _git_line_path(line, start + 1)
    file_header = []
    for raw in lines[start + 1 :]:
        if raw.startswith(b"@@"):
            break
        file_header.append(raw.rstrip(b"\r\n"))
    if b"--- /dev/null" not in file_header:
        raise InputError(f"{why}, but its diff of {path} is not a new file (no '--- /dev/null')")
    return b"".join(lines[:start]), path


def expected_bytes(path: Path, name: str, data: bytes, source: bytes) -> bytes:
    """What generated member ``name`` (its file ``path``, now ``data``) must hold for ``source``."""
    try:
        header, tree_path = split_generated(data, source_of(path))
        if not source:
            raise InputError(f"{source_of(path)} is empty (a new file needs at least one line)")
    except InputError as exc:
        raise exc.located(file=path, member=name) from None
    return generate(header, tree_path, source)


def _read_source(path: Path, name: str) -> bytes:
    try:
        return read_regular(source_of(path), MEMBER_LIMIT, "a member's source")
    except OSError as exc:
        raise InputError(f"cannot read {source_of(path)}: {exc}", file=path, member=name) from None


def check_generated(path: Path, name: str, data: bytes) -> None:
    """The load-time rule: member ``name`` (bytes ``data``), which has a source beside it, must be
    what that source makes."""
    if data != expected_bytes(path, name, data, _read_source(path, name)):
        raise InputError(f"out of date with {source_of(path)}; run make members", file=path, member=name)


class Generated(NamedTuple):
    """A generated member of a recipe: its file now, and what its source makes."""

    name: str
    path: Path
    current: bytes
    wanted: bytes

    @property
    def stale(self) -> bool:
        return self.current != self.wanted


def generated_members(recipe: Recipe) -> list[Generated]:
    """The recipe's members that have a source beside them, each with the bytes it must hold.
    What it must hold is parsed as a member is: a header or path the source cannot mend is
    refused here (InputError), before anything is written."""
    found = []
    for name in recipe.members:
        path = recipe.member_path(name)
        if not Path(source_of(path)).exists():
            continue
        current = member_bytes(path, name)
        wanted = expected_bytes(path, name, current, _read_source(path, name))
        parse_member(name, path, wanted)
        found.append(Generated(name, path, current, wanted))
    return found


def regenerate(members: list[Generated]) -> None:
    """Write each stale member from its source, each file atomically (temp file and rename),
    keeping its mode (the temp file is made 0600)."""
    for member in members:
        if member.stale:
            mode = os.stat(member.path).st_mode & 0o7777
            atomic_write(member.path, member.wanted)
            os.chmod(member.path, mode)
