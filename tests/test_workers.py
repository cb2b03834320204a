"""`apply --out` across worker processes: the same output, report, key and error as one
process, whatever the number of workers; nothing left behind when a worker fails."""

from __future__ import annotations

import os

import pytest

from builder import workers
from builder.errors import InputError
from builder.members import ParseMemo
from builder.recipe import load_recipe
from builder.tree import pinned_tree
from builder.workers import apply_to_dir, member_groups, partition

# Real files of the pinned wheel, and what the members below do to them.
from tests.helpers import run_cli, snapshot
from tools.synthetic import git_diff, member_text, write_recipe

# Real files of the pinned wheel, and what the members below do to them.
FILES = [
    "vllm/__init__.py",
    "vllm/config/cache.py",
    "vllm/config/model.py",
    "vllm/config/parallel.py",
    "vllm/config/scheduler.py",
    "vllm/envs.py",
    "vllm/sampling_params.py",
    "vllm/outputs.py",
    "vllm/sequence.py",
    "vllm/logger.py",
]


def edit(data: bytes, at: float, text: bytes) -> bytes:
    lines = data.splitlines(keepends=True)
    lines[int(len(lines) * at)] = text
    return b"".join(lines)


def chained_members(wheel_zip) -> dict[str, str]:
    """40 members: one per file and fraction, so that members share files in chains (each
    applying on the one before it), one member spans two chains, one adds a file, one
    deletes one, and one applies with an offset."""
    members: dict[str, str] = {}
    state = {path: wheel_zip.read(path) for path in FILES}
    for step in range(4):
        for n, path in enumerate(FILES[:9]):
            before = state[path]
            after = edit(before, (step + 1) / 6, f"# edit {step} of {path}\n".encode())
            members[f"m{step}_{n}"] = member_text(git_diff({path: before}, {path: after}))
            state[path] = after
    # one member joins the chains of two files; another adds a file; another deletes one
    a, b = FILES[0], FILES[1]
    members["bridge"] = member_text(
        git_diff({a: state[a], b: state[b]}, {a: state[a] + b"# bridge\n", b: b"# bridge\n" + state[b]})
    )
    members["added"] = member_text(
        git_diff({"vllm/added_by_member.py": None}, {"vllm/added_by_member.py": b"ADDED = True\n"})
    )
    members["deleted"] = member_text(git_diff({FILES[9]: state[FILES[9]]}, {FILES[9]: None}))
    # a member made against a copy with 3 extra lines at the top: it applies 3 lines up
    c = FILES[2]
    shifted = b"# x\n# y\n# z\n" + state[c]
    members["offset"] = member_text(git_diff({c: shifted}, {c: edit(shifted, 0.9, b"# near the end\n")}))
    return members


@pytest.fixture
def recipe_path(tmp_path, wheel_zip, isolated_cache, monkeypatch):
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(isolated_cache))
    return write_recipe(tmp_path / "recipe", chained_members(wheel_zip))


def run_with(recipe_path, out, jobs, memo=None):
    recipe = load_recipe(recipe_path)
    return apply_to_dir(recipe, pinned_tree(recipe.vllm), memo or ParseMemo.for_recipe(recipe), out, jobs=jobs)


def test_groups_join_members_that_share_a_file():
    diff = b"Description: x\n\ndiff --git a/%s b/%s\n"
    datas = [
        diff % (b"a", b"a"),
        diff % (b"b", b"b"),
        diff % (b"a", b"a") + diff % (b"c", b"c"),
        diff % (b"c", b"c"),
        None,
    ]
    groups = member_groups(datas)
    assert sorted(groups) == [[0, 2, 3], [1], [4]]  # 0-2 share a, 2-3 share c; an unreadable one alone
    assert groups[0] == [0, 2, 3]  # the heaviest first
    assert partition(datas, 2) == [[0, 2, 3], [1, 4]]  # whole groups, the lighter ones together
    assert partition(datas, 8) == [[0, 2, 3], [1], [4]]  # no more workers than groups


