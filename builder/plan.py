"""Plan: should CI build the recipe's image?  ``rebuild`` or ``up-to-date``, from keys alone.

Nothing here reads the base tree or starts a build: the keys come from the
recipe and members, the answer from the produced-image rows and, when the
repository names a registry, the ``ik-`` tag there.
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
    row = find_row(ik)
    if row is not None:
        return Plan(False, rk, ik, f"produced {row.get('image')} ({row.get('time')})")
    from builder.image import registry_of, tags_for

    if registry_of(recipe.image.repository):
        from builder.errors import RegistryUnreachable
        from builder.image import docker_client, in_registry

        ref = tags_for(recipe, rendered).image
        try:
            digest = in_registry(docker_client(), ref)
        except RegistryUnreachable as exc:
            return Plan(True, rk, ik, f"no produced row, and the registry cannot tell ({exc})")
        if digest is not None:
            return Plan(False, rk, ik, f"{ref} is in the registry ({digest})")
        return Plan(True, rk, ik, f"no produced row, and {ref} is not in the registry")
    return Plan(True, rk, ik, "no produced row for this image key (and no registry in the repository name)")


def write_github_output(result: Plan) -> None:
    path = os.environ.get("GITHUB_OUTPUT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            rebuild = "true" if result.rebuild else "false"
            out.write(f"rebuild={rebuild}\nkey={result.runtime_key}\nimage-key={result.image_key}\n")
