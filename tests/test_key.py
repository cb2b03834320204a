"""Runtime key: golden values, recomputed by hand from the README's serialization."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import docker
import unidiff
import yaml

from builder.key import key_material, runtime_key, short_key
from builder.members import load_recipe_members
from builder.recipe import load_recipe
from tests.helpers import run_cli
from tools.synthetic import DEFAULT_RECIPE, ROOT, VLLM_PIN, write_recipe

# Two small members, written out by hand (no tree needed: the key never reads it).
DIFF_A = """diff --git a/vllm/a.py b/vllm/a.py
index 1111111..2222222 100644
--- a/vllm/a.py
+++ b/vllm/a.py
@@ -1,3 +1,3 @@ def f():
 one
-two
+TWO
 three
"""
DIFF_B = """diff --git a/vllm/new.py b/vllm/new.py
new file mode 100644
index 0000000..3333333
--- /dev/null
+++ b/vllm/new.py
@@ -0,0 +1 @@
+x = 1
\\ No newline at end of file
"""
HEADER = "Description: {d}\nAuthor: A <a@example.invalid>\nUpstream-Status: Pending\n\n"
# The normalized diffs, by the README's rules: no header, index line, timestamps or section text;
# counts always written; a missing final newline marked after the line.
NORMAL_A = "--- a/vllm/a.py\n+++ b/vllm/a.py\n@@ -1,3 +1,3 @@\n one\n-two\n+TWO\n three\n"
NORMAL_B = (
    "new file mode 100644\n--- /dev/null\n+++ b/vllm/new.py\n@@ -0,0 +1,1 @@\n+x = 1\n\\ No newline at end of file\n"
)
# == hand_key(), pinned so a format change is seen
GOLDEN = "rk-baa6ab2a798d287080630a84edfadff025c6c892d0e7a753df9cd7af950f99d1"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def key_of(
    tmp: Path, a: str = DIFF_A, b: str = DIFF_B, order=("alpha", "beta"), desc="first", vllm=None, extra=""
) -> str:
    d = tmp / f"r{len(list(tmp.iterdir()))}"
    d.mkdir()
    path = write_recipe(
        d,
        {"alpha": HEADER.format(d=desc) + a, "beta": HEADER.format(d="second") + b},
        list(order),
        vllm=vllm,
        extra=extra,
    )
    recipe = load_recipe(path)
    return runtime_key(recipe, load_recipe_members(recipe))


def hand_key(order=("alpha", "beta")) -> str:
    digests = {"alpha": sha(NORMAL_A), "beta": sha(NORMAL_B)}
    text = f"vllm-overlay-runtime-key 1\npin vllm {VLLM_PIN['version']} sha256:{VLLM_PIN['sha256']}\n"
    text += "".join(f"member {n} sha256:{digests[n]}\n" for n in order)
    return "rk-" + sha(text)


def test_key_is_the_documented_serialization(tmp_path):
    assert key_of(tmp_path) == hand_key()
    assert key_of(tmp_path, order=("beta", "alpha")) == hand_key(("beta", "alpha"))


def test_golden_key(tmp_path):
    assert key_of(tmp_path) == GOLDEN


def test_cosmetic_changes_keep_the_key(tmp_path):
    stamped = DIFF_A.replace("--- a/vllm/a.py", "--- a/vllm/a.py\t2026-01-01 00:00:00").replace(
        "+++ b/vllm/a.py", "+++ b/vllm/a.py\t2026-11-29 10:00:00"
    )
    assert key_of(tmp_path, a=stamped) == GOLDEN
    assert key_of(tmp_path, a=DIFF_A.replace("index 1111111..2222222", "index abcdef0..fedcba9")) == GOLDEN
    assert key_of(tmp_path, a=DIFF_A.replace("@@ def f():", "@@ class Other:")) == GOLDEN
    assert key_of(tmp_path, desc="reworded entirely\n  with a continuation line") == GOLDEN
    # optional recipe fields left unset, or set to where things already are, do not enter the key
    assert key_of(tmp_path, vllm={"url": "https://example.invalid/vllm.whl"}) == GOLDEN


def test_real_changes_change_the_key(tmp_path):
    keys = {
        key_of(tmp_path, order=("beta", "alpha")),
        key_of(tmp_path, a=DIFF_A.replace("+TWO", "+TWo")),
        key_of(tmp_path, b=DIFF_B.replace("new file mode 100644", "new file mode 100755")),
        key_of(tmp_path, b=DIFF_B.replace("\\ No newline at end of file\n", "")),
        key_of(tmp_path, vllm={"sha256": "0" * 64}),
        key_of(tmp_path, vllm={"version": "0.31.0", "wheel": "vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl"}),
        key_of(tmp_path, order=("alpha",)),
    }
    assert GOLDEN not in keys
    assert len(keys) == 7


def test_key_material_and_short_form(tmp_path):
    path = write_recipe(tmp_path, {"alpha": HEADER.format(d="x") + DIFF_A}, ["alpha"])
    recipe = load_recipe(path)
    material = key_material(recipe, load_recipe_members(recipe)).decode()
    assert material.splitlines()[0] == "vllm-overlay-runtime-key 1"
    assert material.endswith(f"member alpha sha256:{sha(NORMAL_A)}\n")
    key = runtime_key(recipe, load_recipe_members(recipe))
    assert short_key(key) == key[3:19] and len(short_key(key)) == 16


def test_key_command_is_the_same_from_two_clones(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
        write_recipe(d, {"alpha": HEADER.format(d="x") + DIFF_A, "beta": HEADER.format(d="y") + DIFF_B})
    out = [run_cli("key", d / "recipe.yaml", cwd=d) for d in (one, two)]
    assert out[0].returncode == out[1].returncode == 0
    assert out[0].stdout == out[1].stdout == hand_key() + "\n"
    short = run_cli("key", "--short", one / "recipe.yaml")
    assert short.stdout.strip() == hand_key()[3:19]


def test_key_is_the_same_in_another_environment(tmp_path, services):
    """The closest to a second machine this one offers: a container of the test base image
    (Debian's Python build, not this one), the code copied to another path, another user,
    HOME, locale and time zone.  Its `key` of the default recipe and of the hand-made one
    must be this machine's."""
    src = tmp_path / "src"
    for part in ("builder", "recipes", "overlay"):
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    deps = tmp_path / "deps"
    for module in (unidiff, yaml):  # pure Python, and PyYAML's CPython 3.11 extension
        shutil.copytree(
            Path(module.__file__).parent, deps / module.__name__, ignore=shutil.ignore_patterns("__pycache__")
        )
    hand = tmp_path / "hand"
    hand.mkdir()
    write_recipe(hand, {"alpha": HEADER.format(d="x") + DIFF_A, "beta": HEADER.format(d="y") + DIFF_B})
    for directory in (src, deps, hand):
        for path in [directory, *directory.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    engine = docker.DockerClient(base_url=services["DOCKER_HOST"], timeout=120)
    try:
        script = (
            "python3 --version 1>&2; cd /elsewhere/src && "
            "python3 -m builder key recipes/v41-sm120.yaml && python3 -m builder key /elsewhere/hand/recipe.yaml"
        )
        logs = engine.containers.run(
            services["VLLM_OVERLAY_TEST_BASE_IMAGE"],
            ["sh", "-c", script],
            user="4321:4321",
            remove=True,
            environment={
                "PYTHONPATH": "/elsewhere/src:/elsewhere/deps",
                "HOME": "/tmp/home",
                "LANG": "C",
                "TZ": "Pacific/Kiritimati",
                "PYTHONDONTWRITEBYTECODE": "1",
            },
            volumes={
                str(src): {"bind": "/elsewhere/src", "mode": "ro"},
                str(deps): {"bind": "/elsewhere/deps", "mode": "ro"},
                str(hand): {"bind": "/elsewhere/hand", "mode": "ro"},
            },
            network_disabled=True,
            stdout=True,
            stderr=False,
        )
    finally:
        engine.close()
    elsewhere = logs.decode().split()
    here = [run_cli("key", DEFAULT_RECIPE).stdout.strip(), run_cli("key", hand / "recipe.yaml").stdout.strip()]
    assert elsewhere == here
    assert here[1] == hand_key()
