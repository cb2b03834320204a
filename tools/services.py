"""Where the real components of the integration tests are.

`.ci/services.sh start` starts dockerd, the registry and the package index,
imports the base image, and writes their coordinates to an env file
(`/run/vllm-overlay/env`, or `$VO_ENV_FILE`) as NAME=VALUE lines.
The file wins; the environment fills in what the file lacks (or stands in
for a missing file, e.g. when the services run elsewhere).
"""

from __future__ import annotations

import os
from pathlib import Path

SERVICE_VARS = (
    "DOCKER_HOST",  # unix:///run/vllm-overlay/docker.sock
    "VLLM_OVERLAY_TEST_REGISTRY",  # 127.0.0.1:5000
    "VLLM_OVERLAY_TEST_INDEX",  # http://127.0.0.1:5001/simple/
    "VLLM_OVERLAY_TEST_BASE_IMAGE",  # vllm-overlay-test/debian-python:bookworm
)
START_COMMAND = "bash .ci/services.sh start"


class ServicesNotRunning(RuntimeError):
    """The real components are not started (or not fully)."""


def env_file() -> Path:
    state = os.environ.get("VO_STATE_DIR", "/run/vllm-overlay")
    return Path(os.environ.get("VO_ENV_FILE", f"{state}/env"))


def load_service_env() -> dict[str, str]:
    """SERVICE_VARS from the env file, else from the environment."""
    found: dict[str, str] = {}
    path = env_file()
    if path.is_file():
        for line in path.read_text().splitlines():
            name, sep, value = line.partition("=")
            if sep and name in SERVICE_VARS and value:
                found[name] = value
    for name in SERVICE_VARS:
        if name not in found and os.environ.get(name):
            found[name] = os.environ[name]
    missing = [name for name in SERVICE_VARS if name not in found]
    if missing:
        where = f"{path}" if path.is_file() else f"{path} (absent)"
        raise ServicesNotRunning(
            f"test services not configured: {', '.join(missing)} not set in the "
            f"environment or {where}; start them with: {START_COMMAND}"
        )
    return found
