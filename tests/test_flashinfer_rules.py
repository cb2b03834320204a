"""The self-test's FlashInfer readers on the real sources, and on edited copies.

- 0.6.18.post1: the flashinfer package installed in the probe venv (fixture
  ``probe_python``, built once and cached).
- 0.7.2.post1: the real wheel from PyPI, fetched once with ``pip download``
  into the user cache (sha256-checked); only the files the reader needs are
  unpacked.

Expected rules and their file:line are written out by hand from reading
those sources; none is computed by the module under test.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from builder.cache import cache_root
from tests.helpers import v41_facts

DECODE, SINGLE, DUAL = "decode kernel", "prefill single", "prefill dual"
HEADS = frozenset({8, 16, 32, 64, 128})
DECODE_PAIRS_06 = frozenset((h, t) for h in HEADS for t in (128, 192, 256, 512, 1024))

FI07_VERSION = "0.7.2.post1"
FI07_WHEEL = "flashinfer_python-0.7.2.post1-py3-none-any.whl"
FI07_SHA256 = "bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49"
ARGV = ["--", "/models/v41", "-tp", "4"]


# ---- fixtures ---------------------------------------------------------------


@pytest.fixture(scope="session")
def fi06_root(probe_python) -> Path:
    """The flashinfer package (0.6.18.post1) installed in the probe venv."""
    venv = Path(probe_python).parent.parent
    found = sorted(venv.glob("lib/python3*/site-packages/flashinfer"))
    assert found, f"no flashinfer package under {venv}/lib"
    assert (found[0].parent / "flashinfer_python-0.6.18.post1.dist-info").is_dir()
    return found[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="session")
def fi07_wheel() -> Path:
    """The real flashinfer-python 0.7.2.post1 wheel, fetched once and sha256-checked."""
    cache = cache_root() / "test-wheels"
    wheel = cache / FI07_WHEEL
    if not wheel.is_file() or _sha256(wheel) != FI07_SHA256:
        cache.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                f"flashinfer-python=={FI07_VERSION}",
                "-d",
                str(cache),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert wheel.is_file(), f"pip download left no {wheel}"
    digest = _sha256(wheel)
    if digest != FI07_SHA256:
        wheel.unlink()
        pytest.fail(f"{FI07_WHEEL}: sha256 {digest}, expected {FI07_SHA256}")
    return wheel


@pytest.fixture(scope="session")
def fi07_root(fi07_wheel, tmp_path_factory, selftest_module) -> Path:
    """The wheel's flashinfer/ files the 0.7.x reader reads, unpacked."""
    dest = tmp_path_factory.mktemp("fi07")
    wanted = {f"flashinfer/{rel}" for rel in selftest_module.FILES_READ}
    with zipfile.ZipFile(fi07_wheel) as zf:
        names = set(zf.namelist())
        assert wanted <= names, sorted(wanted - names)
        # the whole Python package directory, so the layout check sees a directory
        pkg = f"flashinfer/{selftest_module._FI07_PY_DIR}/"
        zf.extractall(dest, sorted(wanted | {n for n in names if n.startswith(pkg)}))
    return dest / "flashinfer"


@pytest.fixture(scope="session")
def rules06(selftest_module, fi06_root):
    return selftest_module.read_flashinfer_06x(fi06_root, "0.6.18.post1")


@pytest.fixture(scope="session")
def rules07(selftest_module, fi07_root):
    return selftest_module.read_flashinfer_07x(fi07_root, FI07_VERSION)


# ---- helpers ----------------------------------------------------------------


def route(rules, name, cache=None):
    (r,) = [r for r in rules.routes if r.name == name and (cache is None or r.cache == cache)]
    return r


def rule(r, field):
    (x,) = [x for x in r.rules if x.field == field]
    return x


def by_field(r, field):
    return [(x.op, x.values) for x in r.rules if x.field == field]


