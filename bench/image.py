"""Issue 4's speed figures for the image, each printed beside the comparison it names.

Printed, never asserted.  Runs against the local services (`.ci/services.sh
start`; coordinates from tools.services.load_service_env()), with a
repository of its own under the local registry and a temporary produced-rows
file, so it never touches images/produced.yaml.

  (a) a member change's rebuild (`vllm-overlay image`, the whole command)
      against a full build of the same recipe on the same engine with the
      layer cache off: ratio, target <= 0.1
  (b) the overlay layers' size (every layer above the installed stage, from
      the image's history) against the touched files' bytes: at most 64 KiB over
  (c) `vllm-overlay plan` when nothing changed (median of several runs), from
      a produced row (the recipe under a repository without a registry: only
      there does a row count) and from the registry: < 0.5 s, and no build started
      (engine events and image count over the runs)
  (d) issue 14: `plan` from the registry with digest verification (the ik- tag's
      manifest and image config fetched, each checked against its sha256, the
      image-key label compared), with no engine at all (DOCKER_HOST names none)
      and no produced row: the whole command (median), < 0.5 s; and the
      registry check alone, in process

The full build is the most expensive part (the 315 MB wheel is installed
again, about 20-30 s); its images are removed afterwards, as are this run's tags.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import docker  # noqa: E402
import yaml  # noqa: E402

from builder import image as img  # noqa: E402
from builder.apply import apply_members  # noqa: E402
from builder.key import runtime_key  # noqa: E402
from builder.members import load_recipe_members  # noqa: E402
from builder.output import manifest  # noqa: E402
from builder.recipe import load_recipe  # noqa: E402
from builder.render import context_files, render_image  # noqa: E402
from builder.tree import pinned_tree  # noqa: E402
from tools.image_recipes import changed_overlay, cli_env, made_images, remove_images, write_recipe_copy  # noqa: E402
from tools.services import ServicesNotRunning, load_service_env  # noqa: E402

KIB = 1024
PLAN_RUNS = 7


def verdict(ok: bool) -> str:
    return "ok" if ok else "OVER TARGET"


def vo(*args: object, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    """One CLI run (it must succeed) and its wall time."""
    full_env = dict(os.environ, **env)
    full_env["PYTHONPATH"] = str(ROOT)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "builder", *map(str, args)], cwd=ROOT, env=full_env, capture_output=True, text=True
    )
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench: vllm-overlay {' '.join(map(str, args))} failed:\n{proc.stderr[-2000:]}")
    return took, proc


class _NoCacheAPI:
    """The low-level client, with every build's layer cache off."""

    def __init__(self, api) -> None:
        self._api = api

    def build(self, **kwargs):
        return self._api.build(nocache=True, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._api, name)


class _NoCacheClient:
    def __init__(self, client: docker.DockerClient) -> None:
        self._client = client
        self.api = _NoCacheAPI(client.api)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


def full_build(client: docker.DockerClient, recipe_path: Path, log: list[str]) -> tuple[float, str]:
    """The recipe built from nothing but the base image: apply, render, both builds, the report run.

    Returns the time and the image id; ``log`` collects the build's lines as it goes.
    """
    start = time.perf_counter()
    recipe = load_recipe(recipe_path)
    members = load_recipe_members(recipe)
    overlay = apply_members(pinned_tree(recipe.vllm), members)
    key = runtime_key(recipe, members)
    rendered = render_image(recipe, key)
    files = context_files(rendered, overlay, manifest(recipe, overlay, key))
    image = img.build(_NoCacheClient(client), recipe, rendered, files, progress=log.append)
    return time.perf_counter() - start, image.id


def overlay_layers(client: docker.DockerClient, image: str) -> list[tuple[str, int]]:
    """The image's steps above its installed stage (the pins check), with their sizes, oldest first."""
    above = []
    for entry in client.api.history(image):  # newest first
        if "image_checks.py pins" in (entry.get("CreatedBy") or ""):
            return list(reversed(above))
        above.append((entry.get("CreatedBy") or "", int(entry.get("Size") or 0)))
    raise SystemExit(f"bench: {image} has no pins step in its history")


