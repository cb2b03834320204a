# SPDX-License-Identifier: Apache-2.0
"""SM120 decode-shape self-test for DeepSeek V4.1 on FlashInfer sparse MLA.

Run it with a rank's exact ``vllm serve`` argv, before the launch::

    python -m vllm.models.deepseek_v41.nvidia.sm120_decode_shape_selftest \\
        [--static] [--json] -- <the rank's vllm serve argv>

It parses the argv with vLLM's own serve parser, builds the engine's
ModelConfig from the checkpoint's config.json, reads the figures that decide
which FlashInfer SM120 kernel every small attention call needs (padded local
heads, sliding window, prefill SWA width, SWA page size, compressed pool
pages, extra top-k, d_qk) from the installed vLLM tree, and reads the decode
envelope (token ceiling, page size, (heads, topk) dispatch set, bytes per
token, d_qk) from the installed FlashInfer. Every fact is printed with where
it came from.

Shapes checked: decode with 1, 8 and 64 query tokens (topk = sliding window,
extra segment = index_topk) and the 8-token short prefill chunk (topk =
prefill width). Each is accepted or refused statically, naming the condition
that failed. On an SM120 device (compute capability 12.x) each shape is also
run through ``flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4`` with
synthetic tensors; without one the verdict is FAIL unless ``--static`` is
given, in which case it rests on the static checks and says so.

The last line printed is the verdict: ``SELFTEST PASS``, ``SELFTEST PASS
(static)`` or ``SELFTEST FAIL: <reasons>``; the exit code is 0 only on PASS.

vLLM, torch and FlashInfer are imported lazily so the evaluation logic can be
imported and driven with injected facts in a plain Python.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import io
import json
import os
import sys
import textwrap
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

PASS = "SELFTEST PASS"
PASS_STATIC = "SELFTEST PASS (static)"
FAIL = "SELFTEST FAIL"
NO_DEVICE_REASON = "no SM120 device: kernel calls not run"

DECODE_TOKEN_COUNTS = (1, 8, 64)
PREFILL_CHUNK_TOKENS = 8
SM120_MAJOR = 12

# FlashInfer module holding the SM120 sparse-MLA dispatch (0.6.x and 0.7.x).
_FI_SM120_MODULE = "flashinfer.mla._sparse_mla_sm120"
_FI_SM120_RELPATH = ("mla", "_sparse_mla_sm120.py")
# Names read from that module on FlashInfer 0.6.x.
_FI_CONSTANTS = (
    "_DECODE_MAX_TOKENS",
    "_DECODE_DSV4_DISPATCH",
    "_DECODE_DSV4_PAGE_BLOCK_SIZE",
    "_BPT_DSV4",
)
_FI_PREDICATE = "_decode_dsv4_dispatchable"
# vLLM sizes its FlashInfer DSv4 workspace at 128 MiB
# (_FLASHINFER_DSV4_WORKSPACE_BUFFER_SIZE in flashinfer_sparse.py).
_WORKSPACE_BYTES = 128 * 1024 * 1024


class SelftestError(Exception):
    """A fact could not be established; ``str(exc)`` is the FAIL reason."""


# --------------------------------------------------------------------------
# Facts
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fact:
    name: str
    value: Any
    source: str


@dataclasses.dataclass
class VllmFacts:
    """What the installed vLLM tree will ask the kernel for, on this rank."""

    tensor_parallel_size: int
    num_heads: int
    local_heads: int
    padded_heads: int
    sliding_window: int
    prefill_width: int
    swa_page_block_size: int
    # (compress_ratio, page tokens) for each distinct non-zero ratio.
    compressed_pages: tuple[tuple[int, int], ...]
    extra_topk: int
    d_qk: int
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    def facts(self) -> list[Fact]:
        names = (
            "tensor_parallel_size",
            "num_heads",
            "local_heads",
            "padded_heads",
            "sliding_window",
            "prefill_width",
            "swa_page_block_size",
            "compressed_pages",
            "extra_topk",
            "d_qk",
        )
        out = []
        for name in names:
            value = getattr(self, name)
            if name == "compressed_pages":
                value = {f"ratio {r}": p for r, p in value}
            out.append(Fact(f"vllm.{name}", value, self.sources.get(name, "")))
        return out


@dataclasses.dataclass
class FlashInferFacts:
    """The SM120 DSv4 decode envelope of the installed FlashInfer."""

    version: str
    reader: str  # "import" or "source"
    max_num_tokens: int
    d_qk: int
    bytes_per_token: int
    # Accepted SWA page sizes; None when the page size is a runtime value.
    page_block_sizes: tuple[int, ...] | None
    # Exact (num_heads, topk) decode set (0.6.x); None when the envelope is
    # described by head_counts/max_num_heads and topks/min_topk (0.7.x).
    dispatch: frozenset[tuple[int, int]] | None = None
    head_counts: frozenset[int] | None = None
    max_num_heads: int | None = None
    topks: frozenset[int] | None = None
    min_topk: int | None = None
    topk_is_runtime: bool = False
    extra_page_block_sizes: frozenset[int] = frozenset()
    # FlashInfer's own predicate when the package imported; called with a
    # Shape, returns bool.
    predicate: Callable[[Shape], bool] | None = None
    predicate_name: str = ""
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    note: str = ""

    def facts(self) -> list[Fact]:
        out = [
            Fact("flashinfer.version", self.version, self.sources.get("version", "")),
            Fact("flashinfer.reader", self.reader, self.sources.get("reader", "")),
            Fact(
                "flashinfer.max_num_tokens",
                self.max_num_tokens,
                self.sources.get("max_num_tokens", ""),
            ),
            Fact(
                "flashinfer.page_block_sizes",
                "runtime" if self.page_block_sizes is None else list(self.page_block_sizes),
                self.sources.get("page_block_sizes", ""),
            ),
        ]
        if self.dispatch is not None:
            out.append(
                Fact(
                    "flashinfer.decode_dispatch",
                    _format_dispatch(self.dispatch),
                    self.sources.get("dispatch", ""),
                )
            )
        else:
            heads = (
                sorted(self.head_counts)
                if self.head_counts is not None
                else f"1..{self.max_num_heads}"
            )
            topk = (
                f">= {self.min_topk}"
                if self.topk_is_runtime
                else sorted(self.topks or ())
            )
            out.append(
                Fact(
                    "flashinfer.decode_envelope",
                    {"num_heads": heads, "topk": topk},
                    self.sources.get("dispatch", ""),
                )
            )
        out += [
            Fact(
                "flashinfer.bytes_per_token",
                self.bytes_per_token,
                self.sources.get("bytes_per_token", ""),
            ),
            Fact("flashinfer.d_qk", self.d_qk, self.sources.get("d_qk", "")),
        ]
        if self.extra_page_block_sizes:
            out.append(
                Fact(
                    "flashinfer.extra_page_block_sizes",
                    sorted(self.extra_page_block_sizes),
                    self.sources.get("extra_page_block_sizes", ""),
                )
            )
        return out

    # ---- static check -----------------------------------------------------

    def refusals(self, shape: Shape) -> list[str]:
        """Conditions of the decode kernel that ``shape`` fails, in words."""
        reasons = []
        if shape.num_tokens > self.max_num_tokens:
            reasons.append(
                f"num_tokens {shape.num_tokens} above the decode ceiling "
                f"{self.max_num_tokens}"
            )
        if shape.d_qk != self.d_qk:
            reasons.append(f"d_qk {shape.d_qk}, kernel needs {self.d_qk}")
        if self.page_block_sizes is not None:
            if shape.page_block_size not in self.page_block_sizes:
                needs = " or ".join(str(p) for p in self.page_block_sizes)
                reasons.append(
                    f"page_block_size {shape.page_block_size}, kernel needs {needs}"
                )
        elif shape.page_block_size <= 0:
            reasons.append(f"page_block_size {shape.page_block_size} is not positive")
        if self.dispatch is not None:
            if (shape.num_heads, shape.topk) not in self.dispatch:
                reasons.append(
                    f"({shape.num_heads}, {shape.topk}) not in the decode dispatch set"
                )
        else:
            if self.head_counts is not None:
                heads_ok = shape.num_heads in self.head_counts
            else:
                heads_ok = 1 <= shape.num_heads <= (self.max_num_heads or 0)
            if not heads_ok:
                reasons.append(f"num_heads {shape.num_heads} outside the decode envelope")
            if self.topk_is_runtime:
                if self.min_topk is not None and shape.topk < self.min_topk:
                    reasons.append(
                        f"topk {shape.topk} below the decode minimum {self.min_topk}"
                    )
            elif shape.topk not in (self.topks or ()):
                reasons.append(f"topk {shape.topk} not in the decode topk set")
        if self.extra_page_block_sizes:
            for ratio, page in shape.compressed_pages:
                if page not in self.extra_page_block_sizes:
                    reasons.append(
                        f"compressed page {page} (ratio {ratio}), kernel's extra "
                        f"cache takes {sorted(self.extra_page_block_sizes)}"
                    )
        if self.predicate is not None:
            accepted = bool(self.predicate(shape))
            if not accepted and not reasons:
                reasons.append(f"refused by FlashInfer's {self.predicate_name}")
            if accepted and reasons:
                # FlashInfer's own predicate is authoritative for the
                # conditions it covers; keep only the ones it does not check.
                reasons = [r for r in reasons if r.startswith("d_qk ")]
        return reasons


def _format_dispatch(dispatch: frozenset[tuple[int, int]]) -> dict[str, list[int]]:
    by_heads: dict[int, list[int]] = {}
    for heads, topk in sorted(dispatch):
        by_heads.setdefault(heads, []).append(topk)
    return {f"heads {h}": topks for h, topks in by_heads.items()}


# --------------------------------------------------------------------------
# Shapes and evaluation
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Shape:
    label: str
    kind: str  # "decode" or "prefill"
    num_tokens: int
    num_heads: int
    topk: int
    extra_topk: int
    d_qk: int
    page_block_size: int
    compressed_pages: tuple[tuple[int, int], ...] = ()
    static_reasons: list[str] = dataclasses.field(default_factory=list)
    kernel: str = "not run"  # "not run", "ran" or "raised: ..."

    @property
    def accepted(self) -> bool:
        return not self.static_reasons

    def as_dict(self) -> dict[str, Any]:
        return {
            "shape": self.label,
            "kind": self.kind,
            "num_tokens": self.num_tokens,
            "num_heads": self.num_heads,
            "topk": self.topk,
            "extra_topk": self.extra_topk,
            "d_qk": self.d_qk,
            "page_block_size": self.page_block_size,
            "static": "accepted" if self.accepted else "refused",
            "static_reasons": list(self.static_reasons),
            "kernel": self.kernel,
        }


def build_shapes(vf: VllmFacts) -> list[Shape]:
    """The shapes this rank's engine will hand the SM120 decode kernel."""
    common = dict(
        num_heads=vf.padded_heads,
        extra_topk=vf.extra_topk,
        d_qk=vf.d_qk,
        page_block_size=vf.swa_page_block_size,
        compressed_pages=vf.compressed_pages,
    )
    shapes = [
        Shape(
            label=f"decode {n}",
            kind="decode",
            num_tokens=n,
            topk=vf.sliding_window,
            **common,
        )
        for n in DECODE_TOKEN_COUNTS
    ]
    shapes.append(
        Shape(
            label=f"prefill chunk {PREFILL_CHUNK_TOKENS}",
            kind="prefill",
            num_tokens=PREFILL_CHUNK_TOKENS,
            topk=vf.prefill_width,
            **common,
        )
    )
    return shapes


