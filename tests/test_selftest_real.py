"""The self-test against real upstream code: vLLM 0.30.0 and FlashInfer 0.6.18.post1.

Runs the module with the probe venv's python (vLLM and its dependencies,
CPU torch) in two shadow trees of the installed vLLM: unpatched (the
self-test file alone) and patched (the whole overlay). Checkpoints are
synthetic DeepSeek-V4.1 config.json files (tools/checkpoints.py).

The argv variations run in one interpreter (vLLM is imported once), through
the module's own ``run()``; the CLI-level behaviour (exit codes, no device,
bad argv) runs the module as ``python -m``. Expected verdicts are written out
by hand from the rules as read (REFERENCE.md, and the files named below).

Fixtures from conftest: ``probe_python`` and ``overlay_files``.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from builder.probe import TEXT_ONLY, SelftestRun, installed_vllm_dir, run_selftest
from builder.probe_env import shadow_tree
from tools.checkpoints import write_v41_checkpoint

SELFTEST_MODULE = "vllm.models.deepseek_v41.nvidia.sm120_decode_shape_selftest"
PAGE_32 = "page_block_size 32 not in {64}"
DECODE_1152 = "num_heads,topk (16, 1152) not in the set"
EXTRA_PAGE_128 = "extra_page_block_size 128 not in {2, 64}"
DUAL = "flashinfer/data/csrc/sparse_mla_sm120_prefill.cu:"


def _json(stdout: str) -> dict:
    body = stdout.rstrip("\n").splitlines()[:-1]
    start = next(i for i, ln in enumerate(body) if ln.startswith("{"))
    return json.loads("\n".join(body[start:]))


@pytest.fixture(scope="module")
def installed_vllm(probe_python) -> Path:
    path = installed_vllm_dir(probe_python)
    assert (path / "__init__.py").is_file()
    return path


@pytest.fixture(scope="module")
def trees(installed_vllm, overlay_files, tmp_path_factory) -> dict[str, Path]:
    return {
        "unpatched": shadow_tree(
            installed_vllm, overlay_files["selftest-only"], tmp_path_factory.mktemp("shadow-unpatched")
        ),
        "patched": shadow_tree(installed_vllm, overlay_files["patched"], tmp_path_factory.mktemp("shadow-patched")),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    empty = root / "no-config"
    empty.mkdir()
    return {
        # compress_ratios 0/1/2: a ratio-1 layer has a compressed page of 128 // 1
        "v41": write_v41_checkpoint(root / "v41"),
        # compressed layers all ratio 2 (page 64), window 128
        "r2": write_v41_checkpoint(root / "r2", compress_ratios=(0, 2, 2)),
        "r2-h128": write_v41_checkpoint(root / "r2-h128", compress_ratios=(0, 2, 2), heads=128),
        "r2-w256": write_v41_checkpoint(root / "r2-w256", compress_ratios=(0, 2, 2), sliding_window=256),
        "r2-k1024": write_v41_checkpoint(root / "r2-k1024", compress_ratios=(0, 2, 2), index_topk=1024),
        "no-config": empty,
        "missing": root / "does-not-exist",
    }


_DRIVER = """
import io, json, sys
from vllm.models.deepseek_v41.nvidia import sm120_decode_shape_selftest as selftest
for name, argv in json.loads(sys.stdin.read()).items():
    out = io.StringIO()
    code = selftest.run(["--static", "--json", "--", *argv], out=out)
    print(json.dumps({"name": name, "code": code, "stdout": out.getvalue()}), flush=True)