def accepts(
    mod,
    rules,
    *,
    num_tokens,
    dual,
    num_heads,
    topk,
    d_qk=512,
    page_block_size=64,
    extra_topk=512,
    extra_page_block_size=64,
):
    """Whether the routes taking one call of ``num_tokens`` tokens accept it: (ok, reasons)."""
    call = mod.Call(
        kind="test",
        layer="test",
        min_tokens=num_tokens,
        max_tokens=num_tokens,
        num_heads=num_heads,
        topk=topk,
        page_block_size=page_block_size,
        extra_topk=extra_topk if dual else 0,
        extra_page_block_size=extra_page_block_size if dual else 0,
        d_qk=d_qk,
    )
    checks = mod.plan_checks([call], rules)
    assert len(checks) == 1
    return not checks[0].reasons, checks[0].reasons


def vllm_facts(mod, *, page=64, width=128, layers=((0, 0), (1, 128), (2, 64))):
    """vLLM 0.30.0 on the synthetic checkpoint at TP 4 (hand-written), text-only by default."""
    return v41_facts(mod, swa_page_block_size=page, prefill_width=width, layer_types=layers)


def run_static(mod, vf, rules):
    out = io.StringIO()
    rc = mod.run(
        ["--static", *ARGV],
        out=out,
        vllm_facts=lambda a: (vf, []),
        flashinfer_rules=rules,
        device_capability=lambda: None,
    )
    return rc, out.getvalue().rstrip("\n").splitlines()[-1]


def copy_tree(src: Path, dst: Path, rels) -> Path:
    for rel in rels:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dst / rel)
    return dst


def edit(root: Path, rel: str, old: str, new: str, count: int = 1) -> None:
    p = root / rel
    text = p.read_text(encoding="utf-8")
    assert text.count(old) == count, (rel, old, text.count(old))
    p.write_text(text.replace(old, new), encoding="utf-8")


# ---- 0.6.18.post1, as installed in the probe venv --------------------------

PY06 = "flashinfer/mla/_sparse_mla_sm120.py"
CU06 = "flashinfer/data/csrc/sparse_mla_sm120_prefill.cu"
BIND06 = "flashinfer/data/csrc/sparse_mla_sm120.cu"
FILES06 = ("mla/_sparse_mla_sm120.py", "data/csrc/sparse_mla_sm120_prefill.cu", "data/csrc/sparse_mla_sm120.cu")


def test_06_routes(rules06):
    assert rules06.version == "0.6.18.post1"
    assert rules06.reader == "source (0.6.x layout)"
    assert [(r.name, r.min_tokens, r.max_tokens, r.cache) for r in rules06.routes] == [
        (DECODE, 1, 64, "any"),
        (SINGLE, 65, None, "single"),
        (DUAL, 65, None, "dual"),
    ]
    assert route(rules06, DECODE).source.startswith(f"{PY06}:74 _DECODE_MAX_TOKENS")
    assert f"{BIND06}:261 num_tokens > 64" in route(rules06, SINGLE).source
    assert rules06.bytes_per_token == 584
    assert rules06.sources["bytes_per_token"].startswith(f"{PY06}:141 ")


def test_06_decode_rules(rules06):
    r = route(rules06, DECODE)
    assert [x.field for x in r.rules] == ["d_qk", "page_block_size", "num_heads,topk"]
    assert (rule(r, "d_qk").values, rule(r, "page_block_size").values) == (frozenset({512}), frozenset({64}))
    assert rule(r, "num_heads,topk").values == DECODE_PAIRS_06
    assert rule(r, "d_qk").source.startswith(f"{PY06}:256 ")
    assert rule(r, "page_block_size").source.startswith(f"{PY06}:107 ")
    assert rule(r, "num_heads,topk").source.startswith(f"{PY06}:78 ")


def test_06_prefill_single_rules(rules06):
    r = route(rules06, SINGLE)
    assert rule(r, "num_heads").values == HEADS
    assert rule(r, "topk").values == frozenset({128, 192, 256, 512, 1024, 2048})
    assert rule(r, "topk").source.startswith(f"{CU06}:297 ")
    assert rule(r, "page_block_size").values == frozenset({64})
    assert rule(r, "page_block_size").source.startswith(f"{CU06}:266 ")
    assert rule(r, "d_qk").values == frozenset({512})