KernelCall = Callable[[Shape, VllmFacts, FlashInferFacts], None]
DeviceQuery = Callable[[], "tuple[int, int] | None"]


@dataclasses.dataclass
class Report:
    facts: list[Fact]
    shapes: list[Shape]
    static: bool
    device: tuple[int, int] | None
    passed: bool
    verdict: str
    reasons: list[str]
    notes: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "facts": [dataclasses.asdict(f) for f in self.facts],
            "shapes": [s.as_dict() for s in self.shapes],
            "static": self.static,
            "device_capability": list(self.device) if self.device else None,
            "passed": self.passed,
            "reasons": list(self.reasons),
            "notes": list(self.notes),
            "verdict": self.verdict,
        }


def _group_reasons(shapes: Sequence[Shape]) -> list[str]:
    """One reason per failed condition, naming the shapes it refused."""
    grouped: dict[str, list[str]] = {}
    for shape in shapes:
        for reason in shape.static_reasons:
            grouped.setdefault(reason, []).append(shape.label)
    return [f"{r} [{', '.join(labels)}]" for r, labels in grouped.items()]


def _fail_verdict(reasons: Sequence[str]) -> str:
    return f"{FAIL}: " + "; ".join(reasons)


def evaluate(
    vf: VllmFacts,
    fi: FlashInferFacts,
    *,
    static: bool = False,
    kernel_call: KernelCall | None = None,
    device_capability: DeviceQuery | None = None,
    extra_facts: Sequence[Fact] = (),
) -> Report:
    """Check every shape statically, then on an SM120 device for real."""
    shapes = build_shapes(vf)
    for shape in shapes:
        shape.static_reasons = fi.refusals(shape)
    facts = list(extra_facts) + vf.facts() + fi.facts()
    static_reasons = _group_reasons(shapes)

    query = device_capability or cuda_device_capability
    device = query()
    is_sm120 = device is not None and device[0] == SM120_MAJOR

    if static:
        if static_reasons:
            verdict = _fail_verdict(static_reasons)
            return Report(facts, shapes, True, device, False, verdict, static_reasons)
        return Report(facts, shapes, True, device, True, PASS_STATIC, [])

    if not is_sm120:
        reasons = [NO_DEVICE_REASON] + static_reasons
        return Report(
            facts, shapes, False, device, False, _fail_verdict(reasons), reasons
        )

    call = kernel_call or flashinfer_kernel_call
    kernel_reasons = []
    notes = []
    for shape in shapes:
        try:
            call(shape, vf, fi)
        except Exception as exc:  # the kernel's refusal is the result
            message = _one_line(f"{type(exc).__name__}: {exc}")
            shape.kernel = f"raised: {message}"
            kernel_reasons.append(f"{shape.label} raised {message}")
        else:
            shape.kernel = "ran"
            if not shape.accepted:
                notes.append(
                    f"{shape.label}: static check refused it "
                    f"({'; '.join(shape.static_reasons)}) but the kernel ran"
                )
    if kernel_reasons:
        return Report(
            facts,
            shapes,
            False,
            device,
            False,
            _fail_verdict(kernel_reasons),
            kernel_reasons,
            notes,
        )
    return Report(facts, shapes, False, device, True, PASS, [], notes)


