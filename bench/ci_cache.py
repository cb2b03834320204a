"""Issue 14's CI figure: a member change rebuilt on an empty engine with the registry as cache.

Printed, never asserted.  Two empty engines (tools/fresh_engine.py), each a
fresh CI runner, against the local registry and index:

  full:    `vllm-overlay image --push` of the recipe on an empty engine, nothing
           in the registry for it: pull the base, install, build, push
  change:  the same recipe with one member's hunk changed, on another empty
           engine: pull the base and the previous image (the moving tag), rebuild
           the overlay with it as cache, push

Target: change / full <= 0.15, pulling included.  The local recipe installs only
the two pinned wheels (the index has no CUDA closure), so its full build is far
cheaper than the default recipe's several-GB install: the ratio here is an upper
bound on what a real recipe sees.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import docker  # noqa: E402

from tools.fresh_engine import fresh_engine  # noqa: E402
from tools.image_recipes import changed_overlay, cli_env, write_recipe_copy  # noqa: E402
from tools.services import ServicesNotRunning, load_service_env  # noqa: E402

TARGET = 0.15


def _image_on_empty_engine(services: dict[str, str], recipe: Path, produced: Path) -> float:
    with fresh_engine(services["DOCKER_HOST"]) as engine:
        t0 = time.perf_counter()
        env = {**os.environ, **cli_env(services, produced, DOCKER_HOST=engine), "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, "-m", "builder", "image", str(recipe), "--push"]
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench ci-cache: image {recipe} failed: {proc.stderr[-600:]}")
    return seconds


def main() -> None:
    try:
        services = load_service_env()
    except ServicesNotRunning as exc:
        print(f"ci cache: skipped ({exc})")
        return
    client = docker.DockerClient(base_url=services["DOCKER_HOST"], timeout=600)
    run = uuid.uuid4().hex[:8]
    registry = services["VLLM_OVERLAY_TEST_REGISTRY"]
    base = f"{registry}/vllm-overlay-bench-{run}/base:bookworm-dev"
    client.images.get(services["VLLM_OVERLAY_TEST_BASE_IMAGE"]).tag(base)
    for chunk in client.images.push(base, stream=True, decode=True):
        if "error" in chunk:
            raise SystemExit(f"bench ci-cache: push of the base failed: {chunk['error']}")
    repo = f"{registry}/vllm-overlay-bench-{run}/v41"
    with tempfile.TemporaryDirectory(prefix="vo-bench-ci-") as tmp:
        work = Path(tmp)
        full_recipe = write_recipe_copy(work / "full" / "recipe.yaml", services, repo, base=base)
        overlay = changed_overlay(work / "overlay", f"bench {run}")
        change_recipe = write_recipe_copy(work / "change" / "recipe.yaml", services, repo, base=base, overlay=overlay)
        full = _image_on_empty_engine(services, full_recipe, work / "produced-full.yaml")
        change = _image_on_empty_engine(services, change_recipe, work / "produced-change.yaml")
    client.images.remove(base)
    ratio = change / full
    print("CI rebuild on an empty engine (issue 14; pulls included, both runs push)")
    print(f"  full build, empty engine:            {full:6.1f} s")
    print(f"  member change, empty engine + cache: {change:6.1f} s")
    print(f"  ratio {ratio:.3f}  (target <= {TARGET})  {'ok' if ratio <= TARGET else 'OVER TARGET'}")


if __name__ == "__main__":
    main()
