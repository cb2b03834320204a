"""Lock: the image's whole package set, every file by sha256, resolved once and checked in.

``vllm-overlay lock RECIPE`` runs uv's cross-platform resolver (``uv pip
compile``) for the image's platform, never this machine's: Linux x86-64 with
the recipe's image.python, from the recipe's indexes (image.pip), for exactly
the requirements the image asks for (builder.render.requirement_list).  It
installs nothing.  The result is ``<recipe dir>/<recipe name>.lock``, a pip
requirements file with ``--hash`` lines, under one header line recording the
sha256 of those inputs, so a lock that no longer matches its recipe is told
(``lock_problem``) and never built from.

In mode cuda a recipe has its lock or ``image.unlocked: <reason>``, never both
and never neither (``image_lock``); mode vllm installs nothing and has neither.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from builder.cache import MIB, atomic_write, cache_root, read_regular
from builder.errors import CheckFailed, InputError, ServiceUnreachable, StorageFailed
from builder.recipe import Recipe

LOCK_FORMAT = 1
# The image's platform.  manylinux_2_35 admits vLLM's +cu128 release wheel (manylinux_2_35) and
# everything older, and runs on any glibc >= 2.35: Ubuntu 24.04's 2.39 and Debian 12's 2.36 (the
# test base).  uv names it x86_64-manylinux_2_35 (`uv pip compile --help`, --python-platform).
PLATFORM = "x86_64-manylinux_2_35"
# pip, which installs the unlocked image, takes the best version over all indexes; so does this.
# uv's default (the first index that has the project) would also lock the projects PyTorch's index
# mirrors (numpy, jinja2, ...) to that mirror's few old versions.  Picking a version over all
# indexes is what the "unsafe" warns of: the hashes it records keep a later upload out.
INDEX_STRATEGY = "unsafe-best-match"
LOCK_LIMIT = 16 * MIB
HEADER_RE = re.compile(r"# vllm-overlay lock inputs sha256:([0-9a-f]{64})")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Entry:
    """One locked requirement: ``name==version`` or ``name @ url``, with its files' sha256."""

    name: str  # normalized (PEP 503)
    version: str | None
    url: str | None
    hashes: tuple[str, ...]


@dataclass(frozen=True)
class Lock:
    path: Path
    data: bytes
    inputs: str  # the recorded sha256 of the inputs it was resolved from
    entries: dict[str, Entry]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def lock_path(recipe: Recipe) -> Path:
    return recipe.path.parent / f"{recipe.name}.lock"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def inputs_material(recipe: Recipe) -> bytes:
    """Everything the resolution depends on, and nothing else (not members, base or labels)."""
    from builder.render import requirement_list

    pip = recipe.image.pip
    lines = [
        f"vllm-overlay-lock {LOCK_FORMAT}",
        f"platform {PLATFORM}",
        f"python {recipe.image.python}",
        f"index-strategy {INDEX_STRATEGY}",
        f"index-url {pip.index_url}",
        *(f"extra-index-url {url}" for url in pip.extra_index_urls),
        *(f"find-links {url}" for url in pip.find_links),
        *(f"trusted-host {host}" for host in pip.trusted_hosts),
        f"no-deps {'yes' if pip.no_deps else 'no'}",
        *(f"requirement {r}" for r in requirement_list(recipe)),
    ]
    return ("\n".join(lines) + "\n").encode()


def inputs_digest(recipe: Recipe) -> str:
    return hashlib.sha256(inputs_material(recipe)).hexdigest()


# ---------------------------------------------------------------- reading


def parse_lock(path: Path, data: bytes) -> Lock:
    """A lock as this module writes it; anything else is an InputError naming the file and line."""

    def bad(line: int, what: str) -> InputError:
        return InputError(f"{what}; not a lock vllm-overlay wrote: run `vllm-overlay lock` again", file=path, line=line)

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise bad(1, "not UTF-8") from None
    lines = text.splitlines()
    header = HEADER_RE.fullmatch(lines[0]) if lines else None
    if header is None:
        raise bad(1, "no '# vllm-overlay lock inputs sha256:...' first line")
    entries: dict[str, Entry] = {}
    logical, start = "", 0
    for number, raw in enumerate(lines, 1):
        if raw.lstrip().startswith("#"):
            continue
        line = raw.split(" #", 1)[0].rstrip()  # a URL's #sha256= fragment has no space before it
        if not logical:
            start = number
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        if logical.strip():
            entry = _entry(logical.split())
            if entry is None:
                raise bad(start, f"unreadable requirement {logical.strip()[:80]!r}")
            if entry.name in entries:
                raise bad(start, f"{entry.name} is locked twice")
            entries[entry.name] = entry
        logical = ""
    if logical.strip():
        raise bad(start, "the last requirement continues past the end of the file")
    return Lock(path, data, header.group(1), entries)


_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"


