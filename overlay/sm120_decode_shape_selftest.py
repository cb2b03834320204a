# SPDX-License-Identifier: Apache-2.0
"""SM120 kernel-route self-test for DeepSeek V4.1 on FlashInfer sparse MLA.

Run it with a rank's exact ``vllm serve`` argv, before the launch::

    python -m vllm.models.deepseek_v41.nvidia.sm120_decode_shape_selftest \\
        [--static] [--json] -- <the rank's vllm serve argv>

It parses the argv with vLLM's own serve parser and engine arguments, builds
the engine's ModelConfig from the checkpoint's config.json, and derives every
attention call vLLM's SM120 FlashInfer backend
(``DeepseekV4FlashInferSM120Attention``) will make, per layer type
(sliding-window only; compressed ratio 1; compressed ratio 2): decode calls
(all decode tokens of a step in one call, CUDA-graph capture sizes included)
and prefill calls (chunks of ``PREFILL_CHUNK_SIZE`` requests with all their
tokens), each with the top-k and the pages it carries. FlashInfer flattens a
call's query, so its token count picks the kernel route: up to
``_DECODE_MAX_TOKENS`` the standalone decode kernel, above it the C++ prefill
dispatch (single cache, or dual with a compressed cache). The rules of each
route are read from the installed FlashInfer: its Python constants and
predicate, and the prefill dispatch's accepted combinations from its shipped
``csrc`` source. Every fact is printed with the file and line it came from;
a rule that cannot be read is a FAIL ("cannot establish"), never a PASS.

On an SM120 device (compute capability 12.x) each route and layer type is
also called for real through ``flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4``
with synthetic tensors at the derived token counts; without one the verdict is
FAIL unless ``--static`` is given, in which case it rests on the static
checks and says so. What the verdict does not cover is printed beside it.

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
import importlib.util
import inspect
import io
import json
import os
import pathlib
import re
import sys
import textwrap
import types
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

PASS = "SELFTEST PASS"
PASS_STATIC = "SELFTEST PASS (static)"
FAIL = "SELFTEST FAIL"
NO_DEVICE_REASON = "no SM120 device: kernel calls not run"
SM120_MAJOR = 12

ROUTE_DECODE = "decode kernel"
ROUTE_SINGLE = "prefill single"
ROUTE_DUAL = "prefill dual"
ROUTES = (ROUTE_DECODE, ROUTE_SINGLE, ROUTE_DUAL)

# vLLM sizes its FlashInfer DSv4 workspace at 128 MiB
# (_FLASHINFER_DSV4_WORKSPACE_BUFFER_SIZE in flashinfer_sparse.py).
_WORKSPACE_BYTES = 128 * 1024 * 1024


class SelftestError(Exception):
    """A fact could not be established; ``str(exc)`` is the FAIL reason."""


class CannotEstablish(SelftestError):
    """A rule could not be read from the installed sources."""

    def __init__(self, what: str) -> None:
        super().__init__(f"cannot establish {what}")


@dataclasses.dataclass(frozen=True)
class Fact:
    name: str
    value: Any
    source: str


# --------------------------------------------------------------------------
# FlashInfer's rules: routes, and the conditions each puts on a call
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """One condition a kernel route puts on a call field, and where it was read."""

    field: str  # a Call field, or "num_heads,topk" for an exact pair set
    op: str  # "in" | "multiple_of" | "min" | "max" | "positive"
    values: frozenset  # "in": accepted values; else frozenset({n}); empty for "positive"
    source: str  # "flashinfer/<path>:<line> <what>"

    def refusal(self, call: Call) -> str | None:
        """The condition ``call`` fails, in words with its source, or None."""
        if self.field == "num_heads,topk":
            value: Any = (call.num_heads, call.topk)
        else:
            value = getattr(call, self.field)
        n = next(iter(self.values), None)
        if self.op == "in" and self.field == "num_heads,topk":
            ok = value in self.values
            topks = [t for h, t in self.values if h == call.num_heads]
            want = f"not in the set: heads {call.num_heads} take topk {_set_text(topks)}" if topks else "not in the set"
        elif self.op == "in":
            ok = value in self.values
            want = f"not in {_set_text(self.values)}"
        elif self.op == "multiple_of":
            ok = value % n == 0
            want = f"not a multiple of {n}"
        elif self.op == "min":
            ok = value >= n
            want = f"below {n}"
        elif self.op == "max":
            ok = value <= n
            want = f"above {n}"
        elif self.op == "positive":
            ok = value > 0
            want = "not positive"
        else:
            raise CannotEstablish(f"rule {self.field} {self.op}: unknown operator")
        if ok:
            return None
        shown = f"({value[0]}, {value[1]})" if isinstance(value, tuple) else value
        return f"{self.field} {shown} {want} ({self.source})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "field": self.field,
            "op": self.op,
            "values": sorted(self.values),
            "source": self.source,
        }


@dataclasses.dataclass(frozen=True)
class Route:
    """One kernel route: the calls it takes and the rules it applies to them."""

    name: str
    min_tokens: int
    max_tokens: int | None  # None: unbounded
    cache: str  # "single" (no compressed cache), "dual" (with one), "any"
    rules: tuple[Rule, ...]
    source: str  # where the route selection itself was read

    def takes(self, call: Call) -> bool:
        return self.cache == "any" or self.cache == ("dual" if call.has_extra else "single")

    def token_range(self, lo: int, hi: int) -> tuple[int, int] | None:
        """The part of ``lo..hi`` this route takes, or None."""
        lo = max(lo, self.min_tokens)
        hi = hi if self.max_tokens is None else min(hi, self.max_tokens)
        return (lo, hi) if lo <= hi else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tokens": [self.min_tokens, self.max_tokens],
            "cache": self.cache,
            "rules": [r.as_dict() for r in self.rules],
            "source": self.source,
        }


@dataclasses.dataclass
class FlashInferRules:
    version: str
    reader: str
    bytes_per_token: int
    routes: tuple[Route, ...]
    sources: dict[str, str]
    notes: list[str]  # what is not modelled or not executed, in plain words
    # FlashInfer's own decode predicate, when the package imported: called
    # with a Call, returns bool. Authoritative beside the rules read.
    predicate: Callable[[Call], bool] | None = None
    predicate_name: str = ""

    def facts(self) -> list[Fact]:
        out = [
            Fact("flashinfer.version", self.version, self.sources.get("version", "")),
            Fact("flashinfer.reader", self.reader, self.sources.get("reader", "")),
            Fact(
                "flashinfer.bytes_per_token",
                self.bytes_per_token,
                self.sources.get("bytes_per_token", ""),
            ),
        ]
        for route in self.routes:
            top = "" if route.max_tokens is None else f"..{route.max_tokens}"
            out.append(
                Fact(
                    f"flashinfer.route[{route.name}]",
                    f"num_tokens {route.min_tokens}{top if top else '+'}, "
                    f"cache {route.cache}",
                    route.source,
                )
            )
            for rule in route.rules:
                value = (
                    _pairs_text(rule.values)
                    if rule.field == "num_heads,topk"
                    else f"{rule.op} {_set_text(rule.values)}"
                    if rule.op == "in"
                    else f"{rule.op} {next(iter(rule.values), '')}".strip()
                )
                out.append(
                    Fact(f"flashinfer.route[{route.name}].{rule.field}", value, rule.source)
                )
        return out


def _set_text(values: Iterable[Any]) -> str:
    return "{" + ", ".join(str(v) for v in sorted(values)) + "}"


def _pairs_text(pairs: Iterable[tuple[int, int]]) -> str:
    by_heads: dict[int, list[int]] = {}
    for heads, topk in sorted(pairs):
        by_heads.setdefault(heads, []).append(topk)
    return "; ".join(f"heads {h}: topk {_set_text(t)}" for h, t in by_heads.items())


# --------------------------------------------------------------------------
# Reading FlashInfer's sources (never executing them)
# --------------------------------------------------------------------------

class _Source:
    """One file of the installed FlashInfer, with ``file:line`` provenance."""

    def __init__(self, root: Path, rel: str) -> None:
        self.label = f"flashinfer/{rel}"
        try:
            self.text = (root / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CannotEstablish(f"FlashInfer's SM120 rules: cannot read {self.label}: {exc}") from None
        self.code = _strip_c_comments(self.text) if rel.endswith((".cu", ".h", ".cuh")) else self.text

    def line(self, pos: int) -> int:
        return self.code.count("\n", 0, pos) + 1

    def at(self, pos: int, what: str) -> str:
        return f"{self.label}:{self.line(pos)} {what}"

    def function(self, name: str) -> tuple[int, int]:
        """The body span of the C++ function ``name``'s definition."""
        for m in re.finditer(rf"\b{re.escape(name)}\s*\(", self.code):
            close = _matching(self.code, m.end() - 1, "(", ")")
            rest = self.code[close + 1 :].lstrip()
            if rest.startswith("{"):
                start = len(self.code) - len(rest)
                return start, _matching(self.code, start, "{", "}")
        raise CannotEstablish(f"the definition of {name}() in {self.label}")

    def find(self, pattern: str, what: str, span: tuple[int, int] | None = None) -> re.Match[str]:
        lo, hi = span or (0, len(self.code))
        m = re.compile(pattern).search(self.code, lo, hi)
        if m is None:
            raise CannotEstablish(f"{what} in {self.label}")
        return m

    def ints(self, pattern: str, span: tuple[int, int], what: str) -> tuple[frozenset[int], int]:
        """Every integer ``pattern``'s group 1 takes in ``span``, and the first one's position."""
        found = list(re.compile(pattern).finditer(self.code, *span))
        if not found:
            raise CannotEstablish(f"{what} in {self.label}")
        return frozenset(int(m.group(1)) for m in found), found[0].start()

    def template_page(self, template: str, span: tuple[int, int]) -> tuple[int, int]:
        """The page-size argument (the literal after ``TK``) of ``template<...>`` in ``span``."""
        m = self.find(rf"\b{template}\s*<([^<>]*)>", f"{template}<...> in the dispatch", span)
        args = [a.strip() for a in m.group(1).split(",")]
        if "TK" not in args or args.index("TK") + 1 >= len(args) or not args[args.index("TK") + 1].isdigit():
            raise CannotEstablish(
                f"the page size of {template}<{m.group(1).strip()}> at {self.label}:{self.line(m.start())}"
            )
        return int(args[args.index("TK") + 1]), m.start()


def _matching(code: str, pos: int, open_: str, close: str) -> int:
    end = _match(code, pos, open_, close)
    if end < 0:
        raise CannotEstablish(f"a balanced {open_}{close} at offset {pos}")
    return end


def _py_constants(src: _Source, names: Sequence[str]) -> dict[str, tuple[Any, int]]:
    """Module-level literal constants of a Python source: name -> (value, line)."""
    try:
        tree = ast.parse(src.text)
    except SyntaxError as exc:
        raise CannotEstablish(f"FlashInfer's SM120 rules: {src.label} does not parse: {exc}") from None
    found: dict[str, tuple[Any, int]] = {}
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Name) and target.id in names:
                try:
                    found[target.id] = (_literal(node.value), node.lineno)  # type: ignore[arg-type]
                except (ValueError, TypeError, SyntaxError):
                    raise CannotEstablish(f"{target.id} at {src.label}:{node.lineno} (not a literal)") from None
    missing = [n for n in names if n not in found]
    if missing:
        raise CannotEstablish(f"{', '.join(missing)} in {src.label}")
    return found


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


_FI06_PY = "mla/_sparse_mla_sm120.py"
_FI06_PREFILL = "data/csrc/sparse_mla_sm120_prefill.cu"
_FI06_BINDING = "data/csrc/sparse_mla_sm120.cu"
_FI06_PREDICATE = "_decode_dsv4_dispatchable"


