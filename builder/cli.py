"""The ``vllm-overlay`` command: parse arguments, call the library (builder.api), print.

Exit codes: 0 success, 1 a check or build that said no, 2 bad input (one line,
naming the file, member, hunk or field; nothing changed on disk), 3 a service
that did not answer or a disk that refused a write (builder.errors); 70 an
internal error (one line asking for a report; the traceback with --debug);
130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

from builder import api
from builder.errors import InputError, OverlayError

DEFAULT_RECIPE = "recipes/v41-sm120.yaml"


def cmd_key(args: argparse.Namespace) -> int:
    from builder.key import short_key

    key = api.key(args.recipe)
    print(short_key(key) if args.short else key)
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    applied = api.apply(args.recipe, out=args.out, full_tree=args.full_tree, progress=api.stderr_progress)
    print(applied.key)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from builder.check import render_table

    report = api.check(args.recipe)
    print(json.dumps(report.to_json(), indent=2) if args.json else render_table(report))
    return 0 if report.ok else 1


def cmd_probe(args: argparse.Namespace) -> int:
    from builder.probe import render_arms

    arms = api.probe(args.recipe, args.serve_argv, python=args.python, static=args.static, progress=api.stderr_progress)
    print(render_arms(arms))
    return 0


def cmd_dockerfile(args: argparse.Namespace) -> int:
    context = api.render(args.recipe, out=args.out)
    api.stderr_progress(f"wrote the build context ({len(context.files)} files) to {args.out}")
    print(context.image_key)
    return 0


def cmd_image(args: argparse.Namespace) -> int:
    made = api.build_image(args.recipe, push=args.push, progress=api.stderr_progress)
    print(made.reference)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from builder.plan import write_github_output

    result = api.plan(args.recipe)
    print("\n".join(result.lines()))
    write_github_output(result)
    return 0


def cmd_lock(args: argparse.Namespace) -> int:
    lock = api.lock(args.recipe, progress=api.stderr_progress)
    print(lock.path)
    return 0


def cmd_members(args: argparse.Namespace) -> int:
    members = api.generated_members(args.recipe, write=not args.check)
    if not members:
        api.stderr_progress(f"no member of {args.recipe} is made from a source file")
    if args.check:
        for m in members:
            print(f"{m.name}: out of date with {m.name}.py" if m.stale else f"{m.name}: up to date")
        return 1 if any(m.stale for m in members) else 0
    for m in members:
        print(f"{m.name}: regenerated" if m.stale else f"{m.name}: up to date")
    return 0


def cmd_pin_base(args: argparse.Namespace) -> int:
    pinned = api.pin_base(args.recipe, update=args.update)
    if pinned.written and pinned.previous is None:
        api.stderr_progress(f"pinned {pinned.name} at {pinned.digest} in {pinned.recipe}")
    elif pinned.written:
        api.stderr_progress(f"{pinned.name} moved from {pinned.previous}; pinned at {pinned.digest} in {pinned.recipe}")
    elif pinned.moved:
        api.stderr_progress(
            f"{pinned.name} moved: the recipe pins {pinned.previous}, the tag is now {pinned.digest};"
            " run pin-base --update to pin it"
        )
        print(pinned.previous)
        return 1
    else:
        api.stderr_progress(f"{pinned.name} is pinned at its tag's current digest")
    print(pinned.digest)
    return 0


def cmd_launch_argv(args: argparse.Namespace) -> int:
    argv = api.launch_argv(args.profile, args.rank)
    print(json.dumps(argv) if args.json else shlex.join(argv))
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    result = api.gate(args.profile, static=args.static, timeout=args.timeout, progress=api.stderr_progress)
    print(result.table())
    print(f"receipt {result.receipt}")
    return 0 if result.passed else 1


def cmd_launch_up(args: argparse.Namespace) -> int:
    result = api.launch_up(args.profile, static=args.static, timeout=args.timeout, progress=api.stderr_progress)
    print(result.table())
    print(f"receipt {result.receipt}")
    if not result.passed:
        api.stderr_progress("vllm-overlay: launch: nothing started: the gate failed")
        return 1
    for c in result.containers:
        print(f"started {c['rank']} on {c['engine']}: {c['name']} {c['id'][:12]}")
    return 0


def _print_containers(found: list, verb: str) -> int:
    failed = False
    for engine in found:
        for c in engine.containers:
            print(f"{verb}{c['rank']}  {engine.engine}  {c['name']}  {c['id'][:12]}  {c.get('status', '')}".rstrip())
        if engine.failure is not None:
            api.stderr_progress(f"vllm-overlay: {engine.failure}")
            failed = True
    if not any(engine.containers for engine in found):
        api.stderr_progress("no containers of this profile" + (" removed" if verb else ""))
    return 3 if failed else 0


def cmd_launch_status(args: argparse.Namespace) -> int:
    return _print_containers(api.launch_status(args.profile), "")


def cmd_launch_down(args: argparse.Namespace) -> int:
    return _print_containers(api.launch_down(args.profile), "removed ")


class _Parser(argparse.ArgumentParser):
    """argparse, whose errors (usage and a message, from the top level or a command) become
    the one line every other error is."""

    def error(self, message: str) -> NoReturn:
        raise InputError(
            f"{message} (see {self.prog} --help)", field=self.prog.removeprefix("vllm-overlay").strip() or None
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vllm-overlay", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="on an internal error, show its traceback")
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
    command("lock", cmd_lock, "resolve the image's packages with uv (every file by sha256) into <recipe name>.lock")
    p = command("members", cmd_members, "write each member made from a source file (overlay/<name>.py) from it")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if any is out of date")
    p = command("pin-base", cmd_pin_base, "resolve image.base's tag to its digest (registry API); pin it in the recipe")
    p.add_argument("--update", action="store_true", help="when the tag moved from the pinned digest, pin the new one")

    def gated(p: argparse.ArgumentParser) -> None:
        p.add_argument("profile", help="launch profile YAML (e.g. recipes/launch/v41-sm120.yaml)")
        p.add_argument(
            "--static", action="store_true", help="judge on the static checks alone (recorded; never implied)"
        )
        p.add_argument("--timeout", type=float, metavar="S", help="seconds each rank's self-test may run (default 900)")

    p = sub.add_parser(
        "gate",
        help="run the self-test in the produced image on every rank's engine, with its exact argv; write a receipt",
        description="run the self-test in the produced image on every rank's engine; write a receipt",
    )
    gated(p)
    p.set_defaults(func=cmd_gate)

    # launch ACTION PROFILE: one sub-action per step of a launch.
    launch = sub.add_parser(
        "launch", help="launch profiles: argv, and up/status/down behind the gate", description="launch profiles"
    )
    actions = launch.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser(
        "argv", help="print a rank's exact vllm serve argv", description="print a rank's exact vllm serve argv"
    )
    p.add_argument("profile", help="launch profile YAML (e.g. recipes/launch/v41-sm120.yaml)")
    p.add_argument("--rank", required=True, metavar="NAME", help="the rank's name in the profile")
    p.add_argument("--json", action="store_true", help="a JSON list instead of a shell-quoted line")
    p.set_defaults(func=cmd_launch_argv)
    p = actions.add_parser(
        "up", help="run the gate; only if every rank passed, start each rank's container with the gated argv"
    )
    gated(p)
    p.set_defaults(func=cmd_launch_up)
    for name, func, text in (
        ("status", cmd_launch_status, "list the profile's containers (by its profile key label) on each engine"),
        ("down", cmd_launch_down, "stop and remove the profile's containers (by its profile key label)"),
    ):
        p = actions.add_parser(name, help=text, description=text)
        p.add_argument("profile", help="launch profile YAML")
        p.set_defaults(func=func)
    add_rebase_commands(sub)
    add_member_commands(sub)
    return parser


INTERNAL_ERROR = 70  # EX_SOFTWARE: a bug in this tool, never an input's fault


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # a path that is not UTF-8 must not fail the report of it
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_argv: list[str] = []
    if "--" in argv:  # everything after it is the rank's vllm serve argv, passed on untouched
        at = argv.index("--")
        argv, serve_argv = argv[:at], argv[at + 1 :]
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        args.serve_argv = serve_argv
        return args.func(args)
    except OverlayError as exc:
        print(f"vllm-overlay: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("vllm-overlay: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): as a pipeline expects, no report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:  # a bug: one line and where, the traceback only when asked for
        if debug:
            raise
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{Path(frame.filename).name}:{frame.lineno}"
        print(
            f"vllm-overlay: internal error: {type(exc).__name__}: {exc} (at {where}); please report it,"
            " with the output of the same command run with --debug",
            file=sys.stderr,
        )
        return INTERNAL_ERROR


# ---------------------------------------------------------------- rebase and the member workflow


def cmd_rebase(args: argparse.Namespace) -> int:
    from builder.probe import render_arms

    if args.serve_argv and not args.probe:
        raise InputError("an argv after '--' is for --probe", field="rebase")
    result = api.rebase(
        args.recipe,
        to=args.to,
        to_wheel=args.to_wheel,
        write=args.write,
        probe_argv=args.serve_argv if args.probe else None,
        python=args.python,
        static=args.static,
        progress=api.stderr_progress,
    )
    if args.json:
        data = result.to_json()
        if result.probe is not None:
            data["probe"] = [
                {"tree": a.tree, "argv": a.argv, "routes": a.run.routes, "verdict": a.run.verdict} for a in result.probe
            ]
        print(json.dumps(data, indent=2))
    else:
        print(result.table())
        if result.probe is not None:
            print()
            print(render_arms(result.probe))
    return 1 if result.conflicts else 0  # the probe's table informs, as the probe command's does


def add_rebase_commands(sub: Any) -> None:
    p = sub.add_parser(
        "rebase",
        help="carry the members onto a newer vLLM: a per-member report, and with --write a new recipe",
        description="carry the members onto a newer vLLM: a per-member report, and with --write a new recipe",
    )
    p.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE, help=f"recipe YAML (default {DEFAULT_RECIPE})")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to", metavar="vllm==X.Y.Z", help="the new vLLM release (fetched from the pin's index)")
    to.add_argument("--to-wheel", metavar="PATH", help="a vLLM wheel file on this machine")
    p.add_argument("--write", metavar="DIR", help="write the new recipe and the refreshed members here")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--probe", action="store_true", help="then run the probe (the self-test's table) on the new tree; argv after --"
    )
    p.add_argument("--python", metavar="PY", help="with --probe: an interpreter where the new vLLM is importable")
    p.add_argument("--static", action="store_true", help="with --probe: judge on the static checks alone")
    p.set_defaults(func=cmd_rebase)


def cmd_member_new(args: argparse.Namespace) -> int:
    path = api.member_new(args.recipe, args.name, after=args.after)
    print(path)
    api.stderr_progress(f"edit its header, then: vllm-overlay member edit {args.name} DIR --recipe {args.recipe}")
    return 0


def cmd_member_edit(args: argparse.Namespace) -> int:
    info = api.member_edit(
        args.recipe, args.name, args.dir, files=args.file or (), full=args.full, progress=api.stderr_progress
    )
    for path in info["files"]:
        print(path)
    return 0


def cmd_member_refresh(args: argparse.Namespace) -> int:
    result = api.member_refresh(args.recipe, args.name, args.dir)
    verb = "refreshed" if result.changed else "unchanged"
    print(f"{verb} {result.name}: {', '.join(result.files)}")
    return 0


def add_member_commands(sub: Any) -> None:
    member = sub.add_parser(
        "member",
        help="the member workflow: new, edit in a work directory, refresh",
        description="the member workflow: new, edit in a work directory, refresh",
    )
    actions = member.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, func: Any, text: str) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=text, description=text)
        p.add_argument("name", help="the member's name")
        p.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"recipe YAML (default {DEFAULT_RECIPE})")
        p.set_defaults(func=func)
        return p

    p = action("new", cmd_member_new, "write overlay/NAME.patch (a header template) and place it in the recipe")
    p.add_argument("--after", metavar="OTHER", help="place it after this member (default: last)")
    p = action("edit", cmd_member_edit, "a work directory: the pinned tree with the members up to NAME applied")
    p.add_argument("dir", metavar="DIR", help="the work directory (made, or replaced if an earlier one)")
    p.add_argument(
        "--file", action="append", metavar="PATH", help="a tree path to include too, or a file to create (repeatable)"
    )
    p.add_argument("--full", action="store_true", help="every file of the tree, not only the touched ones")
    p = action("refresh", cmd_member_refresh, "regenerate NAME's diff from its work directory")
    p.add_argument("dir", metavar="DIR", help="the work directory member edit made")
