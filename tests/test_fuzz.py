"""Fuzz: mutated members, recipes and command lines never crash the builder (issue 12).

The contract every run is held to (README, "Exit codes" and "What the tool never does"):
exit 0, or one error line ``vllm-overlay: …`` as the last stderr line (progress lines such
as "applied NAME" may come before it) with exit 2 for bad input, never a traceback, and
nothing written.  A mutated member or recipe that still parses may exit 0, but then a
second run on the same input gives the same key and the same files, and the manifest's
hashes are those of the files.

Everything runs in this process through ``builder.cli.main`` on a small local tree (the
recipe's ``vllm.path``), with the network refused: no wheel and no service is needed.
Hypothesis runs are derandomized and bounded, so CI sees the same examples every time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder.cli import main
from tests.helpers import snapshot
from tools.synthetic import ROOT, git_diff, member_text, write_recipe

FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ------------------------------------------------------------------------- running the CLI


@dataclasses.dataclass
class Run:
    """One in-process run of the CLI: exit code, stdout, stderr, and the traceback of an
    exception that escaped main() (which a user would see as a Python traceback)."""

    code: int | None
    out: str
    err: str
    escaped: str | None = None

    def show(self) -> str:
        return f"exit {self.code}\n--- stdout\n{self.out}--- stderr\n{self.err}" + (
            f"--- escaped main()\n{self.escaped}" if self.escaped else ""
        )


def _refused_network(*args, **kwargs):
    raise urllib.error.URLError("the network is refused in this test")


def run_main(argv: list[str], *, network: bool = False) -> Run:
    """builder.cli.main(argv) with stdout and stderr captured; SystemExit (argparse) is an exit."""
    out, err = io.StringIO(), io.StringIO()
    refuse = contextlib.nullcontext() if network else mock.patch.object(urllib.request, "urlopen", _refused_network)
    with refuse, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:
            return Run(None, out.getvalue(), err.getvalue(), traceback.format_exc())
    return Run(code, out.getvalue(), err.getvalue())


def assert_one_line(run: Run, codes: set[int] | frozenset[int] = frozenset({1, 2, 3}), text: str = "") -> str:
    """A failed run: an exit code in ``codes`` and one error line, the last on stderr
    (progress lines may come before it), which says ``text``; no traceback.  Returns it."""
    assert run.escaped is None, run.show()
    assert run.code in codes, run.show()
    lines = run.err.splitlines()
    errors = [line for line in lines if line.startswith("vllm-overlay: ")]
    assert len(errors) == 1 and lines[-1:] == errors, run.show()
    assert "Traceback (most recent call last)" not in run.err, run.show()
    assert "please report" not in errors[0], run.show()  # an internal error is a bug, never an answer
    assert text in errors[0], run.show()
    return errors[0]


def proc_one_line(proc: subprocess.CompletedProcess, codes: set[int] | frozenset[int], text: str = "") -> str:
    """The same for a ``python -m builder`` process."""
    return assert_one_line(Run(proc.returncode, proc.stdout, proc.stderr), codes, text)


def run_module(*args: str, cwd: Path, env: dict[str, str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """``python -m builder ARGS`` with this checkout importable; a hang past ``timeout`` fails."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full.pop("VLLM_OVERLAY_REPOSITORY", None)
    try:
        return subprocess.run(
            [sys.executable, "-m", "builder", *args],
            cwd=cwd,
            env=full,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"python -m builder {' '.join(args)} still ran after {timeout} s (killed); stderr: {exc.stderr!r}")


# ------------------------------------------------------------------ the project a run reads

# The base tree: what the members patch (small, with a file lacking its final newline).
A_PY = b"".join(b"line %d\n" % i for i in range(1, 31))
TREE = {
    "vllm/__init__.py": b"x = 1\n",
    "vllm/a.py": A_PY,
    "vllm/c.py": b"first\nlast",
    "vllm/old.py": b"gone = True\n",
}