def read_flashinfer_06x(root: Path, version: str = "") -> FlashInferRules:
    """FlashInfer 0.6.x: the decode kernel's rules from ``mla/_sparse_mla_sm120.py``,
    the prefill dispatch's from ``data/csrc/sparse_mla_sm120_prefill.cu`` and
    ``sparse_mla_sm120.cu``; ``root`` is the ``flashinfer`` package directory."""
    py = _Source(root, _FI06_PY)
    consts = _py_constants(
        py, ("_DECODE_MAX_TOKENS", "_DECODE_DSV4_DISPATCH", "_DECODE_DSV4_PAGE_BLOCK_SIZE", "_BPT_DSV4")
    )
    cutoff, cutoff_line = consts["_DECODE_MAX_TOKENS"]
    dispatch, dispatch_line = consts["_DECODE_DSV4_DISPATCH"]
    page, page_line = consts["_DECODE_DSV4_PAGE_BLOCK_SIZE"]
    bpt, bpt_line = consts["_BPT_DSV4"]
    tree = ast.parse(py.text)
    d_qk, d_qk_line = _predicate_d_qk(tree, py)
    refuse_line, orchestrator_line = _python_route_split(tree, py)

    binding = _Source(root, _FI06_BINDING)
    gt = binding.find(r"TVM_FFI_ICHECK_GT\(\s*num_tokens\s*,\s*(\d+)\s*\)", "the prefill orchestrator's token check")
    if int(gt.group(1)) != int(cutoff):
        raise CannotEstablish(
            f"one token cutoff: {py.label}:{cutoff_line} says {cutoff}, "
            f"{binding.at(gt.start(), '')}says num_tokens > {gt.group(1)}"
        )
    resolve = binding.function("resolve_model_type")
    prefill_d_qk = None
    for m in re.finditer(r"\bd_qk\s*==\s*(\d+)", binding.code[resolve[0] : resolve[1]]):
        pos = resolve[0] + m.start()
        branch = binding.code[pos : binding.code.find("}", pos)]
        if "ModelType::DSV4" in branch:
            prefill_d_qk = (int(m.group(1)), pos)
    if prefill_d_qk is None:
        raise CannotEstablish(f"the DSV4 d_qk in resolve_model_type() of {binding.label}")

    cu = _Source(root, _FI06_PREFILL)
    top = cu.function("sparse_mla_prefill_dispatch")
    dual_call = cu.find(
        r"if\s*\(\s*extra_KV_cache\s*!=\s*nullptr\s*\)[^}]*?return\s+dispatch_dsv4_dual\s*\(",
        "sparse_mla_prefill_dispatch: a compressed cache going to dispatch_dsv4_dual",
        top,
    )
    single_call = cu.find(
        r"case\s+ModelType::DSV4\s*:\s*return\s+dispatch_dsv4_single\s*\(",
        "sparse_mla_prefill_dispatch: DSV4 without a compressed cache going to dispatch_dsv4_single",
        top,
    )
    single = cu.function("dispatch_dsv4_single")
    s_heads, s_heads_at = cu.ints(r"\bcase\s+(\d+)\s*:", single, "dispatch_dsv4_single's head cases")
    s_topks, s_topks_at = cu.ints(r"\btopk\s*==\s*(\d+)", single, "dispatch_dsv4_single's topk branches")
    s_page, s_page_at = cu.template_page("launch_prefill_mg", single)
    dual = cu.function("dispatch_dsv4_dual")
    d_heads, d_heads_at = cu.ints(r"\bcase\s+(\d+)\s*:", dual, "dispatch_dsv4_dual's head cases")
    d_topks, d_topks_at = cu.ints(
        r"\btopk\s*!=\s*(\d+)\s*\)\s*return\s+false", dual, "dispatch_dsv4_dual's topk guard"
    )
    d_extra, d_extra_at = cu.ints(
        r"\bextra_page_block_size\s*==\s*(\d+)", dual, "dispatch_dsv4_dual's extra page branches"
    )
    d_page, d_page_at = cu.template_page("launch_prefill_mg_dual", dual)

    d_qk_rule = Rule("d_qk", "in", frozenset({int(prefill_d_qk[0])}), binding.at(prefill_d_qk[1], "resolve_model_type: DSV4"))
    prefill_min = int(cutoff) + 1
    routes = (
        Route(
            ROUTE_DECODE,
            1,
            int(cutoff),
            "any",
            (
                Rule("d_qk", "in", frozenset({int(d_qk)}), f"{py.label}:{d_qk_line} {_FI06_PREDICATE}"),
                Rule("page_block_size", "in", frozenset({int(page)}), f"{py.label}:{page_line} _DECODE_DSV4_PAGE_BLOCK_SIZE"),
                Rule(
                    "num_heads,topk",
                    "in",
                    frozenset((int(h), int(t)) for h, t in dispatch),
                    f"{py.label}:{dispatch_line} _DECODE_DSV4_DISPATCH",
                ),
            ),
            f"{py.label}:{cutoff_line} _DECODE_MAX_TOKENS; a call of at most {cutoff} tokens that no "
            f"decode kernel takes raises at {py.label}:{refuse_line}",
        ),
        Route(
            ROUTE_SINGLE,
            prefill_min,
            None,
            "single",
            (
                d_qk_rule,
                Rule("num_heads", "in", s_heads, cu.at(s_heads_at, "dispatch_dsv4_single: num_heads cases")),
                Rule("topk", "in", s_topks, cu.at(s_topks_at, "dispatch_dsv4_single: topk branches")),
                Rule(
                    "page_block_size",
                    "in",
                    frozenset({s_page}),
                    cu.at(s_page_at, "launch_prefill_mg<..., TK, page>: the only page instantiated; not checked at run time"),
                ),
            ),
            f"{py.label}:{orchestrator_line} module.sparse_mla_sm120_paged_attention; "
            f"{binding.at(gt.start(), 'num_tokens > ' + gt.group(1))}; "
            f"{cu.at(single_call.start(), 'no compressed cache: dispatch_dsv4_single')}",
        ),
        Route(
            ROUTE_DUAL,
            prefill_min,
            None,
            "dual",
            (
                d_qk_rule,
                Rule("num_heads", "in", d_heads, cu.at(d_heads_at, "dispatch_dsv4_dual: num_heads cases")),
                Rule("topk", "in", d_topks, cu.at(d_topks_at, "dispatch_dsv4_dual: topk guard")),
                Rule(
                    "extra_page_block_size",
                    "in",
                    d_extra,
                    cu.at(d_extra_at, "dispatch_dsv4_dual: extra_page_block_size branches"),
                ),
                Rule(
                    "page_block_size",
                    "in",
                    frozenset({d_page}),
                    cu.at(d_page_at, "launch_prefill_mg_dual<..., TK, page, ...>: the only page instantiated; not checked at run time"),
                ),
            ),
            f"{py.label}:{orchestrator_line} module.sparse_mla_sm120_paged_attention; "
            f"{cu.at(dual_call.start(), 'a compressed cache: dispatch_dsv4_dual')}",
        ),
    )
    return FlashInferRules(
        version=version,
        reader="source (0.6.x layout)",
        bytes_per_token=int(bpt),
        routes=routes,
        sources={"bytes_per_token": f"{py.label}:{bpt_line} _BPT_DSV4"},
        notes=[
            "prefill dual's full-tile variant (taken only without topk lengths; vLLM always passes them) is not modelled",
            "the decode kernel's compressed-cache page is a run-time value (pbs_extra); not checked",
        ],
    )


def _predicate_d_qk(tree: ast.Module, py: _Source) -> tuple[int, int]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == _FI06_PREDICATE:
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Compare)
                    and isinstance(sub.left, ast.Name)
                    and sub.left.id == "d_qk"
                    and len(sub.ops) == 1
                    and isinstance(sub.ops[0], ast.Eq)
                    and isinstance(sub.comparators[0], ast.Constant)
                ):
                    return int(sub.comparators[0].value), sub.lineno
    raise CannotEstablish(f"{_FI06_PREDICATE}(... d_qk == N ...) in {py.label}")


def _python_route_split(tree: ast.Module, py: _Source) -> tuple[int, int]:
    """Lines of the decode-sized refusal and of the call to the C++ orchestrator."""
    refuse = orchestrator = None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "num_tokens"
            and isinstance(node.test.ops[0], ast.LtE)
            and isinstance(node.test.comparators[0], ast.Name)
            and node.test.comparators[0].id == "_DECODE_MAX_TOKENS"
            and node.body
            and isinstance(node.body[0], ast.Raise)
        ):
            refuse = node.lineno
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "sparse_mla_sm120_paged_attention"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "module"
        ):
            orchestrator = node.lineno
    if refuse is None or orchestrator is None:
        raise CannotEstablish(
            f"the decode/prefill split in {py.label} (a refusal under "
            "'if num_tokens <= _DECODE_MAX_TOKENS', then module.sparse_mla_sm120_paged_attention)"
        )
    return refuse, orchestrator


# --------------------------------------------------------------------------
# FlashInfer 0.7.x
# --------------------------------------------------------------------------

_FI07_PY_DIR = "mla/_sparse_mla_sm120"


BUILD_META = "_build_meta.py"
CORE_PY = "mla/_core.py"
POLICY_PY = "mla/_sparse_mla_sm120/_policy.py"
RESOLVE_CU = "data/csrc/sparse_mla_sm120/attention_resolve.cu"
PREFILL_DISPATCH_CU = "data/csrc/sparse_mla_sm120/prefill_dispatch.cu"
DECODE_DISPATCH_CU = "data/csrc/sparse_mla_sm120/decode_dispatch.cu"
_INC = "data/include/flashinfer/attention/sparse_mla_sm120/"
PLAN_H = _INC + "execution/attention_plan.h"
PREFILL_LAUNCH_CUH = _INC + "execution/prefill_launch.cuh"
DECODE_LAUNCH_CUH = _INC + "execution/decode_launch.cuh"
PREFILL_MG_CUH = _INC + "kernels/fp8_prefill/prefill_mg.cuh"
KV_TRAITS_CUH = _INC + "model/kv_cache_traits.cuh"

FILES_READ = (
    BUILD_META, CORE_PY, POLICY_PY, RESOLVE_CU, PREFILL_DISPATCH_CU,
    DECODE_DISPATCH_CU, PLAN_H, PREFILL_LAUNCH_CUH, DECODE_LAUNCH_CUH,
    PREFILL_MG_CUH, KV_TRAITS_CUH,
)

_MODEL = "DSV4"  # ModelType selected by kv_cache_format="fp8" / kv_scale_format="auto"


# --------------------------------------------------------------------------
# Source access helpers
# --------------------------------------------------------------------------
class _Sources:
    def __init__(self, root: pathlib.Path):
        self.root = pathlib.Path(root)
        self._raw: dict[str, str] = {}
        self._code: dict[str, str] = {}

    def raw(self, rel: str) -> str:
        if rel not in self._raw:
            path = self.root / rel
            try:
                self._raw[rel] = path.read_text(encoding="utf-8")
            except OSError as e:
                raise CannotEstablish(f"flashinfer/{rel}: cannot read ({e})") from None
        return self._raw[rel]

    def code(self, rel: str) -> str:
        """C/C++ text with comments blanked (offsets and line numbers preserved)."""
        if rel not in self._code:
            self._code[rel] = _strip_c_comments(self.raw(rel))
        return self._code[rel]

    def line(self, rel: str, offset: int) -> int:
        return self.raw(rel).count("\n", 0, offset) + 1

    def prov(self, rel: str, offset_or_line: int, what: str, *, is_line=False) -> str:
        ln = offset_or_line if is_line else self.line(rel, offset_or_line)
        return f"flashinfer/{rel}:{ln} {what}"

    def ast(self, rel: str) -> ast.Module:
        try:
            return ast.parse(self.raw(rel), filename=rel)
        except SyntaxError as e:
            raise CannotEstablish(f"flashinfer/{rel}: not parseable Python ({e})") from None


def _strip_c_comments(text: str) -> str:
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "/" and i + 1 < n and text[i + 1] == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif c == "/" and i + 1 < n and text[i + 1] == "*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            i += 1
    return "".join(out)


def _match(text: str, open_idx: int, open_ch: str, close_ch: str) -> int:
    """Index of the bracket closing the one at open_idx."""
    depth = 0
    for i in range(open_idx, len(text)):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i
    return -1


def _function_body(src: _Sources, rel: str, signature_re: str, what: str) -> tuple[int, int]:
    """(start, end) offsets of the {...} body of the unique function matching signature_re."""
    code = src.code(rel)
    hits = list(re.finditer(signature_re, code))
    if len(hits) != 1:
        raise CannotEstablish(
            f"flashinfer/{rel}: expected exactly one definition of {what} "
            f"(/{signature_re}/), found {len(hits)}"
        )
    m = hits[0]
    brace = code.find("{", m.end())
    semi = code.find(";", m.end())
    if brace < 0 or (0 <= semi < brace):
        raise CannotEstablish(f"flashinfer/{rel}:{src.line(rel, m.start())} {what}: no body found")
    end = _match(code, brace, "{", "}")
    if end < 0:
        raise CannotEstablish(f"flashinfer/{rel}:{src.line(rel, brace)} {what}: unbalanced body")
    return brace, end


def _find_one(src: _Sources, rel: str, pattern: str, what: str, start=0, end=None, flags=0):
    code = src.code(rel)
    end = len(code) if end is None else end
    hits = list(re.compile(pattern, flags).finditer(code, start, end))
    if len(hits) != 1:
        where = f"flashinfer/{rel}" + (f":{src.line(rel, start)}" if start else "")
        raise CannotEstablish(f"{where}: expected exactly one {what} (/{pattern}/), found {len(hits)}")
    return hits[0]


def _constexpr_int(src: _Sources, rel: str, name: str) -> tuple[int, str]:
    m = _find_one(src, rel, rf"constexpr\s+int\s+{name}\s*=\s*(\d+)\s*;", f"constexpr int {name}")
    return int(m.group(1)), src.prov(rel, m.start(), f"constexpr int {name} = {m.group(1)}")


# --------------------------------------------------------------------------
# A tiny evaluator for `if constexpr (...)` conditions in attention_plan.h
# --------------------------------------------------------------------------
_TOKEN_RE = re.compile(r"\s*(ModelType::\w+|==|!=|&&|\|\||!|\(|\)|\d+|\w+)")


def _eval_cond(expr: str, env: dict[str, Any], where: str) -> bool:
    toks, pos = [], 0
    expr = expr.strip()
    while pos < len(expr):
        m = _TOKEN_RE.match(expr, pos)
        if not m or m.end() == pos:
            raise CannotEstablish(f"{where}: cannot parse condition {expr!r}")
        toks.append(m.group(1))
        pos = m.end()
    py = []
    for i, t in enumerate(toks):
        if t.startswith("ModelType::"):
            py.append(repr(t.split("::", 1)[1]))
        elif t == "&&":
            py.append(" and ")
        elif t == "||":
            py.append(" or ")
        elif t == "!":
            # C's `!a == b` would differ from Python's `not a == b`; refuse it.
            if i + 2 < len(toks) and toks[i + 1] not in "(" and toks[i + 2] in ("==", "!="):
                raise CannotEstablish(f"{where}: ambiguous negation in {expr!r}")
            py.append(" not ")
        elif t in ("==", "!=", "(", ")"):
            py.append(f" {t} ")
        elif t.isdigit():
            py.append(t)
        elif t in env:
            py.append(repr(env[t]))
        else:
            raise CannotEstablish(f"{where}: unknown identifier {t!r} in condition {expr!r}")
    try:
        value = eval("".join(py), {"__builtins__": {}}, {})  # only literals/ops built above
    except Exception as e:  # noqa: BLE001
        raise CannotEstablish(f"{where}: cannot evaluate condition {expr!r} ({e})") from None
    if not isinstance(value, bool):
        raise CannotEstablish(f"{where}: condition {expr!r} is not boolean")
    return value


