"""Write a rebase: a new recipe (new pins) and the refreshed members, into one output directory.

``DIR/<recipe file name>`` is the recipe with the new vLLM and FlashInfer pins, its
members those that carried (in order; conflicts and members already upstream are
left out and listed in the recipe's comment) and ``overlay: overlay``;
``DIR/overlay/<name>.patch`` the refreshed members (a member made from a source
file keeps its source beside it when its diff is unchanged).  The directory is
written as builder.output writes every output: whole, with its marker, never over
a foreign directory.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from builder.errors import InputError
from builder.key import runtime_key
from builder.output import Destination, write_files
from builder.rebase import CONFLICT, UPSTREAM
from builder.recipe import WheelPin
from builder.sources import source_of


def _pin(pin: WheelPin, old: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"version": pin.version, "wheel": pin.wheel, "sha256": pin.sha256}
    if pin.path is not None:
        out["path"] = str(pin.path)
    elif "index" in old:
        out["index"] = pin.index
    return out


def recipe_text(rebased: Any) -> bytes:
    recipe = rebased.recipe
    raw = dict(recipe.raw)
    old_version = recipe.vllm.version
    raw["vllm"] = _pin(rebased.new_vllm, raw.get("vllm", {}))
    if rebased.new_flashinfer is not recipe.flashinfer:
        raw["flashinfer"] = _pin(rebased.new_flashinfer, raw.get("flashinfer", {}))
    image = dict(raw.get("image", {}))
    source = image.get("vllm_wheel")
    if isinstance(source, dict) and "url" in source:
        # the release variant of the new version, by the same URL pattern; like the old one it
        # has no recorded sha256 unless the recipe gave one (then it cannot be kept)
        source = dict(source, url=source["url"].replace(old_version, rebased.new_vllm.version))
        if "sha256" in source:
            del source["sha256"]
            source["unverified"] = f"rebased from {old_version}: the new variant's sha256 is not recorded yet"
        image["vllm_wheel"] = source
        raw["image"] = image
    if rebased.torch and "torch" in image:
        image["torch"] = rebased.torch
        raw["image"] = image
    raw["members"] = [r.name for r in rebased.rows if r.written]
    raw["overlay"] = "overlay"
    left = [f"{r.name} ({r.status})" for r in rebased.rows if r.status in (CONFLICT, UPSTREAM)]
    head = [
        f"# Written by vllm-overlay rebase from {recipe.path.name}: vLLM {old_version} -> {rebased.new_vllm.version}.",
        f"# FlashInfer: {rebased.flashinfer_note}.",
        *([f"# torch {rebased.torch}: {rebased.torch_note}."] if rebased.torch else []),
        f"# Left out: {', '.join(left)}." if left else "# Every member carried.",
    ]
    return ("\n".join(head) + "\n" + yaml.safe_dump(raw, sort_keys=False, width=1000)).encode()


def write_rebased(destination: Destination, rebased: Any) -> None:
    recipe = rebased.recipe
    members = [r.member for r in rebased.rows if r.written]
    new_recipe = dataclasses.replace(recipe, vllm=rebased.new_vllm, flashinfer=rebased.new_flashinfer)
    destination = dataclasses.replace(destination, runtime_key=runtime_key(new_recipe, members))
    files: dict[str, bytes] = {recipe.path.name: recipe_text(rebased)}
    for row in rebased.rows:
        if not row.written:
            continue
        files[f"overlay/{row.name}.patch"] = row.text
        source = source_of(recipe.member_path(row.name))
        if os.path.exists(source):
            old = recipe.member_path(row.name).read_bytes()
            if _diff_part(old) == _diff_part(row.text):
                with open(source, "rb") as f:
                    files[f"overlay/{row.name}.py"] = f.read()
    if recipe.path.name == "overlay" or recipe.path.name.startswith("."):
        raise InputError("a recipe file name the output cannot hold", file=recipe.path)
    write_files(destination, files)


def _diff_part(data: bytes) -> bytes:
    at = data.find(b"\ndiff --git ")
    return data[at:] if at >= 0 else data