# --------------------------------------------------------------------------
# Seams: device query and kernel call
# --------------------------------------------------------------------------


def cuda_device_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None without one."""
    try:
        import torch
    except Exception:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
    except Exception:
        return None
    return int(major), int(minor)


def flashinfer_kernel_call(shape: Shape, vf: VllmFacts, fi: FlashInferFacts) -> None:
    """Run ``trtllm_batch_decode_sparse_mla_dsv4`` at ``shape`` on this GPU.

    Tensors are synthetic but laid out as vLLM's SM120 path passes them
    (DeepseekV4FlashInferSM120Attention._forward_decode/_forward_prefill):
    bf16 query [tokens, heads, d_qk], packed uint8 NHD pools
    [pages, page_block_size, 1, bytes_per_token] for the SWA cache and for
    each compressed pool, int32 index rows [tokens, 1, topk], per-token
    lengths, fp32 sinks. Raises whatever FlashInfer raises.

    This path can only be verified on SM120 hardware; CI (no GPU) exercises
    the static checks and the seam with a fake call.
    """
    import torch
    from flashinfer.mla import trtllm_batch_decode_sparse_mla_dsv4

    device = torch.device("cuda", torch.cuda.current_device())
    n, heads = shape.num_tokens, shape.num_heads
    bpt = fi.bytes_per_token

    def pool(topk: int, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pages = -(-topk // page) + 1
        cache = torch.zeros(pages, page, 1, bpt, dtype=torch.uint8, device=device)
        rows = torch.arange(topk, dtype=torch.int32, device=device)
        indices = rows.repeat(n, 1).view(n, 1, topk).contiguous()
        lengths = torch.full((n,), topk, dtype=torch.int32, device=device)
        return cache, indices, lengths

    swa_cache, swa_indices, swa_lens = pool(shape.topk, shape.page_block_size)
    query = torch.randn(n, heads, shape.d_qk, dtype=torch.bfloat16, device=device)
    sinks = torch.zeros(heads, dtype=torch.float32, device=device)
    workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    extra_pools = shape.compressed_pages if shape.extra_topk > 0 else ()
    for _ratio, page in extra_pools or ((0, 0),):
        kwargs: dict[str, Any] = {}
        if page:
            cache, indices, lengths = pool(shape.extra_topk, page)
            kwargs = dict(
                compressed_kv_cache=cache,
                extra_sparse_indices=indices,
                extra_sparse_topk_lens=lengths,
            )
        out = torch.empty(n, heads, shape.d_qk, dtype=torch.bfloat16, device=device)
        trtllm_batch_decode_sparse_mla_dsv4(
            query=query,
            swa_kv_cache=swa_cache,
            workspace_buffer=workspace,
            sparse_indices=swa_indices,
            out=out,
            bmm1_scale=shape.d_qk**-0.5,
            sinks=sinks,
            kv_layout="NHD",
            swa_topk_lens=swa_lens,
            **kwargs,
        )
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------
# FlashInfer facts
# --------------------------------------------------------------------------


def _literal(node: ast.expr) -> Any:
    """literal_eval that also accepts ``frozenset({...})`` and ``set(...)``."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("frozenset", "set")
        and len(node.args) <= 1
        and not node.keywords
    ):
        return frozenset(ast.literal_eval(node.args[0])) if node.args else frozenset()
    return ast.literal_eval(node)