def _head_visitor(src: _Sources, rel: str, func: str, ret_type: str, params: dict[str, Any]):
    """Evaluate a `visit_*_heads` template for the given template arguments.

    Returns (heads:set[int], runtime_fallback:bool, head_lines:list[int], fn_line:int).
    Expected shape: a local `#define HEAD(H) if (heads == H) return call(std::integral_constant<int, H>{});`,
    optional `constexpr bool x = <cond>;` locals, `HEAD(n)` uses either at top level or inside
    `if constexpr (<cond>) { ... }` blocks, and a final `return false;` (no fallback) or
    `return call(std::integral_constant<int, 0>{});` (runtime head count)."""
    code = src.code(rel)
    start, end = _function_body(src, rel, rf"{ret_type}\s+{func}\s*\(\s*int\s+heads\s*,\s*F\s*&&\s*call\s*\)", func)
    fn_line = src.line(rel, start)
    where = f"flashinfer/{rel}:{fn_line} {func}"
    body = code[start + 1:end]
    off = start + 1
    # The HEAD macro must mean "heads == H dispatches the H instantiation".
    macro = re.search(r"#define\s+HEAD\(H\)\s*\\?\s*if\s*\(\s*heads\s*==\s*H\s*\)\s*return\s+call\(\s*std::integral_constant<int,\s*H>\{\}\s*\)\s*;", body)
    if not macro:
        raise CannotEstablish(f"{where}: HEAD(H) macro of the expected shape not found")
    env = dict(params)
    for m in re.finditer(r"constexpr\s+bool\s+(\w+)\s*=\s*([^;]+);", body):
        env[m.group(1)] = _eval_cond(m.group(2), env, f"flashinfer/{rel}:{src.line(rel, off + m.start())}")
    # Blocks guarded by if constexpr.
    blocks = []
    for m in re.finditer(r"if\s+constexpr\s*\(", body):
        p_open = m.end() - 1
        p_close = _match(body, p_open, "(", ")")
        b_open = body.find("{", p_close)
        if p_close < 0 or b_open < 0 or body[p_close + 1:b_open].strip():
            raise CannotEstablish(f"flashinfer/{rel}:{src.line(rel, off + m.start())} {func}: if constexpr without a braced block")
        b_close = _match(body, b_open, "{", "}")
        inner = body[b_open + 1:b_close]
        if "if" in re.findall(r"\b\w+\b", inner.replace("HEAD", "")):
            raise CannotEstablish(f"flashinfer/{rel}:{src.line(rel, off + m.start())} {func}: nested condition not modelled")
        cond = _eval_cond(body[p_open + 1:p_close], env, f"flashinfer/{rel}:{src.line(rel, off + m.start())}")
        blocks.append((b_open, b_close, cond))
    heads, lines = set(), []
    for m in re.finditer(r"\bHEAD\((\d+)\)", body):
        if m.start() < macro.end():
            continue
        enabled = True
        for b_open, b_close, cond in blocks:
            if b_open < m.start() < b_close:
                enabled = cond
        if enabled:
            heads.add(int(m.group(1)))
            lines.append(src.line(rel, off + m.start()))
    # Final statement decides whether unlisted head counts fall through to a runtime instance.
    undef = body.find("#undef HEAD")
    tail = body[undef + len("#undef HEAD"):] if undef >= 0 else ""
    tail = tail.strip()
    if re.fullmatch(r"return\s+false\s*;", tail):
        fallback = False
    elif re.fullmatch(r"return\s+call\(\s*std::integral_constant<int,\s*0>\{\}\s*\)\s*;", tail):
        fallback = True
    else:
        raise CannotEstablish(f"{where}: final statement after '#undef HEAD' not of a known shape: {tail!r}")
    return heads, fallback, sorted(set(lines)), fn_line