def test_any_number_of_workers_gives_the_same_output(tmp_path, recipe_path):
    results = []
    for jobs in (1, 2, 3):
        out = tmp_path / f"out{jobs}"
        applied = run_with(recipe_path, out, jobs)
        results.append((applied, snapshot(out)))
    (one, files_one), *others = results
    assert len(files_one) > 10 and "vllm/added_by_member.py" in files_one and "vllm/logger.py" not in files_one
    assert any("hunk 1 applied with offset -3 lines" in line for line in one.reports)
    for applied, files in others:
        assert files == files_one  # every file and manifest.json, byte for byte
        assert applied == one  # key, reports in recipe order, file count
    assert one.key == run_cli("key", recipe_path).stdout.strip()


def test_a_recipe_without_members(tmp_path, isolated_cache, monkeypatch):
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(isolated_cache))
    applied = run_with(write_recipe(tmp_path / "recipe", {}, []), tmp_path / "out", None)
    assert applied.files == 0 and applied.reports == []
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["manifest.json"]


def test_the_command_takes_its_worker_count_from_the_environment(tmp_path, recipe_path):
    outs = {}
    for jobs in ("1", "2"):
        proc = run_cli("apply", recipe_path, "--out", tmp_path / jobs, env={"VLLM_OVERLAY_JOBS": jobs})
        assert proc.returncode == 0, proc.stderr
        outs[jobs] = (proc.stdout, proc.stderr.replace(str(tmp_path / jobs), "OUT"), snapshot(tmp_path / jobs))
    assert outs["1"] == outs["2"]
    proc = run_cli("apply", recipe_path, "--out", tmp_path / "bad", env={"VLLM_OVERLAY_JOBS": "two"})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "vllm-overlay: VLLM_OVERLAY_JOBS: expected a whole number of at least 1, got 'two'"
    ]
    assert not (tmp_path / "bad").exists()


def test_out_is_the_same_when_a_full_tree_is_written_too(tmp_path, recipe_path):
    """--out with --full-tree is made in one process (the full tree needs every patched
    file's bytes there); its output equals the workers'."""
    alone = run_cli("apply", recipe_path, "--out", tmp_path / "alone", env={"VLLM_OVERLAY_JOBS": "2"})
    both = run_cli("apply", recipe_path, "--out", tmp_path / "both", "--full-tree", tmp_path / "tree")
    assert alone.returncode == 0 and both.returncode == 0, both.stderr
    assert alone.stdout == both.stdout
    assert snapshot(tmp_path / "alone") == snapshot(tmp_path / "both")
    assert (tmp_path / "tree" / "vllm" / "added_by_member.py").read_bytes() == b"ADDED = True\n"


def break_member(recipe_path, name: str, how: str) -> None:
    """Make member ``name`` fail to parse or to apply, keeping its size (the partition into
    workers goes by size: it stays as it was)."""
    path = recipe_path.parent / "overlay" / f"{name}.patch"
    text = path.read_text()
    if how == "parse":
        broken = text.replace(
            "Upstream-Status: Inappropriate [test fixture]", "Upstream-Status: Inappropriate (test fixture)"
        )
    else:  # the first removed line of its first hunk, one character changed
        head, hunks = text.split("\n@@", 1)
        at = hunks.index("\n-") + 2
        broken = head + "\n@@" + hunks[:at] + ("x" if hunks[at] != "x" else "y") + hunks[at + 1 :]
    assert len(broken) == len(text) and broken != text
    path.write_text(broken)


def shards_of(recipe_path) -> list[list[str]]:
    """The members each of two workers takes, by name, in recipe order."""
    recipe = load_recipe(recipe_path)
    datas = [recipe.member_path(name).read_bytes() for name in recipe.members]
    return [[recipe.members[i] for i in shard] for shard in partition(datas, 2)]


