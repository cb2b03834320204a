"""`make gate-local`: the launch gate on this machine's two test engines.

Writes, under the output directory (default out/gate-local): the gate tests'
recipe (the default recipe in `mode: vllm` on the vllm-cpu test image, pushed
to the local registry), the ratio-2 synthetic V4.1 checkpoint (every route
passes text-only) and a two-rank profile whose ranks are the two local engines
(no GPUs). Prints the profile's path; the Makefile then builds and pushes the
image (`vllm-overlay image --push`) and runs `vllm-overlay gate --static`.
Needs `make setup` (the engines, the registry, the vllm-cpu image).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from tools.checkpoints import write_v41_checkpoint
from tools.gate_recipes import write_gate_recipe
from tools.services import load_service_env


def write_local_gate(out: Path) -> Path:
    services = load_service_env()
    out.mkdir(parents=True, exist_ok=True)
    recipe = write_gate_recipe(out / "recipe.yaml", services)
    checkpoint = out / "v41-ratio2"
    write_v41_checkpoint(checkpoint, compress_ratios=(0, 2, 2))
    engines = (services["DOCKER_HOST"], services["VLLM_OVERLAY_TEST_DOCKER_HOST2"])
    master = {"master_addr": "127.0.0.1", "master_port": 29561}
    profile = {
        "name": "local-two-engines",
        "recipe": str(recipe.resolve()),
        "checkpoint": str(checkpoint.resolve()),
        "served_model_name": "v41-local",
        "parallel": {"tensor_parallel_size": 4},
        "requests": {"modality": "LanguageModelOnly", "hf_overrides": {"vision_n_layers": 0}},
        "ranks": [
            {"name": "a", "engine": engines[0], "gpus": [], "node_rank": 0, **master},
            {"name": "b", "engine": engines[1], "gpus": [], "node_rank": 1, **master, "headless": True},
        ],
    }
    path = out / "profile.yaml"
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    return path


if __name__ == "__main__":
    print(write_local_gate(Path(sys.argv[1] if len(sys.argv) > 1 else "out/gate-local")))
