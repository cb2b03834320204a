"""Plan: should CI build the recipe's image?  ``rebuild`` or ``up-to-date``, from keys alone.

Nothing here reads the base tree or needs a Docker engine: the keys come from
the recipe and members.  For a repository that names a registry the answer is
the registry's alone: up to date only when its ``ik-`` tag resolves to an image
whose config carries the image-key label (read through builder.registry); a
produced row never suffices there, since it says what one machine did, not what
the registry holds.  For a repository without a registry, a row counts when its
repository and image key are the recipe's.  Rows for other repositories never count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from builder.key import runtime_key
from builder.members import Member
from builder.produced import find_row
from builder.recipe import Recipe
from builder.render import render_image


@dataclass(frozen=True)
class Plan:
    rebuild: bool
    runtime_key: str
    image_key: str
    reason: str
    lock: str | None = None  # why the recipe's lock no longer matches it (builder.lock.lock_problem)

    def lines(self) -> list[str]:
        return [
            f"{'rebuild' if self.rebuild else 'up-to-date'}: {self.reason}",
            f"runtime key {self.runtime_key}",
            f"image key   {self.image_key}",
        ] + ([f"stale lock: {self.lock}"] if self.lock else [])


def plan(recipe: Recipe, members: tuple[Member, ...]) -> Plan:
    rk = runtime_key(recipe, members)
    rendered = render_image(recipe, rk, revision="")  # the revision label never enters the key
    ik = rendered.image_key
    repository = recipe.image.repository
    row = find_row(ik, repository=repository)  # read (and checked) either way: a corrupt file is bad input
    from builder.image import registry_image, registry_of, tags_for

    if registry_of(repository):
        from builder.errors import RegistryUnreachable

        ref = tags_for(recipe, rendered).image
        try:
            found = registry_image(ref, ik)
        except RegistryUnreachable as exc:
            return Plan(True, rk, ik, f"the registry cannot tell whether {ref} is there ({exc})")
        if found.digest is not None:
            return Plan(False, rk, ik, found.reason)
        unheeded = " (a produced row names it, but for a registry repository only the registry counts)" if row else ""
        return Plan(True, rk, ik, found.reason + unheeded)
    if row is not None:
        return Plan(False, rk, ik, f"produced {row.get('image')} ({row.get('time')})")
    return Plan(True, rk, ik, f"no produced row for {repository} with this image key (and no registry in its name)")


def write_github_output(result: Plan) -> None:
    path = os.environ.get("GITHUB_OUTPUT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            rebuild = "true" if result.rebuild else "false"
            out.write(f"rebuild={rebuild}\nkey={result.runtime_key}\nimage-key={result.image_key}\n")