def _entry(tokens: list[str]) -> Entry | None:
    hashes = tuple(t.removeprefix("--hash=sha256:") for t in tokens if t.startswith("--hash="))
    words = [t for t in tokens if not t.startswith("--hash=")]
    if not hashes or not all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes):
        return None
    if len(words) == 1 and (m := re.fullmatch(rf"({_NAME})==(\S+)", words[0])):
        return Entry(normalize(m.group(1)), m.group(2), None, hashes)
    if len(words) == 3 and words[1] == "@" and re.fullmatch(_NAME, words[0]):
        return Entry(normalize(words[0]), None, words[2], hashes)
    return None


def read_lock(recipe: Recipe) -> Lock | None:
    """The recipe's lock file, parsed; None when there is none."""
    path = lock_path(recipe)
    try:
        data = read_regular(path, LOCK_LIMIT, "a lock")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"cannot read the lock: {exc.strerror or exc}", file=path) from None
    return parse_lock(path, data)


def image_lock(recipe: Recipe) -> Lock | None:
    """The lock the image installs from: mode cuda needs its lock or image.unlocked, one of
    them; mode vllm installs nothing and has neither.  The rule is told before the lock is read."""
    path = lock_path(recipe)
    present = os.path.lexists(path)
    if recipe.image.mode != "cuda":
        if present:
            raise InputError(f"mode vllm installs nothing, so {path} is never used: remove it", file=recipe.path)
        return None
    if present and recipe.image.unlocked:
        raise InputError(
            f"the recipe has its lock {path}: remove image.unlocked (or the lock)",
            file=recipe.path,
            field="image.unlocked",
        )
    if not present and not recipe.image.unlocked:
        raise InputError(
            f"no lock {path}: run `vllm-overlay lock {recipe.path}` (or, if its indexes cannot be reached, "
            "set image.unlocked: <why>)",
            file=recipe.path,
        )
    lock = read_lock(recipe) if present else None
    if present and lock is None:  # a dangling symlink
        raise InputError("cannot read the lock: it points to no file", file=path)
    return lock


def lock_problem(recipe: Recipe, lock: Lock | None) -> str | None:
    """Why ``lock`` does not match ``recipe`` (one line saying what to run), or None."""
    if lock is None:
        return None
    problems = []
    if lock.inputs != inputs_digest(recipe):
        problems.append("made for other inputs than the recipe's (its pins, image.python, image.pip or image.torch)")
    vllm, flashinfer = lock.entries.get("vllm"), lock.entries.get("flashinfer-python")
    wheel = recipe.image.vllm_wheel
    if vllm is None:
        problems.append("vllm is not locked")
    elif wheel is None:
        if vllm.version != recipe.vllm.version:
            problems.append(f"vllm is locked at {vllm.version}, the recipe pins {recipe.vllm.version}")
        elif recipe.vllm.sha256 not in vllm.hashes:
            problems.append("vllm's hashes do not include vllm.sha256")
    elif (vllm.url or "").split("#")[0] != wheel.url.split("#")[0]:
        problems.append(f"vllm is locked from {vllm.url or vllm.version}, the recipe names {wheel.url}")
    elif wheel.sha256 and wheel.sha256 not in vllm.hashes:
        problems.append("vllm's hashes do not include image.vllm_wheel.sha256")
    if flashinfer is None:
        problems.append("flashinfer-python is not locked")
    elif flashinfer.version != recipe.flashinfer.version:
        problems.append(
            f"flashinfer-python is locked at {flashinfer.version}, the recipe pins {recipe.flashinfer.version}"
        )
    elif recipe.flashinfer.sha256 not in flashinfer.hashes:
        problems.append("flashinfer-python's hashes do not include flashinfer.sha256")
    torch = lock.entries.get("torch")
    if recipe.image.torch and (torch is None or torch.version != recipe.image.torch):
        problems.append(
            f"torch is locked at {torch.version if torch else 'nothing'}, the recipe says {recipe.image.torch}"
        )
    if not problems:
        return None
    return f"{lock.path}: lock does not match the recipe: {'; '.join(problems)}: run `vllm-overlay lock {recipe.path}`"


def lock_report(recipe: Recipe) -> str | None:
    """For check: what is wrong with the recipe's lock file, if it has one (mode cuda)."""
    if recipe.image.mode != "cuda" or not os.path.lexists(lock_path(recipe)):
        return None
    return lock_problem(recipe, image_lock(recipe))


# ---------------------------------------------------------------- making


def header(recipe: Recipe) -> bytes:
    return (
        f"# vllm-overlay lock inputs sha256:{inputs_digest(recipe)}\n"
        f"# Written by `vllm-overlay lock` (uv pip compile for {PLATFORM}, Python {recipe.image.python}):\n"
        "# every file the image installs, by sha256.  Do not edit: run it again when the recipe's\n"
        "# pins, image.python, image.pip or image.torch change (check and plan say when).\n"
    ).encode()