"""


def _variations(ck: dict[str, Path]) -> dict[str, list[str]]:
    v41, r2 = str(ck["v41"]), str(ck["r2"])
    sizes = '{"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128]}'
    return {
        "r2-tp4": [r2, "-tp", "4", *TEXT_ONLY],
        "v41-tp4": [v41, "-tp", "4", *TEXT_ONLY],
        "v41-seqs8": [v41, "-tp", "4", "--max-num-seqs", "8", *TEXT_ONLY],
        "v41-seqs256": [v41, "-tp", "4", "--max-num-seqs", "256", *TEXT_ONLY],
        "v41-seqs8-sizes": [v41, "-tp", "4", "--max-num-seqs", "8", "--compilation-config", sizes, *TEXT_ONLY],
        "v41-seqs8-eager": [v41, "-tp", "4", "--max-num-seqs", "8", "--enforce-eager", *TEXT_ONLY],
        "v41-mtp2": [
            v41,
            "-tp",
            "4",
            "--speculative-config",
            '{"method": "mtp", "num_speculative_tokens": 2}',
            *TEXT_ONLY,
        ],
        "r2-tp2": [r2, "-tp", "2", *TEXT_ONLY],
        "r2-tp8": [r2, "-tp", "8", *TEXT_ONLY],
        "r2-tp4-dp2": [r2, "-tp", "4", "-dp", "2", *TEXT_ONLY],
        "r2-h128-tp1": [str(ck["r2-h128"]), "-tp", "1", *TEXT_ONLY],
        "r2-w256": [str(ck["r2-w256"]), "-tp", "4", *TEXT_ONLY],
        "r2-k1024": [str(ck["r2-k1024"]), "-tp", "4", *TEXT_ONLY],
        "r2-vision": [r2, "-tp", "4"],
    }


@pytest.fixture(scope="module")
def variations(probe_python, trees, checkpoints) -> dict[str, dict]:
    """Every argv variation on the patched tree, --static --json, in one interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(
        PYTHONPATH=str(trees["patched"]),
        VLLM_TARGET_DEVICE="cpu",
        VLLM_LOGGING_STREAM="ext://sys.stderr",
        HF_HUB_OFFLINE="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    proc = subprocess.run(
        [str(probe_python), "-c", _DRIVER],
        input=json.dumps(_variations(checkpoints)),
        capture_output=True,
        text=True,
        env=env,
        cwd=trees["patched"],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        row = json.loads(line)
        verdict = row["stdout"].rstrip("\n").splitlines()[-1]
        out[row["name"]] = {"code": row["code"], "verdict": verdict, "table": _json(row["stdout"])}
    assert sorted(out) == sorted(_variations(checkpoints))
    return out


def _facts(table: dict) -> dict[str, dict]:
    return {f["name"]: f for f in table["facts"]}


def _routes(result: dict) -> dict[str, str]:
    return {name: r["status"] for name, r in result["table"]["routes"].items()}


def _checks(result: dict, route: str) -> list[tuple[str, str, int, int]]:
    return sorted(
        (c["layer"], c["kind"], c["min_tokens"], c["max_tokens"])
        for c in result["table"]["checks"]
        if c["route"] == route
    )


# ---- the routes tell the checkpoints apart ----------------------------------


def test_ratio_2_text_only_passes_every_route(variations):
    r = variations["r2-tp4"]
    assert r["verdict"] == "SELFTEST PASS (static)" and r["code"] == 0
    assert _routes(r) == {"decode kernel": "pass", "prefill single": "pass", "prefill dual": "pass"}


def test_ratio_1_layers_fail_the_dual_prefill_route(variations):
    r = variations["v41-tp4"]
    assert r["code"] == 1
    assert r["verdict"].startswith("SELFTEST FAIL: prefill dual: " + EXTRA_PAGE_128 + " (" + DUAL + "325 ")
    assert "compressed ratio 1, decode 65..512" in r["verdict"]
    assert "compressed ratio 2" not in r["verdict"]
    assert _routes(r) == {"decode kernel": "pass", "prefill single": "pass", "prefill dual": "FAIL"}


def test_decode_calls_reach_the_capture_ceiling(variations):
    # CPU defaults leave max_num_seqs at 128 x TP 4 = 512 here; capture sizes reach
    # min(512 x 1 x 2, 512) = 512 (VllmConfig._set_cudagraph_sizes).
    assert ("compressed ratio 1", "decode", 65, 512) in _checks(variations["v41-tp4"], "prefill dual")
    # --max-num-seqs 256: 256 decode tokens a step, capture sizes up to min(256 x 1 x 2, 512) = 512.
    assert ("compressed ratio 1", "decode", 65, 512) in _checks(variations["v41-seqs256"], "prefill dual")


def test_eight_sequences_keep_decode_calls_on_the_decode_kernel(variations):
    r = variations["v41-seqs8"]
    # 8 requests of 1 token, capture sizes up to 8 x 1 x 2 = 16: no decode call passes 64.
    assert not [c for c in _checks(r, "prefill dual") if c[1] == "decode"]
    assert ("compressed ratio 1", "decode", 1, 16) in _checks(r, "decode kernel")
    # prefill chunks still do, and ratio-1 layers still fail there
    assert r["code"] == 1 and "compressed ratio 1, prefill 65.." in r["verdict"]
    assert "compressed ratio 1, decode 65" not in r["verdict"]


def test_explicit_capture_sizes_widen_the_decode_calls(variations):
    r = variations["v41-seqs8-sizes"]
    assert ("compressed ratio 1", "decode", 65, 128) in _checks(r, "prefill dual")
    assert "compressed ratio 1, decode 65..128" in r["verdict"]


def test_enforce_eager_captures_nothing(variations):
    r = variations["v41-seqs8-eager"]
    assert ("sliding-window only", "decode", 1, 8) in _checks(r, "decode kernel")
    assert _facts(r["table"])["vllm.capture_sizes"]["value"] == "none (no CUDA graphs)"


def test_mtp_is_refused_by_vllm_itself(variations):
    r = variations["v41-mtp2"]
    assert r["code"] == 1
    assert r["verdict"].startswith("SELFTEST FAIL: vLLM refuses this argv: ")
    assert "no classic-MTP draft" in r["verdict"]


@pytest.mark.parametrize("name, padded", [("r2-tp2", 32), ("r2-tp4-dp2", 16), ("r2-tp8", 8), ("r2-h128-tp1", 128)])
def test_parallel_sizes_and_heads_pass_with_their_padded_heads(variations, name, padded):
    r = variations[name]
    assert r["verdict"] == "SELFTEST PASS (static)", r["verdict"]
    assert _facts(r["table"])["vllm.padded_heads"]["value"] == padded


def test_window_256_fails_only_the_dual_topk(variations):
    r = variations["r2-w256"]
    assert _routes(r) == {"decode kernel": "pass", "prefill single": "pass", "prefill dual": "FAIL"}
    assert r["verdict"].startswith("SELFTEST FAIL: prefill dual: topk 256 not in {128} (" + DUAL + "394 ")


def test_index_topk_1024_has_no_rule_on_0_6(variations):
    r = variations["r2-k1024"]
    assert r["verdict"] == "SELFTEST PASS (static)"
    assert _facts(r["table"])["vllm.extra_topk"]["value"] == 1024


def test_vision_width_fails_decode_and_both_prefill_routes(variations):
    r = variations["r2-vision"]
    assert _routes(r) == {"decode kernel": "FAIL", "prefill single": "FAIL", "prefill dual": "FAIL"}
    assert DECODE_1152 in r["verdict"]
    assert "prefill single: topk 1152 not in {128, 192, 256, 512, 1024, 2048} (" + DUAL + "297 " in r["verdict"]
    assert "prefill dual: topk 1152 not in {128}" in r["verdict"]


# ---- the facts behind the verdicts, with their sources ----------------------


def test_vllm_facts_come_from_the_sm120_builder(variations):
    facts = _facts(variations["v41-tp4"]["table"])
    assert facts["vllm.tensor_parallel_size"]["value"] == 4
    assert facts["vllm.padded_heads"]["value"] == 16
    assert "flashinfer_sparse.py:73" in facts["vllm.padded_heads"]["source"]
    assert facts["vllm.sliding_window"]["value"] == 128
    assert facts["vllm.prefill_width"]["value"] == 128
    width = facts["vllm.prefill_width"]["source"]
    assert width.startswith("vllm/v1/attention/backends/mla/sparse_swa.py:461 ")
    assert "DeepseekSparseSWAFlashInferMetadataBuilder (the SM120 SWA backend's builder" in width
    assert facts["vllm.decode_query_len"]["value"] == 1
    assert facts["vllm.layer_types"]["value"] == {
        "sliding-window only": "no compressed cache",
        "compressed ratio 1": "compressed page 128",
        "compressed ratio 2": "compressed page 64",
    }
    assert (
        "get_supported_kernel_block_sizes() = [128] (vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py:111)"
        in facts["vllm.layer_types"]["source"]
    )
    page = facts["vllm.swa_page_block_size"]
    assert page["value"] == 64 and "DeepseekV4FlashInferSM120Attention.swa_block_size" in page["source"]
    assert facts["vllm.prefill_chunk_requests"]["value"] == 4
    assert "vllm/models/deepseek_v41/attention.py:185" in facts["vllm.prefill_chunk_requests"]["source"]


def test_flashinfer_rules_read_from_source_without_gpu(variations):
    table = variations["v41-tp4"]["table"]
    facts = _facts(table)
    assert facts["flashinfer.version"]["value"] == "0.6.18.post1"
    assert facts["flashinfer.reader"]["value"] == "source (0.6.x layout)"
    assert facts["flashinfer.route[decode kernel]"]["source"].startswith("flashinfer/mla/_sparse_mla_sm120.py:74 ")
    assert facts["flashinfer.route[prefill dual].topk"]["source"].startswith(DUAL + "394 ")
    assert facts["flashinfer.bytes_per_token"]["source"].startswith("flashinfer/mla/_sparse_mla_sm120.py:141 ")
    # import flashinfer fails on this GPU-less host, and the scope says its predicate did not run
    assert any("decode predicate was not executed" in line for line in table["scope"]["not_covered"])


def test_scope_says_what_is_and_is_not_covered(variations):
    scope = variations["v41-tp4"]["table"]["scope"]
    assert any(line.startswith("decode calls of 1..512 tokens") for line in scope["covered"])
    assert any("KV-cache dtype" in line for line in scope["not_covered"])
    assert any(line.startswith("capture sizes: this host's platform (cpu)") for line in scope["not_covered"])


# ---- the module as a command: exit codes, no device, bad argv ---------------


@pytest.fixture(scope="module")
def results(probe_python, trees, checkpoints) -> dict[str, SelftestRun]:
    v41 = str(checkpoints["v41"])
    runs = {
        "unpatched-mm": ("unpatched", ["--static", "--", v41, "-tp", "4"]),
        "patched-no-device": ("patched", ["--", str(checkpoints["r2"]), "-tp", "4", *TEXT_ONLY]),
        "bad-missing-model": ("patched", ["--static", "--", str(checkpoints["missing"]), "-tp", "4"]),
        "bad-no-config": ("patched", ["--static", "--", str(checkpoints["no-config"]), "-tp", "4"]),
        "bad-tp3": ("patched", ["--static", "--", v41, "-tp", "3"]),
        "bad-flag": ("patched", ["--static", "--", v41, "--no-such-flag"]),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(run_selftest, probe_python, trees[tree], args) for name, (tree, args) in runs.items()
        }
        return {name: f.result() for name, f in futures.items()}


def _no_traceback(result: SelftestRun) -> None:
    assert "Traceback" not in result.stdout
    assert "Traceback" not in result.stderr


def test_unpatched_vision_run_fails_on_page_and_width(results):
    r = results["unpatched-mm"]
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.verdict.startswith("SELFTEST FAIL: decode kernel: " + PAGE_32)
    assert DECODE_1152 in r.verdict and EXTRA_PAGE_128 in r.verdict
    assert "routes:" in r.stdout and "not covered:" in r.stdout
    _no_traceback(r)


def test_without_device_and_static_is_fail(results):
    r = results["patched-no-device"]
    assert r.returncode == 1
    assert r.verdict == "SELFTEST FAIL: no SM120 device: kernel calls not run"


@pytest.mark.parametrize(
    "name, words",
    [
        ("bad-missing-model", "is not a directory"),
        ("bad-no-config", "no config.json"),
        ("bad-tp3", "divisible by tensor parallel size (3)"),
        ("bad-flag", "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_argv_is_fail_with_reason(results, name, words):
    r = results[name]
    assert r.returncode == 1
    assert r.verdict.startswith("SELFTEST FAIL: ")
    assert words in r.verdict, r.verdict
    _no_traceback(r)
