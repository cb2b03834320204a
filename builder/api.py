"""The library: what the CLI, bench/, tests and scripts call.

Each function takes a recipe (its path, or one already loaded) and returns
data; none prints.  Long work reports progress lines to ``progress`` (the CLI
passes stderr).  Errors are builder.errors classes, each with its exit code.

    from builder import api
    print(api.key("recipes/v41-sm120.yaml"))
    report = api.check("recipes/v41-sm120.yaml")
    applied = api.apply("recipes/v41-sm120.yaml", out="out/overlay")

Stages run in the order data flows: recipe, members (all parsed before the
base tree is opened, so a bad member is refused before 300 MB are fetched),
tree, apply, key, and then what the caller asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.apply import OverlaySet, apply_members
from builder.check import CheckReport, check_overlay
from builder.errors import InputError
from builder.key import runtime_key
from builder.members import Member, load_recipe_members
from builder.recipe import Recipe, load_recipe
from builder.tree import Tree, pinned_tree

Progress = Callable[[str], None]
RecipeLike = Recipe | str | Path


def _quiet(line: str) -> None:
    pass


def recipe_of(recipe: RecipeLike) -> Recipe:
    return recipe if isinstance(recipe, Recipe) else load_recipe(recipe)


def _loaded(recipe: RecipeLike) -> tuple[Recipe, tuple[Member, ...], Tree]:
    """The recipe, its members (parsed first), and its base tree (fetched on first use)."""
    recipe = recipe_of(recipe)
    members = load_recipe_members(recipe)
    return recipe, members, pinned_tree(recipe.vllm)


def _keyed(recipe: RecipeLike) -> tuple[Recipe, tuple[Member, ...], str]:
    """The recipe, its members (each parsed once, all before any tree is opened or fetched)
    and its runtime key."""
    recipe = recipe_of(recipe)
    members = load_recipe_members(recipe)
    return recipe, members, runtime_key(recipe, members)


def key(recipe: RecipeLike) -> str:
    """The runtime key: from the recipe and its members alone (the tree is never opened)."""
    return _keyed(recipe)[2]


def check(recipe: RecipeLike) -> CheckReport:
    """Whether each member applies to the unpatched pinned tree, and how (``report.ok``)."""
    _, members, tree = _loaded(recipe)
    return check_overlay(tree, members)


@dataclass(frozen=True)
class Applied:
    recipe: Recipe
    tree: Tree
    overlay: OverlaySet
    key: str

    def report(self) -> list[str]:
        """Per member in order: its hunks that applied with an offset, then "applied NAME"."""
        return [line for result in self.overlay.results for line in result.report()]

    def manifest(self) -> dict[str, Any]:
        """manifest.json's content (hashes every touched file)."""
        from builder.output import manifest

        return manifest(self.recipe, self.overlay, self.key)


def apply(
    recipe: RecipeLike,
    *,
    out: str | Path | None = None,
    full_tree: str | Path | None = None,
    progress: Progress = _quiet,
) -> Applied:
    """Apply the members in order onto the pinned tree; with ``out``, write the touched files
    and manifest.json there; with ``full_tree``, the whole patched tree.  Each output replaces
    an earlier one whole, or is left as it was on failure."""
    from builder.output import write_full_tree, write_overlay

    recipe, members, key = _keyed(recipe)
    destinations = {  # refused before any work: a wrong --out costs nothing
        option: _destination(recipe, raw, option, f"apply {option}", key)
        for option, raw in (("--out", out), ("--full-tree", full_tree))
        if raw is not None
    }
    tree = pinned_tree(recipe.vllm)
    applied = Applied(recipe, tree, apply_members(tree, members), key)
    progress("\n".join(applied.report()))
    if destinations:
        data = applied.manifest()
        if "--out" in destinations:
            write_overlay(destinations["--out"], applied.overlay, data)
            progress(f"wrote {len(applied.overlay.changes)} touched files and manifest.json to {out}")
        if "--full-tree" in destinations:
            write_full_tree(destinations["--full-tree"], tree, applied.overlay, data)
            progress(f"wrote the full patched tree to {full_tree}")
    return applied


def _destination(recipe: Recipe, raw: str | Path, option: str, command: str, key: str) -> Any:
    """An output directory, refused now if it holds or lies in what the run reads."""
    from builder.cache import cache_root
    from builder.output import Destination, check_destination

    protected = {"recipe": recipe.path, "overlay": recipe.overlay_dir, "cache": cache_root()}
    destination = Destination.of(raw, option, command, key, protected)
    check_destination(destination)
    return destination


@dataclass(frozen=True)
class Context:
    """The image build context: the rendered Dockerfile (with its keys) and every file."""

    recipe: Recipe
    rendered: Any  # builder.render.RenderedImage
    files: dict[str, bytes]

    @property
    def image_key(self) -> str:
        return self.rendered.image_key


def render(recipe: RecipeLike, *, out: str | Path | None = None) -> Context:
    """The image build context (Dockerfile, checks script, manifest, overlay files);
    with ``out``, written there (replacing an earlier context whole)."""
    from builder.output import write_files
    from builder.render import context_files, render_image

    recipe, members, runtime = _keyed(recipe)
    destination = None if out is None else _destination(recipe, out, "--out", "dockerfile --out", runtime)
    tree = pinned_tree(recipe.vllm)
    applied = Applied(recipe, tree, apply_members(tree, members), runtime)
    rendered = render_image(applied.recipe, applied.key)
    context = Context(applied.recipe, rendered, context_files(rendered, applied.overlay, applied.manifest()))
    if destination is not None:
        write_files(destination, context.files)
    return context