def uv_command(recipe: Recipe) -> list[str]:
    import uv

    from builder.render import index_option_list

    pip = recipe.image.pip
    command = [uv.find_uv_bin(), "pip", "compile", "requirements.in"]
    command += ["--python-platform", PLATFORM, "--python-version", recipe.image.python]
    command += ["--generate-hashes", "--index-strategy", INDEX_STRATEGY]
    command += index_option_list(recipe, trusted_host_flag="--allow-insecure-host")
    if pip.no_deps:
        command.append("--no-deps")
    # Wheels only: no sdist is built to read its metadata (by this machine's Python, not the image's)
    # nor later in the image.  No user or project uv.toml, no Python download, our own header.
    command += ["--no-build", "--no-config", "--no-python-downloads", "--no-header", "--color", "never"]
    return command + ["--cache-dir", str(cache_root() / "uv")]


def make_lock(recipe: Recipe, progress: Progress) -> Lock:
    """Resolve and write the recipe's lock (atomically); nothing is written when uv fails."""
    from builder.render import requirement_list

    if recipe.image.mode != "cuda":
        raise InputError("mode vllm installs nothing: there is nothing to lock", file=recipe.path, field="image.mode")
    path = lock_path(recipe)
    _refuse_foreign(path)
    indexes = ", ".join((recipe.image.pip.index_url, *recipe.image.pip.extra_index_urls, *recipe.image.pip.find_links))
    progress(f"lock: resolving for {PLATFORM}, Python {recipe.image.python}, from {indexes}")
    # uv's own settings from the environment (UV_INDEX_URL, UV_CONSTRAINT, ...) would change what it resolves.
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-lock-") as work:
        Path(work, "requirements.in").write_text("".join(r + "\n" for r in requirement_list(recipe)))
        with open(Path(work, "out.txt"), "wb") as out:
            proc = subprocess.Popen(
                uv_command(recipe), cwd=work, env=env, stdout=out, stderr=subprocess.PIPE, text=True, errors="replace"
            )
            said: list[str] = []
            assert proc.stderr is not None
            for line in proc.stderr:
                said.append(line.rstrip())
                # uv's error and its causes become our one line; and with --no-build no Python builds anything.
                if not any(s.startswith("error:") for s in said) and "will be used to build" not in line:
                    progress("uv: " + line.rstrip())
            code = proc.wait()
        if code != 0:
            raise _failure(recipe, said)
        body = Path(work, "out.txt").read_bytes()
    data = header(recipe) + body
    lock = parse_lock(path, data)  # what we write must read back; a uv that says otherwise is a bug
    try:
        atomic_write(path, data)
    except OSError as exc:
        raise StorageFailed(f"cannot write the lock: {exc.strerror or exc}", file=path) from None
    progress(f"lock: wrote {path} ({len(lock.entries)} packages)")
    if recipe.image.unlocked:
        progress(f"lock: {recipe.path} still says image.unlocked: remove it to build from the lock")
    return lock


def _refuse_foreign(path: Path) -> None:
    """A file at the lock's path that does not start with this tool's header is the user's: never
    replaced (before uv runs, so nothing is resolved for nothing)."""
    if not (path.exists() or path.is_symlink()):
        return
    try:
        first = read_regular(path, LOCK_LIMIT, "a lock").split(b"\n", 1)[0]
    except OSError as exc:
        raise InputError(f"cannot read what is at the lock's path: {exc.strerror or exc}", file=path) from None
    if not HEADER_RE.fullmatch(first.decode("utf-8", "replace").rstrip("\r")):
        raise InputError("is there and is not a lock vllm-overlay wrote: not replacing it", file=path)


NETWORK_SIGNS = ("error sending request", "tcp connect error", "dns error", "Connection refused", "timed out")
FETCH_RE = re.compile(r"Failed to (?:fetch|download)[:\s`]+(?:[^`\s]+ @ )?([a-z+]+://[^\s`]+)")


def _failure(recipe: Recipe, said: list[str]) -> Exception:
    """uv's failure as one line: an unreachable index (exit 3) named as the recipe names it, else
    what the resolver said (exit 1)."""
    text = "\n".join(said)
    if any(sign in text for sign in NETWORK_SIGNS):
        url = next((m.group(1) for m in FETCH_RE.finditer(text)), None)
        pip, wheel = recipe.image.pip, recipe.image.vllm_wheel
        sources = [("package index", u) for u in (*pip.extra_index_urls, pip.index_url)]
        sources += [("find-links", u) for u in pip.find_links] + (
            [("image.vllm_wheel.url", wheel.url)] if wheel else []
        )
        what, source = next(
            ((what, s) for what, s in sources if url and url.startswith(s.rstrip("/"))), ("package index", url or "?")
        )
        cause = [line.strip().removeprefix("cause: ") for line in said if line.strip().startswith("cause:")]
        return ServiceUnreachable(
            f"lock: {what} {source} cannot be reached ({cause[-1] if cause else 'no answer'}); nothing written",
            file=recipe.path,
        )
    first = next((i for i, line in enumerate(said) if line.startswith("error:")), 0)
    error = [re.sub(r"^(error|cause|hint): ", "", line.strip()) for line in said[first:] if line.strip()]
    return CheckFailed(
        f"lock: uv could not resolve the requirements: {'; '.join(error) or 'no reason given'}; nothing written",
        file=recipe.path,
    )
