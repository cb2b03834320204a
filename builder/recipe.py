"""Recipe: the pinned trees, image settings and ordered member list, validated up front.

Every field is checked before anything else runs, and an error names the field
by its dotted path (``vllm.sha256``) so a user can find it in the YAML.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.cache import MIB, read_regular
from builder.errors import InputError
from builder.schema import _boolean, _Field, _field_error, _list_of, _mapping, _quoted, _show, _string, load_yaml

SHA256_RE = re.compile(r"[0-9a-f]{64}")
# Free text that ends up in a Dockerfile LABEL or echo: no quotes, $, backslash or newline.
REASON_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ,.:;()/+_=-]{0,300}")
HOST_RE = re.compile(r"[A-Za-z0-9.-]+(:[0-9]+)?")
TORCH_VERSION_RE = re.compile(r"\d+(\.\d+)*(\+[a-z0-9]+)?")
# PEP 440 public versions, the forms pins actually use (1.2.3, 0.6.18.post1, 0.7.0rc1).
VERSION_RE = re.compile(r"\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?")
MEMBER_NAME_RE = re.compile(r"[a-z0-9_]+")
RECIPE_LIMIT = 1 * MIB  # the largest recipe file read
RECIPE_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")
WHEEL_NAME_RE = re.compile(r"[A-Za-z0-9_.+-]+\.whl")
# Printable ASCII only: a URL reaches the Dockerfile (pip options, the source label), where a
# control or bidirectional character could hide what it says.
URL_RE = re.compile(r"(https?|file)://[!#%*+,\-./0-9:=?@A-Z\[\]^_a-z~]+")
HTTP_URL_RE = re.compile(r"https?://[!#%*+,\-./0-9:=?@A-Z\[\]^_a-z~]+")
# A container image reference: [registry[:port]/]path[:tag][@sha256:digest].
IMAGE_REF_RE = re.compile(
    r"[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?"
)
REPOSITORY_RE = re.compile(r"[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*")
CUDA_VERSION_RE = re.compile(r"\d+\.\d+(\.\d+)?")
ARCH_LIST_RE = re.compile(r"\d+\.\d+a?(\+PTX)?([ ;]\d+\.\d+a?(\+PTX)?)*")
PYTHON_VERSION_RE = re.compile(r"3\.\d+")


@dataclass(frozen=True)
class WheelPin:
    """A wheel pinned by version and sha256; ``url`` or ``index`` say where to fetch it."""

    project: str
    version: str
    wheel: str
    sha256: str
    url: str | None = None
    index: str = "https://pypi.org/simple"
    path: Path | None = None  # a local wheel file or source directory, for work from a clone


@dataclass(frozen=True)
class PipSettings:
    """Where the image's one resolver step finds packages."""

    index_url: str = "https://pypi.org/simple"
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    trusted_hosts: tuple[str, ...] = ()
    no_deps: bool = False  # install only the pinned packages (tests: the CUDA closure is several GB)


@dataclass(frozen=True)
class VllmWheelSource:
    """vLLM from a URL (e.g. a +cu128 release variant) instead of the index."""

    url: str
    sha256: str | None = None
    unverified: str | None = None  # why there is no sha256 yet; required when sha256 is absent


@dataclass(frozen=True)
class ImageSettings:
    base: str
    cuda: str
    torch_cuda_arch_list: str
    flashinfer_cuda_arch_list: str
    python: str
    repository: str
    mode: str = "cuda"  # "cuda": the image installs vLLM; "vllm": the base already has the pinned vLLM
    source: str | None = None  # org.opencontainers.image.source
    torch: str | None = None  # the torch requirement, e.g. 2.13.0+cu128
    pip: PipSettings = PipSettings()
    vllm_wheel: VllmWheelSource | None = None
    accept_cuda_mismatch: str | None = None  # why a CUDA major mismatch is acceptable
    unlocked: str | None = None  # why the install has no lock (mode cuda: else <name>.lock beside the recipe)

    @property
    def base_digest(self) -> str | None:
        return self.base.split("@", 1)[1] if "@" in self.base else None

    @property
    def base_name(self) -> str:
        return self.base.split("@", 1)[0]


@dataclass(frozen=True)
class Recipe:
    path: Path
    name: str
    vllm: WheelPin
    flashinfer: WheelPin
    image: ImageSettings
    members: tuple[str, ...]
    overlay_dir: Path
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    def member_path(self, name: str) -> Path:
        return self.overlay_dir / f"{name}.patch"


# ---------------------------------------------------------------- validation


