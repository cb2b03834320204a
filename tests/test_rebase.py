"""rebase: the default overlay carried from vLLM 0.30.0 onto the real 0.31.0, 0.32.0 and 0.33.0
wheels (fetched once through the pinning path into the cache, sha256 from PyPI's index), each
report checked against facts read from the trees here, independently of the code under test;
--write's recipe checks; real upstream changes read "already upstream"; a moved file is found;
a conflict shows its hunk, the nearest region and the three-way text.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import urllib.request
import zipfile
from pathlib import Path

import pytest

from builder import api
from builder.apply import apply_members
from builder.errors import InputError
from builder.members import load_recipe_members
from builder.merge3 import merge, unified_hunks
from builder.newpin import fetch, resolve_pin
from builder.recipe import load_recipe
from builder.tree import WheelTree
from tests.helpers import run_cli, snapshot
from tools.synthetic import DEFAULT_RECIPE, ROOT, git_diff, member_text, write_recipe

ATTENTION = "vllm/models/deepseek_v41/attention.py"
SPARSE = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
SWA = "sm120_swa_page_block_size"
SELFTEST = "sm120_decode_shape_selftest"
VERSIONS = ("0.31.0", "0.32.0", "0.33.0")
TODAY = "2026-12-01"
# checkpoints: written once per session (the probe tests)
pytest_plugins = ["tests.selftest_runs"]


# ---- fixtures ---------------------------------------------------------------


@pytest.fixture(scope="session")
def new_wheels(vllm_wheel) -> dict[str, Path]:
    """The real newer vLLM wheels, fetched once (PyPI) and sha256-checked like any pin (through
    vllm_wheel these tests are marked `wheel`: `make test-fast` leaves them out)."""
    like = load_recipe(DEFAULT_RECIPE).vllm
    return {v: fetch(resolve_pin("vllm", v, like)) for v in VERSIONS}


@pytest.fixture(scope="session")
def rebased(new_wheels) -> dict[str, api.Rebased]:
    return {v: api.rebase(DEFAULT_RECIPE, to=f"vllm=={v}", today=TODAY) for v in VERSIONS}


def read(wheel: Path, path: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(path)


def line_of(data: bytes, text: bytes, after: bytes | None = None) -> int:
    """The 1-based line of the one line equal to ``text`` (after the first line equal to ``after``)."""
    lines = data.splitlines(keepends=True)
    start = lines.index(after) if after is not None else 0
    found = [i for i, line in enumerate(lines) if i >= start and line == text]
    assert len(found) == 1, (text, found)
    return found[0] + 1


def row(result: api.Rebased, name: str):
    return next(r for r in result.rows if r.name == name)


# ---- the default overlay onto the real newer pins ---------------------------


def test_new_pin_sha256_is_pypis(new_wheels):
    """The recorded sha256 is what PyPI's HTML simple page (PEP 503, not the JSON form the
    code reads) gives in the wheel's link, and the bytes' own."""
    req = urllib.request.Request("https://pypi.org/simple/vllm/", headers={"Accept": "text/html"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        page = resp.read().decode()
    for wheel in new_wheels.values():
        published = re.search(rf'href="[^"]*/{re.escape(wheel.name)}#sha256=([0-9a-f]{{64}})"', page).group(1)
        assert wheel.parent.name == published
        assert hashlib.sha256(wheel.read_bytes()).hexdigest() == published


@pytest.mark.parametrize("version", VERSIONS)
def test_report_matches_the_new_tree(version, rebased, new_wheels, vllm_wheel):
    result = rebased[version]
    old_att, new_att = read(vllm_wheel, ATTENTION), read(new_wheels[version], ATTENTION)
    old_sp, new_sp = read(vllm_wheel, SPARSE), read(new_wheels[version], SPARSE)
    member = load_recipe_members(load_recipe(DEFAULT_RECIPE))[0]
    # facts of the trees: the first hunk's context is gone, block_size=32 is still there with a
    # changed line after it, and the SM120 class's use_fp8_ds_mla_layout line moved
    assert member.files[0].hunks[0].old_block not in new_att
    block = b"            block_size=32,\n"
    old_block_line, new_block_line = line_of(old_att, block), line_of(new_att, block)
    old_next = old_att.splitlines()[old_block_line]
    new_next = new_att.splitlines()[new_block_line]
    assert old_next != new_next
    anchor = b"    use_fp8_ds_mla_layout: ClassVar[bool] = True\n"
    cls = b"class DeepseekV4FlashInferSM120Attention(DeepseekV4Attention):\n"
    shift = line_of(new_sp, anchor, after=cls) - line_of(old_sp, anchor, after=cls)
    assert shift != 0
    assert not any(
        name.endswith("sm120_decode_shape_selftest.py") for name in zipfile.ZipFile(new_wheels[version]).namelist()
    )

    swa = row(result, SWA)
    assert swa.status == "carried by a three-way merge"
    assert swa.files == [
        {"file": ATTENTION, "how": "three-way merge"},
        {"file": SPARSE, "how": f"applies with offset {shift:+d} lines"},
    ]
    # the block_size line is carried and flagged: it lands 3 lines lower (the class attribute's
    # three added lines come before it), next to upstream's changed line
    assert len(swa.review) == 1
    review = swa.review[0]
    assert review["file"] == ATTENTION
    assert review["line"] == new_block_line + 3
    assert review["lines"] == ["            block_size=self.swa_block_size,"]
    assert review["upstream_now"] == [new_next.decode()]
    assert review["upstream_changed_line"] == old_block_line + 1
    assert row(result, SELFTEST).status == "applies"
    assert result.conflicts == []
    table = result.table()
    assert f"review {ATTENTION}:{new_block_line + 3}" in table
    assert "rebase: 2 of 2 members carried" in table

    # the refreshed member applies to the new tree, and says what the old one said there
    patched = apply_members(WheelTree(new_wheels[version]), [swa.member]).by_path()
    att = patched[ATTENTION].after.decode()
    assert att.splitlines()[new_block_line + 2] == "            block_size=self.swa_block_size,"
    assert "    swa_block_size: ClassVar[int] = 32\n" in att
    assert "Last-Update: " + TODAY in swa.text.decode()
    assert swa.text.decode().startswith("Description: Use 64-token pages")


def test_flashinfer_pin_read_from_the_new_metadata(rebased, new_wheels):
    for version, wheel in new_wheels.items():
        with zipfile.ZipFile(wheel) as zf:
            meta = zf.read(f"vllm-{version}.dist-info/METADATA").decode()
        pinned = [
            line.split("==")[1] for line in meta.splitlines() if line.startswith("Requires-Dist: flashinfer-python==")
        ]
        assert [rebased[version].new_flashinfer.version] == pinned
        fi = rebased[version].new_flashinfer
        cached = Path(fetch(fi))
        assert hashlib.sha256(cached.read_bytes()).hexdigest() == fi.sha256


def test_written_033_recipe_checks(rebased, new_wheels, tmp_path):
    before = snapshot(ROOT / "overlay") | {"recipe": DEFAULT_RECIPE.read_bytes()}
    out = tmp_path / "rebased"
    proc = run_cli("rebase", DEFAULT_RECIPE, "--to", "vllm==0.33.0", "--write", out)
    assert proc.returncode == 0, proc.stderr
    assert snapshot(ROOT / "overlay") | {"recipe": DEFAULT_RECIPE.read_bytes()} == before
    recipe_path = out / DEFAULT_RECIPE.name
    recipe = load_recipe(recipe_path)
    assert (recipe.vllm.version, recipe.vllm.sha256) == ("0.33.0", new_wheels["0.33.0"].parent.name)
    assert recipe.flashinfer.version == "0.7.2.post1"
    assert recipe.members == (SWA, SELFTEST)
    assert (out / ".vllm-overlay-output").is_file()
    check = run_cli("check", recipe_path)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "overlay check: OK" in check.stdout

    applied = api.apply(recipe_path)
    tree = ast.parse(applied.overlay.by_path()[ATTENTION].after)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DeepseekV4Attention")
    attrs = {n.target.id: n.value for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert ast.literal_eval(attrs["swa_block_size"]) == 32
    calls = [
        n for n in ast.walk(cls) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "DeepseekV4SWACache"
    ]
    assert len(calls) == 1
    block = next(k.value for k in calls[0].keywords if k.arg == "block_size")
    assert ast.unparse(block) == "self.swa_block_size"
    sparse = ast.parse(applied.overlay.by_path()[SPARSE].after)
    sm120 = next(
        n for n in sparse.body if isinstance(n, ast.ClassDef) and n.name == "DeepseekV4FlashInferSM120Attention"
    )
    values = {
        n.target.id: n.value for n in sm120.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert ast.literal_eval(values["swa_block_size"]) == 64
    # the self-test member stays made from its source
    assert (out / "overlay" / f"{SELFTEST}.py").read_bytes() == (ROOT / "overlay" / f"{SELFTEST}.py").read_bytes()


def test_json_report(new_wheels):
    proc = run_cli("rebase", DEFAULT_RECIPE, "--to", "vllm==0.32.0", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["to"]["version"] == "0.32.0"
    assert [m["status"] for m in data["members"]] == ["carried by a three-way merge", "applies"]
    assert data["conflicts"] == []
    assert data["torch"]["requirement"].startswith("2.13.0")


def test_later_members_meet_earlier_new_results(new_wheels, vllm_wheel, tmp_path):
    """A member that edits the line the first member wrote applies on top of its carried result."""
    recipe = load_recipe(DEFAULT_RECIPE)
    old_att = apply_members(WheelTree(vllm_wheel), load_recipe_members(recipe)[:1]).by_path()[ATTENTION].after
    after = old_att.replace(b"swa_block_size: ClassVar[int] = 32", b"swa_block_size: ClassVar[int] = 16")
    members = {
        SWA: (ROOT / "overlay" / f"{SWA}.patch").read_text(),
        "smaller": member_text(git_diff({ATTENTION: old_att}, {ATTENTION: after})),
    }
    path = write_recipe(tmp_path, members)
    result = api.rebase(path, to="vllm==0.33.0", today=TODAY)
    # its context after the class attribute changed upstream too: merged, on top of the first
    # member's carried line (which only exists in the new tree because the first carried)
    assert [r.status for r in result.rows] == ["carried by a three-way merge"] * 2
    new_tree = WheelTree(new_wheels["0.33.0"])
    both = apply_members(new_tree, [r.member for r in result.rows]).by_path()[ATTENTION].after
    assert b"    swa_block_size: ClassVar[int] = 16\n" in both
    assert b"            block_size=self.swa_block_size,\n" in both
    with pytest.raises(InputError):  # the second does not apply without the first
        apply_members(new_tree, [result.rows[1].member])


# ---- real upstream changes read "already upstream" ---------------------------

UPSTREAM_FILE = "vllm/lora/request.py"  # changed from 0.31.0 to 0.32.0, unchanged in 0.33.0
AGAIN_FILE = "vllm/model_executor/layers/quantization/auto_awq.py"  # changed in 0.32.0 and again in 0.33.0


@pytest.mark.parametrize(
    ("path", "target"), [(UPSTREAM_FILE, "0.32.0"), (UPSTREAM_FILE, "0.33.0"), (AGAIN_FILE, "0.33.0")]
)
def test_real_upstream_change_reads_already_upstream(path, target, new_wheels, tmp_path):
    a, b, c = (read(new_wheels[v], path) for v in VERSIONS)
    assert a != b
    assert (b == c) == (path == UPSTREAM_FILE)
    pin = resolve_pin("vllm", "0.31.0", load_recipe(DEFAULT_RECIPE).vllm)
    recipe = write_recipe(
        tmp_path,
        {"backport": member_text(git_diff({path: a}, {path: b}))},
        vllm={"version": pin.version, "wheel": pin.wheel, "sha256": pin.sha256},
    )
    result = api.rebase(recipe, to=f"vllm=={target}", today=TODAY)
    (only,) = result.rows
    assert only.status == "already upstream", only.to_json()
    assert not only.written
    # the evidence names where each hunk's result is in the new tree: read here from the diff's
    # new side (context and added lines) and the target file
    diff = git_diff({path: a}, {path: b})
    hunks = re.split(r"(?m)^@@ .*\n", diff)[1:]
    new_sides = ["".join(line[1:] + "\n" for line in h.splitlines() if line[:1] in " +") for h in hunks]
    target_text = read(new_wheels[target], path).decode()
    places = [target_text[: target_text.index(side)].count("\n") + 1 for side in new_sides]
    where = ", ".join(f"{path} hunk {n} at line {line}" for n, line in enumerate(places, start=1))
    assert only.evidence == [f"its reverse applies to the new tree: {where}"]


# ---- a moved file and a conflict, in test trees made from the real wheel ----


def small_wheel(vllm_wheel: Path, dest: Path, edit) -> Path:
    """A wheel holding the real 0.30.0 V4.1 package and METADATA, edited by ``edit(files)``."""
    files = {}
    with zipfile.ZipFile(vllm_wheel) as zf:
        for name in zf.namelist():
            if name.startswith("vllm/models/deepseek_v41/") or name == "vllm-0.30.0.dist-info/METADATA":
                files[name] = zf.read(name)
    edit(files)
    wheel = dest / "vllm-0.30.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


def test_moved_file_found_at_its_new_path(vllm_wheel, tmp_path):
    moved = "vllm/models/deepseek_v41/layers/mla_attention.py"

    def move(files):
        files[moved] = files.pop(ATTENTION)

    wheel = small_wheel(vllm_wheel, tmp_path, move)
    out = tmp_path / "out"
    result = api.rebase(DEFAULT_RECIPE, to_wheel=wheel, write=out, today=TODAY)
    swa = row(result, SWA)
    assert swa.status == "file moved"
    assert swa.moved == [{"from": ATTENTION, "to": moved}]
    assert f"diff --git a/{moved} b/{moved}" in swa.text.decode()
    assert ATTENTION not in swa.text.decode()
    assert f"{ATTENTION} -> {moved}" in result.table()
    check = run_cli("check", out / DEFAULT_RECIPE.name)
    assert check.returncode == 0, check.stdout + check.stderr


def test_moved_and_changed_file_is_merged_at_its_new_path(vllm_wheel, tmp_path):
    """Moved, and upstream changed the line next to the member's: merged at the new path, flagged."""
    moved = "vllm/models/deepseek_v41/layers/mla_attention.py"
    after_block = b"            packed_bytes_per_token=self.kv_bytes_per_token,\n"

    def move_and_change(files):
        data = files.pop(ATTENTION)
        assert data.count(after_block) == 1
        files[moved] = data.replace(after_block, b"            packed_bytes_per_token=self.swa_bytes_per_token,\n")

    wheel = small_wheel(vllm_wheel, tmp_path, move_and_change)
    result = api.rebase(DEFAULT_RECIPE, to_wheel=wheel, today=TODAY)
    swa = row(result, SWA)
    assert swa.status == "file moved"
    assert swa.moved == [{"from": ATTENTION, "to": moved}]
    assert swa.files[0] == {"file": moved, "how": "three-way merge"}
    new = read(wheel, moved)
    assert [(r["file"], r["line"]) for r in swa.review] == [(moved, line_of(new, b"            block_size=32,\n") + 3)]
    patched = apply_members(WheelTree(wheel), [swa.member]).by_path()[moved].after
    assert b"            block_size=self.swa_block_size,\n" in patched


