"""Test helpers: run the CLI, snapshot a directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tools.synthetic import ROOT


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


def v41_facts(selftest, **over):
    """The self-test's VllmFacts for vLLM 0.30.0 on the synthetic V4.1 checkpoint at TP 4,
    patched (SWA page 64), with vision (prefill width 1152); ``over`` replaces fields."""
    fields = dict(
        tensor_parallel_size=4,
        num_heads=64,
        local_heads=16,
        padded_heads=16,
        sliding_window=128,
        prefill_width=1152,
        decode_query_len=1,
        swa_page_block_size=64,
        layer_types=((0, 0), (1, 128), (2, 64)),
        extra_topk=512,
        d_qk=512,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=65536,
        prefill_chunk_requests=4,
        capture_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        sources={"swa_page_block_size": "test source"},
        scope_notes=["a vLLM scope note"],
    )
    fields.update(over)
    return selftest.VllmFacts(**fields)
