"""The corpus of bad inputs: each gives one clear line, exit code 2, and writes nothing.

Each directory under tests/bad_inputs/ is a case, run in this process through the CLI's
entry point (builder.cli.main) on a copy of it, with recipe.yaml written by the test:

- `expected`: text the one-line error must contain;
- `override.yaml` (optional): only the fields the case changes in the base recipe
  (base_recipe() below: the default recipe's pins and image, members [fix] in overlay/),
  deep-merged: a mapping merges key by key, anything else (a list, a scalar) replaces,
  and `!delete` removes the key;
- `recipe.in` (optional): a case whose bad input is the recipe's text itself (a YAML
  syntax error, a duplicate key), which no mapping can carry: that text, where `$recipe`
  stands for the base recipe (with any override) written as YAML, so it copies no pin;
- `overlay/`: its members; sometimes a local tree or wheel its override points vllm.path at;
- `against-tree` when the input is only bad against the tree (so `key`, which never opens it,
  accepts it), or `apply-only` for a member that conflicts with the tree (apply refuses it as
  bad input; `check` reports it as a failed check, exit 1).

Only a case that meets the pinned vLLM wheel (against the tree, and no local vllm.path) runs
on a warm copy of the real wheel's cache (isolated_cache: marked `wheel`); every other case
runs on an empty cache with the network refused, so it needs no wheel (`make test-fast`)
and shows that it never fetched one. A few cases also run through `python -m builder`.
"""

from __future__ import annotations

import shutil
import string
import urllib.request
from pathlib import Path

import pytest
import yaml

from builder.cli import main
from tests.helpers import run_cli, snapshot
from tools.synthetic import DEFAULT_RECIPE, FLASHINFER_PIN, VLLM_PIN

CORPUS = Path(__file__).parent / "bad_inputs"
CASES = sorted(p.name for p in CORPUS.iterdir() if p.is_dir())
CASE_FILES = {"expected", "override.yaml", "recipe.in", "overlay", "against-tree", "apply-only", "local.whl", "tree"}


class _OverrideLoader(yaml.SafeLoader):
    """The safe loader, plus `!delete`: remove this key from the base recipe."""


_DELETE = object()
_OverrideLoader.add_constructor("!delete", lambda loader, node: _DELETE)


def base_recipe() -> dict:
    """The recipe every case starts from: the default recipe's pins and required image
    fields (read, never copied), its own name and repository, one member `fix`."""
    with open(DEFAULT_RECIPE, encoding="utf-8") as f:
        image = yaml.safe_load(f)["image"]
    return {
        "name": "test",
        "vllm": dict(VLLM_PIN),
        "flashinfer": dict(FLASHINFER_PIN),
        "image": {
            **{k: image[k] for k in ("base", "cuda", "torch_cuda_arch_list", "flashinfer_cuda_arch_list", "python")},
            "repository": "vllm-overlay/test",
        },
        "members": ["fix"],
        "overlay": "overlay",
    }


def _merge(base, override):
    if not (isinstance(base, dict) and isinstance(override, dict)):
        return override
    merged = dict(base)
    for key, value in override.items():
        if value is _DELETE:
            del merged[key]  # a KeyError: the override deletes a field the base does not have
        else:
            merged[key] = _merge(base.get(key), value)
    return merged


def case_recipe(case: str) -> dict:
    """The base recipe with the case's override.yaml merged in."""
    override = CORPUS / case / "override.yaml"
    return _merge(base_recipe(), yaml.load(override.read_text(), _OverrideLoader) if override.exists() else {})


def recipe_text(case: str) -> str:
    text = yaml.safe_dump(case_recipe(case), sort_keys=False, allow_unicode=True)
    template = CORPUS / case / "recipe.in"
    return string.Template(template.read_text()).substitute(recipe=text) if template.exists() else text


def _commands(case: str) -> list[str]:
    # `key` reads only the recipe and members; a case marked against-tree is bad only against the tree.
    if (CORPUS / case / "apply-only").exists():
        return ["apply"]  # a conflict: `check` reports it with exit 1 (tests/test_check.py)
    if (CORPUS / case / "against-tree").exists():
        return ["apply", "check"]
    return ["apply", "check", "key"]


def _meets_pinned_wheel(case: str) -> bool:
    """Whether the case's refusal comes from the real pinned tree (a local vllm.path is its own tree)."""
    tree_level = any((CORPUS / case / marker).exists() for marker in ("apply-only", "against-tree"))
    return tree_level and "path" not in case_recipe(case)["vllm"]