# --------------------------------------------------------------------------
# Python (ast) helpers
# --------------------------------------------------------------------------
def _py_func(src: _Sources, rel: str, name: str) -> ast.FunctionDef:
    hits = [n for n in ast.walk(src.ast(rel)) if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(hits) != 1:
        raise CannotEstablish(f"flashinfer/{rel}: expected one function {name}(), found {len(hits)}")
    return hits[0]


def _py_module_int(src: _Sources, rel: str, name: str) -> tuple[int, int]:
    hits = []
    for node in src.ast(rel).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id == name:
            hits.append(node)
    if len(hits) != 1 or not (isinstance(hits[0].value, ast.Constant) and type(hits[0].value.value) is int):
        raise CannotEstablish(f"flashinfer/{rel}: expected one module-level `{name} = <int>`")
    return hits[0].value.value, hits[0].lineno


def _int_tuple(node) -> tuple[int, ...] | None:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(
            isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts):
        return tuple(e.value for e in node.elts)
    return None


# --------------------------------------------------------------------------
# The reader
# --------------------------------------------------------------------------
def read_flashinfer_07x(root: pathlib.Path, version_seen: str = "") -> FlashInferRules:
    """Read the SM120 sparse-MLA DSv4 (fp8) acceptance rules of an installed FlashInfer 0.7.x."""
    src = _Sources(pathlib.Path(root))
    sources: dict[str, str] = {}
    notes: list[str] = []

    # ---- version ------------------------------------------------------------
    meta = src.ast(BUILD_META)
    version = None
    for node in meta.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets) \
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            version, vline = node.value.value, node.lineno
    if version is None:
        raise CannotEstablish(f"flashinfer/{BUILD_META}: __version__ = '<str>' not found")
    if not version.startswith("0.7."):
        raise CannotEstablish(f"flashinfer/{BUILD_META}:{vline} __version__ = {version!r}: this reader only knows the 0.7.x layout")
    sources["version"] = src.prov(BUILD_META, vline, f"__version__ = {version!r}", is_line=True)

    # ---- public entry: _core.py ----------------------------------------------
    pub = _py_func(src, CORE_PY, "trtllm_batch_decode_sparse_mla_dsv4")
    fmt_default = None
    args = pub.args
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        if a.arg == "kv_cache_format" and isinstance(d, ast.Constant):
            fmt_default = (d.value, d.lineno)
    pos = args.args[len(args.args) - len(args.defaults):]
    for a, d in zip(pos, args.defaults):
        if a.arg == "kv_cache_format" and isinstance(d, ast.Constant):
            fmt_default = (d.value, d.lineno)
    if fmt_default is None or fmt_default[0] != "fp8":
        raise CannotEstablish(f"flashinfer/{CORE_PY}:{pub.lineno} trtllm_batch_decode_sparse_mla_dsv4: kv_cache_format default 'fp8' not found")
    sources["kv_cache_format"] = src.prov(CORE_PY, fmt_default[1], "trtllm_batch_decode_sparse_mla_dsv4 kv_cache_format default 'fp8' (584-byte DSV4 rows; the family modelled here)", is_line=True)
    if not any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "_trtllm_batch_decode_sparse_mla_dsv4_sm120"
               for n in ast.walk(pub)):
        raise CannotEstablish(f"flashinfer/{CORE_PY}:{pub.lineno} trtllm_batch_decode_sparse_mla_dsv4 does not call _trtllm_batch_decode_sparse_mla_dsv4_sm120")

    sm120 = _py_func(src, CORE_PY, "_trtllm_batch_decode_sparse_mla_dsv4_sm120")
    pub_heads = d_qk = row_bytes = lens_required = None
    for n in ast.walk(sm120):
        if isinstance(n, ast.Compare) and isinstance(n.left, ast.Name) and len(n.ops) == 1:
            if n.left.id == "num_heads" and isinstance(n.ops[0], ast.NotIn):
                t = _int_tuple(n.comparators[0])
                if t is not None:
                    if pub_heads is not None:
                        raise CannotEstablish(f"flashinfer/{CORE_PY}:{n.lineno} several `num_heads not in (...)` checks")
                    pub_heads = (frozenset(t), n.lineno)
            if n.left.id == "head_dim" and isinstance(n.ops[0], ast.NotEq) and isinstance(n.comparators[0], ast.Constant):
                d_qk = (n.comparators[0].value, n.lineno)
            if n.left.id == "swa_topk_lens" and isinstance(n.ops[0], ast.Is):
                lens_required = n.lineno
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) \
                and n.targets[0].id == "packed_row_bytes" and isinstance(n.value, ast.IfExp) \
                and isinstance(n.value.orelse, ast.Constant):
            test = n.value.test
            # `528 if kv_cache_format in ("fp8_dsv41", ...) else 584`: "fp8" must take the else branch.
            if isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.In):
                opts = test.comparators[0]
                names = [e.value for e in getattr(opts, "elts", []) if isinstance(e, ast.Constant)]
                if "fp8" not in names:
                    row_bytes = (n.value.orelse.value, n.lineno)
    if pub_heads is None:
        raise CannotEstablish(f"flashinfer/{CORE_PY}:{sm120.lineno} _trtllm_batch_decode_sparse_mla_dsv4_sm120: `num_heads not in (...)` check not found")
    if d_qk is None:
        raise CannotEstablish(f"flashinfer/{CORE_PY}:{sm120.lineno} _trtllm_batch_decode_sparse_mla_dsv4_sm120: `head_dim != <int>` check not found")
    if row_bytes is None:
        raise CannotEstablish(f"flashinfer/{CORE_PY}:{sm120.lineno} _trtllm_batch_decode_sparse_mla_dsv4_sm120: `packed_row_bytes = (... if kv_cache_format in (...) else <int>)` not found")
    if lens_required is None:
        raise CannotEstablish(f"flashinfer/{CORE_PY}:{sm120.lineno} _trtllm_batch_decode_sparse_mla_dsv4_sm120: `swa_topk_lens is None` check not found")

    norm = _py_func(src, CORE_PY, "_normalize_sparse_mla_indices_and_lens")
    topk_pos_line = None
    for n in ast.walk(norm):
        if isinstance(n, ast.If) and isinstance(n.test, ast.Compare) and isinstance(n.test.left, ast.Name) \
                and n.test.left.id == "sparse_topk" and isinstance(n.test.ops[0], ast.LtE) \
                and isinstance(n.test.comparators[0], ast.Constant) and n.test.comparators[0].value == 0 \
                and any(isinstance(s, ast.Raise) for s in n.body):
            topk_pos_line = n.lineno
    if topk_pos_line is None:
        raise CannotEstablish(f"flashinfer/{CORE_PY}:{norm.lineno} _normalize_sparse_mla_indices_and_lens: `if sparse_topk <= 0: raise` not found")

    heads_pub_rule = Rule("num_heads", "in", pub_heads[0], src.prov(CORE_PY, pub_heads[1], f"_trtllm_batch_decode_sparse_mla_dsv4_sm120 rejects num_heads not in {sorted(pub_heads[0])} (backend='sparse')", is_line=True))
    dqk_rule = Rule("d_qk", "in", frozenset({d_qk[0]}), src.prov(CORE_PY, d_qk[1], f"_trtllm_batch_decode_sparse_mla_dsv4_sm120 rejects head_dim != {d_qk[0]}", is_line=True))
    topk_pub_rule = Rule("topk", "positive", frozenset(), src.prov(CORE_PY, topk_pos_line, "_normalize_sparse_mla_indices_and_lens raises if sparse_topk <= 0 (every segment)", is_line=True))
    extra_topk_pub_rule = Rule("extra_topk", "positive", frozenset(), src.prov(CORE_PY, topk_pos_line, "_normalize_sparse_mla_indices_and_lens raises if sparse_topk <= 0 (extra segment)", is_line=True))
    sources["d_qk"] = dqk_rule.source
    sources["swa_topk_lens_required"] = src.prov(CORE_PY, lens_required, "SM120 DSv4 path raises if swa_topk_lens is None", is_line=True)

    # ---- bytes per token -------------------------------------------------------
    m = _find_one(src, KV_TRAITS_CUH, r"static_assert\(\s*KVCacheTraits<ModelType::DSV4>::BYTES_PER_TOKEN\s*==\s*(\d+)\s*\)\s*;", "DSV4 BYTES_PER_TOKEN static_assert")
    bpt = int(m.group(1))
    bpt_src = src.prov(KV_TRAITS_CUH, m.start(), f"static_assert KVCacheTraits<ModelType::DSV4>::BYTES_PER_TOKEN == {bpt}")
    if row_bytes[0] != bpt:
        raise CannotEstablish(f"{bpt_src} disagrees with flashinfer/{CORE_PY}:{row_bytes[1]} packed_row_bytes {row_bytes[0]} for kv_cache_format='fp8'")
    sources["bytes_per_token"] = f"{bpt_src}; flashinfer/{CORE_PY}:{row_bytes[1]} packed_row_bytes = {row_bytes[0]} for kv_cache_format='fp8'"

    # ---- policy (route selection) ---------------------------------------------
    cutoff, cut_line = _py_module_int(src, POLICY_PY, "_DECODE_MAX_TOKENS")
    model_dsv4, _ = _py_module_int(src, POLICY_PY, "_MODEL_TYPE_DSV4")
    kv_cls = [n for n in src.ast(POLICY_PY).body if isinstance(n, ast.ClassDef) and n.name == "KernelVariant"]
    if len(kv_cls) != 1:
        raise CannotEstablish(f"flashinfer/{POLICY_PY}: class KernelVariant not found")
    variants = {}
    for s in kv_cls[0].body:
        if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name) and isinstance(s.value, ast.Constant):
            variants[s.targets[0].id] = s.value.value
    need = ("DECODE_SPLITK", "PREFILL_SG", "PREFILL_MG", "PREFILL_MG_DUAL", "PREFILL_SWAPAB")
    if any(k not in variants for k in need):
        raise CannotEstablish(f"flashinfer/{POLICY_PY}:{kv_cls[0].lineno} KernelVariant lacks one of {need}")
    V_DECODE, V_SG, V_MG, V_DUAL, V_SWAP = (variants[k] for k in need)

    # decode_splitk_eligible: `return num_tokens <= _DECODE_MAX_TOKENS and <DECODE_SPLITK> in _candidates(...)`
    dse = _py_func(src, POLICY_PY, "decode_splitk_eligible")
    ok = False
    for n in ast.walk(dse):
        if isinstance(n, ast.Return) and isinstance(n.value, ast.BoolOp) and isinstance(n.value.op, ast.And):
            cmp_tok, cmp_cand = n.value.values[0], n.value.values[-1]
            if (isinstance(cmp_tok, ast.Compare) and isinstance(cmp_tok.left, ast.Name) and cmp_tok.left.id == "num_tokens"
                    and isinstance(cmp_tok.ops[0], ast.LtE) and isinstance(cmp_tok.comparators[0], ast.Name)
                    and cmp_tok.comparators[0].id == "_DECODE_MAX_TOKENS"
                    and isinstance(cmp_cand, ast.Compare) and isinstance(cmp_cand.ops[0], ast.In)
                    and isinstance(cmp_cand.left, ast.Constant) and cmp_cand.left.value == V_DECODE):
                ok = True
                dse_line = n.lineno
    if not ok:
        raise CannotEstablish(f"flashinfer/{POLICY_PY}:{dse.lineno} decode_splitk_eligible: `num_tokens <= _DECODE_MAX_TOKENS and {V_DECODE} in _candidates(...)` not found")

    # plan(): `variant = KernelVariant.DECODE_SPLITK if decode_ok else pf`
    plan = _py_func(src, POLICY_PY, "plan")
    plan_line = None
    for n in ast.walk(plan):
        if isinstance(n, ast.IfExp) and isinstance(n.body, ast.Attribute) and n.body.attr == "DECODE_SPLITK" \
                and isinstance(n.test, ast.Name) and n.test.id == "decode_ok" and isinstance(n.orelse, ast.Name) and n.orelse.id == "pf":
            plan_line = n.lineno
    if plan_line is None:
        raise CannotEstablish(f"flashinfer/{POLICY_PY}:{plan.lineno} plan(): `KernelVariant.DECODE_SPLITK if decode_ok else pf` not found")

    # filter_metadata_selection(): falls back to DECODE_SPLITK when legal for the actual metadata
    fms = _py_func(src, POLICY_PY, "filter_metadata_selection")
    fms_line = None
    for n in ast.walk(fms):
        if isinstance(n, ast.If) and isinstance(n.test, ast.Compare) and isinstance(n.test.ops[0], ast.In) \
                and isinstance(n.test.left, ast.Call) and isinstance(n.test.left.args[0], ast.Attribute) \
                and n.test.left.args[0].attr == "DECODE_SPLITK":
            fms_line = n.lineno
    if fms_line is None:
        raise CannotEstablish(f"flashinfer/{POLICY_PY}:{fms.lineno} filter_metadata_selection(): decode fallback not found")

    # prefill_variant(): auto order
    pv = _py_func(src, POLICY_PY, "prefill_variant")
    base_order = prepend = None
    for n in ast.walk(pv):
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            tgt = n.targets[0] if isinstance(n, ast.Assign) else n.target
            if isinstance(tgt, ast.Name) and tgt.id == "order" and isinstance(n.value, ast.Tuple):
                elts = n.value.elts
                if all(isinstance(e, ast.Attribute) for e in elts):
                    base_order = ([variants[e.attr] for e in elts], n.lineno)
                elif isinstance(elts[-1], ast.Starred) and all(isinstance(e, ast.Attribute) for e in elts[:-1]):
                    prepend = ([variants[e.attr] for e in elts[:-1]], n.lineno)
    if base_order is None:
        raise CannotEstablish(f"flashinfer/{POLICY_PY}:{pv.lineno} prefill_variant(): `order = (KernelVariant...., ...)` not found")
    order = (prepend[0] if prepend else []) + base_order[0]  # default prefill_impl (auto) keeps the prepend
    if V_MG not in order or V_DUAL not in order:
        raise CannotEstablish(f"flashinfer/{POLICY_PY}:{base_order[1]} prefill_variant(): MG / MG_DUAL not in auto order")

    # envelope cross-check (coarse pre-filter table, not authoritative)
    env_ok = False
    for n in ast.walk(src.ast(POLICY_PY)):
        if isinstance(n, ast.Dict):
            for k, v in zip(n.keys, n.values):
                if isinstance(k, ast.Name) and k.id == "_MODEL_TYPE_DSV4" and isinstance(v, ast.Call):
                    kw = {x.arg: x.value.value for x in v.keywords if isinstance(x.value, ast.Constant)}
                    if kw.get("bytes_per_token") != bpt or kw.get("d_qk") != d_qk[0]:
                        raise CannotEstablish(f"flashinfer/{POLICY_PY}:{v.lineno} _STATIC_DECODE_ENVELOPE[DSV4] {kw} disagrees with bytes_per_token={bpt}/d_qk={d_qk[0]}")
                    env_ok = True
    if not env_ok:
        raise CannotEstablish(f"flashinfer/{POLICY_PY}: _STATIC_DECODE_ENVELOPE[_MODEL_TYPE_DSV4] not found")

    # ---- C++ resolver -----------------------------------------------------------
    r0, r1 = _function_body(src, RESOLVE_CU, r"ExecutionPlan\s+resolve_attention\s*\(\s*const\s+AttentionMetadata\s*&\s*m\s*,", "resolve_attention")
    m = _find_one(src, RESOLVE_CU, r"m\.tokens\s*>\s*0\s*&&\s*m\.heads\s*>\s*0\s*&&\s*m\.heads\s*<=\s*(\w+)\s*&&\s*m\.topk\s*>\s*0",
                  "resolve_attention tokens/heads/topk check", r0, r1)
    max_heads_name = m.group(1)
    max_heads, max_heads_src = _constexpr_int(src, PLAN_H, max_heads_name)
    head_check = src.prov(RESOLVE_CU, m.start(), f"resolve_attention requires 0 < heads <= {max_heads_name} and topk > 0")
    heads_max_rule = Rule("num_heads", "max", frozenset({max_heads}), f"{head_check} ({max_heads_src})")
    topk_res_rule = Rule("topk", "positive", frozenset(), head_check)

    m = _find_one(src, RESOLVE_CU, r"const\s+bool\s+dual\s*=\s*m\.extra_topk\s*>\s*0\s*;", "`dual = m.extra_topk > 0`", r0, r1)
    extra_topk_res_rule = Rule("extra_topk", "positive", frozenset(), src.prov(RESOLVE_CU, m.start(), "resolve_attention: dual iff extra_topk > 0"))

    # main_page_supported / runtime_page (attention_plan.h)
    p0, p1 = _function_body(src, PLAN_H, r"constexpr\s+bool\s+runtime_page\s*\(\s*ModelType\s+model\s*\)", "runtime_page")
    rp = src.code(PLAN_H)[p0 + 1:p1].strip()
    mret = re.fullmatch(r"return\s+(.+);", rp, re.S)
    if not mret:
        raise CannotEstablish(f"flashinfer/{PLAN_H}:{src.line(PLAN_H, p0)} runtime_page: body not `return <cond>;`")
    runtime_main = _eval_cond(mret.group(1), {"model": _MODEL}, f"flashinfer/{PLAN_H}:{src.line(PLAN_H, p0)}")
    rp_src = src.prov(PLAN_H, p0, f"runtime_page(ModelType::{_MODEL}) == {str(runtime_main).lower()}")
    s0, s1 = _function_body(src, PLAN_H, r"constexpr\s+bool\s+main_page_supported\s*\(\s*ModelType\s+model\s*,\s*int\s+page\s*\)", "main_page_supported")
    mps = src.code(PLAN_H)[s0 + 1:s1].strip()
    mm = re.fullmatch(r"return\s+runtime_page\(\s*model\s*\)\s*\?\s*page\s*>\s*0\s*:\s*page\s*==\s*(\w+)\s*;", mps)
    if not mm:
        raise CannotEstablish(f"flashinfer/{PLAN_H}:{src.line(PLAN_H, s0)} main_page_supported: body not `return runtime_page(model) ? page > 0 : page == <const>;`")
    fixed_page, fixed_src = _constexpr_int(src, PLAN_H, mm.group(1))
    mps_src = src.prov(PLAN_H, s0, "main_page_supported")

    def page_rule(field: str, check_offset: int, what: str) -> Rule:
        check = src.prov(RESOLVE_CU, check_offset, what)
        if runtime_main:
            return Rule(field, "positive", frozenset(),
                        f"{check}; {mps_src} -> page > 0 since {rp_src} (runtime page size, not a template value)")
        return Rule(field, "in", frozenset({fixed_page}), f"{check}; {mps_src} -> page == {mm.group(1)} ({fixed_src})")

    m = _find_one(src, RESOLVE_CU, r"TVM_FFI_ICHECK\(\s*main_page_supported\(\s*mt\s*,\s*m\.page_size\s*\)\s*\)", "main page check", r0, r1)
    page_res_rule = page_rule("page_block_size", m.start(), "resolve_attention checks main_page_supported(mt, page_size)")
    m = _find_one(src, RESOLVE_CU, r"!dual\s*\|\|\s*\(\s*main_page_supported\(\s*mt\s*,\s*m\.extra_page_size\s*\)", "extra page check", r0, r1)
    extra_page_res_rule = page_rule("extra_page_block_size", m.start(), "resolve_attention checks main_page_supported(mt, extra_page_size) when dual")

    # decode branch exists, prefill branch requires topk multiple
    _find_one(src, RESOLVE_CU, r"if\s*\(\s*m\.variant\s*==\s*0\s*\)\s*\{", "decode (variant 0) branch", r0, r1)
    m = _find_one(src, RESOLVE_CU, r"m\.variant\s*>=\s*1\s*&&\s*m\.variant\s*<=\s*4\s*&&\s*m\.topk\s*%\s*(\d+)\s*==\s*0", "prefill topk multiple check", r0, r1)
    topk_mult = int(m.group(1))
    topk_mult_rule = Rule("topk", "multiple_of", frozenset({topk_mult}), src.prov(RESOLVE_CU, m.start(), f"resolve_attention prefill variants require topk % {topk_mult} == 0"))
    m = _find_one(src, RESOLVE_CU, r"TVM_FFI_ICHECK\(\s*has_prefill_heads\(\s*mt\s*,\s*m\.variant\s*,\s*m\.heads\s*\)\s*\)", "has_prefill_heads check", r0, r1)
    hph_check = src.prov(RESOLVE_CU, m.start(), "resolve_attention prefill requires has_prefill_heads(mt, variant, heads)")
    m = _find_one(src, RESOLVE_CU, r"m\.variant\s*==\s*(\d+)\s*\?\s*\(\s*mt\s*==\s*ModelType::DSV4\s*&&\s*dual\s*\)\s*:\s*!dual", "MG dual-metadata check", r0, r1)
    if int(m.group(1)) != V_DUAL:
        raise CannotEstablish(f"{src.prov(RESOLVE_CU, m.start(), 'MG dual check')} names variant {m.group(1)}, KernelVariant.PREFILL_MG_DUAL = {V_DUAL}")
    dual_sel_src = src.prov(RESOLVE_CU, m.start(), f"resolve_attention: MG variant {V_DUAL} iff DSV4 && dual, variant {V_MG} iff !dual")

    # C++ cutoff in metadata_candidates
    c0, c1 = _function_body(src, RESOLVE_CU, r"metadata_candidates\s*\(\s*ffi::Array<int64_t>\s+values", "metadata_candidates")
    m = _find_one(src, RESOLVE_CU, r"if\s*\(\s*variant\s*==\s*0\s*&&\s*m\.tokens\s*>\s*(\d+)\s*\)\s*continue\s*;", "decode token cutoff", c0, c1)
    cpp_cut = int(m.group(1))
    cpp_cut_src = src.prov(RESOLVE_CU, m.start(), f"metadata_candidates skips decode (variant 0) when tokens > {cpp_cut}")
    if cpp_cut != cutoff:
        raise CannotEstablish(f"{cpp_cut_src} disagrees with flashinfer/{POLICY_PY}:{cut_line} _DECODE_MAX_TOKENS = {cutoff}")
    sources["cutoff"] = (f"flashinfer/{POLICY_PY}:{cut_line} _DECODE_MAX_TOKENS = {cutoff}; "
                         f"flashinfer/{POLICY_PY}:{dse_line} decode_splitk_eligible (num_tokens <= _DECODE_MAX_TOKENS); {cpp_cut_src}")
    sources["route_selection"] = (f"flashinfer/{POLICY_PY}:{plan_line} plan() picks DECODE_SPLITK if decode-eligible else the prefill variant; "
                                  f"flashinfer/{POLICY_PY}:{fms_line} filter_metadata_selection falls back to decode when the selected variant is illegal")

    # has_prefill_heads: variant -> visit_prefill_heads template argument
    h0, h1 = _function_body(src, PLAN_H, r"inline\s+bool\s+has_prefill_heads\s*\(\s*ModelType\s+model\s*,\s*int\s+variant\s*,\s*int\s+heads\s*\)", "has_prefill_heads")
    hbody = src.code(PLAN_H)[h0:h1]
    explicit = {int(a): int(b) for a, b in re.findall(r"if\s*\(\s*variant\s*==\s*(\d+)\s*\)\s*return\s+visit_prefill_heads<ModelType::M,\s*(\d+)>", hbody)}
    dflt = re.search(r"\n\s*return\s+visit_prefill_heads<ModelType::M,\s*(\d+)>\(heads,\s*present\)\.supported\s*(\\|\n)", hbody)
    if not dflt or not re.search(rf"\bMODEL\({_MODEL}\)", hbody):
        raise CannotEstablish(f"flashinfer/{PLAN_H}:{src.line(PLAN_H, h0)} has_prefill_heads: MODEL({_MODEL}) / default visit_prefill_heads<M, N> not found")
    hph_src = src.prov(PLAN_H, h0, "has_prefill_heads")

    def heads_for_variant(v: int):
        tmpl = explicit.get(v, int(dflt.group(1)))
        heads, fb, lines, fl = _head_visitor(src, PLAN_H, "visit_prefill_heads", "PrefillLaunchResult", {"MT": _MODEL, "Variant": tmpl})
        if fb:
            raise CannotEstablish(f"flashinfer/{PLAN_H}:{fl} visit_prefill_heads has a runtime-head fallback; not modelled")
        return heads, tmpl, lines, fl

    # Variants that precede MG / MG_DUAL in the auto order must not serve DSV4.
    skipped = []
    for v in order:
        if v in (V_MG, V_DUAL):
            break
        hs, tmpl, _, fl = heads_for_variant(v)
        skipped.append(f"{v} (visit_prefill_heads<{_MODEL}, {tmpl}> empty, flashinfer/{PLAN_H}:{fl})")
        if hs:
            raise CannotEstablish(f"flashinfer/{PLAN_H}:{fl} visit_prefill_heads<{_MODEL}, {tmpl}> serves heads {sorted(hs)} for prefill variant {v}, "
                                  f"which precedes MG in flashinfer/{POLICY_PY}:{base_order[1]} auto order; not modelled")

    sources["prefill_variant_order"] = (f"flashinfer/{POLICY_PY}:{base_order[1]} prefill_variant auto order {order} "
                                        f"(SWAPAB={V_SWAP}, SG={V_SG}, MG={V_MG}, MG_DUAL={V_DUAL}); variants before MG serve no "
                                        f"{_MODEL} heads: " + "; ".join(skipped))

    def resolver_heads_rule(v: int) -> Rule:
        hs, tmpl, lines, fl = heads_for_variant(v)
        if not hs:
            raise CannotEstablish(f"flashinfer/{PLAN_H}:{fl} visit_prefill_heads<{_MODEL}, {tmpl}> serves no heads (variant {v})")
        return Rule("num_heads", "in", frozenset(hs),
                    f"{hph_check}; {hph_src} maps variant {v} -> visit_prefill_heads<{_MODEL}, {tmpl}>; "
                    f"flashinfer/{PLAN_H}:{','.join(map(str, lines))} HEAD(...) enabled for {_MODEL}")

    # ---- prefill dispatch (prefill_dispatch.cu) ----------------------------------
    d0, d1 = _function_body(src, PREFILL_DISPATCH_CU, r"PrefillLaunchResult\s+dispatch_prefill\s*\(\s*const\s+execution::AttentionParams\s*&", "dispatch_prefill")
    m_case = _find_one(src, PREFILL_DISPATCH_CU, r"case\s+execution::Implementation::MG\s*:\s*case\s+execution::Implementation::FullTile\s*:\s*\{", "MG/FullTile case", d0, d1)
    m_dual = _find_one(src, PREFILL_DISPATCH_CU, r"if\s*\(\s*m\.extra_topk\s*>\s*0\s*\)\s*return\s+dispatch_dsv4_dual\s*\(", "dual dispatch call", m_case.end(), d1)
    m_single = _find_one(src, PREFILL_DISPATCH_CU, r"if\s*\(\s*mt\s*==\s*ModelType::DSV4\s*\)\s*return\s+dispatch_dsv4_single\s*\(", "single dispatch call", m_case.end(), d1)
    disp_dual_src = src.prov(PREFILL_DISPATCH_CU, m_dual.start(), "dispatch_prefill MG/FullTile: extra_topk > 0 -> dispatch_dsv4_dual")
    disp_single_src = src.prov(PREFILL_DISPATCH_CU, m_single.start(), "dispatch_prefill MG/FullTile: DSV4 -> dispatch_dsv4_single")

    # ---- prefill launch (prefill_launch.cuh) ----------------------------------------
    # kernel meaning of template page 0: runtime page from cold params
    mk = _find_one(src, PREFILL_MG_CUH, r"PAGE_MAIN\s*==\s*0\s*\?\s*cold\.page_block_size\s*:\s*PAGE_MAIN", "runtime main page in MG kernel")
    main0_src = src.prov(PREFILL_MG_CUH, mk.start(), "template page 0 -> runtime cold.page_block_size")
    mk = _find_one(src, PREFILL_MG_CUH, r"PAGE_EXTRA\s*==\s*0\s*\?\s*cold\.extra_page_block_size\s*:\s*PAGE_EXTRA", "runtime extra page in MG kernel")
    extra0_src = src.prov(PREFILL_MG_CUH, mk.start(), "template extra page 0 -> runtime cold.extra_page_block_size")

    def main_page_templates(b0, b1, launcher_re, what):
        vals = [(int(x.group(1)), x.start()) for x in re.finditer(launcher_re, src.code(PREFILL_LAUNCH_CUH)[:b1]) if x.start() > b0]
        if not vals:
            raise CannotEstablish(f"flashinfer/{PREFILL_LAUNCH_CUH}:{src.line(PREFILL_LAUNCH_CUH, b0)} {what}: launcher with a literal main page template not found")
        return vals

    def dispatch_page_rule(vals, what) -> Rule:
        lines = ",".join(str(src.line(PREFILL_LAUNCH_CUH, o)) for _, o in vals)
        pages = {v for v, _ in vals}
        if pages == {0}:
            return Rule("page_block_size", "positive", frozenset(),
                        f"flashinfer/{PREFILL_LAUNCH_CUH}:{lines} {what} instantiates main PAGE_BLOCK_SIZE 0 = runtime page ({main0_src})")
        if 0 in pages:
            raise CannotEstablish(f"flashinfer/{PREFILL_LAUNCH_CUH}:{lines} {what}: mixed runtime/fixed main page templates not modelled")
        return Rule("page_block_size", "in", frozenset(pages), f"flashinfer/{PREFILL_LAUNCH_CUH}:{lines} {what} instantiates main PAGE_BLOCK_SIZE {sorted(pages)}")

    def dispatch_heads_rule(b0, b1, what) -> tuple[Rule, int]:
        mv = _find_one(src, PREFILL_LAUNCH_CUH, rf"execution::visit_prefill_heads<ModelType::{_MODEL},\s*(\d+)>\(\s*num_heads", f"{what} head visitor", b0, b1)
        tmpl = int(mv.group(1))
        hs, fb, lines, fl = _head_visitor(src, PLAN_H, "visit_prefill_heads", "PrefillLaunchResult", {"MT": _MODEL, "Variant": tmpl})
        if fb or not hs:
            raise CannotEstablish(f"flashinfer/{PLAN_H}:{fl} visit_prefill_heads<{_MODEL}, {tmpl}>: runtime fallback or empty head set")
        return Rule("num_heads", "in", frozenset(hs),
                    f"{src.prov(PREFILL_LAUNCH_CUH, mv.start(), f'{what} -> visit_prefill_heads<{_MODEL}, {tmpl}>')}; "
                    f"flashinfer/{PLAN_H}:{','.join(map(str, lines))} HEAD(...) enabled"), tmpl

    s0_, s1_ = _function_body(src, PREFILL_LAUNCH_CUH, r"PrefillLaunchResult\s+dispatch_dsv4_single\s*\(", "dispatch_dsv4_single")
    single_heads_rule, _ = dispatch_heads_rule(s0_, s1_, "dispatch_dsv4_single")
    single_page_rule = dispatch_page_rule(
        main_page_templates(s0_, s1_, rf"launch_prefill_mg<ModelType::{_MODEL},\s*QkComputeMode::\w+,\s*H,\s*(\d+)\s*,", "dispatch_dsv4_single"),
        "dispatch_dsv4_single")

    u0, u1 = _function_body(src, PREFILL_LAUNCH_CUH, r"PrefillLaunchResult\s+dispatch_dsv4_dual\s*\(", "dispatch_dsv4_dual")
    dual_heads_rule, _ = dispatch_heads_rule(u0, u1, "dispatch_dsv4_dual")
    dual_page_rule = dispatch_page_rule(
        main_page_templates(u0, u1, rf"launch_prefill_mg_dual(?:_fulltile)?<ModelType::{_MODEL},\s*(?:QkComputeMode::\w+,\s*)?H,\s*(\d+)\s*,\s*P\s*,", "dispatch_dsv4_dual"),
        "dispatch_dsv4_dual")
    ubody = src.code(PREFILL_LAUNCH_CUH)[u0 + 1:u1]
    if not re.search(r"auto\s+page\s*=\s*\[&\]\s*\(\s*auto\s+pbs\s*\)", ubody) or "decltype(pbs)::value" not in ubody:
        raise CannotEstablish(f"flashinfer/{PREFILL_LAUNCH_CUH}:{src.line(PREFILL_LAUNCH_CUH, u0)} dispatch_dsv4_dual: `page = [&](auto pbs)` extra-page visitor not found")
    lam_end = _match(ubody, ubody.index("{", re.search(r"auto\s+page\s*=\s*\[&\]", ubody).end()), "{", "}")
    after = ubody[lam_end + 1:]
    after_off = u0 + 1 + lam_end + 1
    if not after.lstrip().startswith(";"):
        raise CannotEstablish(f"flashinfer/{PREFILL_LAUNCH_CUH}:{src.line(PREFILL_LAUNCH_CUH, after_off)} dispatch_dsv4_dual: lambda not terminated as expected")
    after_off += after.index(";") + 1
    after = after[after.index(";") + 1:]
    stmts = [(x.group(0), x.start()) for x in re.finditer(r"[^;]*;", after)]
    specials, fallback, fb_off = {}, None, None
    for i, (stmt, o) in enumerate(stmts):
        s = " ".join(stmt.split())
        sp = re.fullmatch(r"if \( ?cold\.extra_page_block_size == (\d+) ?\) return page\(std::integral_constant<int, (\d+)>\{\}\);", s)
        if sp and fallback is None:
            if sp.group(1) != sp.group(2):
                raise CannotEstablish(f"flashinfer/{PREFILL_LAUNCH_CUH}:{src.line(PREFILL_LAUNCH_CUH, after_off + o)} extra page compared to {sp.group(1)} but dispatched as {sp.group(2)}")
            specials[int(sp.group(1))] = src.line(PREFILL_LAUNCH_CUH, after_off + o + len(stmt) - len(stmt.lstrip()))
            continue
        if i == len(stmts) - 1 and re.fullmatch(r"return page\(std::integral_constant<int, 0>\{\}\);", s):
            fallback, fb_off = "runtime", after_off + o
            continue
        if i == len(stmts) - 1 and s == "return false;":
            fallback, fb_off = "none", after_off + o
            continue
        raise CannotEstablish(f"flashinfer/{PREFILL_LAUNCH_CUH}:{src.line(PREFILL_LAUNCH_CUH, after_off + o)} dispatch_dsv4_dual: unexpected statement {s!r}")
    if fallback is None or after[stmts[-1][1] + len(stmts[-1][0]):].strip():
        raise CannotEstablish(f"flashinfer/{PREFILL_LAUNCH_CUH}:{src.line(PREFILL_LAUNCH_CUH, u1)} dispatch_dsv4_dual: final extra-page statement not found")
    fb_line = src.line(PREFILL_LAUNCH_CUH, fb_off + len(after[stmts[-1][1]:]) - len(after[stmts[-1][1]:].lstrip()))
    spec_txt = ", ".join(f"{p} (line {ln})" for p, ln in sorted(specials.items())) or "none"
    if fallback == "runtime":
        dual_extra_page_rule = Rule("extra_page_block_size", "positive", frozenset(),
                                    f"flashinfer/{PREFILL_LAUNCH_CUH}:{fb_line} dispatch_dsv4_dual falls back to extra page template 0 = runtime "
                                    f"({extra0_src}); compile-time specializations: {spec_txt}")
    else:
        if not specials:
            raise CannotEstablish(f"flashinfer/{PREFILL_LAUNCH_CUH}:{fb_line} dispatch_dsv4_dual accepts no extra page size")
        dual_extra_page_rule = Rule("extra_page_block_size", "in", frozenset(specials),
                                    f"flashinfer/{PREFILL_LAUNCH_CUH}:{fb_line} dispatch_dsv4_dual returns false for other extra pages; accepted: {spec_txt}")

    # ---- decode dispatch ----------------------------------------------------------------
    e0, e1 = _function_body(src, DECODE_DISPATCH_CU, r"cudaError_t\s+dispatch_decode\s*\(", "dispatch_decode")
    mdec = _find_one(src, DECODE_DISPATCH_CU, rf"\bMODEL\({_MODEL}\)", f"MODEL({_MODEL})", e0, e1)
    _find_one(src, DECODE_DISPATCH_CU, r"visit_decode_heads<ModelType::M>\(\s*plan\.specialized_heads", "visit_decode_heads in MODEL macro", e0, e1)
    dec_src = src.prov(DECODE_DISPATCH_CU, mdec.start(), f"dispatch_decode MODEL({_MODEL})")
    dheads, dfb, dlines, dfl = _head_visitor(src, PLAN_H, "visit_decode_heads", "auto", {"MT": _MODEL})
    decode_head_rules: list[Rule] = []
    if dfb:
        notes.append(f"Decode kernel: visit_decode_heads (flashinfer/{PLAN_H}:{dfl}) specializes heads {sorted(dheads)} and falls back "
                     f"to a runtime-head instance for other counts, so the kernel itself adds no head-set rule.")
    else:
        decode_head_rules.append(Rule("num_heads", "in", frozenset(dheads), f"flashinfer/{PLAN_H}:{dfl} visit_decode_heads<{_MODEL}> without runtime fallback"))
    ml = _find_one(src, DECODE_LAUNCH_CUH,
                   r"if\s+constexpr\s*\(\s*MT\s*==\s*ModelType::DSV4\s*\)\s*return\s+Dsv4PageDivisors\{\s*flashinfer::uint_fastdiv\(\s*uint32_t\(\s*p\.page_size\s*\)\s*\)\s*,\s*flashinfer::uint_fastdiv\(\s*uint32_t\(\s*p\.extra_page_size\s*\)\s*\)\s*\}",
                   "DSV4 runtime page divisors in launch_decode")
    dec_page_src = src.prov(DECODE_LAUNCH_CUH, ml.start(), "launch_decode<DSV4> takes main and extra page sizes as runtime divisors")
    dec_page_rule = Rule("page_block_size", "positive", frozenset(), dec_page_src) if runtime_main else page_res_rule
    dec_extra_rule = Rule("extra_page_block_size", "positive", frozenset(), dec_page_src) if runtime_main else extra_page_res_rule

    # ---- routes -----------------------------------------------------------------------
    common = (dqk_rule, heads_pub_rule, heads_max_rule, topk_pub_rule, topk_res_rule)
    sel_decode = (f"flashinfer/{POLICY_PY}:{dse_line} decode_splitk_eligible: num_tokens <= _DECODE_MAX_TOKENS ({cutoff}, line {cut_line}); "
                  f"flashinfer/{POLICY_PY}:{plan_line} plan() prefers decode; {cpp_cut_src}; {dec_src}")
    sel_prefill = (f"flashinfer/{POLICY_PY}:{plan_line} plan(): tokens > {cutoff} are not decode-eligible -> prefill_variant "
                   f"(flashinfer/{POLICY_PY}:{base_order[1]} auto order {order}); {cpp_cut_src}")
    routes = (
        Route(ROUTE_DECODE, 1, cutoff, "single",
              common + tuple(decode_head_rules) + (page_res_rule, dec_page_rule), sel_decode),
        Route(ROUTE_DECODE, 1, cutoff, "dual",
              common + tuple(decode_head_rules) + (page_res_rule, dec_page_rule, extra_topk_pub_rule, extra_topk_res_rule,
                                                   extra_page_res_rule, dec_extra_rule), sel_decode),
        Route(ROUTE_SINGLE, cutoff + 1, None, "single",
              common + (resolver_heads_rule(V_MG), single_heads_rule, topk_mult_rule, page_res_rule, single_page_rule),
              f"{sel_prefill}; {dual_sel_src}; {disp_single_src}"),
        Route(ROUTE_DUAL, cutoff + 1, None, "dual",
              common + (resolver_heads_rule(V_DUAL), dual_heads_rule, topk_mult_rule, page_res_rule, dual_page_rule,
                        extra_topk_pub_rule, extra_topk_res_rule, extra_page_res_rule, dual_extra_page_rule),
              f"{sel_prefill}; {dual_sel_src}; {disp_dual_src}"),
    )
    _check_coverage(routes)

    notes += [
        "Only kv_cache_format='fp8' (ModelType::DSV4, 584 B/token, kv_scale_format='auto', backend='sparse') is modelled; "
        "nvfp4 (384 B), fp8_dsv41 / fp8_dsv41_fp4_ca (528 B) and backend='cake' have separate rules not read here.",
        f"Decode-form calls (num_tokens <= {cutoff}) may be sent to a prefill variant by a calibration profile "
        f"(_policy.profile_selection); filter_metadata_selection ({POLICY_PY}:{fms_line}) falls back to decode when that variant is "
        "illegal, so acceptance there is modelled as decode legality (every call the prefill rules accept, the decode rules accept too).",
        "Layout conditions are not modelled: DSV4 rows must be tightly packed (row stride == bytes_per_token, footer scales), "
        "page strides must be multiples of 16 bytes and >= page_size*584 (with a tightly packed cache an odd page size gives "
        "584*odd % 16 == 8 and is refused), 16-byte aligned data pointers, and prefill variants require dense, contiguous index rows "
        "(indices_stride == topk, extra_indices_stride == extra_topk; attention_resolve.cu / attention_binding.cu).",
        "Device-dependent checks are not evaluated: resolved shared memory <= device opt-in maximum (attention_resolve.cu), "
        "workspace/scratch sizing, and the CUDA-graph rule that a functional plan must be warmed up with identical tensor "
        "signatures before capture (_prepared._functional_plan).",
        "Overflow guards not modelled: num_tokens <= INT_MAX/8 and topk <= INT_MAX - 64 - extra_topk (attention_resolve.cu).",
        "Public-entry conditions not expressible as Rule fields: BF16 query, bmm2_scale == 1.0, swa_topk_lens required "
        "(vLLM passes it), extra cache must also be 584-byte packed rows.",
        "Nothing is compiled or executed; rules come from source text only.",
    ]
    return FlashInferRules(
        version=version,
        reader="source (0.7.x layout)",
        bytes_per_token=bpt,
        routes=routes,
        sources=sources,
        notes=notes,
    )


