from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from builder.recipe import load_recipe
from builder.pin import pinned_wheel
from builder.tree import pinned_tree
from tests.helpers import DEFAULT_RECIPE


@pytest.fixture(scope="session")
def vllm_wheel() -> Path:
    """The real pinned vLLM 0.30.0 wheel, fetched once into the user cache and sha256-checked."""
    pin = load_recipe(DEFAULT_RECIPE).vllm
    pinned_tree(pin)  # also leaves the wheel's zip index in the cache, as any run does
    return pinned_wheel(pin)


@pytest.fixture(scope="session")
def wheel_zip(vllm_wheel: Path) -> zipfile.ZipFile:
    return zipfile.ZipFile(vllm_wheel)