def read_sparse_mla_sm120_source(path: str | os.PathLike[str]) -> FlashInferFacts:
    """Read the 0.6.x DSv4 decode envelope from the module's source, unexecuted.

    Module-level constants are evaluated as literals; d_qk is the constant
    ``_decode_dsv4_dispatchable`` compares ``d_qk`` against. Each fact's
    source is ``<file>:<line>``.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
    except (OSError, SyntaxError, ValueError) as exc:
        raise SelftestError(f"cannot read FlashInfer source {path}: {exc}") from None
    label = _fi_label(path)
    values: dict[str, Any] = {}
    lines: dict[str, int] = {}
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Name) and target.id in _FI_CONSTANTS:
                try:
                    values[target.id] = _literal(node.value)  # type: ignore[arg-type]
                except (ValueError, TypeError, SyntaxError):
                    raise SelftestError(
                        f"{label}:{node.lineno}: {target.id} is not a literal"
                    ) from None
                lines[target.id] = node.lineno
    d_qk = None
    d_qk_line = None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == _FI_PREDICATE:
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Compare)
                    and isinstance(sub.left, ast.Name)
                    and sub.left.id == "d_qk"
                    and len(sub.ops) == 1
                    and isinstance(sub.ops[0], ast.Eq)
                    and isinstance(sub.comparators[0], ast.Constant)
                ):
                    d_qk = sub.comparators[0].value
                    d_qk_line = sub.lineno
                    break
    missing = [n for n in _FI_CONSTANTS if n not in values]
    if d_qk is None:
        missing.append(f"{_FI_PREDICATE}(... d_qk == N ...)")
    if missing:
        raise SelftestError(
            f"{label} does not define {', '.join(missing)} (not FlashInfer 0.6.x?)"
        )
    dispatch = frozenset(
        (int(h), int(t)) for h, t in values["_DECODE_DSV4_DISPATCH"]
    )
    return FlashInferFacts(
        version="",
        reader="source",
        max_num_tokens=int(values["_DECODE_MAX_TOKENS"]),
        d_qk=int(d_qk),
        bytes_per_token=int(values["_BPT_DSV4"]),
        page_block_sizes=(int(values["_DECODE_DSV4_PAGE_BLOCK_SIZE"]),),
        dispatch=dispatch,
        sources={
            "max_num_tokens": f"{label}:{lines['_DECODE_MAX_TOKENS']} _DECODE_MAX_TOKENS",
            "dispatch": f"{label}:{lines['_DECODE_DSV4_DISPATCH']} _DECODE_DSV4_DISPATCH",
            "page_block_sizes": (
                f"{label}:{lines['_DECODE_DSV4_PAGE_BLOCK_SIZE']} "
                "_DECODE_DSV4_PAGE_BLOCK_SIZE"
            ),
            "bytes_per_token": f"{label}:{lines['_BPT_DSV4']} _BPT_DSV4",
            "d_qk": f"{label}:{d_qk_line} {_FI_PREDICATE}",
        },
    )


def _fi_label(path: Path) -> str:
    parts = path.parts
    if "flashinfer" in parts:
        idx = len(parts) - 1 - parts[::-1].index("flashinfer")
        return "/".join(parts[idx:])
    return str(path)


def _sm120_source_path() -> Path:
    """Locate flashinfer/mla/_sparse_mla_sm120.py without importing flashinfer."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None:
        raise SelftestError("FlashInfer is not installed")
    for location in spec.submodule_search_locations or ():
        candidate = Path(location).joinpath(*_FI_SM120_RELPATH)
        if candidate.is_file():
            return candidate
    raise SelftestError(
        "FlashInfer has no mla/_sparse_mla_sm120.py (no SM120 sparse-MLA support)"
    )