@functools.cache
def members() -> dict[str, bytes]:
    """Two members: ``fix`` modifies, adds, deletes and edits a last line without a newline;
    ``more`` patches the file ``fix`` added (so their order matters)."""
    a_fixed = A_PY.replace(b"line 5\n", b"line five\n").replace(b"line 25\n", b"line 25\nline 25.5\n")
    b_py = b"def b():\n    return 2\n"
    fix = git_diff(
        {"vllm/a.py": A_PY, "vllm/b.py": None, "vllm/c.py": TREE["vllm/c.py"], "vllm/old.py": TREE["vllm/old.py"]},
        {"vllm/a.py": a_fixed, "vllm/b.py": b_py, "vllm/c.py": b"first\nLAST", "vllm/old.py": None},
    )
    more = git_diff({"vllm/b.py": b_py}, {"vllm/b.py": b_py.replace(b"return 2", b"return 3")})
    extra = "Bug: https://example.invalid/1\nLast-Update: 2026-11-29\nStandalone: no\n"
    return {
        "fix": member_text(fix, "Fix a and c,\n add b, drop old.", extra).encode(),
        "more": member_text(more, "b returns 3").encode(),
    }


@dataclasses.dataclass
class Project:
    root: Path
    recipe: Path
    out: Path
    cache: Path

    def member(self, name: str) -> Path:
        return self.root / "overlay" / f"{name}.patch"


@contextlib.contextmanager
def project(member_bytes: dict[str, bytes] | None = None) -> Iterator[Project]:
    """A fresh project in a temp directory: the tree, the members, a recipe on the tree, an
    empty cache ($VLLM_OVERLAY_CACHE for the duration)."""
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-fuzz.") as tmp:
        root = Path(tmp)
        for path, data in TREE.items():
            (root / "tree" / path).parent.mkdir(parents=True, exist_ok=True)
            (root / "tree" / path).write_bytes(data)
        recipe = write_recipe(root, {}, ["fix", "more"], vllm={"path": str(root / "tree")})
        for name, data in (member_bytes or members()).items():
            (root / "overlay" / f"{name}.patch").write_bytes(data)
        cache = root / "cache"
        cache.mkdir()
        env = {"VLLM_OVERLAY_CACHE": str(cache)}
        with mock.patch.dict(os.environ, env):
            os.environ.pop("VLLM_OVERLAY_REPOSITORY", None)
            yield Project(root, recipe, root / "out", cache)


def check_apply(p: Project, *, failure_codes: frozenset[int] = frozenset({2})) -> Run:
    """``apply --out`` on the project as it is, held to the contract: exit 0 and a second
    run giving the same key and files, with a manifest true to them (and ``key`` agreeing);
    or one line, an exit code in ``failure_codes``, nothing written, and the same answer again."""
    argv = ["apply", str(p.recipe), "--out", str(p.out)]
    before = snapshot(p.root)
    first = run_main(argv)
    assert first.escaped is None, first.show()
    if first.code != 0:
        assert_one_line(first, failure_codes)
        assert first.out == "", first.show()
        assert snapshot(p.root) == before, "a refused run changed the project, the cache or the output"
        again = run_main(argv)
        assert (again.code, again.err) == (first.code, first.err), again.show()
        return first
    assert "Traceback" not in first.err, first.show()
    key = first.out.strip()
    assert key.startswith("rk-") and first.out == key + "\n", first.show()
    files = snapshot(p.out)
    _check_manifest(p, key)
    shutil.rmtree(p.out)
    second = run_main(argv)
    assert second.code == 0 and second.out == first.out, second.show()
    assert snapshot(p.out) == files, "a second run on the same input wrote other files"
    keyed = run_main(["key", str(p.recipe)])
    assert keyed.code == 0 and keyed.out == first.out, keyed.show()
    return first


def _check_manifest(p: Project, key: str) -> None:
    """The manifest names the printed key; each file's hashes are those of the tree's file
    before and of the written file after; the output holds exactly the files it lists."""
    manifest = json.loads((p.out / "manifest.json").read_text())
    assert manifest["runtime_key"] == key
    written = {str(f.relative_to(p.out)) for f in p.out.rglob("*") if f.is_file()} - {
        "manifest.json",
        ".vllm-overlay-output",
    }
    listed = set()
    for row in manifest["files"]:
        base = p.root / "tree" / row["path"]
        before = hashlib.sha256(base.read_bytes()).hexdigest() if base.is_file() else None
        assert row["before_sha256"] == before, row
        if row["after_sha256"] is None:
            assert not (p.out / row["path"]).exists(), row
        else:
            listed.add(row["path"])
            assert hashlib.sha256((p.out / row["path"]).read_bytes()).hexdigest() == row["after_sha256"], row
    assert written == listed, (written, listed)


def test_the_unmutated_project_applies():
    """The fuzz starts from inputs that are good: both members apply, in order."""
    with project() as p:
        run = check_apply(p)
        assert run.code == 0, run.show()
        assert (p.out / "vllm/b.py").read_bytes() == b"def b():\n    return 3\n"
        assert (p.out / "vllm/c.py").read_bytes() == b"first\nLAST"
        assert not (p.out / "vllm/old.py").exists()