def test_conflict_shows_hunk_nearest_region_and_three_way_text(vllm_wheel, tmp_path):
    def change(files):
        files[ATTENTION] = files[ATTENTION].replace(b"            block_size=32,\n", b"            block_size=16,\n")

    wheel = small_wheel(vllm_wheel, tmp_path, change)
    before = snapshot(tmp_path)
    proc = run_cli("rebase", DEFAULT_RECIPE, "--to-wheel", wheel)
    assert proc.returncode == 1, proc.stderr
    assert snapshot(tmp_path) == before
    assert re.search(rf"(?m)^{SWA} +conflict +{ATTENTION} hunk 2: does not apply", proc.stdout)
    assert "conflicts: " + SWA in proc.stdout
    result = api.rebase(DEFAULT_RECIPE, to_wheel=wheel, today=TODAY)
    swa = row(result, SWA)
    assert swa.status == "conflict"
    c = swa.conflict
    assert (c["file"], c["hunk"]) == (ATTENTION, 2)
    assert "            block_size=32,\n" in c["expected"]
    assert "            block_size=16,\n" in c["found"]
    assert c["nearest"]["equal_lines"] == c["nearest"]["of"] - 1
    assert "<<<<<<< member" in c["three_way"] and ">>>>>>> new pin" in c["three_way"]
    assert "+            block_size=self.swa_block_size," not in c["three_way"]
    assert "            block_size=self.swa_block_size,\n||||||| base" in c["three_way"]
    assert result.conflicts == [SWA]
    # the self-test member still carries
    assert row(result, SELFTEST).status == "applies"