def test_06_prefill_dual_rules(rules06):
    r = route(rules06, DUAL)
    assert rule(r, "num_heads").values == HEADS
    assert (rule(r, "topk").op, rule(r, "topk").values) == ("in", frozenset({128}))
    assert rule(r, "topk").source.startswith(f"{CU06}:394 ")
    assert rule(r, "extra_page_block_size").values == frozenset({2, 64})
    assert rule(r, "extra_page_block_size").source.startswith(f"{CU06}:325 ")
    assert rule(r, "page_block_size").values == frozenset({64})
    assert rule(r, "page_block_size").source.startswith(f"{CU06}:366 ")
    assert not [x for x in r.rules if x.field == "extra_topk"]  # topk_extra is a run-time value


def test_06_picked_by_layout_and_version(selftest_module, fi06_root, rules06):
    picked = selftest_module.read_flashinfer_rules(fi06_root, "0.6.18.post1")
    assert picked.routes == rules06.routes


@pytest.mark.parametrize("version", ["0.7.2.post1", "0.5.3", ""])
def test_06_layout_with_other_version_cannot_establish(selftest_module, fi06_root, version):
    with pytest.raises(selftest_module.CannotEstablish, match=r"0\.6\.x"):
        selftest_module.read_flashinfer_rules(fi06_root, version)


def test_06_vllm_030_unpatched_vision_fails_patched_text_fails_only_on_dual(selftest_module, rules06):
    mod = selftest_module
    rep = mod.evaluate(vllm_facts(mod, page=32, width=1152), rules06, static=True, device_capability=lambda: None)
    text = " | ".join(rep.reasons)
    assert "decode kernel: page_block_size 32 not in {64}" in text
    assert "prefill single: topk 1152 not in {128, 192, 256, 512, 1024, 2048}" in text
    rep = mod.evaluate(vllm_facts(mod), rules06, static=True, device_capability=lambda: None)
    assert len(rep.reasons) == 1
    assert rep.reasons[0].startswith(f"prefill dual: extra_page_block_size 128 not in {{2, 64}} ({CU06}:325 ")


# ---- edited copies of 0.6.18.post1 ------------------------------------------


@pytest.fixture
def copy06(fi06_root, tmp_path) -> Path:
    return copy_tree(fi06_root, tmp_path / "flashinfer", FILES06)


def test_06_copy_reads_the_same(selftest_module, copy06, rules06):
    assert selftest_module.read_flashinfer_06x(copy06, "0.6.18.post1").routes == rules06.routes


DUAL_PAGE_2 = "  } else if (extra_page_block_size == 2) {\n    DISPATCH_BY_NH_PBSX(2);\n  }\n"
DUAL_PAGE_128 = "  } else if (extra_page_block_size == 128) {\n    DISPATCH_BY_NH_PBSX(128);\n  }\n"


def test_06_dual_extra_page_128_added_flips_verdict(selftest_module, copy06):
    mod = selftest_module
    vf = vllm_facts(mod)  # patched page 64, text-only: fails only on dual's extra page 128
    rc, last = run_static(mod, vf, lambda: mod.read_flashinfer_06x(copy06, "0.6.18.post1"))
    assert rc == 1 and last.startswith("SELFTEST FAIL: prefill dual: extra_page_block_size 128")
    edit(copy06, FILES06[1], DUAL_PAGE_2, DUAL_PAGE_2.replace("  }\n", "") + DUAL_PAGE_128)
    rules = mod.read_flashinfer_06x(copy06, "0.6.18.post1")
    assert rule(route(rules, DUAL), "extra_page_block_size").values == frozenset({2, 64, 128})
    assert accepts(mod, rules, num_tokens=100, dual=True, num_heads=16, topk=128, extra_page_block_size=128)[0]
    rc, last = run_static(mod, vf, lambda: rules)
    assert (rc, last) == (0, "SELFTEST PASS (static)")


