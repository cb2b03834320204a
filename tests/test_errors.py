"""One error module: every class an OverlayError with its exit code, fields formatted in one
place, and the CLI mapping each to its exit code with one line on stderr."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from builder import errors
from builder.cli import main
from builder.errors import HunkFailure, InputError, OverlayError, RegistryUnreachable, ServiceUnreachable
from builder.recipe import load_recipe
from tools.synthetic import write_recipe


def test_every_error_class_is_an_overlay_error_with_a_documented_exit_code():
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, Exception)]
    assert len(classes) >= 7
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for cls in classes:
        assert issubclass(cls, OverlayError), cls
        assert cls.exit_code in (1, 2, 3), cls
        assert f"`{cls.__name__}`" in readme, f"README's exit-code table does not name {cls.__name__}"


def test_fields_are_formatted_in_one_order():
    exc = InputError("malformed hunk header '@@ x'", line=12, member="fix", file=Path("overlay/fix.patch"))
    assert str(exc) == "overlay/fix.patch: member fix: line 12: malformed hunk header '@@ x'"
    assert exc.fields() == {"file": "overlay/fix.patch", "member": "fix", "line": 12}
    assert str(InputError("expected a list", field="members", file="r.yaml")) == "r.yaml: members: expected a list"


def test_located_fills_only_what_is_missing():
    exc = InputError("bad", field="vllm.sha256").located(file="r.yaml", field="other")
    assert str(exc) == "r.yaml: vllm.sha256: bad"
    with pytest.raises(TypeError):
        InputError("x").located(colour="red")


def test_a_hunk_failure_names_the_tree_path_and_hunk():
    class FakeHunk:
        number, header = 2, "@@ -4,7 +4,7 @@"

    exc = HunkFailure("vllm/a.py", FakeHunk(), "does not apply at line 5").located(file="o/fix.patch", member="fix")
    assert str(exc) == "o/fix.patch: member fix: vllm/a.py: hunk 2 (@@ -4,7 +4,7 @@): does not apply at line 5"
    assert (
        str(HunkFailure("vllm/b.py", None, "the tree has no such file")) == "vllm/b.py: file: the tree has no such file"
    )
    assert exc.exit_code == 2


def test_exit_codes_by_kind():
    assert InputError("x").exit_code == 2
    assert ServiceUnreachable("x").exit_code == 3
    assert RegistryUnreachable("x").exit_code == 3
    assert errors.CheckFailed("x").exit_code == 1


def test_unknown_recipe_key_says_did_you_mean(tmp_path):
    recipe = write_recipe(tmp_path, {}, [])
    recipe.write_text(recipe.read_text().replace("members:", "memebrs:"))
    with pytest.raises(InputError) as caught:
        load_recipe(recipe)
    assert caught.value.field == "memebrs"
    assert "unknown field (did you mean 'members'? expected one of: name, vllm," in str(caught.value)
    nested = write_recipe(tmp_path / "n", {}, [])
    nested.write_text(nested.read_text().replace("  python:", "  pyhton:"))
    with pytest.raises(InputError, match=r"image\.pyhton: unknown field \(did you mean 'python'\?"):
        load_recipe(nested)
    far = write_recipe(tmp_path / "f", {}, [])
    far.write_text(far.read_text().replace("name: test", "name: test\nzzz: 1"))
    with pytest.raises(InputError, match=r"zzz: unknown field \(expected one of"):
        load_recipe(far)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket is closed


def test_an_unreachable_index_is_exit_3_and_changes_nothing(tmp_path, monkeypatch, capsys):
    """The package index did not answer: not bad input (2) but a service (3), one line."""
    port = _closed_port()
    recipe = write_recipe(tmp_path, {}, [], vllm={"index": f"http://127.0.0.1:{port}/simple"})
    cache = tmp_path / "cache"
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(cache))
    code = main(["check", str(recipe)])
    out, err = capsys.readouterr()
    assert code == 3
    assert out == ""
    [line] = err.splitlines()
    assert line.startswith("vllm-overlay: vllm: cannot read the package index http://127.0.0.1:")
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*"))
