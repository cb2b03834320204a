"""Launch profiles: which recipe runs on which hosts, and each rank's exact ``vllm serve`` argv.

A profile (``recipes/launch/<name>.yaml``, README "Launch") names its recipe, the
checkpoint's path on the hosts, the served model name, vLLM's parallel sizes, engine
arguments, typed requests and the ranks.  Everything is validated before anything runs,
and an error names the field by its dotted path, as a recipe's does.  From a valid
profile this module renders each rank's argv and the profile key; it starts nothing.

The flags rendered were read in vLLM 0.30.0 (paths relative to site-packages/vllm):

- ``vllm serve <model_tag>``: the positional model, entrypoints/launchers/cli_args.py:398,
  which takes precedence over ``--model`` (entrypoints/cli/serve.py:54);
- ``--served-model-name`` engine/arg_utils.py:936; ``--tensor-parallel-size`` :1095,
  ``--pipeline-parallel-size`` :1057, ``--data-parallel-size`` :1127;
- ``--language-model-only`` engine/arg_utils.py:1367; ``--hf-overrides`` :940, given in the
  dotted form ``--hf-overrides.KEY VALUE``, which FlexibleArgumentParser folds back into one
  JSON mapping (utils/argparse_utils.py:387-446, see ``render_override_value``);
- multi-node (the ``mp`` backend): ``--nnodes`` engine/arg_utils.py:1063, ``--node-rank``
  :1064, ``--master-addr`` :1061, ``--master-port`` :1062; vLLM requires ``--nnodes`` to
  divide the world size and ``0 <= --node-rank < --nnodes`` (engine/arg_utils.py:2182-2204),
  infers the data-parallel rank and local size from them (:2204-2218, :2280-2284) and uses
  the master address as the data-parallel address (:2322-2326);
- ``--headless`` entrypoints/launchers/cli_args.py:404: no API server (entrypoints/cli/
  serve.py:67-75, :147-148); a node whose rank within its data-parallel group is not 0
  then runs workers that join ``master_addr:master_port`` (serve.py:215-228).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.cache import MIB, read_regular
from builder.errors import InputError
from builder.recipe import RECIPE_NAME_RE, Recipe, load_recipe
from builder.schema import _boolean, _Field, _field_error, _mapping, _quoted, _show, _string, load_yaml

KEY_FORMAT = 1
PROFILE_LIMIT = 1 * MIB  # the largest profile file read
LARGEST_INT = 2**63  # an integer rendered into argv stays below this in magnitude
DEEPEST = 32  # how deeply a mapping or list value may nest

# Printable characters only: a control character in an argv element hides what it says.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HOSTNAME = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
_IPV6 = r"[0-9A-Fa-f]*:[0-9A-Fa-f:.]*"
_PORT = r"[0-9]{1,5}"
# Docker engine URLs, as the Docker SDK takes them (docker.utils.parse_host): a socket path, or
# a host over SSH (port 22 unless given) or TCP (port required).  User and host cannot start
# with '-' (no ssh option can hide in them).
ENGINE_RES = {
    "unix": re.compile(r"unix://(?P<path>/[A-Za-z0-9._/+@-]*)"),
    "ssh": re.compile(
        rf"ssh://((?P<user>[A-Za-z0-9_][A-Za-z0-9._-]{{0,63}})@)?(?P<host>{_HOSTNAME}|\[{_IPV6}\])(:(?P<port>{_PORT}))?"
    ),
    "tcp": re.compile(rf"tcp://(?P<host>{_HOSTNAME}|\[{_IPV6}\]):(?P<port>{_PORT})"),
}
ENGINE_EXPECTED = "a Docker engine URL: unix:///path/to/docker.sock, ssh://[user@]host[:port] or tcp://host:port"
MASTER_ADDR_RE = re.compile(rf"{_HOSTNAME}|{_IPV6}")
RANK_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
SERVED_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")
# vLLM's long flag names, as `vllm serve --help` spells them, without the leading '--'.
FLAG_RE = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")
# An HF config key: vLLM splits a dotted flag's name on '.', and reads '=' and a final '+'
# (utils/argparse_utils.py:408-420), so none of them may be in a key.
OVERRIDE_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# A string override vLLM reads back as itself when given bare: not JSON (json.loads fails on
# it), not a human-readable integer like 80g (it starts with a letter or '_'), not a flag.
_BARE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.:/+-]*")
_JSON_WORDS = {"true", "false", "null", "NaN", "Infinity"}  # what json.loads reads as non-strings

# vLLM's parallel sizes: the profile field (vLLM's own name) and its flag, in argv order.
PARALLEL_FLAGS = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "data_parallel_size": "--data-parallel-size",
}
# Modality requests and the flag each renders.
MODALITIES = {"LanguageModelOnly": "--language-model-only"}
# Flags the profile renders from its own fields: an engine argument may not set them too.
_RESERVED = {
    "model": "checkpoint",
    "served-model-name": "served_model_name",
    **{flag.removeprefix("--"): f"parallel.{name}" for name, flag in PARALLEL_FLAGS.items()},
    "language-model-only": "requests.modality",
    "hf-overrides": "requests.hf_overrides",
    "headless": "ranks[].headless",
    "nnodes": "ranks (one node per rank)",
    "node-rank": "ranks[].node_rank",
    "master-addr": "ranks[].master_addr",
    "master-port": "ranks[].master_port",
}
_MULTI_NODE = ("node_rank", "master_addr", "master_port", "headless")


# ---------------------------------------------------------------- the profile


@dataclass(frozen=True)
class Modality:
    """``requests.modality``: which inputs the server takes (LanguageModelOnly: text only)."""

    kind = "modality"
    value: str

    def argv(self) -> list[str]:
        return [MODALITIES[self.value]]

    def material(self) -> Any:
        return self.value


@dataclass(frozen=True)
class HfOverrides:
    """``requests.hf_overrides``: keys of the checkpoint's HF config replaced at load, one
    dotted flag per key (sorted), each value rendered as vLLM parses it back."""

    kind = "hf_overrides"
    overrides: tuple[tuple[str, Any], ...]

    def argv(self) -> list[str]:
        out: list[str] = []
        for key, value in self.overrides:
            out += [f"--hf-overrides.{key}", render_override_value(value)]
        return out

    def material(self) -> Any:
        return dict(self.overrides)


Request = Modality | HfOverrides


@dataclass(frozen=True)
class Rank:
    """One rank: a host's Docker engine, the GPUs it gets, and its multi-node flags (None:
    not set in the profile)."""

    name: str
    engine: str
    gpus: tuple[int, ...]
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    headless: bool | None = None

    def fields(self) -> dict[str, Any]:
        """The fields the profile sets, but the name (the key's material)."""
        out: dict[str, Any] = {"engine": self.engine, "gpus": list(self.gpus)}
        for name in _MULTI_NODE:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class Profile:
    path: Path
    name: str
    recipe_path: Path
    recipe: Recipe
    checkpoint: str
    served_model_name: str
    parallel: tuple[tuple[str, int], ...]  # (vLLM's name, size), only those set, in PARALLEL_FLAGS order
    engine_args: tuple[tuple[str, Any], ...]  # (flag name without '--', value), sorted by flag
    requests: tuple[Request, ...]  # only the requests made, in REQUESTS order
    ranks: tuple[Rank, ...]

    def rank(self, name: str) -> Rank:
        for rank in self.ranks:
            if rank.name == name:
                return rank
        known = ", ".join(r.name for r in self.ranks)
        raise InputError(f"unknown rank {_quoted(name)} (the profile's ranks: {known})", file=self.path, field="--rank")


# ---------------------------------------------------------------- value checks


def _int_in(low: int, high: int, what: str):
    def check(where: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise _field_error(where, f"expected {what}, got {_show(value)}")
        return value

    return check


def _printable(where: str, value: str) -> str:
    if _CONTROL.search(value):
        raise _field_error(where, f"a control character cannot be rendered into argv: {_quoted(value)}")
    return value


def _checkpoint(where: str, value: Any) -> str:
    path = _printable(where, _string()(where, value))
    if not path.startswith("/"):
        raise _field_error(where, f"expected an absolute path on the hosts, got {_quoted(path)}")
    if posixpath.normpath(path) != path or "//" in path:
        raise _field_error(
            where, f"expected a normalized path (no '.', '..', '//' or trailing '/'), got {_quoted(path)}"
        )
    if ":" in path:
        raise _field_error(where, f"a ':' would break Docker's bind-mount syntax: {_quoted(path)}")
    return path


def _engine(where: str, value: Any) -> str:
    url = _string()(where, value)
    scheme = url.split("://", 1)[0] if "://" in url else ""
    match = ENGINE_RES[scheme].fullmatch(url) if scheme in ENGINE_RES else None
    if match is None:
        raise _field_error(where, f"expected {ENGINE_EXPECTED}, got {_quoted(url)}")
    port = match.groupdict().get("port")
    if port is not None and not 1 <= int(port) <= 65535:
        raise _field_error(where, f"port {port} is not in 1..65535: {_quoted(url)}")
    return url


def _gpus(where: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _field_error(where, f"expected a list of GPU device ids (may be empty), got {_show(value)}")
    seen: set[int] = set()
    for i, gpu in enumerate(value):
        _int_in(0, 1023, "a GPU device id (an integer 0..1023)")(f"{where}[{i}]", gpu)
        if gpu in seen:
            raise _field_error(f"{where}[{i}]", f"duplicate GPU {gpu}")
        seen.add(gpu)
    return tuple(value)


def _json_value(where: str, value: Any, depth: int = 0, top: str | None = None) -> Any:
    """A value JSON renders exactly and vLLM's json.loads reads back as it was written.  An
    error names the item (``hf_overrides.x[1]``); nesting too deep, the value (``hf_overrides.x``)."""
    top = where if top is None else top
    if depth > DEEPEST:
        raise _field_error(top, f"nested deeper than {DEEPEST} levels (a YAML alias that holds itself?)")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not -LARGEST_INT < value < LARGEST_INT:
            raise _field_error(where, f"integer out of range (|n| < 2**63): {_quoted(value)}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _field_error(where, f"{value!r} cannot be rendered: JSON has no such number")
        return value
    if isinstance(value, list):
        return [_json_value(f"{where}[{i}]", v, depth + 1, top) for i, v in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise _field_error(where, f"a mapping key that is not a string cannot be rendered: {_quoted(key)}")
        return {k: _json_value(f"{where}.{k}", v, depth + 1, top) for k, v in value.items()}
    raise _field_error(where, f"{_show(value)} cannot be rendered into argv (quote it to pass a string)")


def canonical_json(value: Any) -> str:
    """One spelling of a value: keys sorted, no spaces, ASCII (README, "The profile key")."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def render_override_value(value: Any) -> str:
    """A ``--hf-overrides.KEY`` value, as vLLM 0.30.0 reads it back: it tries json.loads, then a
    human-readable integer (80g), and keeps the string only if both fail
    (utils/argparse_utils.py:422-432).  Non-strings are JSON; a string is bare only when vLLM
    reads it back as itself, else JSON-quoted ('80g', 'true', '0' and '-x' are quoted)."""
    if isinstance(value, str) and _BARE_RE.fullmatch(value) and value not in _JSON_WORDS:
        return value
    return canonical_json(value)


def _scalar_arg(where: str, value: Any) -> str:
    """An engine argument's scalar value, as its argv element."""
    if isinstance(value, bool) or value is None or not isinstance(value, (int, float, str)):
        raise _field_error(where, f"expected a number or a string, got {_show(value)}")
    if isinstance(value, str):
        return _printable(where, value)
    return canonical_json(_json_value(where, value))


def _engine_arg(where: str, flag: str, value: Any) -> list[str]:
    """The argv of one engine argument: ``true`` is the bare flag; a number or string one
    value; a list one value each (flags vLLM declares with nargs='+'); a mapping one JSON
    value (vLLM's config flags: --compilation-config, --speculative-config, ...).  A value that
    starts with '-' is joined with '=' (``--flag=-0.5``): given apart, argparse would read it
    as a flag, and vLLM's dotted-flag pass reads any argument that starts with '-' and holds
    a '.' as a dotted flag (utils/argparse_utils.py:408)."""
    option = f"--{flag}"
    if value is True:
        return [option]
    if value is False:
        raise _field_error(
            where, f"false is not rendered: leave the flag out (to turn a default off, write no-{flag}: true)"
        )
    if isinstance(value, dict):
        return [option, canonical_json(_json_value(where, value))]
    if isinstance(value, list):
        if not value:
            raise _field_error(where, "an empty list renders no value: leave the flag out")
        items = [_scalar_arg(f"{where}[{i}]", v) for i, v in enumerate(value)]
        for i, item in enumerate(items):
            if item.startswith("-"):
                raise _field_error(
                    f"{where}[{i}]", f"a list value cannot start with '-' (vLLM reads it as a flag): {item!r}"
                )
        return [option, *items]
    item = _scalar_arg(where, value)
    return [f"{option}={item}"] if item.startswith("-") else [option, item]


def _engine_args(where: str, value: Any) -> tuple[tuple[str, Any], ...]:
    if not isinstance(value, dict):
        raise _field_error(where, f"expected a mapping of vLLM flag name to value, got {_show(value)}")
    for flag, arg in value.items():
        item = f"{where}.{flag}" if isinstance(flag, str) else where
        if not isinstance(flag, str) or not FLAG_RE.fullmatch(flag):
            spelled = flag.lstrip("-").replace("_", "-").lower() if isinstance(flag, str) else ""
            hint = f" (did you mean {spelled!r}?)" if FLAG_RE.fullmatch(spelled) else ""
            raise _field_error(item, f"expected vLLM's flag name, like max-model-len, without '--'{hint}")
        if flag.removeprefix("no-") in _RESERVED:
            raise _field_error(
                item, f"set by the profile's {_RESERVED[flag.removeprefix('no-')]}, not an engine argument"
            )
        _engine_arg(item, flag, arg)  # refuses what cannot be rendered
    return tuple(sorted(value.items()))


def _modality(where: str, value: Any) -> Modality:
    name = _string()(where, value)
    if name not in MODALITIES:
        close = difflib.get_close_matches(name, list(MODALITIES), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise _field_error(where, f"unknown modality {_quoted(name)} ({hint}expected one of: {', '.join(MODALITIES)})")
    return Modality(name)


def _hf_overrides(where: str, value: Any) -> HfOverrides:
    if not isinstance(value, dict):
        raise _field_error(where, f"expected a mapping of HF config key to value, got {_show(value)}")
    if not value:
        raise _field_error(where, "an empty request: leave it out")
    for key, override in value.items():
        if not isinstance(key, str) or not OVERRIDE_KEY_RE.fullmatch(key):
            raise _field_error(
                where, f"expected an HF config key like vision_n_layers (letters, digits, _), got {_quoted(key)}"
            )
        _json_value(f"{where}.{key}", override)
    return HfOverrides(tuple(sorted(value.items())))


# The request types, in the order their flags are rendered.  A new type is one more entry: a
# profile that does not make it renders, and keys, as before.
REQUESTS: dict[str, _Field] = {
    "modality": _Field(_modality, required=False),
    "hf_overrides": _Field(_hf_overrides, required=False),
}

PROFILE_SCHEMA = _mapping(
    {
        "name": _Field(_string(RECIPE_NAME_RE, "a name matching [a-z0-9][a-z0-9._-]*")),
        "recipe": _Field(_string(re.compile(r"[^\0\n]+"), "a path")),
        "checkpoint": _Field(_checkpoint),
        "served_model_name": _Field(_string(SERVED_NAME_RE, "a model name like deepseek-ai/DeepSeek-V4.1")),
        "parallel": _Field(
            _mapping(
                {
                    name: _Field(
                        _int_in(1, 1024, "a size (an integer 1..1024)"), required=name == "tensor_parallel_size"
                    )
                    for name in PARALLEL_FLAGS
                }
            )
        ),
        "engine_args": _Field(_engine_args, required=False),
        "requests": _Field(_mapping(REQUESTS), required=False),
        "ranks": _Field(lambda where, value: value),  # checked by _ranks, which needs the parallel sizes
    }
)

RANK_SCHEMA = _mapping(
    {
        "name": _Field(_string(RANK_NAME_RE, "a rank name matching [a-z0-9][a-z0-9._-]*")),
        "engine": _Field(_engine),
        "gpus": _Field(_gpus),
        "node_rank": _Field(_int_in(0, 1023, "a node rank (an integer 0..1023)"), required=False),
        "master_addr": _Field(_string(MASTER_ADDR_RE, "a host name or IP address"), required=False),
        "master_port": _Field(_int_in(1, 65535, "a port (an integer 1..65535)"), required=False),
        "headless": _Field(_boolean, required=False),
    }
)


def _ranks(where: str, value: Any, parallel: dict[str, int]) -> tuple[Rank, ...]:
    if not isinstance(value, list) or not value:
        raise _field_error(where, f"expected a list of one or more ranks, got {_show(value)}")
    ranks = [RANK_SCHEMA(f"{where}[{i}]", item) for i, item in enumerate(value)]
    world = math.prod(parallel.values())
    if world % len(ranks):
        sizes = " x ".join(f"{name} {size}" for name, size in parallel.items())
        raise _field_error(
            "parallel", f"the world size {world} ({sizes}) is not divisible by the {len(ranks)} ranks (vLLM's --nnodes)"
        )
    seen_names: set[str] = set()
    seen_nodes: set[int] = set()
    for i, rank in enumerate(ranks):
        at = f"{where}[{i}]"
        if rank["name"] in seen_names:
            raise _field_error(f"{at}.name", f"duplicate rank {_quoted(rank['name'])}")
        seen_names.add(rank["name"])
        if rank["gpus"] and len(rank["gpus"]) != world // len(ranks):
            raise _field_error(
                f"{at}.gpus",
                f"{len(rank['gpus'])} GPUs, but each of the {len(ranks)} ranks runs {world // len(ranks)} workers"
                f" (world size {world}); list that many, or none",
            )
        if len(ranks) == 1:
            for name in _MULTI_NODE:
                if name in rank:
                    raise _field_error(f"{at}.{name}", "only for a profile of more than one rank (multi-node)")
            continue
        for name in ("node_rank", "master_addr", "master_port"):
            if name not in rank:
                raise _field_error(f"{at}.{name}", "missing required field (a profile of more than one rank)")
        if rank["node_rank"] >= len(ranks):
            raise _field_error(
                f"{at}.node_rank",
                f"{rank['node_rank']} is not below the number of ranks ({len(ranks)}, vLLM's --nnodes)",
            )
        if rank["node_rank"] in seen_nodes:
            raise _field_error(f"{at}.node_rank", f"duplicate node rank {rank['node_rank']}")
        seen_nodes.add(rank["node_rank"])
        for name in ("master_addr", "master_port"):
            if rank[name] != ranks[0][name]:
                raise _field_error(
                    f"{at}.{name}",
                    f"{_quoted(rank[name])} differs from {where}[0]'s {_quoted(ranks[0][name])} (one master for all)",
                )
    return tuple(Rank(**rank) for rank in ranks)


# ---------------------------------------------------------------- loading


def load_profile(path: str | Path) -> Profile:
    """Read and validate a launch profile and the recipe it names; any problem is an
    InputError naming the file and the field."""
    path = Path(path)
    try:
        text = read_regular(path, PROFILE_LIMIT, "a launch profile").decode("utf-8")
    except FileNotFoundError:
        raise InputError("launch profile not found", file=path) from None
    except UnicodeDecodeError as exc:
        raise InputError(
            f"cannot read launch profile: not UTF-8 ({exc.reason} at byte {exc.start})", file=path
        ) from None
    except OSError as exc:
        raise InputError(f"cannot read launch profile: {exc.strerror or exc}", file=path) from None
    raw = load_yaml(text, path)
    try:
        data = PROFILE_SCHEMA("", raw)
        ranks = _ranks("ranks", data["ranks"], data["parallel"])
    except InputError as exc:
        raise exc.located(file=path) from None
    recipe_path = path.parent / data["recipe"]
    return Profile(
        path=path,
        name=data["name"],
        recipe_path=recipe_path,
        recipe=load_recipe(recipe_path),
        checkpoint=data["checkpoint"],
        served_model_name=data["served_model_name"],
        parallel=tuple(data["parallel"].items()),
        engine_args=data.get("engine_args", ()),
        requests=tuple(data.get("requests", {}).values()),
        ranks=ranks,
    )


# ---------------------------------------------------------------- argv and key


def rank_argv(profile: Profile, rank_name: str) -> list[str]:
    """The rank's exact argv: ``vllm serve <checkpoint>``, the served name, the parallel sizes,
    the engine arguments (sorted by flag), the requests' flags, then the rank's multi-node
    flags (README, "Launch")."""
    rank = profile.rank(rank_name)
    argv = ["vllm", "serve", profile.checkpoint, "--served-model-name", profile.served_model_name]
    for name, size in profile.parallel:
        argv += [PARALLEL_FLAGS[name], str(size)]
    for flag, value in profile.engine_args:
        argv += _engine_arg(f"engine_args.{flag}", flag, value)
    for request in profile.requests:
        argv += request.argv()
    if len(profile.ranks) > 1:
        argv += ["--nnodes", str(len(profile.ranks)), "--node-rank", str(rank.node_rank)]
        argv += ["--master-addr", str(rank.master_addr), "--master-port", str(rank.master_port)]
        if rank.headless:
            argv.append("--headless")
    return argv


def key_material(profile: Profile) -> bytes:
    """The profile key's text (README, "The profile key"): only what the profile sets, and a
    request only when it is made."""
    lines = [
        f"vllm-overlay-profile-key {KEY_FORMAT}",
        f"checkpoint {canonical_json(profile.checkpoint)}",
        f"served-model-name {canonical_json(profile.served_model_name)}",
    ]
    lines += [f"parallel {name} {size}" for name, size in profile.parallel]
    lines += [f"engine-arg {flag} {canonical_json(value)}" for flag, value in profile.engine_args]
    lines += [f"request {request.kind} {canonical_json(request.material())}" for request in profile.requests]
    lines += [f"rank {rank.name} {canonical_json(rank.fields())}" for rank in profile.ranks]
    return ("\n".join(lines) + "\n").encode()


def profile_key(profile: Profile) -> str:
    return "pk-" + hashlib.sha256(key_material(profile)).hexdigest()
