"""The ``vllm-overlay`` command: parse arguments, call the library, report.

Exit codes: 0 success, 1 a check that did not pass, 2 bad input (one line,
naming the file, member, hunk or field; no traceback).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

from builder.errors import InputError, OverlayError

DEFAULT_RECIPE = "recipes/v41-sm120.yaml"


def _memo(args: argparse.Namespace, recipe):
    """The recipe's parse memo, saved by main() if the command succeeds."""
    from builder.members import ParseMemo

    memo = ParseMemo.for_recipe(recipe)
    args.memos.append(memo)
    return memo


def _members(args: argparse.Namespace, recipe):
    """The recipe's members, through its parse memo."""
    from builder.members import load_recipe_members

    return load_recipe_members(recipe, _memo(args, recipe))


def _load(args: argparse.Namespace):
    from builder.recipe import load_recipe
    from builder.tree import pinned_tree

    recipe = load_recipe(args.recipe)
    members = _members(args, recipe)
    return recipe, members, pinned_tree(recipe.vllm)


def cmd_key(args: argparse.Namespace) -> int:
    from builder.key import runtime_key, short_key
    from builder.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    key = runtime_key(recipe, _members(args, recipe))
    print(short_key(key) if args.short else key)
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    from builder.apply import apply_members
    from builder.key import runtime_key
    from builder.members import load_recipe_members
    from builder.output import manifest, write_full_tree, write_overlay
    from builder.pin import is_fetched
    from builder.recipe import load_recipe
    from builder.tree import pinned_tree
    from builder.workers import apply_to_dir

    recipe = load_recipe(args.recipe)
    memo = _memo(args, recipe)
    if args.out and not args.full_tree:  # the usual case, split across worker processes when there are many members
        if not is_fetched(recipe.vllm):  # a bad member is refused before 300 MB are fetched
            load_recipe_members(recipe)
        applied = apply_to_dir(recipe, pinned_tree(recipe.vllm), memo, Path(args.out))
        _progress_lines(applied.reports)
        _progress(f"wrote {applied.files} touched files and manifest.json to {args.out}")
        print(applied.key)
        return 0
    # in this process: no output, or a full tree too (which needs every patched file's bytes here)
    members = load_recipe_members(recipe, memo)
    tree = pinned_tree(recipe.vllm)
    overlay = apply_members(tree, members)
    key = runtime_key(recipe, members)
    _progress_lines([line for result in overlay.results for line in result.report()])
    data = manifest(recipe, overlay, key) if args.out or args.full_tree else None  # hashes every file
    if args.out:
        write_overlay(Path(args.out), overlay, data)
        _progress(f"wrote {len(overlay.changes)} touched files and manifest.json to {args.out}")
    if args.full_tree:
        write_full_tree(Path(args.full_tree), tree, overlay, data)
        _progress(f"wrote the full patched tree to {args.full_tree}")
    print(key)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from builder.check import check_overlay, render_table

    _, members, tree = _load(args)
    report = check_overlay(tree, members)
    print(json.dumps(report.to_json(), indent=2) if args.json else render_table(report))
    return 0 if report.ok else 1


def cmd_probe(args: argparse.Namespace) -> int:
    from builder.probe import probe, render_arms
    from builder.probe_env import ensure_probe_venv

    if not args.serve_argv:
        raise InputError("probe: give the rank's vllm serve argv after '--' (e.g. -- /models/v41 -tp 4)")
    recipe, members, tree = _load(args)
    python = Path(args.python) if args.python else ensure_probe_venv(recipe.vllm.version, progress=_progress)
    arms = probe(tree, members, python, args.serve_argv, args.static)
    print(render_arms(arms))
    return 0


def _image_inputs(args: argparse.Namespace):
    from builder.apply import apply_members
    from builder.key import runtime_key
    from builder.output import manifest
    from builder.render import context_files, render_image

    recipe, members, tree = _load(args)
    overlay = apply_members(tree, members)
    key = runtime_key(recipe, members)
    rendered = render_image(recipe, key)
    return recipe, rendered, context_files(rendered, overlay, manifest(recipe, overlay, key))


def cmd_dockerfile(args: argparse.Namespace) -> int:
    from builder.output import write_files

    _, rendered, files = _image_inputs(args)
    write_files(Path(args.out), files)
    print(f"wrote the build context ({len(files)} files) to {args.out}", file=sys.stderr)
    print(rendered.image_key)
    return 0