def test_06_decode_dispatch_with_16_1152(selftest_module, copy06):
    mod = selftest_module
    vf = vllm_facts(mod, width=1152)
    swa = "sliding-window only"

    def parts(rules):
        rep = mod.evaluate(vf, rules, static=True, device_capability=lambda: None)
        return {(c.route, c.call.layer, c.call.kind): c.reasons for c in rep.checks}

    before = parts(mod.read_flashinfer_06x(copy06, "0.6.18.post1"))
    assert any("(16, 1152) not in the set" in r for r in before[(DECODE, swa, "prefill")])
    head = "_DECODE_DSV4_DISPATCH = frozenset(\n    {\n"
    edit(copy06, FILES06[0], head, head + "        (16, 1152),\n")
    rules = mod.read_flashinfer_06x(copy06, "0.6.18.post1")
    assert rule(route(rules, DECODE), "num_heads,topk").values == DECODE_PAIRS_06 | {(16, 1152)}
    after = parts(rules)
    assert after[(DECODE, swa, "prefill")] == []  # the vision prefill chunk's 2..64-token part
    (single,) = after[(SINGLE, swa, "prefill")]
    assert single.startswith("topk 1152 not in {128, 192, 256, 512, 1024, 2048} ")


def test_06_dual_dispatch_renamed_cannot_establish(selftest_module, copy06):
    mod = selftest_module
    edit(copy06, FILES06[1], "dispatch_dsv4_dual(", "dispatch_dsv4_pair(", count=2)
    with pytest.raises(mod.CannotEstablish, match="dispatch_dsv4_dual"):
        mod.read_flashinfer_06x(copy06, "0.6.18.post1")
    rc, last = run_static(mod, vllm_facts(mod), lambda: mod.read_flashinfer_06x(copy06, "0.6.18.post1"))
    assert rc == 1
    assert last.startswith("SELFTEST FAIL: cannot establish ") and "dispatch_dsv4_dual" in last


def test_06_cutoff_disagreement_cannot_establish(selftest_module, copy06):
    edit(copy06, FILES06[0], "_DECODE_MAX_TOKENS = 64", "_DECODE_MAX_TOKENS = 32")
    with pytest.raises(selftest_module.CannotEstablish, match="one token cutoff"):
        selftest_module.read_flashinfer_06x(copy06, "0.6.18.post1")


def test_06_missing_file_cannot_establish(selftest_module, copy06):
    (copy06 / FILES06[2]).unlink()
    with pytest.raises(selftest_module.CannotEstablish, match="cannot read flashinfer/data/csrc/sparse_mla_sm120.cu"):
        selftest_module.read_flashinfer_06x(copy06, "0.6.18.post1")


def test_neither_layout_cannot_establish(selftest_module, tmp_path):
    with pytest.raises(selftest_module.CannotEstablish, match="neither"):
        selftest_module.read_flashinfer_rules(tmp_path, "0.6.18.post1")


# ---- 0.7.2.post1, from the real wheel ---------------------------------------
# Paths relative to flashinfer/ in the wheel; line numbers read by eye.


def test_07_version_and_bytes(rules07):
    assert rules07.version == "0.7.2.post1"  # _build_meta.py:2
    assert rules07.sources["version"].startswith("flashinfer/_build_meta.py:2 ")
    assert rules07.bytes_per_token == 584  # kv_cache_traits.cuh:338; _core.py:1417 packed_row_bytes
    assert "kv_cache_traits.cuh:338 " in rules07.sources["bytes_per_token"]
    assert "mla/_core.py:1417 " in rules07.sources["bytes_per_token"]
    assert rules07.reader == "source (0.7.x layout)"


def test_07_picked_by_layout_and_version(selftest_module, fi07_root, rules07):
    assert selftest_module.read_flashinfer_rules(fi07_root, FI07_VERSION).routes == rules07.routes
    with pytest.raises(selftest_module.CannotEstablish, match=r"0\.7\.x"):
        selftest_module.read_flashinfer_rules(fi07_root, "0.6.18.post1")


def test_07_route_selection(rules07):
    # _policy.py:66 _DECODE_MAX_TOKENS = 64; attention_resolve.cu:297 the C++ cutoff
    assert "mla/_sparse_mla_sm120/_policy.py:66 _DECODE_MAX_TOKENS = 64" in rules07.sources["cutoff"]
    assert "attention_resolve.cu:297" in rules07.sources["cutoff"]
    assert [(r.name, r.cache, r.min_tokens, r.max_tokens) for r in rules07.routes] == [
        (DECODE, "single", 1, 64),
        (DECODE, "dual", 1, 64),
        (SINGLE, "single", 65, None),
        (DUAL, "dual", 65, None),
    ]
    assert "prefill_dispatch.cu:61" in route(rules07, DUAL).source
    assert "prefill_dispatch.cu:64" in route(rules07, SINGLE).source
    # _policy.py:525 auto order SWAPAB, SG, MG, MG_DUAL
    assert "[4, 1, 2, 3]" in rules07.sources["prefill_variant_order"]


