from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from builder.apply import apply_members
from builder.members import load_recipe_members
from builder.pin import pinned_wheel
from builder.probe import SELFTEST_MEMBER
from builder.probe_env import ensure_probe_venv
from builder.recipe import load_recipe
from builder.tree import pinned_tree
from tools.services import load_service_env
from tools.synthetic import DEFAULT_RECIPE, warm_cache_copy

# What a test needs beyond this checkout, by the fixtures it uses (directly or through
# others): `make test-fast` deselects these three, `make test` (and CI) runs everything.
NEEDS = {
    "vllm_wheel": "wheel",  # the pinned vLLM wheel (336 MB, fetched once into the cache)
    "fi07_wheel": "wheel",  # FlashInfer 0.7.2.post1's wheel, fetched once
    "probe_python": "probe",  # the probe venv: vLLM 0.30.0 with CPU torch, imported
    "services": "services",  # dockerd, the registry and the package index (.ci/services.sh)
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "wheel: needs a pinned wheel (fetched once into the cache)")
    config.addinivalue_line("markers", "probe: needs the probe venv (vLLM 0.30.0 imported)")
    config.addinivalue_line("markers", "services: needs the local Docker engine, registry and index")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in set(getattr(item, "fixturenames", ())) & NEEDS.keys():
            item.add_marker(NEEDS[fixture])


@pytest.fixture(scope="session")
def services() -> dict[str, str]:
    """The local services' coordinates (.ci/services.sh start writes them); never skipped."""
    return load_service_env()


@pytest.fixture(scope="session")
def vllm_wheel() -> Path:
    """The real pinned vLLM 0.30.0 wheel, fetched once into the user cache and sha256-checked."""
    pin = load_recipe(DEFAULT_RECIPE).vllm
    pinned_tree(pin).read("vllm/__init__.py")  # fetched and verified once, as any run does
    return pinned_wheel(pin)


@pytest.fixture
def isolated_cache(tmp_path: Path, vllm_wheel: Path) -> Path:
    """A warm cache of its own: nothing to fetch, and any write shows."""
    return warm_cache_copy(vllm_wheel, tmp_path / "cache")


@pytest.fixture(scope="session")
def wheel_zip(vllm_wheel: Path) -> zipfile.ZipFile:
    return zipfile.ZipFile(vllm_wheel)


@pytest.fixture(scope="session")
def overlay_files(vllm_wheel: Path) -> dict[str, dict[str, bytes]]:
    """The default recipe's overlay, made by our engine on the real tree.

    "patched": every file the whole overlay writes; "selftest-only": what the
    self-test member writes applied alone (the unpatched arm).
    """
    recipe = load_recipe(DEFAULT_RECIPE)
    members = load_recipe_members(recipe)
    tree = pinned_tree(recipe.vllm)
    selftest = [m for m in members if m.name == SELFTEST_MEMBER]

    def files(ms) -> dict[str, bytes]:
        return {c.path: c.after for c in apply_members(tree, ms).changes if c.after is not None}

    return {"patched": files(members), "selftest-only": files(selftest)}


@pytest.fixture(scope="session")
def selftest_module() -> ModuleType:
    """The self-test module, imported from its source overlay/sm120_decode_shape_selftest.py
    in this (vLLM-less) interpreter. The member applied to the wheel is checked to equal
    this file elsewhere (tests/test_member_source.py), so no wheel is needed here."""
    path = Path(__file__).resolve().parent.parent / "overlay" / "sm120_decode_shape_selftest.py"
    spec = importlib.util.spec_from_file_location("sm120_decode_shape_selftest", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def probe_python() -> Path:
    """A venv with vllm==0.30.0 and its dependencies (CPU torch), built once and cached."""
    return ensure_probe_venv(
        load_recipe(DEFAULT_RECIPE).vllm.version, progress=lambda line: print(line, file=sys.stderr)
    )