def _flashinfer_version() -> str:
    from importlib import metadata

    for dist in ("flashinfer-python", "flashinfer"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _from_public_query(mla: types.ModuleType, version: str) -> FlashInferFacts:
    """FlashInfer 0.7.x: ``flashinfer.mla.supported_sparse_mla_sm120_configs()``."""
    api = "flashinfer.mla.supported_sparse_mla_sm120_configs()"
    configs = mla.supported_sparse_mla_sm120_configs()
    try:
        cfg = configs["dsv4"]
    except (KeyError, TypeError):
        raise SelftestError(f"{api} has no 'dsv4' entry") from None
    src = f"{api}['dsv4']"
    runtime_page = bool(getattr(cfg, "page_block_size_is_runtime", False))
    page_sizes = getattr(cfg, "page_block_sizes", None)
    if runtime_page:
        pages = None
    elif page_sizes:
        pages = tuple(sorted(int(p) for p in page_sizes))
    else:
        pages = (int(cfg.page_block_size),)
    head_counts = getattr(cfg, "head_counts", None)

    def predicate(shape: Shape) -> bool:
        return bool(
            cfg.supports_decode(
                shape.num_heads,
                shape.topk,
                num_tokens=shape.num_tokens,
                page_block_size=shape.page_block_size,
            )
        )

    return FlashInferFacts(
        version=version,
        reader="import",
        max_num_tokens=int(cfg.max_num_tokens),
        d_qk=int(cfg.d_qk),
        bytes_per_token=int(getattr(cfg, "bytes_per_token", 0)),
        page_block_sizes=pages,
        dispatch=None,
        head_counts=frozenset(head_counts) if head_counts is not None else None,
        max_num_heads=getattr(cfg, "max_num_heads", None),
        topks=frozenset(getattr(cfg, "topks", ()) or ()),
        min_topk=getattr(cfg, "min_topk", None),
        topk_is_runtime=bool(getattr(cfg, "topk_is_runtime", False)),
        extra_page_block_sizes=frozenset(
            getattr(cfg, "extra_page_block_sizes", ()) or ()
        ),
        predicate=predicate,
        predicate_name=f"{src}.supports_decode",
        sources={
            "max_num_tokens": f"{src}.max_num_tokens",
            "page_block_sizes": (
                f"{src}.page_block_size_is_runtime" if runtime_page else f"{src}.page_block_size"
            ),
            "dispatch": f"{src} head_counts/max_num_heads, topks/min_topk",
            "bytes_per_token": f"{src}.bytes_per_token",
            "d_qk": f"{src}.d_qk",
            "extra_page_block_sizes": f"{src}.extra_page_block_sizes",
        },
    )


def _from_imported_module(mod: types.ModuleType, version: str) -> FlashInferFacts:
    """FlashInfer 0.6.x, imported: constants and ``_decode_dsv4_dispatchable``."""
    # Line numbers come from the same file the module was loaded from.
    facts = read_sparse_mla_sm120_source(mod.__file__ or "")
    name = f"{_FI_SM120_MODULE}"
    facts.reader = "import"
    facts.max_num_tokens = int(mod._DECODE_MAX_TOKENS)
    facts.dispatch = frozenset(mod._DECODE_DSV4_DISPATCH)
    facts.page_block_sizes = (int(mod._DECODE_DSV4_PAGE_BLOCK_SIZE),)
    facts.bytes_per_token = int(mod._BPT_DSV4)
    dispatchable = getattr(mod, _FI_PREDICATE)

    def predicate(shape: Shape) -> bool:
        return bool(
            dispatchable(
                shape.num_tokens,
                shape.num_heads,
                shape.topk,
                shape.d_qk,
                shape.page_block_size,
                shape.extra_topk,
            )
        )

    facts.predicate = predicate
    facts.predicate_name = f"{name}.{_FI_PREDICATE}"
    for key, const in (
        ("max_num_tokens", "_DECODE_MAX_TOKENS"),
        ("dispatch", "_DECODE_DSV4_DISPATCH"),
        ("page_block_sizes", "_DECODE_DSV4_PAGE_BLOCK_SIZE"),
        ("bytes_per_token", "_BPT_DSV4"),
    ):
        facts.sources[key] = f"{name}.{const} ({facts.sources[key].split(' ')[0]})"
    facts.sources["d_qk"] = f"{name}.{_FI_PREDICATE} ({facts.sources['d_qk']})"
    return facts


def collect_flashinfer_facts() -> FlashInferFacts:
    """FlashInfer's SM120 DSv4 envelope: via import, else from its source."""
    version = _flashinfer_version()
    source_path = _sm120_source_path()
    try:
        import flashinfer  # noqa: F401  (queries the GPU at import time)
        import flashinfer.mla as mla
    except Exception as exc:
        facts = read_sparse_mla_sm120_source(source_path)
        facts.version = version
        facts.note = _one_line(f"import flashinfer failed: {type(exc).__name__}: {exc}")
        facts.sources["reader"] = facts.note + "; read the module source with ast"
    else:
        if hasattr(mla, "supported_sparse_mla_sm120_configs"):
            facts = _from_public_query(mla, version)
        else:
            mod = importlib.import_module(_FI_SM120_MODULE)
            facts = _from_imported_module(mod, version)
        facts.sources["reader"] = "import flashinfer"
    facts.sources["version"] = "importlib.metadata"
    return facts


# --------------------------------------------------------------------------
# vLLM facts
# --------------------------------------------------------------------------


def _strip_serve_prefix(argv: Sequence[str]) -> list[str]:
    argv = list(argv)
    if argv[:1] == ["vllm"]:
        argv = argv[1:]
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    return argv


class _Locator:
    """``<path relative to the vllm package's parent>:<line>`` for sources."""

    def __init__(self) -> None:
        import vllm

        self.root = Path(vllm.__file__).parent.parent

    def path(self, obj: Any) -> str:
        filename = inspect.getsourcefile(obj) or inspect.getfile(obj)
        rel = os.path.relpath(filename, self.root)
        return filename if rel.startswith("..") else rel.replace(os.sep, "/")

    def at(self, obj: Any, line: int | None = None) -> str:
        if line is None:
            line = inspect.getsourcelines(obj)[1]
        return f"{self.path(obj)}:{line}"


def _parse_serve_argv(argv: list[str]) -> argparse.Namespace:
    from vllm.engine.arg_utils import EngineArgs  # noqa: F401  (import check)
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit:
        lines = [ln.strip() for ln in err.getvalue().splitlines() if ln.strip()]
        detail = next(
            (ln for ln in reversed(lines) if "error:" in ln),
            lines[-1] if lines else "rejected",
        )
        raise SelftestError(f"vllm serve argv: {detail}") from None
    # ServeSubcommand.cmd (vllm/entrypoints/cli/serve.py): the positional
    # model tag takes precedence over --model.
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    return args


def _check_model_dir(model: str) -> Path:
    path = Path(model)
    if not path.is_dir():
        raise SelftestError(
            f"model path {model!r} is not a directory (the self-test reads the "
            "checkpoint's config.json from a local path)"
        )
    if not (path / "config.json").is_file():
        raise SelftestError(f"no config.json in model path {model!r}")
    return path


def _prefill_width_rule(model_config: Any, loc: _Locator) -> tuple[int, int, str, str]:
    """Run vLLM's own prefill-width statements on this ModelConfig.

    DeepseekSparseSWAMetadataBuilder.__init__ (sparse_swa.py) derives
    ``window_size``, ``max_image_tokens`` and ``prefill_index_width`` from
    ``hf_config`` in a few plain statements; those statements are taken from
    the installed source and executed against this ModelConfig, so the width
    is computed by vLLM's rule, not a copy of it.
    """
    from vllm.v1.attention.backends.mla import sparse_swa

    builder = sparse_swa.DeepseekSparseSWAMetadataBuilder
    fn = builder.__init__
    where = loc.path(fn)
    lines, start = inspect.getsourcelines(fn)
    func = ast.parse(textwrap.dedent("".join(lines))).body[0]
    assert isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef))

    def assigns(stmt: ast.stmt, name: str, on_self: bool) -> bool:
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            return False
        t = stmt.targets[0]
        if on_self:
            return (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
                and t.attr == name
            )
        return isinstance(t, ast.Name) and t.id == name

    body = func.body
    first = next((i for i, s in enumerate(body) if assigns(s, "hf_config", False)), None)
    last = next(
        (i for i, s in enumerate(body) if assigns(s, "prefill_index_width", True)), None
    )
    if first is None or last is None or last < first:
        raise SelftestError(
            f"cannot find vLLM's prefill SWA width rule "
            f"(self.prefill_index_width = ...) in {where}"
        )
    stmts = body[first : last + 1]
    for stmt in stmts:
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Assert)):
            raise SelftestError(
                f"unexpected statement in vLLM's prefill width rule at "
                f"{where}:{start + stmt.lineno - 1}; update the self-test"
            )
    fake_self = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(model_config=model_config)
    )
    code = compile(ast.Module(body=stmts, type_ignores=[]), where, "exec")
    exec(code, {"self": fake_self})  # noqa: S102  (vLLM's own statements)
    line_of = {
        name: start + s.lineno - 1
        for s in stmts
        for name in ("window_size", "prefill_index_width")
        if assigns(s, name, True)
    }
    window_src = f"{where}:{line_of.get('window_size', start)} (sliding window, as DeepseekSparseSWAMetadataBuilder reads it)"
    width_src = (
        f"{where}:{line_of['prefill_index_width']} (vLLM's rule, run on this "
        f"ModelConfig: vision_n_layers={getattr(model_config.hf_config, 'vision_n_layers', 0)}, "
        f"max_image_tokens={fake_self.max_image_tokens})"
    )
    return (
        int(fake_self.window_size),
        int(fake_self.prefill_index_width),
        window_src,
        width_src,
    )