def _check_coverage(routes) -> None:
    for cache in ("single", "dual"):
        spans = sorted((r.min_tokens, r.max_tokens) for r in routes if r.cache in (cache, "any"))
        nxt = 1
        for lo, hi in spans:
            if lo > nxt:
                raise CannotEstablish(f"routes leave num_tokens {nxt}..{lo - 1} uncovered for {cache} cache")
            if hi is None:
                nxt = None
                break
            nxt = max(nxt, hi + 1)
        if nxt is not None:
            raise CannotEstablish(f"routes leave num_tokens >= {nxt} uncovered for {cache} cache")


# --------------------------------------------------------------------------
# Which reader: by the installed layout and version
# --------------------------------------------------------------------------


def read_flashinfer_rules(root: Path, version: str) -> FlashInferRules:
    """The SM120 DSv4 routes of the FlashInfer at ``root`` (its package directory)."""
    if (root / _FI06_PY).is_file():
        if not version.startswith("0.6."):
            raise CannotEstablish(
                f"FlashInfer {version}'s SM120 rules: its layout ({_FI06_PY}) is the 0.6.x one, "
                "and this self-test reads that layout only for 0.6.x"
            )
        return read_flashinfer_06x(root, version)
    if (root / _FI07_PY_DIR).is_dir():
        if not version.startswith("0.7."):
            raise CannotEstablish(
                f"FlashInfer {version}'s SM120 rules: its layout ({_FI07_PY_DIR}/) is the 0.7.x one, "
                "and this self-test reads that layout only for 0.7.x"
            )
        return read_flashinfer_07x(root, version)
    raise CannotEstablish(
        f"FlashInfer {version}'s SM120 rules: neither flashinfer/{_FI06_PY} nor "
        f"flashinfer/{_FI07_PY_DIR}/ is installed (no SM120 sparse-MLA support, or a new layout)"
    )