def test_07_common_rules(rules07):
    for r in rules07.routes:
        assert ("in", frozenset({512})) in by_field(r, "d_qk")  # _core.py:1378
        assert ("in", HEADS) in by_field(r, "num_heads")  # _core.py:1402
        assert ("max", frozenset({128})) in by_field(r, "num_heads")  # attention_resolve.cu:98, attention_plan.h:14
        assert ("positive", frozenset()) in by_field(r, "topk")  # attention_resolve.cu:98, _core.py:220
        assert set(by_field(r, "page_block_size")) == {("positive", frozenset())}  # attention_plan.h:16-24


def test_07_decode_rules(rules07):
    for cache in ("single", "dual"):
        r = route(rules07, DECODE, cache)
        assert ("multiple_of", frozenset({64})) not in by_field(r, "topk")
        assert not [x for x in r.rules if x.field == "topk" and x.op == "in"]
        assert any("decode_launch.cuh:40" in x.source for x in r.rules)
    d = route(rules07, DECODE, "dual")
    assert set(by_field(d, "extra_page_block_size")) == {("positive", frozenset())}  # attention_resolve.cu:123
    assert set(by_field(d, "extra_topk")) == {("positive", frozenset())}  # attention_resolve.cu:108


def test_07_prefill_rules(rules07):
    for name in (SINGLE, DUAL):
        r = route(rules07, name)
        assert ("multiple_of", frozenset({64})) in by_field(r, "topk")  # attention_resolve.cu:185
        assert (
            by_field(r, "num_heads").count(("in", HEADS)) == 3
        )  # _core.py:1402, attention_plan.h:37,41,47, prefill_launch
    s = route(rules07, SINGLE)
    assert any("prefill_launch.cuh:345,347" in x.source for x in s.rules)
    d = route(rules07, DUAL)
    assert set(by_field(d, "extra_page_block_size")) == {("positive", frozenset())}
    (disp,) = [x for x in d.rules if x.field == "extra_page_block_size" and "dispatch_dsv4_dual" in x.source]
    assert "prefill_launch.cuh:370" in disp.source and "2 (line 369)" in disp.source
    assert not [x for x in d.rules if x.field == "topk" and x.op == "in"]
    assert set(by_field(d, "extra_topk")) == {("positive", frozenset())}


def test_07_provenance_format(rules07):
    for r in rules07.routes:
        for x in r.rules:
            head = x.source.split(" ")[0]
            assert x.source.startswith("flashinfer/") and ":" in head, x.source
    for v in rules07.sources.values():
        assert v.startswith("flashinfer/")


@pytest.mark.parametrize("page", [32, 64])
@pytest.mark.parametrize("extra_page", [128, 64])
def test_07_vllm_030_style_calls(selftest_module, rules07, page, extra_page):
    mod = selftest_module
    base = dict(num_heads=16, page_block_size=page)
    for tokens in (1, 64):
        assert accepts(mod, rules07, num_tokens=tokens, dual=False, topk=128, **base)[0]
        assert accepts(mod, rules07, num_tokens=tokens, dual=True, topk=128, extra_page_block_size=extra_page, **base)[
            0
        ]
    for tokens in (65, 8192):
        for width in (128, 1152):
            assert accepts(mod, rules07, num_tokens=tokens, dual=False, topk=width, **base)[0]
            assert accepts(
                mod, rules07, num_tokens=tokens, dual=True, topk=width, extra_page_block_size=extra_page, **base
            )[0]


@pytest.mark.parametrize("page,width", [(32, 1152), (64, 128)])
def test_07_vllm_030_verdict_passes(selftest_module, rules07, page, width):
    rc, last = run_static(selftest_module, vllm_facts(selftest_module, page=page, width=width), lambda: rules07)
    assert (rc, last) == (0, "SELFTEST PASS (static)")


