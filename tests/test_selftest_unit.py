"""Unit tests of the SM120 kernel-route self-test's logic, without vLLM.

The module under test is overlay/sm120_decode_shape_selftest.py, imported
directly (fixture ``selftest_module`` in conftest). VllmFacts and
FlashInferRules are built by hand here; the kernel call and the device query
go through the module's seams. Every expected value below is written out by
hand from the sources (FlashInfer 0.6.18.post1, vLLM 0.30.0), never computed
by the module.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re

import pytest

from tests.helpers import v41_facts

# ---- FlashInfer 0.6.18.post1, written out by hand -----------------------
# flashinfer/mla/_sparse_mla_sm120.py:74 _DECODE_MAX_TOKENS = 64, :78 the
# (heads, topk) set, :107 page 64, :256 d_qk == 512; data/csrc/
# sparse_mla_sm120_prefill.cu:297 single topk, :266 single page, :394 dual
# topk == 128, :325 dual extra page {64, 2}, :366 dual page.
HEADS = frozenset({8, 16, 32, 64, 128})
DECODE_TOPKS = (128, 192, 256, 512, 1024)
SINGLE_TOPKS = frozenset({128, 192, 256, 512, 1024, 2048})

PY = "flashinfer/mla/_sparse_mla_sm120.py"
CU = "flashinfer/data/csrc/sparse_mla_sm120_prefill.cu"
BINDING = "flashinfer/data/csrc/sparse_mla_sm120.cu"

DECODE, SINGLE, DUAL = "decode kernel", "prefill single", "prefill dual"

ARGV = ("--", "/models/v41", "-tp", "4")


def rules_06(
    mod, *, cutoff: int = 64, prefill_min: int | None = None, dual_extra=frozenset({2, 64}), decode_pairs=None
):
    R = mod.Rule
    pairs = decode_pairs if decode_pairs is not None else frozenset((h, t) for h in HEADS for t in DECODE_TOPKS)
    d_qk = R("d_qk", "in", frozenset({512}), f"{BINDING}:68 resolve_model_type: DSV4")
    start = cutoff + 1 if prefill_min is None else prefill_min
    routes = (
        mod.Route(
            DECODE,
            1,
            cutoff,
            "any",
            (
                R("d_qk", "in", frozenset({512}), f"{PY}:256 _decode_dsv4_dispatchable"),
                R("page_block_size", "in", frozenset({64}), f"{PY}:107 _DECODE_DSV4_PAGE_BLOCK_SIZE"),
                R("num_heads,topk", "in", pairs, f"{PY}:78 _DECODE_DSV4_DISPATCH"),
            ),
            f"{PY}:74 _DECODE_MAX_TOKENS",
        ),
        mod.Route(
            SINGLE,
            start,
            None,
            "single",
            (
                d_qk,
                R("num_heads", "in", HEADS, f"{CU}:275 dispatch_dsv4_single: num_heads cases"),
                R("topk", "in", SINGLE_TOPKS, f"{CU}:297 dispatch_dsv4_single: topk branches"),
                R("page_block_size", "in", frozenset({64}), f"{CU}:266 launch_prefill_mg"),
            ),
            f"{BINDING}:261 num_tokens > 64",
        ),
        mod.Route(
            DUAL,
            start,
            None,
            "dual",
            (
                d_qk,
                R("num_heads", "in", HEADS, f"{CU}:334 dispatch_dsv4_dual: num_heads cases"),
                R("topk", "in", frozenset({128}), f"{CU}:394 dispatch_dsv4_dual: topk guard"),
                R(
                    "extra_page_block_size",
                    "in",
                    frozenset(dual_extra),
                    f"{CU}:325 dispatch_dsv4_dual: extra_page_block_size branches",
                ),
                R("page_block_size", "in", frozenset({64}), f"{CU}:366 launch_prefill_mg_dual"),
            ),
            f"{CU}:418 dispatch_dsv4_dual",
        ),
    )
    return mod.FlashInferRules(
        version="0.6.18.post1",
        reader="hand-built",
        bytes_per_token=584,
        routes=routes,
        sources={"bytes_per_token": f"{PY}:141 _BPT_DSV4"},
        notes=["hand-built rules note"],
    )


def facts(mod, **over):
    """vLLM 0.30.0 on the synthetic checkpoint at TP 4, patched (SWA page 64), vision."""
    return v41_facts(mod, **over)


def text_only(mod, **over):
    over.setdefault("prefill_width", 128)
    return facts(mod, **over)


def good(mod, **over):
    """No ratio-1 layer, window 128, text-only: every route accepts on 0.6.18."""
    over.setdefault("layer_types", ((0, 0), (2, 64)))
    return text_only(mod, **over)


class FakeKernel:
    """Records (route, layer, kind, cache, tokens); raises where ``fail`` says."""

    def __init__(self, fail=None):
        self.calls = []
        self.fail = fail or (lambda check, n: None)

    def __call__(self, check, n, vf, fi):
        self.calls.append((check.route, check.call.layer, check.call.kind, n))
        exc = self.fail(check, n)
        if exc is not None:
            raise exc


def never_called(*args):
    raise AssertionError("kernel called")


SM120 = lambda: (12, 0)  # noqa: E731
NO_DEVICE = lambda: None  # noqa: E731


def run(mod, vf, fi=None, argv=ARGV, **kw):
    out = io.StringIO()
    fi = fi if fi is not None else rules_06(mod)
    kw.setdefault("device_capability", NO_DEVICE)
    rc = mod.run(list(argv), out=out, vllm_facts=lambda a: (vf, []), flashinfer_rules=lambda: fi, **kw)
    text = out.getvalue()
    return rc, text, text.rstrip("\n").splitlines()[-1]


def static(mod, vf, fi=None):
    return mod.evaluate(vf, fi if fi is not None else rules_06(mod), static=True, device_capability=NO_DEVICE)


def statuses(report):
    return {name: r["status"] for name, r in report.routes().items()}


def reasons_on(report, route):
    return [r for r in report.reasons if r.startswith(f"{route}: ")]


# ---- per-route verdicts on 0.6.18.post1 rules ------------------------------


def test_ratio1_decode_above_64_tokens_fails_prefill_dual_on_extra_page_128(selftest_module):
    rep = static(selftest_module, text_only(selftest_module))
    assert not rep.passed
    assert statuses(rep) == {DECODE: "pass", SINGLE: "pass", DUAL: "FAIL"}
    (reason,) = reasons_on(rep, DUAL)
    assert "extra_page_block_size 128 not in {2, 64}" in reason
    assert f"({CU}:325 " in reason
    # Both the decode calls past 64 tokens (capture sizes up to 512) and the
    # prefill calls of the ratio-1 layer reach dual with the 128-token page.
    assert "compressed ratio 1, decode 65..512" in reason
    assert "compressed ratio 1, prefill 65..8192" in reason
    assert "compressed ratio 2" not in reason
    assert rep.verdict.startswith("SELFTEST FAIL: prefill dual: extra_page_block_size 128 not in {2, 64}")


def test_ratio1_layer_has_two_refused_dual_parts(selftest_module):
    rep = static(selftest_module, text_only(selftest_module))
    dual = [c for c in rep.checks if c.route == DUAL and c.call.layer == "compressed ratio 1"]
    assert [(c.call.kind, c.min_tokens, c.max_tokens) for c in dual] == [("decode", 65, 512), ("prefill", 65, 8192)]
    assert all(len(c.reasons) == 1 for c in dual)


@pytest.mark.parametrize("layers", [((2, 64),), ((0, 0), (2, 64))])
def test_ratio2_only_window_128_text_only_passes_every_route(selftest_module, layers):
    rep = static(selftest_module, good(selftest_module, layer_types=layers))
    assert rep.passed and rep.verdict == "SELFTEST PASS (static)"
    assert statuses(rep) == {DECODE: "pass", SINGLE: "pass" if (0, 0) in layers else "not reached", DUAL: "pass"}
    assert rep.reasons == []


def test_window_256_fails_prefill_dual_on_topk(selftest_module):
    rep = static(selftest_module, good(selftest_module, sliding_window=256, prefill_width=256))
    assert statuses(rep) == {DECODE: "pass", SINGLE: "pass", DUAL: "FAIL"}
    (reason,) = reasons_on(rep, DUAL)
    assert reason.startswith("prefill dual: topk 256 not in {128} (" + CU + ":394 ")
    assert "compressed ratio 2, decode 65..512" in reason
    assert "compressed ratio 2, prefill 65..8192" in reason


@pytest.mark.parametrize("index_topk", [128, 512, 2048, 4096])
def test_index_topk_does_not_matter_for_06_dual(selftest_module, index_topk):
    # 0.6.18's dispatch_dsv4_dual takes topk_extra at run time: no rule on it.
    rep = static(selftest_module, good(selftest_module, extra_topk=index_topk))
    assert rep.passed, rep.reasons
    dual = [c for c in rep.checks if c.route == DUAL]
    assert dual and all(c.call.extra_topk == index_topk for c in dual)


def test_max_num_seqs_8_decode_stays_on_decode_route_prefill_reaches_dual(selftest_module):
    vf = text_only(selftest_module, max_num_seqs=8, decode_query_len=2, capture_sizes=(1, 2, 4, 8, 16))
    rep = static(selftest_module, vf)
    decode_calls = [c for c in rep.checks if c.call.kind == "decode"]
    assert {c.route for c in decode_calls} == {DECODE}
    assert {(c.min_tokens, c.max_tokens) for c in decode_calls} == {(1, 16)}
    r1_prefill = {
        c.route: (c.min_tokens, c.max_tokens)
        for c in rep.checks
        if c.call.kind == "prefill" and c.call.layer == "compressed ratio 1"
    }
    assert r1_prefill == {DECODE: (3, 64), DUAL: (65, 8192)}
    (reason,) = reasons_on(rep, DUAL)
    assert "extra_page_block_size 128" in reason
    assert "compressed ratio 1, prefill 65..8192" in reason and "decode" not in reason
    # The table says so: decode rows accepted on the decode route, the dual prefill row refused.
    out = io.StringIO()
    selftest_module.render_text(rep, out)
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in out.getvalue().splitlines() if "compressed ratio 1" in ln]
    table = {(r[0], r[2]): r for r in rows if len(r) == 11 and r[1] == "compressed ratio 1"}
    assert set(table) == {(DECODE, "decode"), (DECODE, "prefill"), (DUAL, "prefill")}
    assert table[(DECODE, "decode")][3] == "1..16" and table[(DECODE, "decode")][-1] == "accepted"
    assert table[(DECODE, "prefill")][3] == "3..64" and table[(DECODE, "prefill")][-1] == "accepted"
    assert table[(DUAL, "prefill")][3] == "65..8192"
    assert table[(DUAL, "prefill")][-1].startswith("refused: extra_page_block_size 128 not in {2, 64}")


def test_enforce_eager_decode_calls_end_at_max_num_seqs(selftest_module):
    # No capture sizes: decode calls reach max_num_seqs * decode_query_len only.
    vf = text_only(selftest_module, max_num_seqs=64, capture_sizes=())
    rep = static(selftest_module, vf)
    decode_calls = [c for c in rep.checks if c.call.kind == "decode"]
    assert {(c.route, c.min_tokens, c.max_tokens) for c in decode_calls} == {(DECODE, 1, 64)}
    (reason,) = reasons_on(rep, DUAL)
    assert "decode" not in reason.split("[", 1)[1]
    fact = {f.name: f.value for f in rep.facts}["vllm.capture_sizes"]
    assert fact == "none (no CUDA graphs)"
    # With the default 512-size captures the same layer's decode calls do reach dual.
    rep2 = static(selftest_module, text_only(selftest_module, max_num_seqs=64))
    assert "compressed ratio 1, decode 65..512" in reasons_on(rep2, DUAL)[0]


def test_128_heads_pass_every_route(selftest_module):
    vf = good(selftest_module, tensor_parallel_size=1, num_heads=128, local_heads=128, padded_heads=128)
    rep = static(selftest_module, vf)
    assert rep.passed, rep.reasons
    assert {c.call.num_heads for c in rep.checks} == {128}


def test_128_heads_with_topk_2048_decode_part_refused_naming_the_pair_set(selftest_module):
    vf = good(selftest_module, padded_heads=128, prefill_width=2048, layer_types=((0, 0),))
    rep = static(selftest_module, vf)
    assert statuses(rep) == {DECODE: "FAIL", SINGLE: "pass", DUAL: "not reached"}
    (reason,) = reasons_on(rep, DECODE)
    assert "num_heads,topk (128, 2048) not in the set: heads 128 take topk {128, 192, 256, 512, 1024}" in reason
    assert "sliding-window only, prefill 2..64" in reason


def test_unpatched_page_32_and_vision_width_fail_their_routes(selftest_module):
    rep = static(selftest_module, facts(selftest_module, swa_page_block_size=32))
    assert statuses(rep) == {DECODE: "FAIL", SINGLE: "FAIL", DUAL: "FAIL"}
    text = " | ".join(rep.reasons)
    assert "decode kernel: page_block_size 32 not in {64}" in text
    assert "decode kernel: num_heads,topk (16, 1152) not in the set" in text
    assert "prefill single: topk 1152 not in {128, 192, 256, 512, 1024, 2048}" in text
    assert "prefill dual: topk 1152 not in {128}" in text


def test_route_gap_is_cannot_establish(selftest_module):
    fi = rules_06(selftest_module, prefill_min=80)
    calls = selftest_module.plan_calls(good(selftest_module))
    with pytest.raises(selftest_module.CannotEstablish, match="calls of 65 tokens"):
        selftest_module.plan_checks(calls, fi)
    rc, text, last = run(selftest_module, good(selftest_module), fi, static=True)
    assert rc == 1
    assert last.startswith("SELFTEST FAIL: cannot establish the kernel route of ")
    assert "calls of 65 tokens" in last
    assert "Traceback" not in text


def test_route_gap_not_reached_by_calls_is_fine(selftest_module):
    # Decode calls of at most 64 tokens and no prefill calls never need 65..79.
    vf = good(selftest_module, max_num_seqs=64, capture_sizes=(), max_num_batched_tokens=64, decode_query_len=64)
    fi = rules_06(selftest_module, prefill_min=80)
    checks = selftest_module.plan_checks(selftest_module.plan_calls(vf), fi)
    assert {c.route for c in checks} == {DECODE}


# ---- routes() statuses, --json and text output ----------------------------


def test_routes_statuses_and_reasons(selftest_module):
    rep = static(selftest_module, text_only(selftest_module, layer_types=((1, 128),)))
    routes = rep.routes()
    assert list(routes) == [DECODE, SINGLE, DUAL]
    assert routes[DECODE] == {"status": "pass", "reasons": []}
    assert routes[SINGLE] == {"status": "not reached", "reasons": []}
    assert routes[DUAL]["status"] == "FAIL"
    assert len(routes[DUAL]["reasons"]) == 1 and "extra_page_block_size 128" in routes[DUAL]["reasons"][0]


def test_json_shape(selftest_module):
    rc, text, last = run(selftest_module, text_only(selftest_module), argv=("--static", "--json", *ARGV))
    assert rc == 1
    assert last.startswith("SELFTEST FAIL: prefill dual: extra_page_block_size 128")
    data = json.loads(text[: text.rstrip("\n").rfind("\n")])
    assert data["verdict"] == last and data["passed"] is False and data["static"] is True
    assert {n: r["status"] for n, r in data["routes"].items()} == {DECODE: "pass", SINGLE: "pass", DUAL: "FAIL"}
    check = next(
        c
        for c in data["checks"]
        if c["route"] == DUAL and c["kind"] == "prefill" and c["layer"] == "compressed ratio 1"
    )
    assert (check["min_tokens"], check["max_tokens"], check["num_heads"], check["topk"]) == (65, 8192, 16, 128)
    assert (check["extra_topk"], check["extra_page_block_size"], check["page_block_size"]) == (512, 128, 64)
    assert check["static"] == "refused" and check["kernel"] == []
    assert set(data["scope"]) == {"covered", "not_covered"}
    assert "decode calls of 1..512 tokens" in data["scope"]["covered"]
    assert "prefill calls of 2..8192 tokens" in data["scope"]["covered"]
    assert "a vLLM scope note" in data["scope"]["not_covered"]
    assert "hand-built rules note" in data["scope"]["not_covered"]


def test_text_output_has_routes_and_not_covered(selftest_module):
    rc, text, last = run(selftest_module, good(selftest_module), static=True)
    assert rc == 0 and last == "SELFTEST PASS (static)"
    lines = text.splitlines()
    i = lines.index("routes:")
    assert lines[i + 1].split() == ["decode", "kernel", "pass"]
    assert lines[i + 2].split() == ["prefill", "single", "pass"]
    assert lines[i + 3].split() == ["prefill", "dual", "pass"]
    j = lines.index("not covered:")
    assert "  - a vLLM scope note" in lines[j:]
    assert "  - hand-built rules note" in lines[j:]
    assert "covered:" in lines
    assert "device: no CUDA device; mode: static checks only (--static)" in lines
    assert f"{PY}:78 _DECODE_DSV4_DISPATCH" in text  # rules are printed with their source


# ---- the seam: kernel calls on a fake SM120 device ------------------------


def test_kernel_called_once_per_route_part_and_token_count(selftest_module):
    vf = good(selftest_module, layer_types=((2, 64),))
    kernel = FakeKernel()
    rc, _, last = run(selftest_module, vf, kernel_call=kernel, device_capability=SM120)
    assert (rc, last) == (0, "SELFTEST PASS")
    L = "compressed ratio 2"
    # decode calls 1..512: 1 and 64 on the decode kernel, 65 and 512 (largest capture) on dual;
    # prefill calls 2..8192: 2 and 64 on the decode kernel, 65, 512 and 8192 on dual.
    assert kernel.calls == [
        (DECODE, L, "decode", 1),
        (DECODE, L, "decode", 64),
        (DUAL, L, "decode", 65),
        (DUAL, L, "decode", 512),
        (DECODE, L, "prefill", 2),
        (DECODE, L, "prefill", 64),
        (DUAL, L, "prefill", 65),
        (DUAL, L, "prefill", 512),
        (DUAL, L, "prefill", 8192),
    ]


def test_kernel_token_counts_by_hand(selftest_module):
    vf = good(selftest_module)
    checks = selftest_module.plan_checks(selftest_module.plan_calls(vf), rules_06(selftest_module))
    counts = {(c.route, c.call.layer, c.call.kind): selftest_module.kernel_token_counts(c, vf) for c in checks}
    assert counts[(DECODE, "sliding-window only", "decode")] == [1, 64]
    assert counts[(SINGLE, "sliding-window only", "decode")] == [65, 512]
    assert counts[(DUAL, "compressed ratio 2", "decode")] == [65, 512]
    assert counts[(SINGLE, "sliding-window only", "prefill")] == [65, 512, 8192]


def test_raising_kernel_fails_naming_route_and_layer(selftest_module):
    def fail(check, n):
        if check.route == DUAL and check.call.kind == "prefill" and n == 8192:
            return RuntimeError("no kernel for this shape")
        return None

    kernel = FakeKernel(fail)
    rc, text, last = run(selftest_module, good(selftest_module), kernel_call=kernel, device_capability=SM120)
    assert rc == 1
    assert last == (
        "SELFTEST FAIL: prefill dual: RuntimeError: no kernel for this shape [compressed ratio 2, prefill 8192]"
    )
    # The other calls still ran: one refusal does not stop the table.
    assert len(kernel.calls) == 18
    assert "8192: raised RuntimeError: no kernel for this shape" in text


def test_kernel_that_runs_on_statically_refused_part_still_fails_with_note(selftest_module):
    kernel = FakeKernel()
    rc, text, last = run(selftest_module, text_only(selftest_module), kernel_call=kernel, device_capability=SM120)
    assert rc == 1
    assert last.startswith("SELFTEST FAIL: prefill dual: extra_page_block_size 128 not in {2, 64}")
    assert (
        "note: prefill dual, compressed ratio 1, prefill 65..8192: the kernel ran, but the rules read refuse it"
    ) in text
    assert (DUAL, "compressed ratio 1", "prefill", 8192) in kernel.calls


def test_no_device_fails_and_calls_no_kernel(selftest_module):
    rc, text, last = run(selftest_module, good(selftest_module), kernel_call=never_called, device_capability=NO_DEVICE)
    assert rc == 1
    assert last == "SELFTEST FAIL: no SM120 device: kernel calls not run"


@pytest.mark.parametrize("cap", [(9, 0), (10, 0), (11, 0)])
def test_other_device_fails_and_calls_no_kernel(selftest_module, cap):
    rc, _, last = run(selftest_module, good(selftest_module), kernel_call=never_called, device_capability=lambda: cap)
    assert rc == 1 and last.startswith("SELFTEST FAIL: no SM120 device")


def test_no_device_lists_static_refusals_too(selftest_module):
    rc, _, last = run(selftest_module, text_only(selftest_module), kernel_call=never_called)
    assert rc == 1
    assert last.startswith(
        "SELFTEST FAIL: no SM120 device: kernel calls not run; prefill dual: extra_page_block_size 128"
    )


def test_sm121_counts_as_sm120(selftest_module):
    kernel = FakeKernel()
    rc, text, last = run(selftest_module, good(selftest_module), kernel_call=kernel, device_capability=lambda: (12, 1))
    assert (rc, last) == (0, "SELFTEST PASS")
    assert kernel.calls
    assert "device: compute capability 12.1; mode: kernel calls" in text


@pytest.mark.parametrize("how", ["flag", "keyword"])
def test_static_never_calls_kernel(selftest_module, how):
    argv = ("--static", *ARGV) if how == "flag" else ARGV
    kw = {} if how == "flag" else {"static": True}
    rc, _, last = run(
        selftest_module, good(selftest_module), argv=argv, kernel_call=never_called, device_capability=SM120, **kw
    )
    assert (rc, last) == (0, "SELFTEST PASS (static)")


# ---- errors: one FAIL line, no traceback ----------------------------------


def _one_fail_line(text):
    fails = [ln for ln in text.splitlines() if ln.startswith("SELFTEST")]
    assert len(fails) == 1 and fails[0] == text.rstrip("\n").splitlines()[-1]
    assert "Traceback" not in text
    return fails[0]


def test_bad_selftest_option(selftest_module):
    rc, text, _ = run(selftest_module, good(selftest_module), argv=("--bogus", *ARGV))
    assert rc == 1
    line = _one_fail_line(text)
    assert line.startswith("SELFTEST FAIL: self-test options: ") and "--bogus" in line


def test_collector_selftest_error(selftest_module):
    def boom(argv):
        raise selftest_module.SelftestError("model path '/nope' is not a directory")

    out = io.StringIO()
    rc = selftest_module.run(
        list(ARGV),
        out=out,
        vllm_facts=boom,
        flashinfer_rules=lambda: rules_06(selftest_module),
        device_capability=NO_DEVICE,
    )
    assert rc == 1
    assert _one_fail_line(out.getvalue()) == "SELFTEST FAIL: model path '/nope' is not a directory"


def test_collector_unexpected_exception(selftest_module, monkeypatch):
    monkeypatch.delenv("SM120_SELFTEST_DEBUG", raising=False)

    def boom():
        raise KeyError("surprise")

    out = io.StringIO()
    rc = selftest_module.run(
        list(ARGV),
        out=out,
        vllm_facts=lambda a: (good(selftest_module), []),
        flashinfer_rules=boom,
        device_capability=NO_DEVICE,
    )
    assert rc == 1
    assert _one_fail_line(out.getvalue()) == "SELFTEST FAIL: internal error: KeyError: 'surprise'"


def test_serve_argv_reaches_collector_unchanged(selftest_module):
    seen = []

    def collect(argv):
        seen.append(list(argv))
        return good(selftest_module), []

    out = io.StringIO()
    selftest_module.run(
        ["--static", "--", "/m", "-tp", "4", "--static-x"],
        out=out,
        vllm_facts=collect,
        flashinfer_rules=lambda: rules_06(selftest_module),
        device_capability=NO_DEVICE,
    )
    assert seen == [["/m", "-tp", "4", "--static-x"]]


def test_module_imports_no_vllm_torch_flashinfer(selftest_module):
    src = open(selftest_module.__file__, encoding="utf-8").read()
    top = [ln for ln in src.splitlines() if ln.startswith(("import ", "from "))]
    assert not [ln for ln in top if any(m in ln for m in ("vllm", "torch", "flashinfer"))]
    assert dataclasses.is_dataclass(selftest_module.VllmFacts)
