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
    """Whether each member applies to the unpatched pinned tree, and how (``report.ok``); and
    whether the recipe's lock, if it has one, still matches it (``report.lock``)."""
    from builder.lock import lock_report

    recipe, members, tree = _loaded(recipe)
    report = check_overlay(tree, members)
    report.lock = lock_report(recipe)
    return report


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
    from builder.errors import CheckFailed
    from builder.lock import lock_problem
    from builder.output import write_files
    from builder.render import context_files, render_image

    recipe, members, runtime = _keyed(recipe)
    destination = None if out is None else _destination(recipe, out, "--out", "dockerfile --out", runtime)
    rendered = render_image(recipe, runtime)  # reads the lock: refused here, before the tree is fetched
    stale = lock_problem(recipe, rendered.lock)
    if stale:
        raise CheckFailed(f"not rendering from a stale lock: {stale}")
    tree = pinned_tree(recipe.vllm)
    applied = Applied(recipe, tree, apply_members(tree, members), runtime)
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
    from dataclasses import replace

    from builder.lock import image_lock, lock_problem
    from builder.plan import plan as plan_keys

    recipe = recipe_of(recipe)
    result = plan_keys(recipe, load_recipe_members(recipe))
    return replace(result, lock=lock_problem(recipe, image_lock(recipe)))


def lock(recipe: RecipeLike, *, progress: Progress = _quiet) -> Any:
    """Resolve the image's whole package set with uv (for the image's platform, from the recipe's
    indexes; nothing installed) and write ``<recipe dir>/<name>.lock`` (builder.lock.Lock)."""
    from builder.lock import make_lock

    return make_lock(recipe_of(recipe), progress)


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
    from builder.gate import run_gate

    return _gate_call(run_gate, profile, static, timeout, engines, receipts, progress)


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
    from builder.gate import launch_up as up

    return _gate_call(up, profile, static, timeout, engines, receipts, progress)