def _split(combinations: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(without the wheel, on the pinned wheel)"""
    return (
        [c for c in combinations if not _meets_pinned_wheel(c[0])],
        [c for c in combinations if _meets_pinned_wheel(c[0])],
    )


NO_WHEEL, ON_WHEEL = _split([(case, command) for case in CASES for command in _commands(case)])
# One case per command through the real `python -m builder`: exit code and stderr of a process.
SMOKE_NO_WHEEL, SMOKE_ON_WHEEL = _split(
    [("recipe_yaml_syntax", "key"), ("symlink_escape", "check"), ("hunk_does_not_match", "apply")]
)


def _argv(command: str) -> list[str]:
    return [command, "recipe.yaml"] + (["--out", "out"] if command == "apply" else [])


def _case_copy(case: str, tmp_path: Path) -> tuple[Path, str]:
    work = tmp_path / case
    shutil.copytree(CORPUS / case, work, symlinks=True)
    (work / "recipe.yaml").write_text(recipe_text(case), encoding="utf-8")
    return work, (work / "expected").read_text().strip()


def _assert_refused(code: int, stdout: str, stderr: str, expected: str) -> None:
    assert code == 2, (stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("vllm-overlay: ")
    assert expected in lines[0]
    assert "Traceback" not in stderr
    assert stdout == ""


def _no_network(*args, **kwargs):
    raise AssertionError(f"a bad-input case tried to fetch: {args} {kwargs}")


def _run_in_process(case, command, tmp_path, cache, monkeypatch, capsys) -> None:
    work, expected = _case_copy(case, tmp_path)
    monkeypatch.chdir(work)
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(cache))
    monkeypatch.delenv("VLLM_OVERLAY_REPOSITORY", raising=False)
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)  # the builder fetches with urlopen
    before = snapshot(work), snapshot(cache)
    code = main(_argv(command))
    out, err = capsys.readouterr()
    _assert_refused(code, out, err, expected)
    assert (snapshot(work), snapshot(cache)) == before  # no output directory, nothing cached


def test_corpus_is_large_enough():
    assert len(CASES) >= 41


def test_cases_copy_no_pin():
    """Cases hold only what they change: no recipe.yaml (the test writes it) and no pin's sha256."""
    pins = [VLLM_PIN["sha256"].encode(), FLASHINFER_PIN["sha256"].encode()]
    for case in CASES:
        assert {p.name for p in (CORPUS / case).iterdir()} <= CASE_FILES, case
        assert (CORPUS / case / "expected").is_file(), case
        for path in (CORPUS / case).rglob("*"):
            if path.is_file() and not path.is_symlink():
                assert not any(pin in path.read_bytes() for pin in pins), path


@pytest.mark.parametrize(("case", "command"), NO_WHEEL)
def test_bad_input(case: str, command: str, tmp_path: Path, monkeypatch, capsys):
    cache = tmp_path / "cache"  # empty: a case that never meets the pinned tree fetches nothing
    cache.mkdir()
    _run_in_process(case, command, tmp_path, cache, monkeypatch, capsys)


@pytest.mark.parametrize(("case", "command"), ON_WHEEL)
def test_bad_input_against_pinned_tree(
    case: str, command: str, tmp_path: Path, isolated_cache: Path, monkeypatch, capsys
):
    _run_in_process(case, command, tmp_path, isolated_cache, monkeypatch, capsys)


def _run_subprocess(case: str, command: str, tmp_path: Path, cache: Path) -> None:
    work, expected = _case_copy(case, tmp_path)
    before = snapshot(work), snapshot(cache)
    proc = run_cli(*_argv(command), cwd=work, env={"VLLM_OVERLAY_CACHE": str(cache)})
    _assert_refused(proc.returncode, proc.stdout, proc.stderr, expected)
    assert (snapshot(work), snapshot(cache)) == before


@pytest.mark.parametrize(("case", "command"), SMOKE_NO_WHEEL)
def test_bad_input_subprocess(case: str, command: str, tmp_path: Path):
    cache = tmp_path / "cache"
    cache.mkdir()
    _run_subprocess(case, command, tmp_path, cache)


@pytest.mark.parametrize(("case", "command"), SMOKE_ON_WHEEL)
def test_bad_input_subprocess_against_pinned_tree(case: str, command: str, tmp_path: Path, isolated_cache: Path):
    _run_subprocess(case, command, tmp_path, isolated_cache)