def _flashinfer_root() -> Path:
    """The installed ``flashinfer`` package directory, found without importing it."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        raise SelftestError("FlashInfer is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _flashinfer_version() -> str:
    from importlib import metadata

    for dist in ("flashinfer-python", "flashinfer"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise CannotEstablish("FlashInfer's version (no flashinfer-python distribution metadata)")


def collect_flashinfer_rules() -> FlashInferRules:
    """The installed FlashInfer's rules, read from its sources; with its own decode
    predicate beside them when ``import flashinfer`` works (0.6.x)."""
    version = _flashinfer_version()
    root = _flashinfer_root()
    rules = read_flashinfer_rules(root, version)
    rules.sources["version"] = "importlib.metadata (flashinfer-python)"
    rules.sources["reader"] = f"{root}: read as text, not executed"
    if not (root / _FI06_PY).is_file():
        rules.notes.append("FlashInfer's own code was not executed: every rule was read from its sources")
        return rules
    try:
        import flashinfer  # noqa: F401  (queries the GPU at import time on some hosts)

        module = importlib.import_module("flashinfer.mla._sparse_mla_sm120")
        dispatchable = getattr(module, _FI06_PREDICATE)
    except Exception as exc:
        rules.notes.append(
            "FlashInfer's own decode predicate was not executed: "
            + _one_line(f"import failed: {type(exc).__name__}: {exc}", limit=200)
            + "; the decode kernel's rules were read from its source"
        )
    else:

        def predicate(call: Call) -> bool:
            return bool(
                dispatchable(
                    call.max_tokens,
                    call.num_heads,
                    call.topk,
                    call.d_qk,
                    call.page_block_size,
                    call.extra_topk,
                )
            )

        rules.predicate = predicate
        rules.predicate_name = f"flashinfer.mla._sparse_mla_sm120.{_FI06_PREDICATE}"
    return rules


# --------------------------------------------------------------------------
# vLLM facts: what the installed vLLM will ask the kernels for, on this rank
# --------------------------------------------------------------------------

LAYER_SWA = "sliding-window only"


def layer_name(ratio: int) -> str:
    return LAYER_SWA if ratio == 0 else f"compressed ratio {ratio}"


@dataclasses.dataclass
class VllmFacts:
    tensor_parallel_size: int
    num_heads: int
    local_heads: int
    padded_heads: int
    sliding_window: int  # the decode calls' topk
    prefill_width: int  # the prefill calls' topk
    decode_query_len: int  # a request of more query tokens is a prefill
    swa_page_block_size: int
    # (compress_ratio, compressed page tokens) per layer type; ratio 0: no compressed cache.
    layer_types: tuple[tuple[int, int], ...]
    extra_topk: int
    d_qk: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefill_chunk_requests: int
    capture_sizes: tuple[int, ...]
    kv_cache_dtype: str = "auto"
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    scope_notes: list[str] = dataclasses.field(default_factory=list)

    def facts(self) -> list[Fact]:
        out = []
        for field in dataclasses.fields(self):
            if field.name in ("sources", "scope_notes"):
                continue
            value = getattr(self, field.name)
            if field.name == "layer_types":
                value = {layer_name(r): (f"compressed page {p}" if r else "no compressed cache") for r, p in value}
            elif field.name == "capture_sizes":
                value = f"{len(value)} sizes, {value[0]}..{value[-1]}" if value else "none (no CUDA graphs)"
            out.append(Fact(f"vllm.{field.name}", value, self.sources.get(field.name, "")))
        return out


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

    def line_with(self, obj: Any, needle: str) -> str:
        """``path:line`` of the first line of ``obj``'s source holding ``needle``."""
        lines, start = inspect.getsourcelines(obj)
        for i, text in enumerate(lines):
            if needle in text:
                return self.at(obj, start + i)
        raise CannotEstablish(f"'{needle}' in {self.at(obj)}")


def _parse_serve_argv(argv: list[str]) -> argparse.Namespace:
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


# What the SWA metadata builder's __init__ sets that this self-test reads.
_BUILDER_ATTRS = ("decode_threshold", "window_size", "max_image_tokens", "prefill_index_width")


def _builder_rule(builder: type, vllm_config: Any, loc: _Locator) -> tuple[types.SimpleNamespace, dict[str, str]]:
    """Run the SM120 SWA metadata builder's own statements on this config.

    ``builder`` is the class the SM120 backend uses
    (``swa_backend_cls.get_builder_cls()``). The statements that set
    ``decode_threshold``, ``window_size`` and ``prefill_index_width`` are
    taken from the ``__init__`` that defines them and executed against this
    VllmConfig; a subclass ``__init__`` between ``builder`` and it that sets
    any of them again cannot be modelled, and fails.
    """
    definer = None
    for cls in builder.__mro__:
        init = vars(cls).get("__init__")
        if init is None:
            continue
        func = _function_ast(init)
        assigned = {a for s in func.body for a in _BUILDER_ATTRS if _assigns(s, a, True)}
        if assigned and "prefill_index_width" in assigned:
            definer = (cls, init, func)
            break
        if assigned:
            raise CannotEstablish(
                f"{cls.__name__}.__init__ ({loc.at(init)}) sets {', '.join(sorted(assigned))} "
                f"after the builder that defines the prefill width: not modelled"
            )
    if definer is None:
        raise CannotEstablish(f"the prefill width rule (self.prefill_index_width = ...) in {builder.__name__}'s __init__ chain")
    cls, init, func = definer
    where = loc.path(init)
    start = inspect.getsourcelines(init)[1]
    body = func.body
    first = next((i for i, s in enumerate(body) if _assigns(s, "spec_config", False)), None)
    last = next((i for i, s in enumerate(body) if _assigns(s, "prefill_index_width", True)), None)
    if first is None or last is None or last < first:
        raise CannotEstablish(f"vLLM's decode threshold and prefill width rules in {where}")
    stmts = body[first : last + 1]
    for stmt in stmts:
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Assert)):
            raise CannotEstablish(
                f"vLLM's prefill width rule: an unexpected statement at {where}:{start + stmt.lineno - 1}"
            )
    fake_self = types.SimpleNamespace(vllm_config=vllm_config)
    code = compile(ast.Module(body=stmts, type_ignores=[]), where, "exec")
    exec(code, {"self": fake_self})  # noqa: S102  (vLLM's own statements)
    lines = {a: start + s.lineno - 1 for s in stmts for a in _BUILDER_ATTRS if _assigns(s, a, True)}
    used = (
        f"{builder.__name__} (the SM120 SWA backend's builder, {loc.at(builder)})"
        + ("" if cls is builder else f", __init__ inherited from {cls.__name__}")
    )
    sources = {
        "decode_query_len": f"{where}:{lines.get('decode_threshold', start)} decode_threshold, run on this config; {used}",
        "sliding_window": f"{where}:{lines.get('window_size', start)} window_size: the decode calls' topk; {used}",
        "prefill_width": (
            f"{where}:{lines['prefill_index_width']} prefill_index_width, run on this config "
            f"(max_image_tokens={fake_self.max_image_tokens}); {used}"
        ),
    }
    return fake_self, sources