def test_result_already_in_the_new_tree_reads_already_upstream(vllm_wheel, tmp_path):
    """Upstream made the member's change and also changed a line of its context: the reverse
    does not apply, but the three-way merge changes nothing."""
    recipe = load_recipe(DEFAULT_RECIPE)
    members = load_recipe_members(recipe)
    patched = apply_members(WheelTree(vllm_wheel), members[:1]).by_path()

    def absorb(files):
        for path, change in patched.items():
            files[path] = change.after
        files[ATTENTION] = files[ATTENTION].replace(
            b"    @classmethod\n    @abstractmethod\n", b"    @staticmethod\n", 1
        )

    wheel = small_wheel(vllm_wheel, tmp_path, absorb)
    result = api.rebase(DEFAULT_RECIPE, to_wheel=wheel, today=TODAY)
    swa = row(result, SWA)
    assert swa.status == "already upstream"
    assert swa.evidence == [
        "a three-way merge with the new tree changes nothing: the new tree already holds its result"
    ]
    assert "already upstream: " + SWA in result.table()


# ---- bad input: one line, exit 2, nothing written ---------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--to", "vllm>=0.33"], "--to: expected vllm==X.Y.Z"),
        (["--to", "vllm==0.33.0", "--to-wheel", "x.whl"], "not allowed with argument"),
        ([], "one of the arguments --to --to-wheel is required"),
        (["--to-wheel", "/nonexistent/vllm-1.0.0-py3-none-any.whl"], "no such wheel file"),
        (["--to-wheel", __file__], "not a wheel file name"),
    ],
)
def test_bad_arguments(args, expected, tmp_path):
    cache = tmp_path / "empty-cache"
    proc = run_cli("rebase", DEFAULT_RECIPE, *args, "--write", tmp_path / "out", env={"VLLM_OVERLAY_CACHE": str(cache)})
    assert proc.returncode == 2, proc.stderr
    assert not cache.exists()  # refused before anything was fetched
    assert expected in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_write_refuses_a_foreign_directory_before_fetching(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    proc = run_cli(
        "rebase",
        DEFAULT_RECIPE,
        "--to",
        "vllm==0.33.0",
        "--write",
        foreign,
        env={"VLLM_OVERLAY_CACHE": str(tmp_path / "c")},
    )
    assert proc.returncode == 2
    assert "not an earlier vllm-overlay output" in proc.stderr
    assert (foreign / "notes.txt").read_text() == "keep"
    assert not (tmp_path / "c").exists()  # refused before anything was fetched


def test_write_refuses_the_overlay_directory(tmp_path):
    proc = run_cli("rebase", DEFAULT_RECIPE, "--to", "vllm==0.33.0", "--write", ROOT / "overlay")
    assert proc.returncode == 2
    assert "holds the overlay" in proc.stderr


# ---- the line merge itself (unit) -------------------------------------------


def lines(text: str) -> list[bytes]:
    return [line.encode() + b"\n" for line in text.split()]


def test_merge_carries_an_edit_next_to_an_upstream_change_and_flags_it():
    base, ours, theirs = lines("a b c d"), lines("a B c d"), lines("a b C d")
    merged = merge(base, ours, theirs)
    assert merged.lines == lines("a B C d")
    assert [(r.line, r.text, r.upstream_line) for r in merged.reviews] == [(2, ("B",), 3)]


def test_merge_conflict_on_shared_lines_and_identical_edits_taken_once():
    merged = merge(lines("a b c"), lines("a X c"), lines("a Y c"))
    assert not merged.clean
    assert (
        merged.conflicts[0].text
        == "<<<<<<< member (old pin + member)\nX\n||||||| base (old pin)\nb\n=======\nY\n>>>>>>> new pin\n"
    )
    same = merge(lines("a b c"), lines("a X c"), lines("a X c"))
    assert same.clean and same.same == 1 and same.lines == lines("a X c")
    apart = merge(lines("a b c d e f"), lines("a B c d e f"), lines("a b c d E f"))
    assert apart.lines == lines("a B c d E f") and not apart.reviews


def test_unified_hunks_apply_with_git(tmp_path):
    import subprocess

    old = b"".join(b"line %d\n" % i for i in range(30))
    new = old.replace(b"line 3\n", b"line three\n").replace(b"line 20\n", b"") + b"tail"
    (tmp_path / "f").write_bytes(old)
    patch = b"diff --git a/f b/f\n--- a/f\n+++ b/f\n" + b"".join(
        unified_hunks(old.splitlines(True), new.splitlines(True))
    )
    (tmp_path / "p.diff").write_bytes(patch)
    subprocess.run(["git", "apply", "p.diff"], cwd=tmp_path, check=True)
    assert (tmp_path / "f").read_bytes() == new


# ---- rebase --probe ---------------------------------------------------------
# The probe needs a venv of the new vLLM; only 0.30.0's is built here (builder/probe_env.py,
# ~5.5 GB, ~12 min), so the real runs are: onto the 0.30.0 wheel itself with that venv (the
# four arms run), and onto 0.33.0 with it (refused: the installed files are not the new tree's).


def test_probe_runs_the_four_arms_on_the_new_tree(probe_python, checkpoints, vllm_wheel):
    proc = run_cli(
        "rebase", DEFAULT_RECIPE, "--to-wheel", vllm_wheel, "--probe", "--python", probe_python, "--static",
        "--", checkpoints["v41"], "--headless", "-tp", "4",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report, _, table = proc.stdout.partition("\n\ntree ")
    assert re.search(rf"(?m)^{SWA} +applies *$", report)
    rows = {tuple(re.split(r"\s{2,}", line.strip())[:2]): line for line in table.splitlines()[1:]}
    assert sorted(rows) == sorted(
        [("unpatched", "as given"), ("unpatched", "text-only"), ("patched", "as given"), ("patched", "text-only")]
    )
    assert "page_block_size 32 not in {64}" in rows[("unpatched", "as given")]
    assert "page_block_size 32" not in rows[("patched", "as given")]


def test_probe_with_another_versions_venv_is_refused(probe_python, checkpoints, new_wheels):
    proc = run_cli(
        "rebase", DEFAULT_RECIPE, "--to", "vllm==0.33.0", "--probe", "--python", probe_python, "--static",
        "--", checkpoints["v41"], "-tp", "4",
    )  # fmt: skip
    assert proc.returncode == 2
    assert "the installed vLLM differs from the pinned tree" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 3  # progress lines, then the one error line


def test_probe_needs_an_argv():
    proc = run_cli("rebase", DEFAULT_RECIPE, "--to", "vllm==0.33.0", "--probe")
    assert proc.returncode == 2 and "give the rank's vllm serve argv after '--'" in proc.stderr
    proc = run_cli("rebase", DEFAULT_RECIPE, "--to", "vllm==0.33.0", "--", "x")
    assert proc.returncode == 2 and "an argv after '--' is for --probe" in proc.stderr
