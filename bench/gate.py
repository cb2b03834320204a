"""Issue 13's speed figure for the launch gate, printed beside its target; never asserted.

"Gate overhead for two ranks on two local engines, beyond the self-test's own run: at most 2 s."

One ``vllm-overlay gate PROFILE --static`` (a subprocess, as an operator runs it) with two
ranks, ``a`` on the first local engine and ``b`` on the second, no GPUs, TP 4, the text-only
request, on the ratio-2 synthetic checkpoint (every route passes), in the gate tests' image
(tests/gate_fixtures.py: made and pushed here the same way, found in both engines when a test run
already made it).  The self-test's own run on each rank is its container's life on that engine,
from the engine's ``start`` event to its ``die`` event; overhead = the command's wall time
− the longer of the two.  The overhead thus holds the interpreter's start, the profile and
recipe keys, looking up the image on both engines, creating and removing the containers,
reading their logs and writing the receipt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import docker  # noqa: E402
import yaml  # noqa: E402

from tools.checkpoints import write_v41_checkpoint  # noqa: E402
from tools.gate_image import ensure_vllm_cpu_image  # noqa: E402
from tools.gate_recipes import pull_by_digest, write_gate_recipe  # noqa: E402
from tools.image_recipes import cli_env  # noqa: E402
from tools.services import ServicesNotRunning, load_service_env  # noqa: E402

TARGET = 2.0  # seconds
LABEL = "io.vllm-overlay"


def vo(*args: object, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    full = dict(os.environ, **env, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "builder", *map(str, args)], env=full, capture_output=True, text=True)
    return time.perf_counter() - start, proc


def selftest_seconds(client, profile: str, since: float, until: float) -> list[float]:
    """Each self-test container's life on this engine (start event to die event), in seconds."""
    filters = {"type": "container", "label": [f"{LABEL}.profile={profile}", f"{LABEL}.role=selftest"]}
    events = client.events(since=int(since) - 1, until=int(until) + 1, filters=filters, decode=True)
    starts: dict[str, int] = {}
    lives = []
    for event in events:
        if event.get("Action") == "start":
            starts[event["id"]] = event["timeNano"]
        elif event.get("Action") == "die" and event["id"] in starts:
            lives.append((event["timeNano"] - starts.pop(event["id"])) / 1e9)
    return lives


def main() -> None:
    try:
        services = load_service_env()
    except ServicesNotRunning as exc:
        print(f"gate bench: not run: {exc}")
        return
    hosts = (services["DOCKER_HOST"], services["VLLM_OVERLAY_TEST_DOCKER_HOST2"])
    clients = [docker.DockerClient(base_url=host, timeout=1800) for host in hosts]
    print(f"gate bench  (engines {hosts[0]}, {hosts[1]})\n")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # the gate tests' image and its row (found, not rebuilt, after a test run)
        ensure_vllm_cpu_image(clients[0], progress=lambda line: None)
        recipe, produced = write_gate_recipe(work / "recipe.yaml", services), work / "produced.yaml"
        env = cli_env(services, produced)
        _, proc = vo("image", recipe, "--push", env=env)
        if proc.returncode != 0:
            print(f"gate bench: not run: the gate image: {proc.stderr.strip().splitlines()[-1:]}")
            return
        [row] = yaml.safe_load(produced.read_text())
        repository = yaml.safe_load(recipe.read_text())["image"]["repository"]
        for client in clients:
            pull_by_digest(client, f"{repository}@{row['digest']}", lambda line: None)
        checkpoint = write_v41_checkpoint(work / "v41-ratio2", compress_ratios=(0, 2, 2))
        name = f"bench-gate-{os.getpid()}"
        rank = {"gpus": [], "master_addr": "127.0.0.1", "master_port": 29541}
        profile = work / f"{name}.yaml"
        profile.write_text(
            yaml.safe_dump(
                {
                    "name": name,
                    "recipe": str(recipe),
                    "checkpoint": str(checkpoint),
                    "served_model_name": "v41-bench",
                    "parallel": {"tensor_parallel_size": 4},
                    "requests": {"modality": "LanguageModelOnly", "hf_overrides": {"vision_n_layers": 0}},
                    "ranks": [
                        {"name": "a", "engine": hosts[0], "node_rank": 0, **rank},
                        {"name": "b", "engine": hosts[1], "node_rank": 1, "headless": True, **rank},
                    ],
                }
            )
        )
        env["VLLM_OVERLAY_RECEIPTS"] = str(work / "receipts")
        since = time.time()
        wall, proc = vo("gate", "--static", profile, env=env)
        until = time.time()
        if proc.returncode != 0:
            print(f"gate bench: the gate failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr[-2000:]}")
            return
        lives = [selftest_seconds(client, name, since, until) for client in clients]
        receipt = json.loads(next((work / "receipts").iterdir()).read_text())
    for client in clients:
        client.close()
    if any(len(life) != 1 for life in lives):
        print(f"gate bench: expected one self-test container per engine, saw {lives}")
        return
    selftest = max(life[0] for life in lives)
    overhead = wall - selftest
    print("gate overhead, two ranks on two local engines, `gate --static` (one run):")
    for rank, life in zip(receipt["ranks"], lives, strict=True):
        print(f"  rank {rank['name']}: self-test container {life[0]:6.2f} s, {rank['verdict']}")
    print(f"  gate wall time                {wall:6.2f} s   (python -m builder gate, whole command)")
    print(
        f"  overhead = wall - max(self-test) {overhead:6.2f} s   target <= {TARGET:g} s: {verdict(overhead <= TARGET)}"
    )


def verdict(ok: bool) -> str:
    return "ok" if ok else "OVER TARGET"


if __name__ == "__main__":
    main()
