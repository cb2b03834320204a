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
from collections.abc import Iterable

from builder.members import Member
from builder.recipe import Recipe

KEY_FORMAT = 1


def key_material(recipe: Recipe, members: Iterable[Member]) -> bytes:
    return _material(recipe, ((m.name, m.digest) for m in members))


def runtime_key(recipe: Recipe, members: Iterable[Member]) -> str:
    return key_of_digests(recipe, ((m.name, m.digest) for m in members))


def key_of_digests(recipe: Recipe, digests: Iterable[tuple[str, str]]) -> str:
    """The key from (member name, digest of its normalized diff) pairs, in recipe order."""
    return "rk-" + hashlib.sha256(_material(recipe, digests)).hexdigest()


def _material(recipe: Recipe, digests: Iterable[tuple[str, str]]) -> bytes:
    lines = [f"vllm-overlay-runtime-key {KEY_FORMAT}", f"pin vllm {recipe.vllm.version} sha256:{recipe.vllm.sha256}"]
    lines += [f"member {name} sha256:{digest}" for name, digest in digests]
    return ("\n".join(lines) + "\n").encode()


def short_key(key: str) -> str:
    """The first 16 hex digits, used in image tags as ``rk-<short>``."""
    return key.removeprefix("rk-")[:16]