# ------------------------------------------------------------------------------ mutations

# Bytes worth inserting: line structure, encodings, control characters, diff and YAML syntax.
TOKENS = [
    b"\n",
    b"\r",
    b"\r\n",
    b"\x00",
    b"\t",
    b" ",
    b"\x0c",
    b"\x1b[31m",
    b"\xe2\x80\xae",  # RIGHT-TO-LEFT OVERRIDE
    b"\xef\xbb\xbf",  # BOM
    b"\xff\xfe",
    b"\xc3",  # a truncated UTF-8 sequence
    b"\xed\xa0\x80",  # an encoded surrogate
    "é".encode(),
    b"+",
    b"-",
    b"\\",
    b"@@",
    b"@@ -1,1 +1,1 @@\n",
    b"\\ No newline at end of file\n",
    b"diff --git a/vllm/a.py b/vllm/a.py\n",
    b"diff --git a/vllm/x.py b/vllm/y.py\n",
    b"--- a/vllm/a.py\n",
    b"+++ b/../etc/passwd\n",
    b"--- /dev/null\n",
    b"new file mode 120000\n",
    b"deleted file mode 160000\n",
    b"index 0000000..1111111 100644\n",
    b"GIT binary patch\n",
    b"rename from vllm/a.py\n",
    b"old mode 100644\n",
    b"Binary files a/x and b/x differ\n",
    b"9" * 40,
    b"9" * 5000,
]
HEADER_NAMES = [
    "Description",
    "Author",
    "Origin",
    "Bug",
    "Reviewed-by",
    "Forwarded",
    "Applied-Upstream",
    "Last-Update",
    "Upstream-Status",
    "Standalone",
    "X-Unknown",
    "description",
    "Bug ",
    " Bug",
    "",
    "Ünïcode",
    "Upstream-Status:",
]
HEADER_VALUES = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        ["yes", "no", "Pending", "Submitted [x]", "Inappropriate []", "2026-13-45", "2026-11-29", "", " ", "\x00"]
    ),
)
HUNK_NUMBERS = st.one_of(
    st.integers(0, 40).map(str),
    st.sampled_from(["-1", "99999999999999999999", "9" * 5000, "1e3", "0x10", " 1", "١"]),
)

positions = st.integers(0, 1 << 16)
MUTATION = st.one_of(
    st.tuples(st.just("flip"), positions, st.integers(1, 255)),
    st.tuples(st.just("insert"), positions, st.one_of(st.sampled_from(TOKENS), st.binary(min_size=1, max_size=6))),
    st.tuples(st.just("delete"), positions, st.integers(1, 24)),
    st.tuples(st.just("truncate"), positions),
    st.tuples(st.just("duplicate line"), positions),
    st.tuples(st.just("drop line"), positions),
    st.tuples(st.just("swap lines"), positions, positions),
    st.tuples(st.just("header field"), st.integers(0, 6), st.sampled_from(HEADER_NAMES), HEADER_VALUES),
    st.tuples(st.just("hunk header"), positions, HUNK_NUMBERS, HUNK_NUMBERS, HUNK_NUMBERS, HUNK_NUMBERS),
    st.tuples(st.just("bom")),
    st.tuples(st.just("crlf")),
)


def mutate(data: bytes, mutation: tuple) -> bytes:
    """One mutation applied to ``data`` (positions are taken modulo its size)."""
    kind, *args = mutation
    size = len(data)
    lines = data.splitlines(keepends=True)
    if kind == "flip":
        if not data:
            return data
        at = args[0] % size
        return data[:at] + bytes([data[at] ^ args[1]]) + data[at + 1 :]
    if kind == "insert":
        at = args[0] % (size + 1)
        return data[:at] + args[1] + data[at:]
    if kind == "delete":
        at = args[0] % (size + 1)
        return data[:at] + data[at + args[1] :]
    if kind == "truncate":
        return data[: args[0] % (size + 1)]
    if kind in ("duplicate line", "drop line", "swap lines"):
        if not lines:
            return data
        i = args[0] % len(lines)
        if kind == "duplicate line":
            lines.insert(i, lines[i])
        elif kind == "drop line":
            del lines[i]
        else:
            j = args[1] % len(lines)
            lines[i], lines[j] = lines[j], lines[i]
        return b"".join(lines)
    if kind == "header field":
        at, name, value = args
        start = next((i for i, line in enumerate(lines) if line.startswith(b"diff --git ")), len(lines))
        lines.insert(min(at, start), f"{name}: {value}\n".encode())
        return b"".join(lines)
    if kind == "hunk header":
        headers = [i for i, line in enumerate(lines) if line.startswith(b"@@ ")]
        if not headers:
            return data
        i = headers[args[0] % len(headers)]
        old_start, old_len, new_start, new_len = args[1:]
        lines[i] = f"@@ -{old_start},{old_len} +{new_start},{new_len} @@\n".encode()
        return b"".join(lines)
    if kind == "bom":
        return b"\xef\xbb\xbf" + data
    if kind == "crlf":
        return data.replace(b"\n", b"\r\n")
    raise AssertionError(kind)