def _members(where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _field_error(where, f"expected a list of member names, got {_show(value)}")
    seen: set[str] = set()
    for i, name in enumerate(value):
        item = f"{where}[{i}]"
        if not isinstance(name, str) or not MEMBER_NAME_RE.fullmatch(name):
            raise _field_error(item, f"expected a member name matching [a-z0-9_]+, got {_show(name)}")
        if name in seen:
            raise _field_error(item, f"duplicate member {_quoted(name)}")
        seen.add(name)
    return tuple(value)


_SHA256 = _string(SHA256_RE, "64 lowercase hex digits")
_VERSION = _string(VERSION_RE, "a version like 0.30.0 or 0.6.18.post1")
_URL = _string(URL_RE, "an http(s):// or file:// URL without spaces or shell characters")
_HTTP_URL = _string(HTTP_URL_RE, "an http(s):// URL without spaces or shell characters (a local file: use path)")
_PATH = _string(re.compile(r"[^\0\n]+"), "a path")
_REASON = _string(REASON_RE, "a short reason in plain words (letters, digits, spaces and , . : ; ( ) / + _ = -)")
_REPOSITORY = _string(REPOSITORY_RE, "an image repository like ghcr.io/org/vllm-overlay")


def _pin_schema(wheel_required: bool) -> dict[str, _Field]:
    return {
        "version": _Field(_VERSION),
        "wheel": _Field(_string(WHEEL_NAME_RE, "a wheel file name ending in .whl"), required=wheel_required),
        "sha256": _Field(_SHA256),
        "url": _Field(_HTTP_URL, required=False),
        "index": _Field(_HTTP_URL, required=False),
        "path": _Field(_PATH, required=False),
    }


RECIPE_SCHEMA = _mapping(
    {
        "name": _Field(_string(RECIPE_NAME_RE, "a name matching [a-z0-9][a-z0-9._-]*")),
        "vllm": _Field(_mapping(_pin_schema(wheel_required=True))),
        "flashinfer": _Field(_mapping(_pin_schema(wheel_required=True))),
        "image": _Field(
            _mapping(
                {
                    "base": _Field(
                        _string(
                            IMAGE_REF_RE, "an image reference like nvidia/cuda:12.8.1-devel-ubuntu24.04[@sha256:...]"
                        )
                    ),
                    "cuda": _Field(_string(CUDA_VERSION_RE, "a CUDA version like 12.8.1")),
                    "torch_cuda_arch_list": _Field(_string(ARCH_LIST_RE, "an arch list like 12.0")),
                    "flashinfer_cuda_arch_list": _Field(_string(ARCH_LIST_RE, "an arch list like 12.0a")),
                    "python": _Field(_string(PYTHON_VERSION_RE, "a Python version like 3.12")),
                    "repository": _Field(_REPOSITORY),
                    "mode": _Field(
                        _string(
                            re.compile(r"cuda|vllm"), "cuda (install vLLM on a CUDA base) or vllm (the base has it)"
                        ),
                        required=False,
                    ),
                    "source": _Field(_URL, required=False),
                    "torch": _Field(
                        _string(TORCH_VERSION_RE, "a torch version like 2.13.0 or 2.13.0+cu128"), required=False
                    ),
                    "pip": _Field(
                        _mapping(
                            {
                                "index_url": _Field(_URL, required=False),
                                "extra_index_urls": _Field(_list_of(_URL), required=False),
                                "find_links": _Field(_list_of(_URL), required=False),
                                "trusted_hosts": _Field(_list_of(_string(HOST_RE, "a host name")), required=False),
                                "no_deps": _Field(_boolean, required=False),
                            }
                        ),
                        required=False,
                    ),
                    "vllm_wheel": _Field(
                        _mapping(
                            {
                                "url": _Field(_URL),
                                "sha256": _Field(_SHA256, required=False),
                                "unverified": _Field(_REASON, required=False),
                            }
                        ),
                        required=False,
                    ),
                    "accept_cuda_mismatch": _Field(_REASON, required=False),
                    "unlocked": _Field(_REASON, required=False),
                }
            )
        ),
        "members": _Field(_members),
        "overlay": _Field(_PATH, required=False),
    }
)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe; any problem is an InputError naming the field path."""
    path = Path(path)
    try:
        text = read_regular(path, RECIPE_LIMIT, "a recipe").decode("utf-8")
    except FileNotFoundError:
        raise InputError("recipe not found", file=path) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"cannot read recipe: not UTF-8 ({exc.reason} at byte {exc.start})", file=path) from None
    except OSError as exc:
        raise InputError(f"cannot read recipe: {exc.strerror or exc}", file=path) from None
    raw = load_yaml(text, path)
    try:
        data = RECIPE_SCHEMA("", raw)
        base = path.parent
        vllm, flashinfer = _pin("vllm", data["vllm"], base), _pin("flashinfer-python", data["flashinfer"], base)
    except InputError as exc:
        raise exc.located(file=path) from None
    return Recipe(
        path=path,
        name=data["name"],
        vllm=vllm,
        flashinfer=flashinfer,
        image=_image(data["image"], path),
        members=data["members"],
        overlay_dir=(base / data.get("overlay", "../overlay")).resolve(),
        raw=raw,
    )


def _image(data: dict[str, Any], path: Path) -> ImageSettings:
    data = dict(data)
    override = os.environ.get("VLLM_OVERLAY_REPOSITORY")
    if override:  # e.g. CI pushing to its own registry; validated like the field
        try:
            data["repository"] = _REPOSITORY("VLLM_OVERLAY_REPOSITORY", override)
        except InputError as exc:
            raise exc.located(file="environment") from None
    data["pip"] = PipSettings(**data.get("pip", {}))
    wheel = data.get("vllm_wheel")
    if wheel is not None:
        if ("sha256" in wheel) == ("unverified" in wheel):
            raise InputError(
                "give sha256, or (only if it cannot be had yet) unverified: <why>", file=path, field="image.vllm_wheel"
            )
        data["vllm_wheel"] = VllmWheelSource(**wheel)
    if "unlocked" in data and data.get("mode") == "vllm":
        raise InputError(
            "mode vllm installs nothing, so there is no lock to go without: remove it",
            file=path,
            field="image.unlocked",
        )
    return ImageSettings(**data)


def _pin(project: str, data: dict[str, Any], base: Path) -> WheelPin:
    parts = data["wheel"].split("-")
    if len(parts) < 3 or parts[1] != data["version"]:
        field_name = "vllm" if project == "vllm" else "flashinfer"
        raise _field_error(f"{field_name}.wheel", f"{data['wheel']!r} is not a wheel of version {data['version']}")
    local = data.get("path")
    return WheelPin(
        project=project,
        version=data["version"],
        wheel=data["wheel"],
        sha256=data["sha256"],
        url=data.get("url"),
        index=data.get("index", WheelPin.index),
        path=(base / local).resolve() if local else None,
    )