def _gate_call(
    run: Any,
    profile: Any,
    static: bool,
    timeout: float | None,
    engines: Any,
    receipts: str | Path | None,
    progress: Progress,
) -> Any:
    """gate and launch up take the same options: the profile loaded, the defaults filled in."""
    from builder.gate import DEFAULT_TIMEOUT

    return run(
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


# ---------------------------------------------------------------- rebase and the member workflow


@dataclass(frozen=True)
class Rebased:
    """A rebase report (builder.rebase): the old and new pins, one row per member in order."""

    recipe: Recipe
    new_vllm: Any  # builder.recipe.WheelPin
    new_flashinfer: Any  # WheelPin: the new vLLM's own FlashInfer pin, or the old one (see note)
    flashinfer_note: str  # where the FlashInfer pin was read, or why it was kept
    rows: list[Any]  # builder.rebase.MemberRebase
    torch: str | None = None  # the image's torch requirement for the new vLLM (its local suffix kept)
    torch_note: str = ""
    written: Path | None = None
    probe: list[Any] | None = None  # builder.probe.Arm, with rebase --probe

    @property
    def conflicts(self) -> list[str]:
        from builder.rebase import CONFLICT

        return [r.name for r in self.rows if r.status == CONFLICT]

    def table(self) -> str:
        from builder.rebase import render_report

        text = render_report(self.rows, f"vllm {self.recipe.vllm.version}", f"vllm {self.new_vllm.version}")
        text += f"\nflashinfer-python {self.new_flashinfer.version}: {self.flashinfer_note}"
        return text + (f"\ntorch {self.torch}: {self.torch_note}" if self.torch else "")

    def to_json(self) -> dict[str, Any]:
        def pin(p: Any) -> dict[str, Any]:
            return {"version": p.version, "wheel": p.wheel, "sha256": p.sha256}

        return {
            "from": pin(self.recipe.vllm),
            "to": pin(self.new_vllm),
            "flashinfer": {**pin(self.new_flashinfer), "note": self.flashinfer_note},
            "torch": {"requirement": self.torch, "note": self.torch_note},
            "members": [r.to_json() for r in self.rows],
            "conflicts": self.conflicts,
            "written": None if self.written is None else str(self.written),
        }


def rebase(
    recipe: RecipeLike,
    *,
    to: str | None = None,
    to_wheel: str | Path | None = None,
    write: str | Path | None = None,
    today: str | None = None,
    probe_argv: list[str] | None = None,
    python: str | Path | None = None,
    static: bool = False,
    progress: Progress = _quiet,
) -> Rebased:
    """Carry the recipe's members onto ``to`` (``vllm==X.Y.Z``, fetched from the pin's index,
    its sha256 as the index records it) or ``to_wheel`` (a wheel file); with ``write``, a new
    recipe and the refreshed members of every member that is not a conflict go there (the
    original recipe and members are never touched).  With ``probe_argv`` (a rank's vllm serve
    argv), the probe's four arms run on the new tree with the members that carried, in
    ``python`` (default: the cached probe venv of the new vLLM, built on first use), whose
    installed vLLM must be the new tree's files."""
    from builder import newpin
    from builder.rebase import check_today, rebase_members, today_utc
    from builder.tree import WheelTree

    if (to is None) == (to_wheel is None):
        raise InputError("give one of --to vllm==X.Y.Z or --to-wheel PATH", field="rebase")
    if probe_argv is not None and not probe_argv:
        raise InputError("rebase --probe: give the rank's vllm serve argv after '--' (e.g. -- /models/v41 -tp 4)")
    recipe = recipe_of(recipe)
    members = load_recipe_members(recipe)
    new_pin = (
        newpin.local_pin(Path(to_wheel))
        if to_wheel is not None
        else newpin.resolve_pin("vllm", newpin.parse_target(to), recipe.vllm)
    )
    destination = None
    if write is not None:  # refused before anything is fetched
        destination = _destination(recipe, write, "--write", "rebase --write", "rk-pending")
    old_tree = pinned_tree(recipe.vllm)
    progress(f"rebase: vllm {new_pin.version} ({new_pin.wheel}, sha256 {new_pin.sha256})")
    wheel = newpin.fetch(new_pin, progress=_Stream(progress))
    new_tree = WheelTree(wheel)
    flashinfer, note = _new_flashinfer(recipe, wheel, to_wheel is not None, progress)
    torch, torch_note = _new_torch(recipe, wheel)
    rows = rebase_members(old_tree, new_tree, members, check_today(today or today_utc()))
    result = Rebased(recipe, new_pin, flashinfer, note, rows, torch, torch_note)
    if destination is not None:
        from dataclasses import replace

        from builder.rebase_write import write_rebased

        write_rebased(destination, result)
        progress(f"wrote the rebased recipe and {sum(r.written for r in rows)} members to {write}")
        result = replace(result, written=Path(write))
    if probe_argv is not None:
        from dataclasses import replace

        from builder.probe import probe as run_probe
        from builder.probe_env import ensure_probe_venv

        carried = tuple(r.member for r in rows if r.written)
        interpreter = Path(python) if python else ensure_probe_venv(new_pin.version, progress=progress)
        progress(f"rebase --probe: the self-test on vllm {new_pin.version} with {len(carried)} carried members")
        result = replace(result, probe=run_probe(new_tree, carried, interpreter, probe_argv, static))
    return result


def _new_torch(recipe: Recipe, wheel: Path) -> tuple[str | None, str]:
    """The image's torch requirement for the new vLLM: the version its METADATA pins, with the
    recipe's local suffix (e.g. +cu128) kept; None when the recipe names no torch."""
    from builder import newpin

    old = recipe.image.torch
    if old is None:
        return None, ""
    version, where = newpin.metadata_pin(wheel, "torch")
    if version is None:
        return old, f"kept: {where}"
    suffix = old.partition("+")[2]
    new = version + (f"+{suffix}" if suffix else "")
    return new, ("unchanged, " if new == old else f"was {old}; ") + f"{where} pins torch=={version}"


class _Stream:
    """A file-like progress for builder.pin's download lines."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def write(self, text: str) -> None:
        if text.strip():
            self.progress(text.rstrip("\n"))

    def flush(self) -> None:
        pass


def _new_flashinfer(recipe: Recipe, wheel: Path, local: bool, progress: Progress) -> tuple[Any, str]:
    """The FlashInfer pin the new vLLM's METADATA names, fetched and verified; or the old pin,
    and why."""
    from builder import newpin

    version, where = newpin.metadata_flashinfer(wheel)
    if version is None:
        return recipe.flashinfer, f"kept the old pin: {where}"
    if version == recipe.flashinfer.version:
        return recipe.flashinfer, f"unchanged, as {where} pins it"
    if local and recipe.flashinfer.path is not None:
        return recipe.flashinfer, f"kept the old local pin: {where} pins {version}"
    pin = newpin.resolve_pin("flashinfer-python", version, recipe.flashinfer)
    newpin.fetch(pin, progress=_Stream(progress))
    return pin, f"pinned by {where}; sha256 from {pin.index}"


def member_new(recipe: str | Path, name: str, *, after: str | None = None, today: str | None = None) -> Path:
    """overlay/NAME.patch with a header template (no diff yet), placed in the recipe's members
    after ``after`` (default: last); the recipe's other text and comments are kept."""
    import getpass

    from builder.rebase import check_today, today_utc
    from builder.workdir import new_member

    author = f"{getpass.getuser()} <{getpass.getuser()}@localhost>"
    return new_member(recipe, name, after, check_today(today or today_utc()), author)


def member_edit(
    recipe: RecipeLike,
    name: str,
    out: str | Path,
    *,
    files: list[str] | tuple[str, ...] = (),
    full: bool = False,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """A work directory: the pinned tree with the members up to and including NAME applied;
    only the files those members touch and ``files`` (``full``: every file)."""
    from builder.workdir import check_member, check_paths, edit

    recipe = recipe_of(recipe)
    check_member(recipe, name)  # before the tree is opened (or fetched)
    check_paths(list(files))
    try:  # the marker records the recipe's key; a member without a diff yet has none
        runtime = _keyed(recipe)[2]
    except InputError:
        runtime = "none (a member has no diff yet)"
    destination = _destination(recipe, out, "DIR", f"member edit {name}", runtime)
    tree = pinned_tree(recipe.vllm)
    info = edit(recipe, tree, name, destination, list(files), full, runtime)
    progress(f"wrote {'the full tree' if full else str(len(info['files'])) + ' files'} for {name} to {out}")
    return info


def member_refresh(recipe: RecipeLike, name: str, workdir: str | Path, *, today: str | None = None) -> Any:
    """NAME's diff regenerated from the work directory (its header kept, Last-Update set);
    refused, naming them, when later members would no longer apply (builder.workdir.Refreshed)."""
    from builder.rebase import check_today, today_utc
    from builder.workdir import check_member, check_workdir, refresh

    recipe = recipe_of(recipe)
    check_member(recipe, name)
    check_workdir(Path(workdir), recipe, name)  # before the tree is opened (or fetched)
    return refresh(recipe, pinned_tree(recipe.vllm), name, Path(workdir), check_today(today or today_utc()))