def pushed_overlay_bytes(client: docker.DockerClient, registry: str, ref: str) -> tuple[int, int]:
    """The overlay layers as the registry holds them (compressed): their count and bytes."""
    image = client.images.get(ref)
    installed = image.id
    while "image_checks.py pins" not in (client.api.history(installed)[0].get("CreatedBy") or ""):
        installed = client.images.get(installed).attrs["Parent"]  # the classic builder keeps each step's image
    below = len(client.images.get(installed).attrs["RootFS"]["Layers"])
    name, tag = ref.removeprefix(registry + "/").rsplit(":", 1)
    request = urllib.request.Request(
        f"http://{registry}/v2/{name}/manifests/{tag}",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        pushed = json.load(response)["layers"][below:]
    return len(pushed), sum(layer["size"] for layer in pushed)


def build_events(client: docker.DockerClient, since: float, until: float) -> list[str]:
    """Container creations and image builds/tags in the engine between two times (any client's)."""
    found = []
    for event in client.events(since=int(since), until=int(until) + 1, decode=True):
        if not since * 1e9 <= event.get("timeNano", 0) <= until * 1e9:  # the query is by whole seconds
            continue
        kind, action = event.get("Type"), event.get("Action") or event.get("status")
        if (kind == "container" and action == "create") or (kind == "image" and action in ("tag", "build", "import")):
            found.append(f"{kind} {action} {event.get('id', '')[:19]}")
    return found


def plan_times(recipe: Path, env: dict[str, str]) -> tuple[float, str]:
    times, first = [], ""
    for _ in range(PLAN_RUNS):
        took, proc = vo("plan", recipe, env=env)
        times.append(took)
        first = proc.stdout.splitlines()[0]
    return statistics.median(times), first


def registry_check_time(reference: str, image_key: str) -> tuple[float, str]:
    """The registry part of plan alone (builder.image.registry_image), in process: median."""
    times, said = [], ""
    for _ in range(PLAN_RUNS):
        start = time.perf_counter()
        found = img.registry_image(reference, image_key)
        times.append(time.perf_counter() - start)
        said = found.reason
    return statistics.median(times), said


def main() -> None:
    try:
        services = load_service_env()
    except ServicesNotRunning as exc:
        print(f"image bench: not run: {exc}")
        return
    client = docker.DockerClient(base_url=services["DOCKER_HOST"], timeout=900)
    client.ping()
    run_id = uuid.uuid4().hex[:10]
    prefix = f"{services['VLLM_OVERLAY_TEST_REGISTRY']}/vllm-overlay-bench-{run_id}/"
    print(f"image bench  (engine {services['DOCKER_HOST']}, repositories {prefix}*)\n")
    # The logs of the builds only this run can have made (the member change is new, the full build
    # uncached), for the images to remove at the end; the recipe as it is stays cached for the next run.
    logs: list[str | list[str]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            produced, empty = work / "produced.yaml", work / "empty.yaml"
            env = cli_env(services, produced)
            recipe = write_recipe_copy(work / "a.yaml", services, prefix + "v41-sm120")
            changed = write_recipe_copy(
                work / "b.yaml",
                services,
                prefix + "v41-sm120",
                overlay=changed_overlay(work / "overlay", f"bench {run_id}"),
            )
            # the same recipe as b.yaml under another repository: the full build's tags stay apart
            full = write_recipe_copy(work / "full.yaml", services, prefix + "full", overlay=work / "overlay")

            # (a) the recipe as it is (the engine's cache warm, as after any earlier build), then one member changed
            before, _ = vo("image", recipe, env=env)
            rebuild, proc = vo("image", changed, env=env)
            logs.append(proc.stderr)
            cached = sum(1 for line in proc.stderr.splitlines() if line.strip() == "---> Using cache")
            ran = sum(1 for line in proc.stderr.splitlines() if line.strip().startswith("---> Running in"))
            ref = proc.stdout.strip().splitlines()[-1]
            # (c) plan when nothing changed: from the produced row, then (rows empty) from the registry.
            # A row counts only for a repository without a registry: the same row, under a local name.
            local = f"vllm-overlay-bench-{run_id}/v41-sm120"
            [row] = [r for r in yaml.safe_load(produced.read_text()) if r["image"] == ref]
            local_rows = work / "local-rows.yaml"
            local_rows.write_text(yaml.safe_dump([{**row, "repository": local}], sort_keys=False))
            images_before = len(client.images.list(all=True))
            started = time.time()
            plan_row, said_row = plan_times(changed, cli_env(services, local_rows, VLLM_OVERLAY_REPOSITORY=local))
            events = build_events(client, started, time.time())
            push_time, _ = vo("image", changed, "--push", env=env)
            started = time.time()
            plan_registry, said_registry = plan_times(changed, cli_env(services, empty))
            events += build_events(client, started, time.time())
            images_after = len(client.images.list(all=True))
            # (d) the same, verified through the registry API with no engine to ask
            no_engine = cli_env(services, empty, DOCKER_HOST="unix:///nonexistent")
            plan_verified, said_verified = plan_times(changed, no_engine)
            image_key = client.images.get(ref).labels["io.vllm-overlay.image-key"]
            ik_tag = ref.rsplit(":", 1)[0] + ":ik-" + image_key.removeprefix("ik-")[:16]
            check_time, said_check = registry_check_time(ik_tag, image_key)
            # (b) the overlay layers of the member-changed image against the touched files
            layers = overlay_layers(client, ref)
            layer_bytes = sum(size for _, size in layers)
            r = load_recipe(changed)
            touched = apply_members(pinned_tree(r.vllm), load_recipe_members(r)).changes
            touched_bytes = sum(len(c.after) for c in touched if c.after is not None)
            pushed_layers, pushed_bytes = pushed_overlay_bytes(client, services["VLLM_OVERLAY_TEST_REGISTRY"], ref)
            # (a) the full build of the same recipe, layer cache off
            full_log: list[str] = []
            logs.append(full_log)
            full_time, _ = full_build(client, full, full_log)

        print("(a) member change, rebuild against a full build (same recipe, same engine):")
        print(f"  `image` of the recipe as it is (warm cache, for reference)   {before:7.2f} s")
        steps = f"({cached} steps from cache, {ran} run)"
        print(f"  `image` after one member's hunk changed                      {rebuild:7.2f} s   {steps}")
        print(f"  full build, layer cache off (apply + render + build)        {full_time:7.2f} s")
        ratio = rebuild / full_time
        print(f"  ratio {ratio:6.3f}   target <= 0.1   {verdict(ratio <= 0.1)}")
        print()
        over = layer_bytes - touched_bytes
        print("(b) overlay layers against the touched files:")
        for created_by, size in layers:
            shown = re.sub(r"^/bin/(ba)?sh( -o pipefail)? -c (#\(nop\) )?\s*", "", created_by)[:70]
            print(f"  {size:10,d} B   {shown}")
        print(f"  overlay layers {layer_bytes:,d} B   touched files ({len(touched)}) {touched_bytes:,d} B")
        print(f"  over by {over:,d} B ({over / KIB:.1f} KiB)   target <= 64 KiB   {verdict(over <= 64 * KIB)}")
        print(f"  as pushed: {pushed_layers} layers, {pushed_bytes:,d} B compressed (tar headers included)")
        print()
        print(f"(c) `plan` when nothing changed (median of {PLAN_RUNS} runs):")
        for source, took, said in (("produced row", plan_row, said_row), ("registry", plan_registry, said_registry)):
            print(f"  from the {source:15s} {took:6.3f} s   target < 0.5 s   {verdict(took < 0.5)}   [{said[:60]}]")
        print(f"  (the push between them, for reference: {push_time:.2f} s)")
        print(
            f"  engine events during the {2 * PLAN_RUNS} plans (any client's): {len(events)} container creations "
            f"or image builds/tags; images in the engine {images_before} -> {images_after} (the push between adds none)"
        )
        print(f"  builds started: {len(events)}   target 0   {verdict(not events)}")
        print()
        print(f"(d) `plan` from the registry with digest verification, no engine (median of {PLAN_RUNS} runs):")
        ok = plan_verified < 0.5 and said_verified.startswith("up-to-date")
        shown = said_verified[:60]
        print(f"  the whole command     {plan_verified:6.3f} s   target < 0.5 s   {verdict(ok)}   [{shown}]")
        print(f"  the registry check alone (in process)   {check_time * 1000:6.1f} ms   [{said_check[-40:]}]")
    finally:
        made = [i for log in logs for i in made_images(log if isinstance(log, str) else "\n".join(log))]
        remove_images(client, (prefix,), made)
        client.close()


if __name__ == "__main__":
    main()
