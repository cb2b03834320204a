"""Test helpers: make members with real `git diff --no-index`, write recipes, run the CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = ROOT / "recipes" / "v41-sm120.yaml"
VLLM_PIN = {
    "version": "0.30.0",
    "wheel": "vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl",
    "sha256": "ef52ee58c410ead0b8afb190838fa4cbcb52075596f67862a03859d984966ac4",
}
FLASHINFER_PIN = {
    "version": "0.6.18.post1",
    "wheel": "flashinfer_python-0.6.18.post1-py3-none-any.whl",
    "sha256": "adb6d2952b47131138e108bd2999b1fe18b71f1a4c0b2684f168753db9563991",
}
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


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "builder", *map(str, args)],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
    )


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file below ``directory`` with its bytes, to show a failed run wrote nothing."""
    return {
        str(p.relative_to(directory)): (p.read_bytes() if p.is_file() and not p.is_symlink() else b"<link or dir>")
        for p in sorted(directory.rglob("*"))
    }


def warm_cache_copy(wheel: Path, cache: Path) -> Path:
    """A cache as a warm run has it, for one wheel: (a link to) the verified wheel, its
    remembered hash and its zip index, taken from the user cache; no parse memo."""
    from builder.pin import cache_root

    dest = cache / "wheels" / wheel.parent.name / wheel.name
    dest.parent.mkdir(parents=True)
    dest.symlink_to(wheel)
    memo = json.loads((cache_root() / "verified.json").read_text())
    (cache / "verified.json").write_text(json.dumps({str(wheel.resolve()): memo[str(wheel.resolve())]}))
    index = cache_root() / "zipindex" / f"{wheel.parent.name}.marshal"
    (cache / "zipindex").mkdir()
    shutil.copy(index, cache / "zipindex" / index.name)
    return cache
