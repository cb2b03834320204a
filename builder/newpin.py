"""New pins: a newer release's wheel named, hashed and fetched through the pinning path.

The wheel and its sha256 are read from the index's PEP 691 (JSON) simple page, the
same page builder.pin downloads from; the wheel is then fetched and verified by
builder.pin.pinned_wheel into the content-addressed cache like any pin.  The
FlashInfer pin of a vLLM release is its own ``Requires-Dist: flashinfer-python==``
line (the new wheel's METADATA), never a guess.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import TextIO

from builder.errors import InputError
from builder.pin import index_files, pinned_wheel, sha256_file
from builder.recipe import VERSION_RE, WHEEL_NAME_RE, WheelPin

_REQUIREMENT_RE = re.compile(r"vllm==(\S+)")


def parse_target(text: str) -> str:
    """The version of a ``vllm==X.Y.Z`` argument."""
    match = _REQUIREMENT_RE.fullmatch(text.strip())
    if not match or not VERSION_RE.fullmatch(match.group(1)):
        raise InputError(f"expected vllm==X.Y.Z (an exact version), got {text!r}", field="--to")
    return match.group(1)


def _tags(wheel: str) -> str:
    """A wheel file name's tags (python-abi-platform), the part after name and version."""
    return "-".join(wheel[: -len(".whl")].split("-")[2:])


def resolve_pin(project: str, version: str, like: WheelPin, index: str | None = None) -> WheelPin:
    """``project`` ``version``'s wheel with the same tags as ``like``'s (e.g.
    cp38-abi3-manylinux_2_28_x86_64), its sha256 as the index records it."""
    index = index or like.index
    tags = _tags(like.wheel)
    stem = like.wheel.split("-")[0]
    wanted = f"{stem}-{version}-{tags}.whl"
    entries = [f for f in index_files(project, index)[1] if f["filename"] == wanted]
    if not entries:
        raise InputError(f"{project} {version}: the index {index} lists no {wanted}", field="--to")
    digest = (entries[0].get("hashes") or {}).get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise InputError(f"{project} {version}: the index records no sha256 for {wanted}", field="--to")
    return WheelPin(project=project, version=version, wheel=wanted, sha256=digest, index=index)


def fetch(pin: WheelPin, progress: TextIO | None = None) -> Path:
    """The verified wheel (fetched once into the cache)."""
    return pinned_wheel(pin, progress=progress)


def local_pin(path: Path, project: str = "vllm") -> WheelPin:
    """A pin for a wheel file on this machine (``--to-wheel``): its version from its name,
    its sha256 computed."""
    path = Path(path)
    if not path.is_file():
        raise InputError("no such wheel file", file=path, field="--to-wheel")
    name = path.name
    parts = name.split("-")
    if not WHEEL_NAME_RE.fullmatch(name) or len(parts) < 3 or not VERSION_RE.fullmatch(parts[1]):
        raise InputError("not a wheel file name (NAME-VERSION-TAGS.whl)", file=path, field="--to-wheel")
    return WheelPin(project=project, version=parts[1], wheel=name, sha256=sha256_file(path), path=path.resolve())


def metadata_flashinfer(wheel: Path) -> tuple[str | None, str]:
    """(the flashinfer-python version vLLM's METADATA pins, where it was read)."""
    return metadata_pin(wheel, "flashinfer-python")


def metadata_pin(wheel: Path, project: str) -> tuple[str | None, str]:
    """(the version of ``project`` the wheel's METADATA pins with ``==``, file:line where it
    was read), or (None, why not)."""
    pattern = re.compile(rf"Requires-Dist:\s*{re.escape(project)}\s*==\s*([^\s;,]+)\s*$", re.IGNORECASE)
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(names) != 1:
                return None, f"{wheel.name}: no single *.dist-info/METADATA"
            text = zf.read(names[0]).decode("utf-8", "replace")
    except (zipfile.BadZipFile, OSError) as exc:
        raise InputError(f"not a valid wheel (zip): {exc}", file=wheel) from None
    for number, line in enumerate(text.splitlines(), start=1):
        match = pattern.match(line)
        if match and VERSION_RE.fullmatch(match.group(1)):
            return match.group(1), f"{names[0]}:{number}"
    return None, f"{names[0]}: no 'Requires-Dist: {project}==' line"
