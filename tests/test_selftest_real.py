"""The self-test against real upstream code: vLLM 0.30.0 and FlashInfer 0.6.18.post1.

Runs the module with the probe venv's python (vLLM and its dependencies,
CPU torch) in two shadow trees of the installed vLLM: unpatched (the
self-test file alone) and patched (the whole overlay). Checkpoints are
synthetic DeepSeek-V4.1 config.json files (tools/checkpoints.py).

Every run is made once per session (tests/selftest_runs.py): one interpreter
per tree imports vLLM once and runs the module as ``python -m`` would, once
per argv. ``variations`` are the argv variations (--static --json, patched
tree); ``results`` the module as a command (exit codes, no device, bad argv,
text output). Expected verdicts are written out by hand from the rules as
read (REFERENCE.md, and the files named below).

Fixtures from tests/selftest_runs.py (a plugin): ``variation_runs`` and
``command_runs``, made from conftest's ``probe_python`` and ``overlay_files``.
"""

from __future__ import annotations

import json

import pytest

from builder.probe import SelftestRun

# variation_runs, command_runs (and the checkpoints and trees they run on): made once per session
pytest_plugins = ["tests.selftest_runs"]

PAGE_32 = "page_block_size 32 not in {64}"
DECODE_1152 = "num_heads,topk (16, 1152) not in the set"
EXTRA_PAGE_128 = "extra_page_block_size 128 not in {2, 64}"
DUAL = "flashinfer/data/csrc/sparse_mla_sm120_prefill.cu:"


def _json(stdout: str) -> dict:
    body = stdout.rstrip("\n").splitlines()[:-1]
    start = next(i for i, ln in enumerate(body) if ln.startswith("{"))
    return json.loads("\n".join(body[start:]))


@pytest.fixture(scope="module")
def variations(variation_runs) -> dict[str, dict]:
    """Every argv variation on the patched tree, --static --json: exit code, verdict, JSON table."""
    return {
        name: {"code": run.returncode, "verdict": run.verdict, "table": _json(run.stdout)}
        for name, run in variation_runs.items()
    }


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


def test_no_variation_prints_a_traceback(variation_runs):
    # vLLM refusing an argv (MTP) or FlashInfer's import failing on this host is a verdict, not a crash
    assert [name for name, run in variation_runs.items() if "Traceback" in run.stdout + run.stderr] == []


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
def results(command_runs) -> dict[str, SelftestRun]:
    return command_runs


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