def _swa_page_block_size(attn_mod: Any, sm120_cls: type, loc: _Locator) -> tuple[int, str]:
    """The SWA page size the SM120 attention class builds its cache with.

    Reads the ``block_size=`` argument of ``DeepseekV4SWACache(...)`` in
    DeepseekV4Attention's source: a literal is the page size (unpatched
    tree); ``self.<attr>`` is resolved on the SM120 class.
    """
    base = attn_mod.DeepseekV4Attention
    where = loc.path(attn_mod)
    text = inspect.getsource(attn_mod)
    tree = ast.parse(text)
    cls_node = next(
        (
            n
            for n in tree.body
            if isinstance(n, ast.ClassDef) and n.name == base.__name__
        ),
        None,
    )
    call = None
    if cls_node is not None:
        for node in ast.walk(cls_node):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if name == "DeepseekV4SWACache":
                    call = node
                    break
    if call is None:
        raise SelftestError(f"no DeepseekV4SWACache(...) call in {where}")
    kw = next((k for k in call.keywords if k.arg == "block_size"), None)
    if kw is None:
        cache_cls = attn_mod.DeepseekV4SWACache
        default = inspect.signature(cache_cls.__init__).parameters["block_size"].default
        return int(default), (
            f"{where}:{call.lineno} DeepseekV4SWACache(...) without block_size; "
            f"its default in {loc.path(cache_cls)}"
        )
    value = kw.value
    if isinstance(value, ast.Constant) and isinstance(value.value, int):
        return int(value.value), (
            f"{where}:{value.lineno} hard-coded block_size={value.value} "
            "in DeepseekV4SWACache(...)"
        )
    if (
        isinstance(value, ast.Attribute)
        and isinstance(value.value, ast.Name)
        and value.value.id == "self"
    ):
        attr = value.attr
        owner = next((k for k in sm120_cls.__mro__ if attr in vars(k)), None)
        if owner is None:
            raise SelftestError(
                f"{where}:{value.lineno} uses self.{attr}, which "
                f"{sm120_cls.__name__} does not define"
            )
        page = getattr(sm120_cls, attr)
        return int(page), (
            f"{sm120_cls.__name__}.{attr} (defined on {owner.__name__}, "
            f"{_attr_line(owner, attr, loc)}), used at {where}:{value.lineno}"
        )
    raise SelftestError(
        f"{where}:{value.lineno}: cannot evaluate block_size="
        f"{ast.unparse(value)} statically"
    )


