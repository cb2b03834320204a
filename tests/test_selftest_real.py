"""The self-test against real upstream code: vLLM 0.30.0 and FlashInfer 0.6.18.post1.

Runs the module with the probe venv's python (vLLM and its dependencies,
CPU torch) in two shadow trees of the installed vLLM: unpatched (the
self-test file alone) and patched (the whole overlay). The checkpoint is a
synthetic DeepSeek-V4.1 config.json (64 heads, window 128, index_topk 512,
compress_ratios 0/1/2, 2 vision layers, 1024 image tokens). Expected
verdicts of the four probe arms are checked through the CLI in test_probe.py;
here are the JSON table, the facts' sources, the no-device rule and bad argv.

Fixtures from conftest: ``probe_python`` (path of the probe venv's python)
and ``overlay_files`` ({"patched": {tree path: bytes}, "selftest-only":
{tree path: bytes}}).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from builder.probe import TEXT_ONLY, SelftestRun, installed_vllm_dir, run_selftest
from builder.probe_env import shadow_tree
from tests.checkpoints import write_v41_checkpoint

PAGE_32 = "page_block_size 32, kernel needs 64"
WIDTH_1152 = "(16, 1152) not in the decode dispatch set"


def _json(run: SelftestRun) -> dict:
    body = run.stdout.rstrip("\n").splitlines()[:-1]
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
            installed_vllm,
            overlay_files["selftest-only"],
            tmp_path_factory.mktemp("shadow-unpatched"),
        ),
        "patched": shadow_tree(
            installed_vllm,
            overlay_files["patched"],
            tmp_path_factory.mktemp("shadow-patched"),
        ),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    empty = root / "no-config"
    empty.mkdir()
    return {
        "v41": write_v41_checkpoint(root / "v41"),
        "no-config": empty,
        "missing": root / "does-not-exist",
    }


@pytest.fixture(scope="module")
def results(probe_python, trees, checkpoints) -> dict[str, SelftestRun]:
    """Every run of this module, two at a time (each takes ~20 s)."""
    v41 = str(checkpoints["v41"])
    runs = {
        "unpatched-mm": ("unpatched", ["--static", "--json", "--", v41, "-tp", "4"]),
        "patched-text": (
            "patched",
            ["--static", "--json", "--", v41, "-tp", "4", *TEXT_ONLY],
        ),
        "patched-no-device": ("patched", ["--", v41, "-tp", "4", *TEXT_ONLY]),
        "bad-missing-model": (
            "patched",
            ["--static", "--", str(checkpoints["missing"]), "-tp", "4"],
        ),
        "bad-no-config": (
            "patched",
            ["--static", "--", str(checkpoints["no-config"]), "-tp", "4"],
        ),
        "bad-tp3": ("patched", ["--static", "--", v41, "-tp", "3"]),
        "bad-flag": ("patched", ["--static", "--", v41, "--no-such-flag"]),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(run_selftest, probe_python, trees[tree], args)
            for name, (tree, args) in runs.items()
        }
        return {name: f.result() for name, f in futures.items()}


def _no_traceback(result: SelftestRun) -> None:
    assert "Traceback" not in result.stdout
    assert "Traceback" not in result.stderr


# ---- the four arms at TP 4, --static ---------------------------------------


def test_unpatched_multimodal_json_run_fails_on_page_and_width(results):
    r = results["unpatched-mm"]
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.verdict.startswith("SELFTEST FAIL: ")
    assert PAGE_32 in r.verdict and WIDTH_1152 in r.verdict
    _no_traceback(r)


def test_patched_text_only_json_run_passes_static(results):
    r = results["patched-text"]
    assert r.verdict == "SELFTEST PASS (static)", r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0
    _no_traceback(r)


def test_without_device_and_static_is_fail(results):
    r = results["patched-no-device"]
    assert r.returncode == 1
    assert r.verdict.startswith("SELFTEST FAIL: no SM120 device: kernel calls not run")


# ---- the facts behind the verdicts -----------------------------------------


def _facts(result: SelftestRun) -> dict[str, dict]:
    return {f["name"]: f for f in _json(result)["facts"]}


def test_unpatched_facts_come_from_the_tree(results):
    facts = _facts(results["unpatched-mm"])
    assert facts["vllm.tensor_parallel_size"]["value"] == 4
    assert facts["vllm.padded_heads"]["value"] == 16
    assert facts["vllm.sliding_window"]["value"] == 128
    assert facts["vllm.prefill_width"]["value"] == 1152
    assert "vllm/v1/attention/backends/mla/sparse_swa.py:" in facts["vllm.prefill_width"]["source"]
    page = facts["vllm.swa_page_block_size"]
    assert page["value"] == 32
    assert "vllm/models/deepseek_v41/attention.py:470" in page["source"]
    assert facts["vllm.compressed_pages"]["value"] == {"ratio 1": 128, "ratio 2": 64}
    assert facts["vllm.extra_topk"]["value"] == 512
    assert facts["vllm.d_qk"]["value"] == 512
    assert "flashinfer_sparse.py:73" in facts["vllm.padded_heads"]["source"]


def test_flashinfer_facts_read_from_source_without_gpu(results):
    facts = _facts(results["unpatched-mm"])
    assert facts["flashinfer.version"]["value"] == "0.6.18.post1"
    assert facts["flashinfer.reader"]["value"] == "source"
    assert facts["flashinfer.max_num_tokens"]["value"] == 64
    assert facts["flashinfer.max_num_tokens"]["source"].startswith(
        "flashinfer/mla/_sparse_mla_sm120.py:74"
    )
    assert facts["flashinfer.page_block_sizes"]["value"] == [64]
    assert facts["flashinfer.page_block_sizes"]["source"].startswith(
        "flashinfer/mla/_sparse_mla_sm120.py:107"
    )
    assert facts["flashinfer.bytes_per_token"]["value"] == 584
    assert facts["flashinfer.bytes_per_token"]["source"].startswith(
        "flashinfer/mla/_sparse_mla_sm120.py:141"
    )
    assert facts["flashinfer.decode_dispatch"]["value"]["heads 16"] == [128, 192, 256, 512, 1024]


def test_patched_text_only_table(results):
    data = _json(results["patched-text"])
    facts = {f["name"]: f for f in data["facts"]}
    page = facts["vllm.swa_page_block_size"]
    assert page["value"] == 64
    assert "DeepseekV4FlashInferSM120Attention.swa_block_size" in page["source"]
    assert "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py:" in page["source"]
    assert facts["vllm.prefill_width"]["value"] == 128
    shapes = [(s["shape"], s["num_tokens"], s["topk"], s["static"]) for s in data["shapes"]]
    assert shapes == [
        ("decode 1", 1, 128, "accepted"),
        ("decode 8", 8, 128, "accepted"),
        ("decode 64", 64, 128, "accepted"),
        ("prefill chunk 8", 8, 128, "accepted"),
    ]
    assert all(s["kernel"] == "not run" for s in data["shapes"])


# ---- bad argv: a FAIL line with the reason, never a traceback ---------------


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
    assert words in r.verdict
    _no_traceback(r)