def test_07_refusals(selftest_module, rules07):
    mod = selftest_module
    ok, failed = accepts(mod, rules07, num_tokens=100, dual=False, num_heads=16, topk=100)
    assert not ok and any("not a multiple of 64" in f for f in failed)
    assert accepts(mod, rules07, num_tokens=10, dual=False, num_heads=16, topk=100)[0]  # decode: any topk > 0
    assert not accepts(mod, rules07, num_tokens=10, dual=False, num_heads=24, topk=128)[0]  # _core.py:1402
    assert not accepts(mod, rules07, num_tokens=10, dual=False, num_heads=16, topk=128, d_qk=576)[0]


def test_07_reader_on_06_tree_cannot_establish(selftest_module, fi06_root):
    with pytest.raises(selftest_module.CannotEstablish, match="0.7.x layout"):
        selftest_module.read_flashinfer_07x(fi06_root)


# ---- edited copies of 0.7.2.post1 (the helper's mutation tests) -------------

FALLBACK = "  return page(std::integral_constant<int, 0>{});\n}"
SPECIAL_2 = "  if (cold.extra_page_block_size == 2) return page(std::integral_constant<int, 2>{});\n"
SPECIAL_128 = "  if (cold.extra_page_block_size == 128) return page(std::integral_constant<int, 128>{});\n"


@pytest.fixture
def copy07(selftest_module, fi07_root, tmp_path) -> Path:
    return copy_tree(fi07_root, tmp_path / "flashinfer", selftest_module.FILES_READ)


def test_07_copy_reads_the_same(selftest_module, copy07, rules07):
    copy = selftest_module.read_flashinfer_07x(copy07)
    assert copy.routes == rules07.routes and copy.bytes_per_token == rules07.bytes_per_token


def test_07_extra_page_specialization_added_keeps_runtime(selftest_module, copy07):
    edit(copy07, selftest_module.PREFILL_LAUNCH_CUH, SPECIAL_2, SPECIAL_2 + SPECIAL_128)
    d = route(selftest_module.read_flashinfer_07x(copy07), DUAL)
    (disp,) = [x for x in d.rules if x.field == "extra_page_block_size" and "dispatch_dsv4_dual" in x.source]
    assert disp.op == "positive"
    assert "2 (line 369), 128 (line 370)" in disp.source and "prefill_launch.cuh:371" in disp.source


def test_07_extra_page_fixed_set(selftest_module, copy07):
    mod = selftest_module
    edit(copy07, mod.PREFILL_LAUNCH_CUH, SPECIAL_2 + FALLBACK, SPECIAL_2 + SPECIAL_128 + "  return false;\n}")
    r = mod.read_flashinfer_07x(copy07)
    assert ("in", frozenset({2, 128})) in by_field(route(r, DUAL), "extra_page_block_size")
    base = dict(num_heads=16, topk=128)
    assert accepts(mod, r, num_tokens=100, dual=True, extra_page_block_size=128, **base)[0]
    assert not accepts(mod, r, num_tokens=100, dual=True, extra_page_block_size=64, **base)[0]
    assert accepts(mod, r, num_tokens=10, dual=True, extra_page_block_size=64, **base)[0]  # decode: runtime


def test_07_dual_dispatch_renamed_cannot_establish(selftest_module, copy07):
    mod = selftest_module
    edit(
        copy07,
        mod.PREFILL_LAUNCH_CUH,
        "PrefillLaunchResult dispatch_dsv4_dual(",
        "PrefillLaunchResult dispatch_dsv4_dual_v2(",
    )
    with pytest.raises(mod.CannotEstablish, match="dispatch_dsv4_dual"):
        mod.read_flashinfer_07x(copy07)


def test_07_dual_dispatch_renamed_everywhere_cannot_establish(selftest_module, copy07):
    mod = selftest_module
    edit(copy07, mod.PREFILL_LAUNCH_CUH, "dispatch_dsv4_dual(", "dispatch_dsv4_pair(")
    edit(copy07, mod.PREFILL_DISPATCH_CU, "dispatch_dsv4_dual(", "dispatch_dsv4_pair(")
    with pytest.raises(mod.CannotEstablish, match="dispatch_dsv4_dual"):
        mod.read_flashinfer_07x(copy07)