def _function_ast(fn: Any) -> ast.FunctionDef:
    lines, _ = inspect.getsourcelines(fn)
    func = ast.parse(textwrap.dedent("".join(lines))).body[0]
    assert isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef))
    return func  # type: ignore[return-value]


def _assigns(stmt: ast.stmt, name: str, on_self: bool) -> bool:
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, ast.AnnAssign):
        targets = [stmt.target]
    for t in targets:
        if on_self and isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
            if t.value.id == "self" and t.attr == name:
                return True
        if not on_self and isinstance(t, ast.Name) and t.id == name:
            return True
    return False


def _swa_page_block_size(attn_mod: Any, sm120_cls: type, loc: _Locator) -> tuple[int, str]:
    """The SWA page size the SM120 attention class builds its cache with.

    Reads the ``block_size=`` argument of ``DeepseekV4SWACache(...)`` in
    DeepseekV4Attention's source: a literal is the page size (unpatched
    tree); ``self.<attr>`` is resolved on the SM120 class.
    """
    base = attn_mod.DeepseekV4Attention
    where = loc.path(attn_mod)
    tree = ast.parse(inspect.getsource(attn_mod))
    cls_node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == base.__name__), None)
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
        raise CannotEstablish(f"the SWA page size: no DeepseekV4SWACache(...) call in {where}")
    kw = next((k for k in call.keywords if k.arg == "block_size"), None)
    if kw is None:
        cache_cls = attn_mod.DeepseekV4SWACache
        default = inspect.signature(cache_cls.__init__).parameters["block_size"].default
        return int(default), (
            f"{where}:{call.lineno} DeepseekV4SWACache(...) without block_size; its default in {loc.path(cache_cls)}"
        )
    value = kw.value
    if isinstance(value, ast.Constant) and isinstance(value.value, int):
        return int(value.value), f"{where}:{value.lineno} hard-coded block_size={value.value} in DeepseekV4SWACache(...)"
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self":
        attr = value.attr
        owner = next((k for k in sm120_cls.__mro__ if attr in vars(k)), None)
        if owner is None:
            raise CannotEstablish(f"the SWA page size: {where}:{value.lineno} uses self.{attr}, which {sm120_cls.__name__} does not define")
        page = getattr(sm120_cls, attr)
        return int(page), (
            f"{sm120_cls.__name__}.{attr} (defined on {owner.__name__}, "
            f"{_attr_line(owner, attr, loc)}), used at {where}:{value.lineno}"
        )
    raise CannotEstablish(f"the SWA page size: {where}:{value.lineno} block_size={ast.unparse(value)}")


def _attr_line(cls: type, attr: str, loc: _Locator) -> str:
    lines, start = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    for node in tree.body[0].body:  # type: ignore[attr-defined]
        if _assigns(node, attr, False):
            return loc.at(cls, start + node.lineno - 1)
    return loc.at(cls)


def _engine_config(args: argparse.Namespace) -> tuple[Any, Any]:
    """vLLM's VllmConfig for this argv, as ``vllm serve`` builds it, and the
    compilation config as the argv gave it (before the platform adjusts it)."""
    import copy

    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    try:
        engine_args = EngineArgs.from_cli_args(args)
        requested = copy.deepcopy(engine_args.compilation_config)
        vllm_config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    except Exception as exc:
        hint = ""
        if "infer device type" in str(exc):
            hint = " (on a host without a GPU, set VLLM_TARGET_DEVICE=cpu)"
        raise SelftestError(
            "vLLM refuses this argv: " + _one_line(f"{type(exc).__name__}: {exc}", limit=400) + hint
        ) from None
    return vllm_config, requested


def _capture_sizes(vllm_config: Any, requested: Any, loc: _Locator) -> tuple[tuple[int, ...], str, list[str]]:
    """The CUDA-graph capture sizes this engine will use on the GPU."""
    from vllm.config import VllmConfig
    from vllm.platforms import current_platform

    rule = loc.at(VllmConfig._set_cudagraph_sizes)
    if current_platform.is_cuda():
        sizes = tuple(vllm_config.compilation_config.cudagraph_capture_sizes or ())
        return sizes, f"VllmConfig.compilation_config.cudagraph_capture_sizes ({rule})", []
    # This host's platform turns CUDA graphs off; run vLLM's own sizing rule
    # on the compilation config the argv asked for, as a CUDA platform would.
    import copy

    shadow = copy.copy(vllm_config)
    object.__setattr__(shadow, "compilation_config", requested)
    VllmConfig._set_cudagraph_sizes(shadow)
    sizes = tuple(requested.cudagraph_capture_sizes or ())
    note = (
        f"capture sizes: this host's platform ({current_platform.device_type}) has no CUDA graphs; "
        f"they were computed with vLLM's VllmConfig._set_cudagraph_sizes ({rule}) on the argv's "
        "compilation config, as on a CUDA platform that is not data-centre Blackwell"
    )
    return sizes, f"VllmConfig._set_cudagraph_sizes ({rule}), run on the argv's compilation config", [note]


