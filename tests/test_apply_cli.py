"""`vllm-overlay apply`: overlay output, manifest, full tree, local trees, atomic replacement."""

from __future__ import annotations

import hashlib
import json
import zipfile

from tests.helpers import run_cli
from tools.synthetic import VLLM_PIN, git_diff, member_text, write_recipe

ATT = "vllm/models/deepseek_v41/attention.py"
CFG = "vllm/transformers_utils/configs/deepseek_v41.py"
NEW = "vllm/models/deepseek_v41/nvidia/added.py"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def members(wheel_zip):
    att = wheel_zip.read(ATT)
    att2 = att.replace(b"block_size=32,", b"block_size=self.swa_block_size,")
    assert att2 != att
    return (
        att,
        att2,
        {
            "one": member_text(git_diff({ATT: att, NEW: None}, {ATT: att2, NEW: b"#!/usr/bin/env python3\n"})),
            "two": member_text(git_diff({CFG: wheel_zip.read(CFG)}, {CFG: None})),
        },
    )


def test_overlay_output_and_manifest(tmp_path, wheel_zip):
    att, att2, ms = members(wheel_zip)
    recipe = write_recipe(tmp_path, ms)
    out = tmp_path / "out"
    proc = run_cli("apply", recipe, "--out", out)
    assert proc.returncode == 0, proc.stderr
    key = proc.stdout.strip()
    assert key == run_cli("key", recipe).stdout.strip()
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert written == sorted([ATT, NEW, "manifest.json", ".vllm-overlay-output"])
    marker = json.loads((out / ".vllm-overlay-output").read_text())
    assert marker == {"tool": "vllm-overlay", "format": 1, "command": "apply --out", "runtime_key": key}
    assert (out / ATT).read_bytes() == att2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["runtime_key"] == key
    assert manifest["pins"]["vllm"]["sha256"] == VLLM_PIN["sha256"]
    assert [m["name"] for m in manifest["members"]] == ["one", "two"]
    files = {f["path"]: f for f in manifest["files"]}
    assert files[ATT]["before_sha256"] == sha(att) and files[ATT]["after_sha256"] == sha(att2)
    assert files[NEW]["before_sha256"] is None and files[NEW]["after_sha256"] == sha(b"#!/usr/bin/env python3\n")
    assert files[CFG]["before_sha256"] == sha(wheel_zip.read(CFG)) and files[CFG]["after_sha256"] is None
    # running again replaces the earlier output whole
    (out / "stale.txt").write_text("x")
    assert run_cli("apply", recipe, "--out", out).returncode == 0
    assert not (out / "stale.txt").exists()


def test_refuses_to_replace_a_directory_it_did_not_write(tmp_path, wheel_zip):
    _, _, ms = members(wheel_zip)
    recipe = write_recipe(tmp_path, ms)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    proc = run_cli("apply", recipe, "--out", precious)
    assert proc.returncode == 2 and "is not an earlier vllm-overlay output" in proc.stderr
    assert [p.name for p in precious.iterdir()] == ["keep.txt"]


def test_full_tree_from_a_local_wheel_and_from_a_directory(tmp_path, wheel_zip, vllm_wheel):
    # a small local wheel made of real files, then the same files as a directory (a checkout)
    small = tmp_path / "vllm-0.30.0-py3-none-any.whl"
    names = [ATT, CFG, "vllm/__init__.py"]
    with zipfile.ZipFile(small, "w") as z:
        for n in names:
            z.writestr(n, wheel_zip.read(n))
    checkout = tmp_path / "checkout"
    for n in names:
        (checkout / n).parent.mkdir(parents=True, exist_ok=True)
        (checkout / n).write_bytes(wheel_zip.read(n))
    att, att2, ms = members(wheel_zip)
    results = []
    for label, vllm in (
        ("wheel", {"path": str(small), "sha256": sha(small.read_bytes())}),
        ("dir", {"path": str(checkout)}),
    ):
        d = tmp_path / label
        d.mkdir()
        recipe = write_recipe(d, ms, vllm=vllm)
        proc = run_cli("apply", recipe, "--full-tree", d / "tree")
        assert proc.returncode == 0, proc.stderr
        tree = d / "tree"
        got = {str(p.relative_to(tree)): p.read_bytes() for p in tree.rglob("*") if p.is_file() and p.parent != tree}
        results.append(got)
        assert got[ATT] == att2 and CFG not in got and got["vllm/__init__.py"] == wheel_zip.read("vllm/__init__.py")
        assert (d / "tree" / NEW).stat().st_mode & 0o777 == 0o644
    assert results[0].keys() == results[1].keys()
    assert checkout.joinpath(ATT).read_bytes() == att  # the checkout itself is never written
