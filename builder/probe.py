"""Probe: run the decode-shape self-test in four arms against the real vLLM tree.

Arms: the unpatched tree (the self-test member alone) and the patched tree
(the whole overlay), each with the argv as given and with the text-only
flags added.  Each arm runs the self-test module with an interpreter where
the pinned vLLM is importable (the probe venv, or ``--python``), through a
shadow package that differs from the installed vLLM only in the overlay's
files.  The installed files must be the pinned tree's (before hashes).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from builder.apply import OverlaySet, apply_members, sha256
from builder.cache import cache_root
from builder.errors import InputError
from builder.members import Member
from builder.probe_env import shadow_tree
from builder.tree import Tree

SELFTEST_MEMBER = "sm120_decode_shape_selftest"
SELFTEST_MODULE = "vllm.models.deepseek_v41.nvidia.sm120_decode_shape_selftest"
TEXT_ONLY = ["--language-model-only", "--hf-overrides.vision_n_layers", "0"]
# The self-test's kernel routes, in the order its table prints them.
ROUTES = ("decode kernel", "prefill single", "prefill dual")
RUN_TIMEOUT = 600


@dataclass(frozen=True)
class SelftestRun:
    returncode: int
    stdout: str
    stderr: str

    @property
    def verdict(self) -> str:
        """The last line of stdout: ``SELFTEST PASS...`` or ``SELFTEST FAIL...``."""
        lines = self.stdout.rstrip("\n").splitlines()
        last = lines[-1] if lines else ""
        if last.startswith(("SELFTEST PASS", "SELFTEST FAIL")):
            return last
        tail = (self.stderr.strip().splitlines() or ["no output"])[-1]
        return f"SELFTEST FAIL: the self-test did not finish (exit {self.returncode}): {tail}"

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and self.verdict.startswith("SELFTEST PASS")

    @property
    def routes(self) -> dict[str, str]:
        """Each kernel route's status ("pass", "FAIL", "not reached") from the --json table;
        "-" for every route when the run made no table (it failed before the routes)."""
        lines = self.stdout.rstrip("\n").splitlines()[:-1]
        start = next((i for i, line in enumerate(lines) if line.startswith("{")), None)
        try:
            table = json.loads("\n".join(lines[start:])) if start is not None else {}
        except ValueError:
            table = {}
        found = table.get("routes") or {}
        return {name: found.get(name, {}).get("status", "-") for name in ROUTES}


@dataclass(frozen=True)
class Arm:
    tree: str  # "unpatched" or "patched"
    argv: str  # "as given" or "text-only"
    run: SelftestRun

    @property
    def reasons(self) -> str:
        verdict = self.run.verdict
        return verdict.split(": ", 1)[1] if ": " in verdict else ""


def installed_vllm_dir(python: Path) -> Path:
    """Where ``python`` imports vllm from, found without importing it."""
    code = "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('vllm').origin))"
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise InputError(f"--python {python}: cannot find an installed vllm: {exc}") from None
    return Path(out.stdout.strip())


def check_installed_matches(vllm_dir: Path, overlay: OverlaySet) -> None:
    """The installed files the overlay replaces must be the pinned tree's, byte for byte."""
    site = vllm_dir.parent
    for change in overlay.changes:
        installed = site / change.path
        have = sha256(installed.read_bytes() if installed.is_file() else None)
        if have != change.before_sha256:
            raise InputError(
                f"{installed}: the installed vLLM differs from the pinned tree "
                f"(sha256 {have or 'absent'}, pinned {change.before_sha256 or 'absent'})"
            )


def selftest_env(tree: Path) -> dict[str, str]:
    """The environment the self-test runs in, with ``tree`` (a shadow package dir) first on
    the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_TARGET_DEVICE", "VLLM_LOGGING_STREAM")}
    env.update(
        PYTHONPATH=str(tree),
        VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"),  # vLLM cannot infer a device without a GPU
        VLLM_LOGGING_STREAM="ext://sys.stderr",  # keep stdout for the table and the verdict
        HF_HUB_OFFLINE="1",
        PYTHONDONTWRITEBYTECODE="1",
        # vLLM's model-info cache is one file per model class: a patched and an unpatched
        # tree sharing it throw each other's away, and each miss re-imports vLLM in a
        # subprocess (~11 s of CPU).  One cache per tree's contents (vllm/envs.py:34).
        VLLM_CACHE_ROOT=str(cache_root() / "vllm-cache" / _tree_identity(tree)),
        # humming (a vLLM dependency) starts two background CUDA builds at import, which fail
        # without a GPU and cost seconds of CPU (humming/ops/utils.py:138, kernel/humming.py:531).
        HUMMING_DISABLE_PARALLEL_BUILD="1",
    )
    return env


def _tree_identity(tree: Path) -> str:
    """The shadow tree's overlay files (the only ones that differ from the installed vLLM):
    their paths and sha256, hashed."""
    h = hashlib.sha256()
    for path in sorted(p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()):
        h.update(str(path.relative_to(tree)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def run_selftest(python: Path, tree: Path, args: list[str], timeout: int = RUN_TIMEOUT) -> SelftestRun:
    """Run the self-test module with ``tree`` (a shadow package dir) first on the path."""
    env = selftest_env(tree)
    try:
        proc = subprocess.run(
            [str(python), "-m", SELFTEST_MODULE, *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tree,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return SelftestRun(124, "", f"timed out after {timeout} s")
    return SelftestRun(proc.returncode, proc.stdout, proc.stderr)


def probe(tree: Tree, members: tuple[Member, ...], python: Path, argv: list[str], static: bool) -> list[Arm]:
    by_name = {m.name: m for m in members}
    if SELFTEST_MEMBER not in by_name:
        raise InputError(f"the recipe has no member {SELFTEST_MEMBER}: nothing to probe with")
    overlays = {
        "unpatched": apply_members(tree, [by_name[SELFTEST_MEMBER]]),
        "patched": apply_members(tree, members),
    }
    vllm_dir = installed_vllm_dir(python)
    check_installed_matches(vllm_dir, overlays["patched"])
    flags = ["--json", "--static"] if static else ["--json"]
    arms = [(t, a) for t in ("unpatched", "patched") for a in ("as given", "text-only")]
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-probe-") as tmp:
        shadows = {
            name: shadow_tree(vllm_dir, {c.path: c.after for c in ov.changes if c.after is not None}, Path(tmp, name))
            for name, ov in overlays.items()
        }
        with ThreadPoolExecutor(max_workers=2) as pool:  # each run is ~20 s of one core
            futures = [
                pool.submit(
                    run_selftest, python, shadows[t], [*flags, "--", *argv, *(TEXT_ONLY if a == "text-only" else [])]
                )
                for t, a in arms
            ]
            return [Arm(t, a, f.result()) for (t, a), f in zip(arms, futures, strict=True)]


def render_arms(arms: list[Arm]) -> str:
    """One row per arm: each route's status, the verdict, and its reasons."""
    rows = [("tree", "argv", *ROUTES, "verdict", "reasons")]
    for arm in arms:
        routes = arm.run.routes
        verdict = arm.run.verdict.split(":", 1)[0]
        rows.append((arm.tree, arm.argv, *(routes[name] for name in ROUTES), verdict, arm.reasons))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)), r[-1]]) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