def build_image(recipe: RecipeLike, *, push: bool = False, progress: Progress = _quiet) -> Any:
    """The recipe's image: found in the engine or the registry by its image key, else built;
    tagged, pushed if asked, and recorded in the produced rows.  Returns builder.image.Made."""
    from builder.image import ensure_image
    from builder.produced import load_rows

    load_rows()  # a corrupt rows file is bad input, refused before any work
    context = render(recipe)
    return ensure_image(context.recipe, context.rendered, context.files, push=push, progress=progress)


def plan(recipe: RecipeLike) -> Any:
    """For CI: rebuild or up to date, from the keys alone (builder.plan.Plan)."""
    from builder.plan import plan as plan_keys

    recipe = recipe_of(recipe)
    return plan_keys(recipe, load_recipe_members(recipe))


def probe(
    recipe: RecipeLike,
    serve_argv: list[str],
    *,
    python: str | Path | None = None,
    static: bool = False,
    progress: Progress = _quiet,
) -> list[Any]:
    """The self-test in four arms (unpatched/patched x as given/text-only) with the rank's
    ``vllm serve`` argv; a list of builder.probe.Arm."""
    from builder.probe import probe as run_probe
    from builder.probe_env import ensure_probe_venv

    if not serve_argv:
        raise InputError("probe: give the rank's vllm serve argv after '--' (e.g. -- /models/v41 -tp 4)")
    recipe, members, tree = _loaded(recipe)
    interpreter = Path(python) if python else ensure_probe_venv(recipe.vllm.version, progress=progress)
    return run_probe(tree, members, interpreter, serve_argv, static)


def generated_members(recipe: RecipeLike, *, write: bool = True) -> list[Any]:
    """The members made from a source file (overlay/<name>.py), each with whether it was
    out of date; with ``write``, the stale ones are written from their source."""
    from builder.sources import generated_members as find
    from builder.sources import regenerate

    members = find(recipe_of(recipe))
    if write:
        regenerate(members)
    return members


def stderr_progress(line: str) -> None:
    """The CLI's progress: each line to stderr at once (an empty report prints nothing)."""
    if line:
        print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- launch


def load_profile(profile: Any) -> Any:
    """A launch profile (its path, or one already loaded), validated with the recipe it names
    (builder.launch.Profile)."""
    from builder.launch import Profile
    from builder.launch import load_profile as load

    return profile if isinstance(profile, Profile) else load(profile)


def launch_argv(profile: Any, rank: str) -> list[str]:
    """The rank's exact argv, starting ``vllm serve <checkpoint>``; an unknown rank is an
    InputError naming the profile's ranks."""
    from builder.launch import rank_argv

    return rank_argv(load_profile(profile), rank)


def profile_key(profile: Any) -> str:
    """The profile key (``pk-`` + 64 hex; README, "The profile key")."""
    from builder.launch import profile_key as key_of

    return key_of(load_profile(profile))


def gate(
    profile: Any,
    *,
    static: bool = False,
    timeout: float | None = None,
    engines: Any = None,
    receipts: str | Path | None = None,
    progress: Progress = _quiet,
) -> Any:
    """The self-test in the produced image on every rank's engine, with that rank's exact argv
    (builder.gate.GateResult: ``result.passed``, ``result.ranks``, ``result.receipt``,
    ``result.table()``).  A stale image is an InputError before any container starts; the
    receipt is written whatever happens once an engine was asked.  ``engines`` maps an engine
    URL to its seam (tests); ``receipts`` overrides $VLLM_OVERLAY_RECEIPTS."""
    from builder.gate import DEFAULT_TIMEOUT, run_gate

    return run_gate(
        load_profile(profile),
        static=static,
        timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
        engines=engines,
        receipts=None if receipts is None else Path(receipts),
        progress=progress,
    )


def launch_up(
    profile: Any,
    *,
    static: bool = False,
    timeout: float | None = None,
    engines: Any = None,
    receipts: str | Path | None = None,
    progress: Progress = _quiet,
) -> Any:
    """The gate, then, only when every rank passed in it, each rank's serving container with the
    gated argv (``result.containers``; none after a failed gate)."""
    from builder.gate import DEFAULT_TIMEOUT
    from builder.gate import launch_up as up

    return up(
        load_profile(profile),
        static=static,
        timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
        engines=engines,
        receipts=None if receipts is None else Path(receipts),
        progress=progress,
    )


def launch_status(profile: Any, *, engines: Any = None) -> list[Any]:
    """The serving containers labelled with the profile's key, per engine (builder.gate.EngineContainers)."""
    from builder.gate import launch_status as status

    return status(load_profile(profile), engines=engines)


def launch_down(profile: Any, *, engines: Any = None) -> list[Any]:
    """Stop and remove exactly the serving containers labelled with the profile's key."""
    from builder.gate import launch_down as down

    return down(load_profile(profile), engines=engines)


# ---------------------------------------------------------------- the base image's pin


def pin_base(recipe: RecipeLike, *, update: bool = False) -> Any:
    """Resolve the recipe's image.base tag to its digest through the registry API and write
    ``base: name:tag@sha256:...`` into the recipe file (that value alone; atomic).  An already
    pinned base is resolved again and rewritten only with ``update`` when its tag moved
    (builder.basepin.BasePin: ``digest``, ``previous``, ``moved``, ``written``)."""
    from builder.basepin import pin_base as pin

    return pin(recipe_of(recipe), update=update)