def collect_vllm_facts(serve_argv: Sequence[str]) -> tuple[VllmFacts, list[Fact]]:
    """Facts from the installed vLLM tree for this exact serve argv."""
    argv = _strip_serve_prefix(serve_argv)
    try:
        args = _parse_serve_argv(argv)
    except ImportError as exc:
        raise SelftestError(f"cannot import vLLM's serve parser: {exc}") from None
    model = getattr(args, "model", None)
    if not model:
        raise SelftestError("vllm serve argv names no model")
    _check_model_dir(model)
    vllm_config, requested = _engine_config(args)
    model_config = vllm_config.model_config

    import vllm
    from vllm.models.deepseek_v41 import attention as attn_mod
    from vllm.models.deepseek_v41.nvidia import flashinfer_sparse as fs
    from vllm.platforms import current_platform

    loc = _Locator()
    hf = model_config.hf_config
    sm120_cls = fs.DeepseekV4FlashInferSM120Attention
    extra = [
        Fact("vllm.version", getattr(vllm, "__version__", "unknown"), "vllm.__version__"),
        Fact("vllm.model", str(model), "vllm serve argv (model_tag / --model)"),
        Fact("vllm.architectures", list(getattr(model_config, "architectures", []) or []), "ModelConfig.architectures"),
    ]
    sources: dict[str, str] = {}
    scope: list[str] = []

    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    sources["tensor_parallel_size"] = "VllmConfig.parallel_config.tensor_parallel_size"
    heads = int(hf.num_attention_heads)
    sources["num_heads"] = "ModelConfig.hf_config.num_attention_heads"
    if tp <= 0 or heads % tp:
        raise SelftestError(f"tensor parallel size {tp} does not divide {heads} attention heads")
    local = heads // tp
    sources["local_heads"] = f"num_heads // tensor_parallel_size (DeepseekV4Attention.__init__, {loc.path(attn_mod)})"
    try:
        padded = int(fs._pad_to_supported_q_heads(local))
    except ValueError as exc:
        raise SelftestError(_one_line(str(exc))) from None
    sources["padded_heads"] = f"_pad_to_supported_q_heads({local}) ({loc.at(fs._pad_to_supported_q_heads)})"

    spec = vllm_config.speculative_config
    if spec is not None and getattr(spec, "use_dspark", lambda: False)():
        raise CannotEstablish("the decode calls' topk under DSpark speculative decoding (its non-causal SWA width is not modelled)")
    builder = sm120_cls.swa_backend_cls.get_builder_cls()
    rule, rule_sources = _builder_rule(builder, vllm_config, loc)
    sources.update(rule_sources)

    page, sources["swa_page_block_size"] = _swa_page_block_size(attn_mod, sm120_cls, loc)

    backend = sm120_cls.backend_cls
    sizes = list(backend.get_supported_kernel_block_sizes())
    block = next((s for s in sizes if isinstance(s, int)), None)
    ratios = sorted({int(r) for r in (getattr(hf, "compress_ratios", None) or [0])})
    if any(ratios) and block is None:
        raise CannotEstablish(f"the compressed page: {backend.__name__}.get_supported_kernel_block_sizes() returned {sizes!r}")
    layer_types = tuple((r, int(block) // r if r else 0) for r in ratios)
    sources["layer_types"] = (
        f"ModelConfig.hf_config.compress_ratios; compressed page = kernel block "
        f"{backend.__name__}.get_supported_kernel_block_sizes() = {sizes} "
        f"({loc.at(backend.get_supported_kernel_block_sizes)}) // ratio, as "
        f"{loc.line_with(sm120_cls._forward_decode, '// self.compress_ratio')} computes it"
    )

    extra_topk = getattr(hf, "index_topk", None)
    if extra_topk is None:
        raise CannotEstablish("the compressed layers' topk: the checkpoint's config has no index_topk")
    sources["extra_topk"] = "ModelConfig.hf_config.index_topk"
    d_qk = int(model_config.get_head_size())
    sources["d_qk"] = "ModelConfig.get_head_size()"

    sched = vllm_config.scheduler_config
    sources["max_num_seqs"] = "VllmConfig.scheduler_config.max_num_seqs"
    sources["max_num_batched_tokens"] = "VllmConfig.scheduler_config.max_num_batched_tokens"
    sources["max_model_len"] = "VllmConfig.model_config.max_model_len"
    if not current_platform.is_cuda():
        scope.append(
            f"batch limits: this host's platform ({current_platform.device_type}) sets vLLM's defaults for "
            "what the argv leaves unset (EngineArgs.get_batch_defaults); a GPU host's differ"
        )
    captures, sources["capture_sizes"], notes = _capture_sizes(vllm_config, requested, loc)
    scope += notes
    chunk = int(sm120_cls.PREFILL_CHUNK_SIZE)
    sources["prefill_chunk_requests"] = (
        f"{sm120_cls.__name__}.PREFILL_CHUNK_SIZE ({_attr_line(attn_mod.DeepseekV4Attention, 'PREFILL_CHUNK_SIZE', loc)}); "
        f"chunks at {loc.line_with(sm120_cls._forward_prefill, 'PREFILL_CHUNK_SIZE')}"
    )
    kv_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    sources["kv_cache_dtype"] = "VllmConfig.cache_config.cache_dtype"
    return (
        VllmFacts(
            tensor_parallel_size=tp,
            num_heads=heads,
            local_heads=local,
            padded_heads=padded,
            sliding_window=int(rule.window_size),
            prefill_width=int(rule.prefill_index_width),
            decode_query_len=int(rule.decode_threshold),
            swa_page_block_size=page,
            layer_types=layer_types,
            extra_topk=int(extra_topk),
            d_qk=d_qk,
            max_num_seqs=int(sched.max_num_seqs),
            max_num_batched_tokens=int(sched.max_num_batched_tokens),
            max_model_len=int(model_config.max_model_len),
            prefill_chunk_requests=chunk,
            capture_sizes=captures,
            kv_cache_dtype=kv_dtype,
            sources=sources,
            scope_notes=scope,
        ),
        extra,
    )


# --------------------------------------------------------------------------
# The calls vLLM makes, and the route each takes
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    """One kind of attention call: every call of this kind carries these shapes,
    with a query of ``min_tokens..max_tokens`` tokens."""

    kind: str  # "decode" or "prefill"
    layer: str
    min_tokens: int
    max_tokens: int
    num_heads: int
    topk: int
    page_block_size: int
    extra_topk: int  # 0 without a compressed cache
    extra_page_block_size: int  # 0 without a compressed cache
    d_qk: int

    @property
    def has_extra(self) -> bool:
        return self.extra_page_block_size > 0


def plan_calls(vf: VllmFacts) -> list[Call]:
    """Every attention call this rank's engine makes on the SM120 backend.

    Decode: one call holds every decode token of a step, up to max_num_seqs
    requests of up to decode_query_len tokens (capped by max_num_batched_tokens),
    and a CUDA graph is captured at each capture size. Prefill: one call per
    chunk of PREFILL_CHUNK_SIZE requests with all their tokens; a prefill
    request has more than decode_query_len tokens, and a step at most
    max_num_batched_tokens.
    """
    decode_max = max(
        min(vf.max_num_seqs * vf.decode_query_len, vf.max_num_batched_tokens),
        max(vf.capture_sizes, default=0),
    )
    prefill_min = vf.decode_query_len + 1
    prefill_max = min(vf.max_num_batched_tokens, vf.prefill_chunk_requests * vf.max_model_len)
    calls = []
    for ratio, page in vf.layer_types:
        common = dict(
            layer=layer_name(ratio),
            num_heads=vf.padded_heads,
            page_block_size=vf.swa_page_block_size,
            extra_topk=vf.extra_topk if ratio else 0,
            extra_page_block_size=page if ratio else 0,
            d_qk=vf.d_qk,
        )
        calls.append(Call(kind="decode", min_tokens=1, max_tokens=decode_max, topk=vf.sliding_window, **common))
        if prefill_min <= prefill_max:
            calls.append(
                Call(kind="prefill", min_tokens=prefill_min, max_tokens=prefill_max, topk=vf.prefill_width, **common)
            )
    return calls


@dataclasses.dataclass
class Check:
    """The part of one call kind that one route takes, and what it found."""

    route: str
    call: Call
    min_tokens: int
    max_tokens: int
    reasons: list[str]
    kernel: list[str] = dataclasses.field(default_factory=list)  # "<tokens>: ran" / "<tokens>: raised ..."

    @property
    def label(self) -> str:
        return f"{self.call.layer}, {self.call.kind} {self.min_tokens}..{self.max_tokens}"

    def as_dict(self) -> dict[str, Any]:
        out = {"route": self.route, **dataclasses.asdict(self.call)}
        out.update(
            min_tokens=self.min_tokens,
            max_tokens=self.max_tokens,
            static="accepted" if not self.reasons else "refused",
            reasons=list(self.reasons),
            kernel=list(self.kernel),
        )
        return out


def plan_checks(calls: Sequence[Call], fi: FlashInferRules) -> list[Check]:
    """Split each call kind across the routes by token count, and check each part."""
    checks = []
    for call in calls:
        parts = []
        for route in fi.routes:
            span = route.token_range(call.min_tokens, call.max_tokens) if route.takes(call) else None
            if span is not None:
                parts.append((span, route))
        covered = call.min_tokens
        for (lo, hi), _route in sorted(parts, key=lambda p: p[0]):
            if lo > covered:
                break
            covered = max(covered, hi + 1)
        if covered <= call.max_tokens:
            raise CannotEstablish(
                f"the kernel route of {call.layer} {call.kind} calls of {covered} tokens "
                f"(FlashInfer {fi.version}'s routes do not cover it)"
            )
        for (lo, hi), route in parts:
            part = dataclasses.replace(call, min_tokens=lo, max_tokens=hi)
            checks.append(Check(route.name, part, lo, hi, _refusals(route, part, fi)))
    return checks


def _refusals(route: Route, call: Call, fi: FlashInferRules) -> list[str]:
    reasons = []
    for rule in route.rules:
        if rule.field.startswith("extra_") and not call.has_extra:
            continue
        reason = rule.refusal(call)
        if reason:
            reasons.append(reason)
    if route.name == ROUTE_DECODE and fi.predicate is not None and not fi.predicate(call):
        if not reasons:
            reasons.append(f"refused by FlashInfer's {fi.predicate_name}")
    return reasons


# --------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------

KernelCall = Callable[["Check", int, VllmFacts, FlashInferRules], None]
DeviceQuery = Callable[[], "tuple[int, int] | None"]


@dataclasses.dataclass
class Report:
    facts: list[Fact]
    checks: list[Check]
    static: bool
    device: tuple[int, int] | None
    passed: bool
    verdict: str
    reasons: list[str]
    covered: list[str] = dataclasses.field(default_factory=list)
    not_covered: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def routes(self) -> dict[str, dict[str, Any]]:
        """Each route's status: "pass", "FAIL" or "not reached", with its reasons."""
        out = {}
        for name in ROUTES:
            checks = [c for c in self.checks if c.route == name]
            failed = [c for c in checks if c.reasons or any(": raised" in k for k in c.kernel)]
            out[name] = {
                "status": "not reached" if not checks else "FAIL" if failed else "pass",
                "reasons": _group_reasons(failed),
            }
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "facts": [dataclasses.asdict(f) for f in self.facts],
            "routes": self.routes(),
            "checks": [c.as_dict() for c in self.checks],
            "static": self.static,
            "device_capability": list(self.device) if self.device else None,
            "passed": self.passed,
            "reasons": list(self.reasons),
            "scope": {"covered": list(self.covered), "not_covered": list(self.not_covered)},
            "notes": list(self.notes),
            "verdict": self.verdict,
        }


def _group_reasons(checks: Sequence[Check]) -> list[str]:
    """One reason per (route, failed condition), naming the calls it refused."""
    grouped: dict[str, list[str]] = {}
    for check in checks:
        for reason in check.reasons:
            grouped.setdefault(f"{check.route}: {reason}", []).append(check.label)
        for result in check.kernel:
            if ": raised" in result:
                grouped.setdefault(f"{check.route}: {result.split(': raised ', 1)[1]}", []).append(
                    f"{check.call.layer}, {check.call.kind} {result.split(':', 1)[0]}"
                )
    return [f"{r} [{'; '.join(labels)}]" for r, labels in grouped.items()]


def _fail_verdict(reasons: Sequence[str]) -> str:
    return f"{FAIL}: " + "; ".join(reasons)


def kernel_token_counts(check: Check, vf: VllmFacts) -> list[int]:
    """Where a route's part is called for real: its ends, 64 and 65 (either side
    of the 0.6.x cutoff) and the largest capture size, where they fall in it."""
    wanted = {check.min_tokens, check.max_tokens, 64, 65, max(vf.capture_sizes, default=1)}
    return sorted(n for n in wanted if check.min_tokens <= n <= check.max_tokens)


def scope(vf: VllmFacts, fi: FlashInferRules, calls: Sequence[Call]) -> tuple[list[str], list[str]]:
    covered = [
        "every attention call of DeepseekV4FlashInferSM120Attention (vLLM's FlashInfer SM120 backend) "
        f"for each layer type of this checkpoint: {', '.join(layer_name(r) for r, _ in vf.layer_types)}",
    ]
    for kind in ("decode", "prefill"):
        spans = {(c.min_tokens, c.max_tokens) for c in calls if c.kind == kind}
        for lo, hi in sorted(spans):
            covered.append(f"{kind} calls of {lo}..{hi} tokens")
    covered.append(f"the routes of FlashInfer {fi.version}: " + ", ".join(r.name for r in fi.routes))
    not_covered = [
        "which attention backend vLLM selects: FLASHINFER_MLA_SPARSE_DSV41 on SM120 is assumed, not checked",
        f"the KV-cache dtype ({vf.kv_cache_dtype}): the packed fp8_ds_mla cache "
        f"({fi.bytes_per_token} bytes per token) is modelled",
        "kernels other than FlashInfer's sparse-MLA attention (indexer, compressor, MoE, GEMMs)",
        "pipeline, expert and context parallelism; LoRA",
        *vf.scope_notes,
        *fi.notes,
    ]
    return covered, not_covered


def evaluate(
    vf: VllmFacts,
    fi: FlashInferRules,
    *,
    static: bool = False,
    kernel_call: KernelCall | None = None,
    device_capability: DeviceQuery | None = None,
    extra_facts: Sequence[Fact] = (),
) -> Report:
    """Check every call on its route statically, then on an SM120 device for real."""
    calls = plan_calls(vf)
    checks = plan_checks(calls, fi)
    facts = list(extra_facts) + vf.facts() + fi.facts()
    covered, not_covered = scope(vf, fi, calls)
    static_reasons = _group_reasons(checks)
    device = (device_capability or cuda_device_capability)()
    is_sm120 = device is not None and device[0] == SM120_MAJOR

    def report(passed: bool, verdict: str, reasons: list[str], notes: list[str] = ()) -> Report:  # type: ignore[assignment]
        return Report(facts, checks, static, device, passed, verdict, reasons, covered, not_covered, list(notes))

    if static:
        if static_reasons:
            return report(False, _fail_verdict(static_reasons), static_reasons)
        return report(True, PASS_STATIC, [])
    if not is_sm120:
        reasons = [NO_DEVICE_REASON] + static_reasons
        return report(False, _fail_verdict(reasons), reasons)

    call = kernel_call or flashinfer_kernel_call
    for check in checks:
        for n in kernel_token_counts(check, vf):
            try:
                call(check, n, vf, fi)
            except Exception as exc:  # the kernel's refusal is the result
                check.kernel.append(f"{n}: raised {_one_line(f'{type(exc).__name__}: {exc}')}")
            else:
                check.kernel.append(f"{n}: ran")
    notes = [
        f"{c.route}, {c.label}: the kernel ran, but the rules read refuse it (a run that does not raise "
        "can still be wrong: the prefill dispatch does not check the page size)"
        for c in checks
        if c.reasons and all(k.endswith(": ran") for k in c.kernel)
    ]
    reasons = _group_reasons(checks)
    if reasons:
        return report(False, _fail_verdict(reasons), reasons, notes)
    return report(True, PASS, [], notes)


# --------------------------------------------------------------------------
# Seams: device query and kernel call
# --------------------------------------------------------------------------


def cuda_device_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None without one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
    except Exception:
        return None
    return int(major), int(minor)


def flashinfer_kernel_call(check: Check, num_tokens: int, vf: VllmFacts, fi: FlashInferRules) -> None:
    """Call ``trtllm_batch_decode_sparse_mla_dsv4`` once, as vLLM's SM120 path
    does for this route and layer type, with a query of ``num_tokens`` tokens.

    Tensors are synthetic but laid out as DeepseekV4FlashInferSM120Attention
    passes them (_forward_decode / _forward_prefill): bf16 query [tokens,
    heads, d_qk], packed uint8 NHD caches [pages, page, 1, bytes_per_token]
    for the SWA cache and, on a compressed layer, the compressed cache with
    its own page; int32 index rows [tokens, 1, topk] and per-token lengths
    for both; fp32 sinks. Raises whatever FlashInfer raises.

    Verified only on SM120 hardware; CI (no GPU) exercises the static checks
    and this seam with a fake call.
    """
    import torch
    from flashinfer.mla import trtllm_batch_decode_sparse_mla_dsv4

    call = check.call
    device = torch.device("cuda", torch.cuda.current_device())
    heads = call.num_heads

    def pool(topk: int, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pages = -(-topk // page) + 1
        cache = torch.zeros(pages, page, 1, fi.bytes_per_token, dtype=torch.uint8, device=device)
        rows = torch.arange(topk, dtype=torch.int32, device=device)
        indices = rows.repeat(num_tokens, 1).view(num_tokens, 1, topk).contiguous()
        lengths = torch.full((num_tokens,), topk, dtype=torch.int32, device=device)
        return cache, indices, lengths

    swa_cache, swa_indices, swa_lens = pool(call.topk, call.page_block_size)
    kwargs: dict[str, Any] = {}
    if call.has_extra:
        cache, indices, lengths = pool(call.extra_topk, call.extra_page_block_size)
        kwargs = dict(compressed_kv_cache=cache, extra_sparse_indices=indices, extra_sparse_topk_lens=lengths)
    query = torch.randn(num_tokens, heads, call.d_qk, dtype=torch.bfloat16, device=device)
    out = torch.empty(num_tokens, heads, call.d_qk, dtype=torch.bfloat16, device=device)
    trtllm_batch_decode_sparse_mla_dsv4(
        query=query,
        swa_kv_cache=swa_cache,
        workspace_buffer=torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device),
        sparse_indices=swa_indices,
        out=out,
        bmm1_scale=call.d_qk**-0.5,
        sinks=torch.zeros(heads, dtype=torch.float32, device=device),
        kv_layout="NHD",
        swa_topk_lens=swa_lens,
        **kwargs,
    )
    torch.cuda.synchronize(device)


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
    print("SM120 kernel-route self-test (DeepSeek V4.1, FlashInfer sparse MLA)", file=out)
    if report.facts:
        print("facts:", file=out)
        width = max(len(f.name) for f in report.facts)
        for fact in report.facts:
            print(f"  {fact.name:<{width}}  {_value_text(fact.value)}", file=out)
            if fact.source:
                print(f"  {'':<{width}}    from {fact.source}", file=out)
    if report.checks:
        print("calls:", file=out)
        header = ("route", "layer", "call", "tokens", "heads", "topk", "page", "extra topk", "extra page", "kernel", "static")
        rows = [
            (
                c.route,
                c.call.layer,
                c.call.kind,
                f"{c.min_tokens}..{c.max_tokens}",
                str(c.call.num_heads),
                str(c.call.topk),
                str(c.call.page_block_size),
                str(c.call.extra_topk or "-"),
                str(c.call.extra_page_block_size or "-"),
                ", ".join(c.kernel) or "not run",
                "accepted" if not c.reasons else "refused: " + "; ".join(c.reasons),
            )
            for c in report.checks
        ]
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header) - 1)]
        for row in [header] + rows:
            cells = [c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]
            print("  " + "  ".join(cells), file=out)
    if report.checks:
        print("routes:", file=out)
        for name, route in report.routes().items():
            print(f"  {name:<15} {route['status']}", file=out)
    for title, lines in (("covered", report.covered), ("not covered", report.not_covered)):
        if lines:
            print(f"{title}:", file=out)
            for line in lines:
                print(f"  - {line}", file=out)
    device = f"compute capability {report.device[0]}.{report.device[1]}" if report.device else "no CUDA device"
    mode = "static checks only (--static)" if report.static else "kernel calls"
    print(f"device: {device}; mode: {mode}", file=out)
    for note in report.notes:
        print(f"note: {note}", file=out)


def _error_report(reason: str, static: bool = False) -> Report:
    return Report([], [], static, None, False, _fail_verdict([reason]), [reason])


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
        description="Check FlashInfer's SM120 kernel routes for a rank's vllm serve argv.",
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
    flashinfer_rules: Callable[[], FlashInferRules] | None = None,
) -> int:
    """Run the self-test on a ``vllm serve`` argv; return the exit code.

    ``argv`` may carry the self-test's own ``--static``/``--json`` before a
    ``--`` separator. ``kernel_call``, ``device_capability``, ``vllm_facts``
    and ``flashinfer_rules`` replace the real kernel call, device query and
    fact readers (tests).
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
            flashinfer_rules=flashinfer_rules or collect_flashinfer_rules,
        )
    except SelftestError as exc:
        report = _error_report(str(exc), static=static)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except Exception as exc:  # never a traceback for an operator
        if os.environ.get("SM120_SELFTEST_DEBUG"):
            raise
        report = _error_report(_one_line(f"internal error: {type(exc).__name__}: {exc}"), static=static)
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
    flashinfer_rules: Callable[[], FlashInferRules],
) -> Report:
    device = (device_capability or cuda_device_capability)()
    if device is None and vllm_facts is collect_vllm_facts and "VLLM_TARGET_DEVICE" not in os.environ:
        # vLLM cannot infer a device on a host without one; the facts read
        # here (parser, engine config, class attributes) do not depend on it.
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    # vLLM and FlashInfer log to stdout; keep stdout for the table and verdict.
    _move_stdout_log_handlers()
    with contextlib.redirect_stdout(sys.stderr):
        vf, extra = vllm_facts(serve_argv)
        fi = flashinfer_rules()
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
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for handler in lg.handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in stdouts:
                handler.setStream(sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
