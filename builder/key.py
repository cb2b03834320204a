"""Runtime key: a content address for "this vLLM pin with these members in this order".

The key is sha256 over a small, versioned text (see README, "The runtime key"):

    vllm-overlay-runtime-key 1
    pin vllm 0.30.0 sha256:<wheel sha256>
    member <name> sha256:<sha256 of the member's normalized diff>
    ...

Only inputs go in: never a timestamp, a path on this machine or header prose.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

from builder.members import Member
from builder.recipe import Recipe

KEY_FORMAT = 1


def key_material(recipe: Recipe, members: Iterable[Member]) -> bytes:
    lines = [f"vllm-overlay-runtime-key {KEY_FORMAT}", f"pin vllm {recipe.vllm.version} sha256:{recipe.vllm.sha256}"]
    lines += [f"member {m.name} sha256:{m.digest}" for m in members]
    return ("\n".join(lines) + "\n").encode()


def runtime_key(recipe: Recipe, members: Iterable[Member]) -> str:
    return "rk-" + hashlib.sha256(key_material(recipe, members)).hexdigest()


def short_key(key: str) -> str:
    """The first 16 hex digits, used in image tags as ``rk-<short>``."""
    return key.removeprefix("rk-")[:16]