# ------------------------------------------------------------------ B: mutated members


@FUZZ
@given(name=st.sampled_from(["fix", "more"]), mutations=st.lists(MUTATION, min_size=1, max_size=3))
def test_mutated_member_applies_the_same_twice_or_is_one_line(name, mutations):
    data = members()[name]
    for mutation in mutations:
        data = mutate(data, mutation)
    with project() as p:
        earlier = run_main(["apply", str(p.recipe), "--out", str(p.out)])  # what a refused run must keep
        assert earlier.code == 0, earlier.show()
        p.member(name).write_bytes(data)
        check_apply(p)


# What the key never depends on (README, "The runtime key"): header prose, index lines,
# hunk section text.
PROSE = st.text(st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs")), min_size=1, max_size=40).filter(
    lambda text: text.strip() == text
)
PROSE_MUTATION = st.one_of(
    st.tuples(st.just("Description"), PROSE),
    st.tuples(st.just("Bug"), PROSE),
    st.tuples(st.just("Forwarded"), PROSE),
    st.tuples(st.just("index"), st.text("0123456789abcdef", min_size=7, max_size=40)),
    st.tuples(st.just("section"), positions, PROSE),
)


def mutate_prose(data: bytes, mutation: tuple) -> bytes:
    kind, *args = mutation
    lines = data.splitlines(keepends=True)
    if kind == "Description":  # its first line rewritten
        at = next(i for i, line in enumerate(lines) if line.startswith(b"Description:"))
        lines[at] = f"Description: {args[0]}\n".encode()
    elif kind in ("Bug", "Forwarded"):  # a field added (Forwarded replaces any earlier one)
        lines = [line for line in lines if kind == "Bug" or not line.startswith(b"Forwarded:")]
        lines.insert(0, f"{kind}: {args[0]}\n".encode())
    elif kind == "index":
        index = f"index {args[0][:7]}..{args[0][-7:]} 100644\n".encode()
        lines = [index if line.startswith(b"index ") else line for line in lines]
    else:  # a hunk header's section text
        headers = [i for i, line in enumerate(lines) if line.startswith(b"@@ ")]
        i = headers[args[0] % len(headers)]
        lines[i] = lines[i][: lines[i].rindex(b"@@") + 2] + f" {args[1]}\n".encode()
    return b"".join(lines)


@settings(FUZZ, max_examples=40)
@given(name=st.sampled_from(["fix", "more"]), mutations=st.lists(PROSE_MUTATION, min_size=1, max_size=3))
def test_prose_index_lines_and_section_text_never_change_the_key_or_the_files(name, mutations):
    with project() as p:
        clean = run_main(["apply", str(p.recipe), "--out", str(p.out)])
        assert clean.code == 0, clean.show()
        files = snapshot(p.out)
        data = members()[name]
        for mutation in mutations:
            data = mutate_prose(data, mutation)
        p.member(name).write_bytes(data)
        run = check_apply(p)
        assert run.code == 0 and run.out == clean.out, run.show()
        assert snapshot(p.out) == files


ODD_MEMBERS = {
    "empty": lambda: b"",
    "only a BOM": lambda: b"\xef\xbb\xbf",
    "NUL bytes": lambda: b"\x00" * 4096,
    "not UTF-8": lambda: b"\xff\xfe" + members()["fix"],
    "UTF-16": lambda: members()["fix"].decode().encode("utf-16"),
    "CR line ends only": lambda: members()["fix"].replace(b"\n", b"\r"),
    "a header and nothing else": lambda: members()["fix"].split(b"diff --git")[0],
    "a diff with no header": lambda: b"diff --git" + members()["fix"].split(b"diff --git", 1)[1],
    "one huge line": lambda: b"Description: " + b"x" * (1 << 20) + b"\n",
    "many tiny hunks": lambda: members()["fix"] + b"@@ -1,1 +1,1 @@\n-x\n+y\n" * 2000,
}


