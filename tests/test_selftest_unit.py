"""Unit tests of the SM120 decode-shape self-test's logic, without vLLM.

The module under test is the file produced by applying the
``sm120_decode_shape_selftest`` member (fixture ``selftest_module`` in
conftest). Facts are injected; the kernel call and the device query go
through the module's seams. The expected values below are written out by
hand from REFERENCE.md, never computed by the module.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

# FlashInfer 0.6.18.post1, flashinfer/mla/_sparse_mla_sm120.py (REFERENCE.md).
HEADS = (8, 16, 32, 64, 128)
TOPKS = (128, 192, 256, 512, 1024)
DISPATCH_0_6_18 = frozenset((h, t) for h in HEADS for t in TOPKS)

PAGE_REASON = "page_block_size 32, kernel needs 64"
WIDTH_REASON = "(16, 1152) not in the decode dispatch set"


def vllm_facts(mod, *, page: int = 64, width: int = 128, padded_heads: int = 16):
    return mod.VllmFacts(
        tensor_parallel_size=4,
        num_heads=64,
        local_heads=16,
        padded_heads=padded_heads,
        sliding_window=128,
        prefill_width=width,
        swa_page_block_size=page,
        compressed_pages=((1, 128), (2, 64)),
        extra_topk=512,
        d_qk=512,
        sources={"swa_page_block_size": "test"},
    )


def fi_facts(mod):
    return mod.FlashInferFacts(
        version="0.6.18.post1",
        reader="source",
        max_num_tokens=64,
        d_qk=512,
        bytes_per_token=584,
        page_block_sizes=(64,),
        dispatch=DISPATCH_0_6_18,
        sources={"max_num_tokens": "test"},
    )


class FakeKernel:
    """Records each call; raises for the shapes named in ``fail``."""

    def __init__(self, fail: dict[str, Exception] | None = None) -> None:
        self.calls: list[tuple[str, int, int, int, int, int]] = []
        self.fail = fail or {}

    def __call__(self, shape, vf, fi) -> None:
        self.calls.append(
            (
                shape.label,
                shape.num_tokens,
                shape.num_heads,
                shape.topk,
                shape.extra_topk,
                shape.page_block_size,
            )
        )
        if shape.label in self.fail:
            raise self.fail[shape.label]


def run(mod, argv=("--", "/models/v41", "-tp", "4"), *, vf=None, fi=None, **kw):
    out = io.StringIO()
    vf = vf if vf is not None else vllm_facts(mod)
    fi = fi if fi is not None else fi_facts(mod)
    rc = mod.run(
        list(argv),
        out=out,
        vllm_facts=lambda argv: (vf, []),
        flashinfer_facts=lambda: fi,
        **kw,
    )
    text = out.getvalue()
    return rc, text, text.rstrip("\n").splitlines()[-1]


SM120 = lambda: (12, 0)  # noqa: E731
NO_DEVICE = lambda: None  # noqa: E731


# ---- kernel path through the seam ---------------------------------------


def test_all_shapes_ran_on_sm120_is_pass(selftest_module):
    kernel = FakeKernel()
    rc, text, last = run(selftest_module, kernel_call=kernel, device_capability=SM120)
    assert last == "SELFTEST PASS"
    assert rc == 0
    # decode 1/8/64 at topk = window, the 8-token prefill chunk at the
    # prefill width; every one with the extra segment and the SWA page.
    assert kernel.calls == [
        ("decode 1", 1, 16, 128, 512, 64),
        ("decode 8", 8, 16, 128, 512, 64),
        ("decode 64", 64, 16, 128, 512, 64),
        ("prefill chunk 8", 8, 16, 128, 512, 64),
    ]
    assert text.count(" ran ") == 4


def test_one_shape_raised_is_fail_naming_it(selftest_module):
    kernel = FakeKernel(
        fail={"prefill chunk 8": ValueError("SM120 sparse-MLA has no decode kernel")}
    )
    rc, _, last = run(selftest_module, kernel_call=kernel, device_capability=SM120)
    assert rc == 1
    assert last.startswith("SELFTEST FAIL: ")
    assert "prefill chunk 8" in last
    assert "SM120 sparse-MLA has no decode kernel" in last
    assert "decode 1 " not in last and "decode 64" not in last
    # The other shapes still ran: a refusal does not stop the table.
    assert len(kernel.calls) == 4


def test_kernel_runs_even_when_static_check_refuses(selftest_module):
    # On a real device the kernel decides; a statically refused shape that
    # runs is a note, not a failure.
    kernel = FakeKernel()
    rc, text, last = run(
        selftest_module,
        vf=vllm_facts(selftest_module, page=32),
        kernel_call=kernel,
        device_capability=SM120,
    )
    assert last == "SELFTEST PASS"
    assert rc == 0
    assert "note:" in text


@pytest.mark.parametrize("device", [NO_DEVICE, lambda: (9, 0), lambda: (10, 0)])
def test_without_sm120_device_is_fail_and_no_kernel_call(selftest_module, device):
    kernel = FakeKernel()
    rc, _, last = run(selftest_module, kernel_call=kernel, device_capability=device)
    assert rc == 1
    assert last.startswith("SELFTEST FAIL: no SM120 device: kernel calls not run")
    assert kernel.calls == []


def test_sm121_counts_as_sm120_family(selftest_module):
    kernel = FakeKernel()
    rc, _, last = run(
        selftest_module, kernel_call=kernel, device_capability=lambda: (12, 1)
    )
    assert (rc, last) == (0, "SELFTEST PASS")


# ---- static verdicts ------------------------------------------------------


def test_static_pass_says_static_and_calls_no_kernel(selftest_module):
    kernel = FakeKernel()
    rc, _, last = run(
        selftest_module,
        argv=("--static", "--", "/models/v41"),
        kernel_call=kernel,
        device_capability=SM120,
    )
    assert last == "SELFTEST PASS (static)"
    assert rc == 0
    assert kernel.calls == []


def test_static_keyword_equals_flag(selftest_module):
    rc, _, last = run(
        selftest_module, argv=("--", "/m"), static=True, device_capability=NO_DEVICE
    )
    assert (rc, last) == (0, "SELFTEST PASS (static)")


def test_static_fail_page_and_width(selftest_module):
    rc, text, last = run(
        selftest_module,
        argv=("--static", "--", "/m"),
        vf=vllm_facts(selftest_module, page=32, width=1152),
        device_capability=NO_DEVICE,
    )
    assert rc == 1
    assert last.startswith("SELFTEST FAIL: ")
    assert PAGE_REASON in last
    assert WIDTH_REASON in last
    # The page refuses all four shapes, the width only the prefill chunk.
    assert f"{PAGE_REASON} [decode 1, decode 8, decode 64, prefill chunk 8]" in last
    assert f"{WIDTH_REASON} [prefill chunk 8]" in last
    assert "no SM120 device" not in last


@pytest.mark.parametrize(
    ("page", "width", "present", "absent"),
    [(32, 128, PAGE_REASON, "not in the decode dispatch set"), (64, 1152, WIDTH_REASON, "page_block_size")],
    ids=["page-only", "width-only"],
)
def test_static_fail_one_cause(selftest_module, page, width, present, absent):
    rc, _, last = run(
        selftest_module,
        argv=("--static", "--", "/m"),
        vf=vllm_facts(selftest_module, page=page, width=width),
        device_capability=NO_DEVICE,
    )
    assert rc == 1
    assert present in last
    assert absent not in last


def test_no_device_lists_static_refusals_too(selftest_module):
    rc, _, last = run(
        selftest_module,
        vf=vllm_facts(selftest_module, page=32, width=1152),
        device_capability=NO_DEVICE,
    )
    assert rc == 1
    assert "no SM120 device: kernel calls not run" in last
    assert PAGE_REASON in last


def test_padded_heads_outside_dispatch_is_refused(selftest_module):
    # 64 heads at TP 1 pad to 64: (64, 128) is in the set; 256 is not a
    # head count FlashInfer instantiates.
    rc, _, last = run(
        selftest_module,
        argv=("--static", "--", "/m"),
        vf=vllm_facts(selftest_module, padded_heads=256),
        device_capability=NO_DEVICE,
    )
    assert rc == 1
    assert "(256, 128) not in the decode dispatch set" in last


def test_runtime_page_envelope_accepts_any_page(selftest_module):
    # FlashInfer 0.7.x style: page size is a runtime value, topk >= min_topk.
    fi = selftest_module.FlashInferFacts(
        version="0.7.0",
        reader="import",
        max_num_tokens=64,
        d_qk=512,
        bytes_per_token=584,
        page_block_sizes=None,
        dispatch=None,
        max_num_heads=128,
        min_topk=1,
        topk_is_runtime=True,
    )
    rc, _, last = run(
        selftest_module,
        argv=("--static", "--", "/m"),
        vf=vllm_facts(selftest_module, page=32, width=1152),
        fi=fi,
        device_capability=NO_DEVICE,
    )
    assert (rc, last) == (0, "SELFTEST PASS (static)")


# ---- output and errors ----------------------------------------------------


def test_json_prints_whole_table_then_verdict(selftest_module):
    rc, text, last = run(
        selftest_module,
        argv=("--static", "--json", "--", "/m"),
        vf=vllm_facts(selftest_module, page=32, width=1152),
        device_capability=NO_DEVICE,
    )
    body = text.rstrip("\n").splitlines()
    data = json.loads("\n".join(body[:-1]))
    assert rc == 1
    assert data["verdict"] == last
    assert [s["shape"] for s in data["shapes"]] == [
        "decode 1",
        "decode 8",
        "decode 64",
        "prefill chunk 8",
    ]
    prefill = data["shapes"][3]
    assert (prefill["num_tokens"], prefill["topk"], prefill["page_block_size"]) == (
        8,
        1152,
        32,
    )
    assert prefill["static"] == "refused"
    assert WIDTH_REASON in prefill["static_reasons"]
    facts = {f["name"]: f for f in data["facts"]}
    assert facts["vllm.swa_page_block_size"]["value"] == 32
    assert facts["vllm.swa_page_block_size"]["source"] == "test"
    assert facts["flashinfer.max_num_tokens"]["value"] == 64


def test_text_output_prints_facts_with_sources(selftest_module):
    _, text, _ = run(selftest_module, argv=("--static", "--", "/m"))
    assert "vllm.swa_page_block_size" in text
    assert "from test" in text


def test_collector_error_is_fail_line_not_traceback(selftest_module):
    out = io.StringIO()

    def broken(argv):
        raise selftest_module.SelftestError("no config.json in model path '/x'")

    rc = selftest_module.run(
        ["--", "/x"],
        out=out,
        vllm_facts=broken,
        flashinfer_facts=lambda: fi_facts(selftest_module),
        device_capability=NO_DEVICE,
    )
    assert rc == 1
    assert out.getvalue().splitlines()[-1] == (
        "SELFTEST FAIL: no config.json in model path '/x'"
    )
    assert "Traceback" not in out.getvalue()


def test_unexpected_exception_is_fail_line(selftest_module, capsys):
    out = io.StringIO()

    def broken(argv):
        raise KeyError("boom")

    rc = selftest_module.run(
        ["--", "/x"], out=out, vllm_facts=broken, device_capability=NO_DEVICE
    )
    assert rc == 1
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("SELFTEST FAIL: internal error: KeyError")
    captured = capsys.readouterr()
    assert "Traceback" not in out.getvalue() + captured.err + captured.out


def test_unknown_selftest_option_is_fail(selftest_module):
    rc, _, last = run(selftest_module, argv=("--frobnicate", "--", "/m"))
    assert rc == 1
    assert last.startswith("SELFTEST FAIL: ")
    assert "--frobnicate" in last


def test_serve_argv_reaches_collector_unchanged(selftest_module):
    seen = []
    argv = ["/models/v41", "--headless", "--hf-overrides.vision_n_layers", "0", "-tp", "4"]

    def collect(serve_argv):
        seen.append(list(serve_argv))
        return vllm_facts(selftest_module), []

    selftest_module.run(
        ["--static", "--", *argv],
        out=io.StringIO(),
        vllm_facts=collect,
        flashinfer_facts=lambda: fi_facts(selftest_module),
        device_capability=NO_DEVICE,
    )
    assert seen == [argv]


def test_module_imports_no_vllm_torch_flashinfer(selftest_module):
    src = Path(selftest_module.__file__).read_text()
    top_level = [ln for ln in src.splitlines() if ln.startswith(("import ", "from "))]
    assert top_level, "expected module-level imports"
    assert not [
        ln for ln in top_level if any(m in ln for m in ("vllm", "torch", "flashinfer"))
    ]


# ---- FlashInfer source reader against the real wheel ----------------------


@pytest.fixture(scope="session")
def flashinfer_sm120_source(probe_python) -> Path:
    """flashinfer/mla/_sparse_mla_sm120.py as installed in the probe venv."""
    venv = Path(probe_python).parent.parent
    found = sorted(venv.glob("lib/python*/site-packages/flashinfer/mla/_sparse_mla_sm120.py"))
    assert found, f"no flashinfer/mla/_sparse_mla_sm120.py under {venv}"
    return found[0]


def test_source_reader_on_flashinfer_0_6_18(selftest_module, flashinfer_sm120_source):
    facts = selftest_module.read_sparse_mla_sm120_source(flashinfer_sm120_source)
    assert facts.reader == "source"
    assert facts.max_num_tokens == 64
    assert facts.page_block_sizes == (64,)
    assert facts.bytes_per_token == 584
    assert facts.d_qk == 512
    assert facts.dispatch == DISPATCH_0_6_18
    assert (16, 1152) not in facts.dispatch
    assert not any(topk == 1152 for _, topk in facts.dispatch)
    src = facts.sources
    assert src["max_num_tokens"].startswith("flashinfer/mla/_sparse_mla_sm120.py:74 ")
    assert src["dispatch"].startswith("flashinfer/mla/_sparse_mla_sm120.py:78 ")
    assert src["page_block_sizes"].startswith("flashinfer/mla/_sparse_mla_sm120.py:107 ")
    assert src["bytes_per_token"].startswith("flashinfer/mla/_sparse_mla_sm120.py:141 ")


def test_source_reader_refuses_a_file_without_the_constants(selftest_module, tmp_path):
    bogus = tmp_path / "flashinfer" / "mla" / "_sparse_mla_sm120.py"
    bogus.parent.mkdir(parents=True)
    bogus.write_text("_DECODE_MAX_TOKENS = 64\n")
    with pytest.raises(selftest_module.SelftestError) as err:
        selftest_module.read_sparse_mla_sm120_source(bogus)
    assert "_DECODE_DSV4_DISPATCH" in str(err.value)
    assert "flashinfer/mla/_sparse_mla_sm120.py" in str(err.value)
