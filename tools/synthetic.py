"""Synthetic inputs: members made with real `git diff --no-index`, recipes around them,
and a warm cache for one wheel.  Pins are the default recipe's, read from it."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = ROOT / "recipes" / "v41-sm120.yaml"


def _pin(project: str) -> dict[str, str]:
    """The default recipe's pin of ``project`` (version, wheel, sha256): read, never copied."""
    with open(DEFAULT_RECIPE, encoding="utf-8") as f:
        pin = yaml.safe_load(f)[project]
    return {field: pin[field] for field in ("version", "wheel", "sha256")}


VLLM_PIN = _pin("vllm")
FLASHINFER_PIN = _pin("flashinfer")
HEADER = """Description: {description}
Author: vllm-overlay tests <tests@example.invalid>
Upstream-Status: Inappropriate [test fixture]
"""


def git_diff(before: dict[str, bytes | None], after: dict[str, bytes | None]) -> str:
    """A git-style diff made by `git diff --no-index` between two temp trees, paths rewritten to a/ b/."""
    with tempfile.TemporaryDirectory() as tmp:
        chunks = []
        for path in sorted(set(before) | set(after)):
            old, new = before.get(path), after.get(path)
            sides = []
            for side, data in (("old", old), ("new", new)):
                if data is None:
                    sides.append("/dev/null")
                    continue
                file = Path(tmp, side, path)
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_bytes(data)
                sides.append(f"{side}/{path}")
            proc = subprocess.run(
                ["git", "diff", "--no-index", "--no-color", "--", *sides], cwd=tmp, capture_output=True
            )
            assert proc.returncode in (0, 1), proc.stderr
            chunks.append(proc.stdout.decode("utf-8", "surrogateescape"))
    text = "".join(chunks)
    # git names both sides after the temp dirs; a member names tree paths.
    return re.sub(
        r"(?m)^(diff --git |--- |\+\+\+ )(.*)$",
        lambda m: m.group(1) + re.sub(r"\b([ab])/(old|new)/", r"\1/", m.group(2)),
        text,
    )


def member_text(diff: str, description: str = "test member", extra: str = "") -> str:
    return HEADER.format(description=description) + extra + "\n" + diff


def write_recipe(
    directory: Path,
    members: dict[str, str],
    order: list[str] | None = None,
    *,
    vllm: dict | None = None,
    extra: str = "",
) -> Path:
    """A recipe in ``directory`` with its members in ``directory/overlay``."""
    overlay = directory / "overlay"
    overlay.mkdir(parents=True, exist_ok=True)
    for name, text in members.items():
        (overlay / f"{name}.patch").write_bytes(text.encode("utf-8", "surrogateescape"))
    pin = dict(VLLM_PIN, **(vllm or {}))
    vllm_lines = "".join(f'  {k}: "{v}"\n' for k, v in pin.items())
    names = order if order is not None else list(members)
    text = (
        "name: test\n"
        f"vllm:\n{vllm_lines}"
        "flashinfer:\n" + "".join(f'  {k}: "{v}"\n' for k, v in FLASHINFER_PIN.items()) + "image:\n"
        "  base: nvidia/cuda:12.8.1-devel-ubuntu24.04\n"
        '  cuda: "12.8.1"\n'
        '  torch_cuda_arch_list: "12.0"\n'
        '  flashinfer_cuda_arch_list: "12.0a"\n'
        '  python: "3.12"\n'
        "  repository: vllm-overlay/test\n"
        f"members: [{', '.join(names)}]\n"
        "overlay: overlay\n" + extra
    )
    path = directory / "recipe.yaml"
    path.write_text(text)
    return path


def warm_cache_copy(wheel: Path, cache: Path) -> Path:
    """A cache as a warm run has it, for one wheel: (a link to) the verified wheel and its
    remembered hash, taken from the user cache."""
    from builder.cache import cache_root

    dest = cache / "wheels" / wheel.parent.name / wheel.name
    dest.parent.mkdir(parents=True)
    dest.symlink_to(wheel)
    memo = json.loads((cache_root() / "verified.json").read_text())
    (cache / "verified.json").write_text(json.dumps({str(wheel.resolve()): memo[str(wheel.resolve())]}))
    return cache


MANY_HUNKS_FILE = "pkg/big.py"


def many_hunks(count: int, touched: bool) -> tuple[bytes, tuple[str, ...]]:
    """A file of 10 * count lines (``MANY_HUNKS_FILE``) and the diffs of the members applied
    to it, in order, for the many-hunk test and bench.

    The last member edits every tenth line (``count`` hunks); its diff was made against a
    copy that lacks a line at 500 of every 1000 and has one more at 900, so the hunks in
    between are one line off.  When ``touched``, an earlier member first adds 4 lines at the
    top (every hunk is 4 more off) and rewrites a line every 200 that the last member's diff
    already has (so those hunks read the earlier member's lines)."""
    path = MANY_HUNKS_FILE
    lines = [b"line %d: value = %d\n" % (i, i * 7 % 1000) for i in range(10 * count)]
    earlier = {i: b"# earlier member %d\n" % i for i in range(3, len(lines), 200)} if touched else {}
    base = b"".join(lines)
    diffs = []
    if touched:
        first = [b"# earlier member\n"] * 4 + [earlier.get(i, line) for i, line in enumerate(lines)]
        diffs.append(git_diff({path: base}, {path: b"".join(first)}))
    before, after = [], []
    for i, line in enumerate(lines):
        if i % 1000 == 500:
            continue
        line = earlier.get(i, line)
        pad = b"# pad\n" if i % 1000 == 900 else b""
        before.append(line + pad)
        after.append((b"edited %d\n" % i if i % 10 == 5 else line) + pad)
    diffs.append(git_diff({path: b"".join(before)}, {path: b"".join(after)}))
    return base, tuple(diffs)
