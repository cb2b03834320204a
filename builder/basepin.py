"""pin-base: resolve the recipe's base image tag to its digest through the registry API
(builder.registry; no Docker engine) and write ``base: name:tag@sha256:...`` into the recipe.

Only the base's value changes: its span in the file (found by the YAML parser's marks) is
replaced, so comments, order, quoting and line endings stay byte-identical, and the result is
parsed again and must equal the old recipe but for ``image.base`` before it is written (atomic,
keeping the file's mode).  The digest pinned is the one the registry answers for the tag: an
index's, for a multi-platform tag (the engine picks the platform from it, as from the tag).

A base already pinned is resolved again: the same digest leaves the file alone; a tag that
moved is reported, and the pin is replaced only with ``update`` (pin-base --update).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from builder import registry
from builder.cache import atomic_write, read_regular
from builder.errors import InputError, RegistryUnreachable
from builder.recipe import RECIPE_LIMIT, Recipe
from builder.schema import load_yaml

FIELD = "image.base"


@dataclass(frozen=True)
class BasePin:
    recipe: Path
    name: str  # name:tag
    digest: str  # what the tag resolves to now
    previous: str | None  # the digest the recipe pinned before the run
    written: bool

    @property
    def moved(self) -> bool:
        """The recipe pinned another digest than the tag's now."""
        return self.previous is not None and self.previous != self.digest


def pin_base(recipe: Recipe, *, update: bool = False) -> BasePin:
    name, previous = recipe.image.base_name, recipe.image.base_digest
    where = {"file": recipe.path, "field": FIELD}
    ref = registry.parse_reference(name)
    if not ref.tag:
        raise InputError(f"{recipe.image.base} has no tag to resolve (write it as name:tag)", **where)
    _located(recipe.path)  # a value that cannot be rewritten in place is refused before any request
    try:
        digest = registry.resolve(name)
    except RegistryUnreachable as exc:
        raise RegistryUnreachable(f"cannot resolve {name}: {exc}", **where) from None
    if digest is None:
        raise InputError(f"{name}: no such tag in registry {ref.registry}", **where)
    if previous == digest or (previous is not None and not update):
        return BasePin(recipe.path, name, digest, previous, written=False)
    rewrite_base(recipe.path, f"{name}@{digest}")
    return BasePin(recipe.path, name, digest, previous, written=True)


def rewrite_base(path: Path, value: str) -> None:
    """Put ``value`` in place of image.base's scalar in the file, changing no other byte."""
    path, text, node = _located(path)
    quote = node.style or ""
    new = text[: node.start_mark.index] + quote + value + quote + text[node.end_mark.index :]
    expected = load_yaml(text, path)
    expected["image"]["base"] = value
    if load_yaml(new, path) != expected:  # e.g. an alias: the span written is not base's alone
        raise InputError("cannot rewrite in place: the value is shared with another field", file=path, field=FIELD)
    mode = os.stat(path).st_mode & 0o7777
    atomic_write(path, new.encode("utf-8"))
    os.chmod(path, mode)  # the temporary file was made 0600


def _located(path: Path) -> tuple[Path, str, yaml.ScalarNode]:
    """The recipe's real path (a symlink's target: the link stays), its text, and image.base's
    node, which must be a one-line plain or quoted scalar."""
    given, path = path, path.resolve()
    text = read_regular(path, RECIPE_LIMIT, "the recipe").decode("utf-8")
    node = _base_node(yaml.compose(text, Loader=yaml.SafeLoader))
    if node is None or node.style not in (None, "'", '"') or node.start_mark.line != node.end_mark.line:
        raise InputError("cannot rewrite in place: expected a one-line scalar value", file=given, field=FIELD)
    return path, text, node


def _base_node(root: Any) -> yaml.ScalarNode | None:
    image = _value(root, "image")
    base = _value(image, "base")
    return base if isinstance(base, yaml.ScalarNode) else None


def _value(node: Any, key: str) -> Any:
    if not isinstance(node, yaml.MappingNode):
        return None
    return next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)