def test_07_unexpected_extra_page_statement_cannot_establish(selftest_module, copy07):
    mod = selftest_module
    edit(copy07, mod.PREFILL_LAUNCH_CUH, SPECIAL_2, "  if (cold.extra_page_block_size % 2) return false;\n" + SPECIAL_2)
    with pytest.raises(mod.CannotEstablish, match="unexpected statement"):
        mod.read_flashinfer_07x(copy07)


def test_07_cutoff_changed_in_both(selftest_module, copy07):
    mod = selftest_module
    edit(copy07, mod.POLICY_PY, "_DECODE_MAX_TOKENS = 64", "_DECODE_MAX_TOKENS = 32")
    edit(copy07, mod.RESOLVE_CU, "m.tokens > 64) continue;", "m.tokens > 32) continue;")
    r = mod.read_flashinfer_07x(copy07)
    assert route(r, DECODE, "single").max_tokens == 32
    assert route(r, DUAL).min_tokens == 33


def test_07_cutoff_disagreement_cannot_establish(selftest_module, copy07):
    mod = selftest_module
    edit(copy07, mod.POLICY_PY, "_DECODE_MAX_TOKENS = 64", "_DECODE_MAX_TOKENS = 128")
    with pytest.raises(mod.CannotEstablish, match="disagrees"):
        mod.read_flashinfer_07x(copy07)


def test_07_prefill_heads_changed(selftest_module, copy07):
    mod = selftest_module
    edit(
        copy07,
        mod.PLAN_H,
        "  if constexpr (mg && (inline_scale || MT == ModelType::DSV4)) {\n    HEAD(128)",
        "  if constexpr (mg && inline_scale) {\n    HEAD(128)",
    )
    r = mod.read_flashinfer_07x(copy07)
    for name in (SINGLE, DUAL):
        assert ("in", frozenset({8, 16, 32, 64})) in by_field(route(r, name), "num_heads")
    assert not accepts(mod, r, num_tokens=100, dual=False, num_heads=128, topk=128)[0]
    assert accepts(mod, r, num_tokens=10, dual=False, num_heads=128, topk=128)[0]


def test_07_fixed_main_page(selftest_module, copy07):
    mod = selftest_module
    edit(copy07, mod.PLAN_H, "return model == ModelType::DSV4 || model", "return model")
    r = mod.read_flashinfer_07x(copy07)
    for x in r.routes:
        assert ("in", frozenset({64})) in by_field(x, "page_block_size")  # FixedPageSize, attention_plan.h:15
    assert not accepts(mod, r, num_tokens=10, dual=False, num_heads=16, topk=128, page_block_size=32)[0]


def test_07_topk_multiple_changed(selftest_module, copy07):
    mod = selftest_module
    edit(copy07, mod.RESOLVE_CU, "m.topk % 64 == 0", "m.topk % 128 == 0")
    r = mod.read_flashinfer_07x(copy07)
    assert ("multiple_of", frozenset({128})) in by_field(route(r, SINGLE), "topk")
    assert not accepts(mod, r, num_tokens=100, dual=False, num_heads=16, topk=192)[0]  # 192 % 128 != 0
    assert accepts(mod, r, num_tokens=100, dual=False, num_heads=16, topk=1152)[0]  # 1152 = 9 * 128


def test_07_missing_file_cannot_establish(selftest_module, copy07):
    (copy07 / selftest_module.PREFILL_LAUNCH_CUH).unlink()
    with pytest.raises(selftest_module.CannotEstablish, match="cannot read"):
        selftest_module.read_flashinfer_07x(copy07)


def test_07_missing_topk_check_cannot_establish(selftest_module, copy07):
    edit(copy07, selftest_module.RESOLVE_CU, "m.topk % 64 == 0 &&", "")
    with pytest.raises(selftest_module.CannotEstablish, match="prefill topk multiple"):
        selftest_module.read_flashinfer_07x(copy07)