@pytest.mark.parametrize("what", list(ODD_MEMBERS))
def test_odd_member_files_are_one_line(what):
    with project({**members(), "fix": ODD_MEMBERS[what]()}) as p:
        run = check_apply(p)
        assert run.code == 2, run.show()


# ------------------------------------------------------------------ B: mutated recipes

# YAML values to put where a recipe value was: every type, huge and odd numbers, tags,
# aliases (recursive too), unhashable keys, strings that are not what they look like.
YAML_VALUES = [
    "~",
    "null",
    "''",
    "true",
    "yes",
    "on",
    "0",
    "-1",
    "3.12",
    "0x1f",
    "0o17",
    "1_000",
    "12:30:00",
    "1e400",
    "-.inf",
    ".nan",
    "9" * 5000,
    "-" + "9" * 5000,
    "0." + "9" * 5000,
    "2001-12-14",
    "2001-12-14t21:59:43.10-05:00",
    "[]",
    "{}",
    "[a, b]",
    "[[[[[]]]]]",
    "{a: 1}",
    "{? [a] : 1}",
    "{[a]: 1}",
    "{{a: 1}: 2}",
    "{? {a: 1}}",
    "&a [*a]",
    "&m {k: *m}",
    "*undefined",
    "&x fix",
    "!!binary aGVsbG8=",
    "!!binary '!!!'",
    "!!set {a, b}",
    "!!omap [{a: 1}, {b: 2}]",
    "!!pairs [{a: 1}]",
    "!!timestamp 2001-12-14",
    "!!str 3.12",
    "!!float 3.12",
    "!!int '0x1f'",
    "!!int 'x'",
    "!!bool 'maybe'",
    "!!python/object/apply:os.system ['true']",
    "!!python/name:builtins.print",
    "!custom x",
    "!<tag:example.com,2000:x> y",
    '"\\ud800"',
    '"\\udcff"',
    '"\\x00"',
    '"\\e[31m"',
    '"\\u202e"',
    '"a\\nb"',
    '"\\t"',
    "|\n    block\n",
    ">-\n    folded\n",
    "'single ''quoted'''",
    "[" * 200 + "]" * 200,
    "{a: " * 200 + "1" + "}" * 200,
    "{a: " * 1200 + "1" + "}" * 1200,
]
# Lines to add at the top level.
YAML_LINES = [
    "? [a]\n: 1\n",
    "? {a: 1}\n: 1\n",
    "? !!set {a}\n: 1\n",
    "<<: {name: other}\n",
    "<<: *undefined\n",
    "name: again\n",
    "%YAML 1.1\n",
    "---\n",
    "...\n",
    "--- !!map\n",
    "&anchor\n",
    "x: &big [&a [1, 1, 1, 1, 1, 1, 1, 1], *a, *a, *a, *a, *a, *a, *a]\n",
    "\t\n",
    "# a comment \x85 with NEL\n",
    "\ufeffname: bom\n",
]
YAML_MUTATION = st.one_of(
    st.tuples(st.just("value"), positions, st.sampled_from(YAML_VALUES)),
    st.tuples(st.just("value"), positions, st.integers(-(1 << 70), 1 << 70).map(str)),
    st.tuples(st.just("value"), positions, st.text(max_size=12).map(json.dumps)),
    st.tuples(st.just("line"), positions, st.sampled_from(YAML_LINES)),
    st.tuples(st.just("bytes"), MUTATION),
)


def mutate_recipe(text: bytes, mutation: tuple) -> bytes:
    kind, *args = mutation
    if kind == "bytes":
        return mutate(text, args[0])
    lines = text.splitlines(keepends=True)
    at = args[0] % (len(lines) + 1)
    if kind == "line":
        lines.insert(at, args[1].encode("utf-8", "surrogatepass"))
        return b"".join(lines)
    # "value": the value of a "key: value" line, or of a list item, becomes the snippet
    keyed = [i for i, line in enumerate(lines) if b": " in line or line.rstrip().endswith(b":")]
    if not keyed:
        return text
    i = keyed[at % len(keyed)]
    key = lines[i].split(b":", 1)[0]
    if key.strip() in (b"path", b"overlay") and not args[1].startswith(("[", "{", "!", "&", "*", "~", "null")):
        return text  # a string there names a directory: fuzz its type, never point it at /
    snippet = args[1].encode("utf-8", "surrogatepass")
    if b"\n" in snippet.rstrip(b"\n"):  # a block scalar: its lines indented under the key
        indent = len(key) - len(key.lstrip()) + 2
        snippet = snippet.replace(b"\n    ", b"\n" + b" " * indent)
    lines[i] = key + b": " + snippet.rstrip(b"\n") + b"\n"
    return b"".join(lines)


