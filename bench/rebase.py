"""Issue 15's speed figure: the rebase report of the default overlay onto a cached newer wheel,
warm (both wheels in the cache, their hashes remembered), printed beside its 1 s target; never
asserted.

Timed as a user runs it: ``vllm-overlay rebase recipes/v41-sm120.yaml --to vllm==X.Y.Z`` in a
subprocess (interpreter start-up, imports, reading PyPI's index page for the new pin's sha256,
both wheels' central directories, the apply/merge of every member, the table), the median of 5,
after one run that fetches the wheel when it is not cached yet.  The in-process stages are shown
beside it so the index round trip (network) is told apart from the work.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from builder.members import load_recipe_members  # noqa: E402
from builder.newpin import fetch, resolve_pin  # noqa: E402
from builder.rebase import rebase_members, today_utc  # noqa: E402
from builder.recipe import load_recipe  # noqa: E402
from builder.tree import WheelTree, pinned_tree  # noqa: E402
from tools.synthetic import DEFAULT_RECIPE  # noqa: E402

TARGET = 1.0  # seconds, warm
VERSIONS = ("0.31.0", "0.33.0")
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def command_time(version: str, runs: int = 5) -> float:
    cmd = [sys.executable, "-m", "builder", "rebase", str(DEFAULT_RECIPE), "--to", f"vllm=={version}"]
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=ENV, capture_output=True, cwd=ROOT)
        times.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise SystemExit(f"bench: {' '.join(cmd)} failed: {proc.stderr.decode()[-500:]}")
    return statistics.median(times)


def stage_times(version: str) -> dict[str, float]:
    recipe = load_recipe(DEFAULT_RECIPE)
    out = {}
    start = time.perf_counter()
    pin = resolve_pin("vllm", version, recipe.vllm)
    out["index page (sha256)"] = time.perf_counter() - start
    start = time.perf_counter()
    members = load_recipe_members(recipe)
    old, new = pinned_tree(recipe.vllm), WheelTree(fetch(pin))
    out["members + both trees"] = time.perf_counter() - start
    start = time.perf_counter()
    rebase_members(old, new, members, today_utc())
    out["rebase of every member"] = time.perf_counter() - start
    return out


def main() -> None:
    recipe = load_recipe(DEFAULT_RECIPE)
    print(f"rebase report of {DEFAULT_RECIPE.name} (vllm {recipe.vllm.version}) onto a cached newer wheel, warm")
    for version in VERSIONS:
        fetch(resolve_pin("vllm", version, recipe.vllm), progress=sys.stderr)  # cached once
        command_time(version, runs=1)  # warm the hash memo and the page cache
        wall = command_time(version)
        verdict = "ok" if wall <= TARGET else "OVER TARGET"
        print(f"  --to vllm=={version}: {wall:6.3f} s  (target <= {TARGET:.1f} s: {verdict})")
        for name, seconds in stage_times(version).items():
            print(f"    {name:<26} {seconds:6.3f} s")


if __name__ == "__main__":
    main()