def cmd_image(args: argparse.Namespace) -> int:
    from builder import image as img
    from builder.produced import find_row

    recipe, rendered, files = _image_inputs(args)
    tags = img.tags_for(recipe, rendered)
    client = img.docker_client()
    built = img.local_image(client, rendered.image_key)
    digest = None
    if built is None and img.registry_of(recipe.image.repository):
        try:
            digest = img.in_registry(client, tags.image)
        except img.RegistryUnreachable as exc:
            _progress(f"warning: {exc}; building")
    if built is not None:
        _progress(f"up to date: an image with image key {rendered.image_key} is in the engine ({built.id})")
        img.tag_all(built, tags)  # this repository's tags may be missing (another repository built it)
    elif digest is not None:
        _progress(f"up to date: {tags.image} is in the registry ({digest})")
    else:
        _progress(f"building {tags.runtime} (image key {rendered.image_key})")
        built = img.build(client, recipe, rendered, files)
    if args.push and built is not None:
        digest = img.push(client, tags.all())
    if find_row(rendered.image_key) is None:
        img.record(recipe, rendered, tags.runtime, digest or built.id)
    print(tags.runtime)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from builder.plan import plan, write_github_output
    from builder.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    result = plan(recipe, _members(args, recipe))
    print("\n".join(result.lines()))
    write_github_output(result)
    return 0


def cmd_members(args: argparse.Namespace) -> int:
    from builder.recipe import load_recipe
    from builder.sources import generated_members, regenerate

    recipe = load_recipe(args.recipe)
    members = generated_members(recipe)
    if not members:
        _progress(f"no member of {args.recipe} is made from a source file")
    if args.check:
        for m in members:
            print(f"{m.name}: out of date with {m.name}.py" if m.stale else f"{m.name}: up to date")
        return 1 if any(m.stale for m in members) else 0
    regenerate(members)
    for m in members:
        print(f"{m.name}: regenerated" if m.stale else f"{m.name}: up to date")
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _progress_lines(lines: list[str]) -> None:
    if lines:
        _progress("\n".join(lines))  # one write: hundreds of members are reported at once


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-overlay", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE, help=f"recipe YAML (default {DEFAULT_RECIPE})")
        p.set_defaults(func=func)
        return p

    p = command("key", cmd_key, "print the recipe's runtime key")
    p.add_argument("--short", action="store_true", help="print the 16-digit form used in tags")
    p = command("apply", cmd_apply, "apply the members onto the pinned tree and write the overlay")
    p.add_argument("--out", metavar="DIR", help="write the touched files and manifest.json here")
    p.add_argument("--full-tree", metavar="DIR", help="write the complete patched tree here")
    p = command("check", cmd_check, "say of each member whether it applies to the unpatched tree")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = command(
        "probe", cmd_probe, "run the SM120 kernel-route self-test in four arms (unpatched/patched x as given/text-only)"
    )
    p.add_argument(
        "--python",
        metavar="PY",
        help="an interpreter where the pinned vLLM is importable (default: the cached probe venv, built on first use)",
    )
    p.add_argument("--static", action="store_true", help="judge on the static checks alone (no SM120 device here)")
    p.epilog = "The rank's vllm serve argv follows '--'."
    p = command(
        "dockerfile", cmd_dockerfile, "write the image build context (Dockerfile, checks, manifest, overlay files)"
    )
    p.add_argument("--out", metavar="DIR", required=True, help="the context directory")
    p = command("image", cmd_image, "build the recipe's image (unless one with its key exists), tag it, record it")
    p.add_argument("--push", action="store_true", help="push the rk-, ik- and recipe-name tags")
    command("plan", cmd_plan, "for CI: rebuild or up-to-date, from the keys, the produced rows and the registry")
    p = command("members", cmd_members, "write each member made from a source file (overlay/<name>.py) from it")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if any is out of date")
    return parser


def main(argv: list[str] | None = None) -> int:
    # What a run allocates is acyclic, and the members and the wheel's index it loads live
    # until it ends: the cyclic collector's passes over them were a tenth of a 500-member
    # apply.  Collect far less often (mypy raises its threshold for the same reason).
    gc.set_threshold(50_000, 20, 100)
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_argv: list[str] = []
    if "--" in argv:  # everything after it is the rank's vllm serve argv, passed on untouched
        at = argv.index("--")
        argv, serve_argv = argv[:at], argv[at + 1 :]
    args = build_parser().parse_args(argv)
    args.serve_argv = serve_argv
    args.memos = []
    try:
        code = args.func(args)
        if code == 0:
            for memo in args.memos:  # only a run that succeeded leaves anything in the cache
                memo.save()
        return code
    except OverlayError as exc:
        print(f"vllm-overlay: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("vllm-overlay: interrupted", file=sys.stderr)
        return 130