@FUZZ
@given(mutations=st.lists(YAML_MUTATION, min_size=1, max_size=3))
def test_mutated_recipe_applies_the_same_twice_or_is_one_line(mutations):
    with project() as p:
        earlier = run_main(["apply", str(p.recipe), "--out", str(p.out)])  # what a refused run must keep
        assert earlier.code == 0, earlier.show()
        text = p.recipe.read_bytes()
        for mutation in mutations:
            text = mutate_recipe(text, mutation)
        p.recipe.write_bytes(text)
        # a recipe that lost its vllm.path is valid and asks the index: refused network, exit 3
        check_apply(p, failure_codes=frozenset({2, 3}))


PATHOLOGICAL_RECIPES = {
    "nested lists, 100,000 deep": "x: " + "[" * 100_000 + "]" * 100_000 + "\n",
    "nested mappings, 1,000 deep": "x: " + "{a: " * 1000 + "1" + "}" * 1000 + "\n",
    "nested mappings, 100,000 deep": "x: " + "{a: " * 100_000 + "1" + "}" * 100_000 + "\n",
    "a billion laughs": "l0: &l0 [lol]\n"
    + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10)),
}


@pytest.mark.parametrize("what", [*PATHOLOGICAL_RECIPES, "a recipe over 1 MiB"])
def test_pathological_recipes_are_one_line_in_a_process(what):
    """YAML that could exhaust the C parser's stack or memory, and a recipe past the size
    limit: run as a process, which must end with one line (a crash or a signal is no answer)."""
    with project() as p:
        recipe = p.recipe.read_text()
        if what == "a recipe over 1 MiB":
            p.recipe.write_text("# padding\n" * 120_000 + recipe)
        else:
            p.recipe.write_text(recipe + PATHOLOGICAL_RECIPES[what])
        before = snapshot(p.root)
        proc = run_module("apply", str(p.recipe), "--out", str(p.out), cwd=p.root, env={}, timeout=60)
        proc_one_line(proc, {2})
        assert snapshot(p.root) == before


# ------------------------------------------------------------ A: any command line at all

ARGV_TOKENS = [
    "key",
    "apply",
    "check",
    "members",
    "dockerfile",
    "--out",
    "--full-tree",
    "--short",
    "--json",
    "--check",
    "--debug",
    "--",
    "-",
    "",
    "--bogus",
    "recipe.yaml",
    "missing.yaml",
    "overlay",
    "overlay/fix.patch",
    "tree",
    "cache",
    ".",
    "out",
    "out/inner",
    "\udcff",
    "-h",
]


@settings(FUZZ, max_examples=50)
@given(argv=st.lists(st.sampled_from(ARGV_TOKENS), max_size=6))
def test_any_command_line_is_an_answer_or_one_line(argv):
    """Random command lines (no image, probe or plan: they reach for services) in a project
    directory: exit 0 or one line with exit 1, 2 or 3; never a traceback."""
    with project() as p:
        cwd = os.getcwd()
        os.chdir(p.root)
        try:
            run = run_main(argv)
        finally:
            os.chdir(cwd)
        assert run.escaped is None, run.show()
        assert "Traceback" not in run.err, run.show()
        if run.code != 0:
            assert_one_line(run, {1, 2, 3})


ARGUMENT_ERRORS = {
    "no command": [],
    "an unknown command": ["nonsense"],
    "an unknown option": ["key", "recipe.yaml", "--bogus"],
    "a required option left out": ["dockerfile", "recipe.yaml"],
    "an option without its value": ["apply", "recipe.yaml", "--out"],
    "two recipes": ["key", "recipe.yaml", "recipe.yaml"],
}


@pytest.mark.parametrize("what", list(ARGUMENT_ERRORS))
def test_argument_errors_are_one_line(what):
    """argparse's refusals too: exit 2, the last line ``vllm-overlay: …`` (a usage line may
    come before it)."""
    with project() as p:
        cwd = os.getcwd()
        os.chdir(p.root)
        try:
            run = run_main(ARGUMENT_ERRORS[what])
        finally:
            os.chdir(cwd)
        assert_one_line(run, {2})