# (which worker has the failure that must win, and which kind; which has the other one)
@pytest.mark.parametrize(
    "winner, loser",
    [
        # a single run parses every member before applying any: a member that does not parse
        # wins over one that does not apply, even one earlier in the recipe
        ((0, "parse"), (1, "apply")),
        ((1, "parse"), (0, "apply")),
        # of two that do not apply, the one earlier in the recipe wins
        ((0, "apply"), (1, "apply")),
        ((1, "apply"), (0, "apply")),
    ],
)
def test_the_error_is_the_one_a_single_run_meets_first(tmp_path, recipe_path, winner, loser):
    shards = shards_of(recipe_path)
    applicable = [[name for name in shard if name != "added"] for shard in shards]  # "added" removes no line
    (win_shard, win_how), (lose_shard, lose_how) = winner, loser
    if win_how == lose_how:  # the winner is the earlier of the two
        win_name, lose_name = applicable[win_shard][0], applicable[lose_shard][-1]
    else:  # the parse failure wins though it comes later
        win_name, lose_name = applicable[win_shard][-1], applicable[lose_shard][0]
    break_member(recipe_path, win_name, win_how)
    break_member(recipe_path, lose_name, lose_how)
    assert shards_of(recipe_path) == shards  # each failure is in the worker the case says
    expected = "malformed Upstream-Status" if win_how == "parse" else ": hunk 1 (@@"
    messages = set()
    for jobs in (1, 2):
        out = tmp_path / f"out{jobs}"
        with pytest.raises(InputError) as caught:
            run_with(recipe_path, out, jobs)
        messages.add(str(caught.value))
        assert not out.exists()
    assert len(messages) == 1
    message = messages.pop()
    assert f"member {win_name}: " in message and expected in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "recipe"]  # no temporary directory left


def test_a_worker_that_fails_fails_the_run_and_leaves_nothing(tmp_path, recipe_path, monkeypatch):
    here = os.getpid()
    real_work = workers._work

    def failing_in_children(*args, **kwargs):
        if os.getpid() != here:
            raise RuntimeError("worker bug")
        return real_work(*args, **kwargs)

    children = []
    real_fork = os.fork

    def recorded_fork() -> int:
        pid = real_fork()
        if pid:
            children.append(pid)
        return pid

    monkeypatch.setattr(workers, "_work", failing_in_children)
    monkeypatch.setattr(os, "fork", recorded_fork)
    with pytest.raises(RuntimeError, match="(?s)a worker process failed:.*RuntimeError: worker bug"):
        run_with(recipe_path, tmp_path / "out", 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "recipe"]
    assert len(children) == 2
    for pid in children:  # each was waited for
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_the_memo_keeps_what_every_worker_parsed(tmp_path, recipe_path):
    recipe = load_recipe(recipe_path)
    first = ParseMemo.for_recipe(recipe)
    run_with(recipe_path, tmp_path / "first", 2, first)
    assert first.parts  # the workers' parts, to be written as they were sent
    first.save()
    again = ParseMemo.for_recipe(recipe)
    assert len(again._entries()) == len(recipe.members)
    run_with(recipe_path, tmp_path / "again", 2, again)
    assert len(again.used) == len(recipe.members) and not again.parts  # all remembered, nothing new
    assert snapshot(tmp_path / "first") == snapshot(tmp_path / "again")


def test_a_bad_member_is_refused_before_the_wheel_is_fetched(tmp_path, wheel_zip):
    """As check and key do: no download (here it could not even connect) for a recipe that
    is refused anyway, and the empty cache stays empty."""
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    members = chained_members(wheel_zip)
    recipe_path = write_recipe(tmp_path / "recipe", members, vllm={"url": "http://127.0.0.1:9/vllm.whl"})
    break_member(recipe_path, "m2_5", "parse")
    proc = run_cli(
        "apply",
        recipe_path,
        "--out",
        tmp_path / "out",
        env={"VLLM_OVERLAY_CACHE": str(cache), "VLLM_OVERLAY_JOBS": "2"},
    )
    assert proc.returncode == 2 and "member m2_5: header: malformed Upstream-Status" in proc.stderr, proc.stderr
    assert list(cache.iterdir()) == [] and not (tmp_path / "out").exists()


def test_writers_of_several_workers_share_the_output_directory(tmp_path):
    """Each worker has its own Writer: one finds a directory another made; a file where a
    directory must go is still an error."""
    from builder.output import Writer

    first, second = Writer(tmp_path), Writer(tmp_path)
    first.write("vllm/config/a.py", b"a\n", None)
    second.write("vllm/config/b.py", b"b\n", None)  # mkdir of vllm/ and vllm/config/ finds them made
    assert sorted(p.name for p in (tmp_path / "vllm" / "config").iterdir()) == ["a.py", "b.py"]
    first.write("vllm/plain", b"", None)
    with pytest.raises(OSError):
        Writer(tmp_path).write("vllm/plain/c.py", b"c\n", None)