def _attr_line(cls: type, attr: str, loc: _Locator) -> str:
    lines, start = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    for node in tree.body[0].body:  # type: ignore[attr-defined]
        target = None
        if isinstance(node, ast.AnnAssign):
            target = node.target
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == attr:
            return loc.at(cls, start + node.lineno - 1)
    return loc.at(cls)


def collect_vllm_facts(serve_argv: Sequence[str]) -> tuple[VllmFacts, list[Fact]]:
    """Facts from the installed vLLM tree for this exact serve argv."""
    argv = _strip_serve_prefix(serve_argv)
    try:
        args = _parse_serve_argv(argv)
    except SelftestError:
        raise
    except ImportError as exc:
        raise SelftestError(f"cannot import vLLM's serve parser: {exc}") from None
    model = getattr(args, "model", None)
    if not model:
        raise SelftestError("vllm serve argv names no model")
    _check_model_dir(model)

    from vllm.engine.arg_utils import EngineArgs

    try:
        model_config = EngineArgs.from_cli_args(args).create_model_config()
    except Exception as exc:
        hint = ""
        if "infer device type" in str(exc):
            hint = " (on a host without a GPU, set VLLM_TARGET_DEVICE=cpu)"
        raise SelftestError(
            "vLLM could not build the ModelConfig: "
            + _one_line(f"{type(exc).__name__}: {exc}", limit=400)
            + hint
        ) from None

    import vllm
    from vllm.models.deepseek_v41 import attention as attn_mod
    from vllm.models.deepseek_v41.nvidia import flashinfer_sparse as fs

    loc = _Locator()
    hf = model_config.hf_config
    sm120_cls = fs.DeepseekV4FlashInferSM120Attention
    extra = [
        Fact("vllm.version", getattr(vllm, "__version__", "unknown"), "vllm.__version__"),
        Fact("vllm.model", str(model), "vllm serve argv (model_tag / --model)"),
        Fact(
            "vllm.architectures",
            list(getattr(model_config, "architectures", []) or []),
            "ModelConfig.architectures",
        ),
    ]
    sources: dict[str, str] = {}

    tp = int(args.tensor_parallel_size)
    sources["tensor_parallel_size"] = (
        "vllm serve parser (make_arg_parser): args.tensor_parallel_size"
    )
    heads = int(hf.num_attention_heads)
    sources["num_heads"] = "ModelConfig.hf_config.num_attention_heads"
    try:
        model_config.verify_with_parallel_config(
            types.SimpleNamespace(
                tensor_parallel_size=tp,
                pipeline_parallel_size=1,
                decode_context_parallel_size=1,
                enable_expert_parallel=False,
            )
        )
    except ValueError as exc:
        raise SelftestError(f"tensor parallel size {tp}: {_one_line(str(exc))}") from None
    except AttributeError:
        if tp <= 0 or heads % tp:
            raise SelftestError(
                f"tensor parallel size {tp} does not divide {heads} attention heads"
            ) from None
    local = heads // tp
    sources["local_heads"] = (
        f"num_heads // tensor_parallel_size (DeepseekV4Attention.__init__, "
        f"{loc.path(attn_mod)})"
    )
    try:
        padded = int(fs._pad_to_supported_q_heads(local))
    except ValueError as exc:
        raise SelftestError(_one_line(str(exc))) from None
    sources["padded_heads"] = (
        f"vllm flashinfer_sparse._pad_to_supported_q_heads({local}) "
        f"({loc.at(fs._pad_to_supported_q_heads)})"
    )

    window, width, window_src, width_src = _prefill_width_rule(model_config, loc)
    sources["sliding_window"] = window_src
    sources["prefill_width"] = width_src

    page, page_src = _swa_page_block_size(attn_mod, sm120_cls, loc)
    sources["swa_page_block_size"] = page_src

    backend = sm120_cls.backend_cls
    sizes = list(backend.get_supported_kernel_block_sizes())
    block = next((s for s in sizes if isinstance(s, int)), None)
    ratios = sorted({int(r) for r in (getattr(hf, "compress_ratios", None) or []) if int(r)})
    if ratios and block is None:
        raise SelftestError(
            f"{backend.__name__}.get_supported_kernel_block_sizes() returned "
            f"{sizes!r}, no fixed kernel block"
        )
    compressed = tuple((r, int(block) // r) for r in ratios) if ratios else ()
    sources["compressed_pages"] = (
        f"{backend.__name__}.get_supported_kernel_block_sizes() = {sizes} "
        f"({loc.at(backend.get_supported_kernel_block_sizes)}) // each non-zero "
        "compress_ratios entry"
    )

    extra_topk = getattr(hf, "index_topk", None)
    if extra_topk is None:
        raise SelftestError("the checkpoint's config has no index_topk")
    sources["extra_topk"] = "ModelConfig.hf_config.index_topk"
    d_qk = int(model_config.get_head_size())
    sources["d_qk"] = "ModelConfig.get_head_size()"

    return (
        VllmFacts(
            tensor_parallel_size=tp,
            num_heads=heads,
            local_heads=local,
            padded_heads=padded,
            sliding_window=window,
            prefill_width=width,
            swa_page_block_size=page,
            compressed_pages=compressed,
            extra_topk=int(extra_topk),
            d_qk=d_qk,
            sources=sources,
        ),
        extra,
    )


# --------------------------------------------------------------------------
# Rendering and CLI
# --------------------------------------------------------------------------


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _value_text(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(", ", ": "))
    return str(value)


def render_text(report: Report, out: TextIO) -> None:
    print("SM120 decode-shape self-test (DeepSeek V4.1, FlashInfer sparse MLA)", file=out)
    if report.facts:
        print("facts:", file=out)
        width = max(len(f.name) for f in report.facts)
        for fact in report.facts:
            print(f"  {fact.name:<{width}}  {_value_text(fact.value)}", file=out)
            if fact.source:
                print(f"  {'':<{width}}    from {fact.source}", file=out)
    if report.shapes:
        print("shapes:", file=out)
        header = ("shape", "tokens", "heads", "topk", "extra_topk", "page", "d_qk", "kernel", "static")
        rows = [
            (
                s.label,
                str(s.num_tokens),
                str(s.num_heads),
                str(s.topk),
                str(s.extra_topk),
                str(s.page_block_size),
                str(s.d_qk),
                s.kernel,
                "accepted" if s.accepted else "refused: " + "; ".join(s.static_reasons),
            )
            for s in report.shapes
        ]
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header) - 1)]
        for row in [header] + rows:
            cells = [c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]
            print("  " + "  ".join(cells), file=out)
    device = (
        f"compute capability {report.device[0]}.{report.device[1]}"
        if report.device
        else "no CUDA device"
    )
    mode = "static checks only (--static)" if report.static else "kernel calls"
    print(f"device: {device}; mode: {mode}", file=out)
    for note in report.notes:
        print(f"note: {note}", file=out)


