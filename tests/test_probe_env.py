"""builder.probe_env: cache-dir resolution, the venv marker, shadow trees."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from builder import probe_env
from builder.probe_env import ProbeEnvError, ensure_probe_venv, shadow_tree


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert probe_env.probe_venv_dir("0.30.0") == tmp_path / "a" / "probe-venv" / "vllm-0.30.0"
    monkeypatch.delenv("VLLM_OVERLAY_CACHE")
    assert probe_env.probe_venv_dir("0.30.0") == (tmp_path / "xdg" / "vllm-overlay" / "probe-venv" / "vllm-0.30.0")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert probe_env.probe_venv_dir("0.31.0") == (
        tmp_path / "home" / ".cache" / "vllm-overlay" / "probe-venv" / "vllm-0.31.0"
    )


def _fake_complete_venv(cache: Path) -> Path:
    venv = cache / "probe-venv" / "vllm-0.30.0"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / ".complete").write_text("vllm==0.30.0\n")
    return venv


def test_complete_venv_is_reused_without_running_anything(monkeypatch, tmp_path):
    venv = _fake_complete_venv(tmp_path)

    def no_process(*a, **k):
        raise AssertionError("must not run a process for a complete venv")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    assert ensure_probe_venv(cache_dir=tmp_path, progress=lambda s: None) == (venv / "bin" / "python")


def test_venv_without_marker_is_removed_and_rebuilt(monkeypatch, tmp_path):
    venv = tmp_path / "probe-venv" / "vllm-0.30.0"
    (venv / "bin").mkdir(parents=True)
    (venv / "leftover").write_text("half-built")
    commands: list[list[str]] = []

    class FakePopen:
        def __init__(self, cmd, **kwargs):
            commands.append(list(cmd))
            if cmd[1:3] == ["-m", "venv"]:
                (Path(cmd[3]) / "bin").mkdir(parents=True)
                (Path(cmd[3]) / "bin" / "python").write_text("")
            self.stdout = iter([f"ran {cmd[-1]}\n"])

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    lines: list[str] = []
    python = ensure_probe_venv(cache_dir=tmp_path, progress=lines.append)
    assert python == venv / "bin" / "python"
    assert not (venv / "leftover").exists()
    assert (venv / ".complete").is_file()
    pip_steps = [c[3:] for c in commands if c[1:3] == ["-m", "pip"]]
    assert pip_steps == [
        ["install", "torch==2.13.0"],
        ["install", "vllm==0.30.0"],
        ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]
    assert "ran vllm==0.30.0" in lines  # pip's output streamed as progress


def test_failed_build_leaves_no_venv(monkeypatch, tmp_path):
    class FailingPopen:
        def __init__(self, cmd, **kwargs):
            if cmd[1:3] == ["-m", "venv"]:
                (Path(cmd[3]) / "bin").mkdir(parents=True)
            self.stdout = iter(["ERROR: No matching distribution found for vllm==9.9.9\n"])
            self.fail = "vllm==" in cmd[-1]

        def wait(self):
            return 1 if self.fail else 0

    monkeypatch.setattr(subprocess, "Popen", FailingPopen)
    with pytest.raises(ProbeEnvError) as err:
        ensure_probe_venv("9.9.9", cache_dir=tmp_path, progress=lambda s: None)
    assert "No matching distribution" in str(err.value)
    assert not (tmp_path / "probe-venv" / "vllm-9.9.9").exists()


# ---- shadow trees -----------------------------------------------------------


@pytest.fixture()
def fake_vllm(tmp_path) -> Path:
    pkg = tmp_path / "site" / "vllm"
    (pkg / "models" / "v41" / "nvidia").mkdir(parents=True)
    (pkg / "other").mkdir()
    (pkg / "__init__.py").write_text("X = 'orig'\n")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "v41" / "__init__.py").write_text("")
    (pkg / "models" / "v41" / "attention.py").write_text("PAGE = 32\n")
    (pkg / "models" / "v41" / "common.py").write_text("C = 1\n")
    (pkg / "models" / "v41" / "nvidia" / "__init__.py").write_text("")
    (pkg / "models" / "v41" / "nvidia" / "fs.py").write_text("CLS = 'sm120'\n")
    (pkg / "other" / "__init__.py").write_text("")
    return pkg


def test_shadow_tree_links_everything_but_touched_paths(fake_vllm, tmp_path):
    dest = shadow_tree(
        fake_vllm,
        {
            "vllm/models/v41/attention.py": b"PAGE = 64\n",
            "vllm/models/v41/nvidia/selftest.py": b"NEW = True\n",
        },
        tmp_path / "shadow",
    )
    root = dest / "vllm"
    assert not root.is_symlink() and root.is_dir()
    assert (root / "__init__.py").is_symlink()
    assert (root / "other").is_symlink()
    assert not (root / "models").is_symlink()
    assert not (root / "models" / "v41").is_symlink()
    assert (root / "models" / "v41" / "common.py").is_symlink()
    assert not (root / "models" / "v41" / "attention.py").is_symlink()
    assert (root / "models" / "v41" / "attention.py").read_bytes() == b"PAGE = 64\n"
    assert (root / "models" / "v41" / "nvidia" / "fs.py").is_symlink()
    assert (root / "models" / "v41" / "nvidia" / "selftest.py").read_bytes() == b"NEW = True\n"
    # The installed tree is untouched.
    assert (fake_vllm / "models" / "v41" / "attention.py").read_text() == "PAGE = 32\n"
    assert not (fake_vllm / "models" / "v41" / "nvidia" / "selftest.py").exists()
    # And it imports: patched file from the shadow, the rest through links.
    code = (
        "import vllm.models.v41.attention as a, vllm.models.v41.common as c, "
        "vllm.models.v41.nvidia.selftest as s; print(a.PAGE, c.C, s.NEW)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(dest)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["64", "1", "True"]


@pytest.mark.parametrize(
    "path",
    ["vllm/../evil.py", "/etc/passwd", "other/x.py", "vllm", "vllm//x.py", "vllm/a\0b.py"],
)
def test_shadow_tree_refuses_paths_outside_the_package(fake_vllm, tmp_path, path):
    with pytest.raises(ProbeEnvError):
        shadow_tree(fake_vllm, {path: b""}, tmp_path / "shadow")


def test_shadow_tree_refuses_non_empty_dest(fake_vllm, tmp_path):
    dest = tmp_path / "shadow"
    dest.mkdir()
    (dest / "x").write_text("")
    with pytest.raises(ProbeEnvError):
        shadow_tree(fake_vllm, {}, dest)