def _error_report(reason: str, facts: Sequence[Fact] = (), static: bool = False) -> Report:
    return Report(list(facts), [], static, None, False, _fail_verdict([reason]), [reason])


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        idx = argv.index("--")
        return argv[:idx], argv[idx + 1 :]
    own = [a for a in argv if a in ("--static", "--json", "-h", "--help")]
    return own, [a for a in argv if a not in own]


class _OwnParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise SelftestError(f"self-test options: {message}")


def _own_parser() -> argparse.ArgumentParser:
    p = _OwnParser(
        prog="python -m vllm.models.deepseek_v41.nvidia.sm120_decode_shape_selftest",
        description="Check FlashInfer's SM120 decode shapes for a rank's vllm serve argv.",
        usage="%(prog)s [--static] [--json] -- <vllm serve argv>",
    )
    p.add_argument("--static", action="store_true", help="verdict from static checks only")
    p.add_argument("--json", action="store_true", help="print the whole table as JSON")
    return p


def run(
    argv: Sequence[str],
    *,
    static: bool = False,
    as_json: bool = False,
    kernel_call: KernelCall | None = None,
    device_capability: DeviceQuery | None = None,
    out: TextIO | None = None,
    vllm_facts: Callable[[Sequence[str]], tuple[VllmFacts, list[Fact]]] | None = None,
    flashinfer_facts: Callable[[], FlashInferFacts] | None = None,
) -> int:
    """Run the self-test on a ``vllm serve`` argv; return the exit code.

    ``argv`` may carry the self-test's own ``--static``/``--json`` before a
    ``--`` separator. ``kernel_call``, ``device_capability``, ``vllm_facts``
    and ``flashinfer_facts`` replace the real kernel call, device query and
    fact collectors (tests).
    """
    out = out if out is not None else sys.stdout
    report: Report
    try:
        own, serve_argv = _split_argv(argv)
        if own:
            opts = _own_parser().parse_args(own)
            static = static or opts.static
            as_json = as_json or opts.json
        report = _run(
            serve_argv,
            static=static,
            kernel_call=kernel_call,
            device_capability=device_capability,
            vllm_facts=vllm_facts or collect_vllm_facts,
            flashinfer_facts=flashinfer_facts or collect_flashinfer_facts,
        )
    except SelftestError as exc:
        report = _error_report(str(exc), static=static)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except Exception as exc:  # never a traceback for an operator
        if os.environ.get("SM120_SELFTEST_DEBUG"):
            raise
        report = _error_report(
            _one_line(f"internal error: {type(exc).__name__}: {exc}"), static=static
        )
    if as_json:
        print(json.dumps(report.as_dict(), indent=2, default=str), file=out)
    else:
        render_text(report, out)
    print(report.verdict, file=out)
    out.flush()
    return 0 if report.passed else 1


def _run(
    serve_argv: list[str],
    *,
    static: bool,
    kernel_call: KernelCall | None,
    device_capability: DeviceQuery | None,
    vllm_facts: Callable[[Sequence[str]], tuple[VllmFacts, list[Fact]]],
    flashinfer_facts: Callable[[], FlashInferFacts],
) -> Report:
    query = device_capability or cuda_device_capability
    device = query()
    if (
        device is None
        and vllm_facts is collect_vllm_facts
        and "VLLM_TARGET_DEVICE" not in os.environ
    ):
        # vLLM cannot infer a device on a host without one; the facts read
        # here (parser, ModelConfig, class attributes) do not depend on it.
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    # vLLM and FlashInfer log to stdout; keep stdout for the table and verdict.
    _move_stdout_log_handlers()
    with contextlib.redirect_stdout(sys.stderr):
        vf, extra = vllm_facts(serve_argv)
        fi = flashinfer_facts()
    return evaluate(
        vf,
        fi,
        static=static,
        kernel_call=kernel_call,
        device_capability=lambda: device,
        extra_facts=extra,
    )


def _move_stdout_log_handlers() -> None:
    """Point logging handlers already writing to stdout at stderr.

    ``python -m`` imports vLLM (and configures its logger) before this module
    runs; lines logged during that import precede the output. Set
    ``VLLM_LOGGING_STREAM=ext://sys.stderr`` to keep stdout clean for --json.
    """
    import logging

    stdouts = {id(sys.stdout), id(sys.__stdout__)}
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values()
        if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for handler in lg.handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in stdouts:
                handler.setStream(sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
