"""Image: build the rendered context through the Docker SDK, tag it by key, push, record.

The engine is whatever ``DOCKER_HOST`` names (``ssh://`` included, through the
system ssh client).  A build is skipped when an image this builder made for the
image key is already in the local engine, or the registry's ``ik-`` tag holds
one (its config labelled with the key; read through builder.registry, no engine).
A skip from the registry with ``--push`` moves the recipe's moving and ``rk-``
tags to that digest by putting its manifest under them: no layer is pulled.
The produced-image row (one per repository and image key) is written only after
a build (and push) succeeded, and replaced when a push gives it the registry digest.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from builder import __version__
from builder.errors import CheckFailed, RegistryUnreachable, ServiceUnreachable, first_line
from builder.key import short_key
from builder.produced import find_row, record_row
from builder.recipe import Recipe
from builder.render import RenderedImage, context_tar, python_in_image

Progress = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def docker_client():
    import docker
    from docker.errors import DockerException

    host = os.environ.get("DOCKER_HOST", "the default socket")
    try:
        client = docker.from_env(use_ssh_client=host.startswith("ssh://"), timeout=600)
        client.ping()
    except DockerException as exc:
        raise ServiceUnreachable(f"Docker engine at {host} cannot be reached: {str(exc).splitlines()[0]}") from None
    return client


def registry_of(repository: str) -> str | None:
    """The registry host a repository names, if it names one (else Docker Hub: never assumed)."""
    first = repository.split("/", 1)[0]
    return first if "/" in repository and ("." in first or ":" in first or first == "localhost") else None


@dataclass(frozen=True)
class Tags:
    runtime: str  # REPO:rk-<short runtime key>
    image: str  # REPO:ik-<short image key>: the one the skip and plan check in a registry
    moving: str  # REPO:<recipe name>

    def all(self) -> list[str]:
        return [self.runtime, self.image, self.moving]


def tag_all(image, tags: Tags) -> None:
    for ref in tags.all():
        image.tag(*ref.rsplit(":", 1))


def tags_for(recipe: Recipe, rendered: RenderedImage) -> Tags:
    repo = recipe.image.repository
    return Tags(
        f"{repo}:rk-{short_key(rendered.runtime_key)}", f"{repo}:ik-{rendered.short_image_key}", moving_tag(recipe)
    )


def local_image(client, image_key: str):
    """The image this builder made for the key.

    An image built FROM it inherits its labels, so the label alone does not
    tell; the builder's own last step (the labels it adds after the build) does.
    """
    for image in client.images.list(filters={"label": f"io.vllm-overlay.image-key={image_key}"}):
        if "LABEL io.vllm-overlay.torch-cuda=" in (client.api.history(image.id)[0].get("CreatedBy") or ""):
            return image
    return None


IMAGE_KEY_LABEL = "io.vllm-overlay.image-key"
# The step build() adds after the build proper: only the image this builder made ends with it (an
# image built FROM it inherits every label, the image key's included).
BUILDER_STEP = "LABEL io.vllm-overlay.torch-cuda="


@dataclass(frozen=True)
class RegistryImage:
    """What the registry's ik- tag holds: ``digest`` only when it is an image this builder made
    for the image key; ``reason`` says what was found either way."""

    digest: str | None
    reason: str


def registry_image(reference: str, image_key: str) -> RegistryImage:
    """Whether ``reference`` (REPO:ik-...) names, in its registry, an image made for ``image_key``:
    the tag resolves and its image config carries the image-key label and the builder's last
    step.  RegistryUnreachable when the registry cannot tell."""
    from builder import registry

    found = registry.image_config(reference)
    if found is None:
        return RegistryImage(None, f"{reference} is not in the registry")
    there = f"{reference} is in the registry ({found.digest})"
    label = found.labels.get(IMAGE_KEY_LABEL)
    if label is None:
        return RegistryImage(None, f"{there} but its image has no image-key label")
    if label != image_key:
        return RegistryImage(None, f"{there} but its image is labelled with image key {label}")
    if BUILDER_STEP not in found.last_step:
        return RegistryImage(None, f"{there} but its image was built FROM the overlay image, not by vllm-overlay")
    return RegistryImage(found.digest, f"{there}, labelled with the image key")


LOCAL_RECIPE = "recipes/local.yaml"


def pull(client, reference: str, progress: Progress = _stderr) -> None:
    """Pull ``reference``, streaming a line per layer as it completes (not every byte count: a
    CUDA base is gigabytes) and the engine's closing status; an error in the stream raises."""
    from docker.errors import APIError

    layers = 0
    for chunk in client.api.pull(reference, stream=True, decode=True):
        if "error" in chunk:
            raise APIError(str(chunk.get("errorDetail", {}).get("message") or chunk["error"]))
        status = chunk.get("status", "")
        if status in ("Pull complete", "Already exists"):
            layers += 1
            progress(f"  layer {layers} {chunk.get('id', '')}: {status}")
        elif status.startswith(("Digest:", "Status:")):
            progress(f"  {status}")


def ensure_base(client, recipe: Recipe, progress: Progress = _stderr) -> None:
    """The base image in the engine, pulled if missing; an unreachable registry is one line that
    names the base and its registry (and the recipe that builds on this machine's own services)."""
    from docker.errors import APIError, ImageNotFound

    base = recipe.image.base
    try:
        client.images.get(base)
        return
    except ImageNotFound:
        pass
    registry = registry_of(base.split("@", 1)[0]) or "docker.io"
    progress(f"pull base {base} from {registry}")
    try:
        pull(client, base, progress)
    except APIError as exc:
        raise ServiceUnreachable(
            f"base image {base} is not in the engine and cannot be pulled from {registry}"
            f" ({first_line(exc)}); on a machine that cannot reach it,"
            f" `make image RECIPE={LOCAL_RECIPE}` builds on the local services `make setup` starts"
        ) from None


def previous_image(client, recipe: Recipe, progress: Progress = _stderr) -> str | None:
    """The recipe's last pushed image (its moving tag), pulled to seed the build cache: on an empty
    engine (a fresh CI runner) its install layers are reused and only the overlay is rebuilt."""
    from docker.errors import APIError

    if not registry_of(recipe.image.repository):
        return None
    moving = moving_tag(recipe)
    progress(f"pull {moving} as build cache")
    try:
        pull(client, moving, progress)
    except APIError as exc:
        progress(f"  no build cache: {first_line(exc)}")
        return None
    return moving


def moving_tag(recipe: Recipe) -> str:
    return f"{recipe.image.repository}:{recipe.name}"


def build(client, recipe: Recipe, rendered: RenderedImage, files: dict[str, bytes], progress: Progress = _stderr):
    """Build the context, stream its steps, then add the labels only the built image can tell."""
    tags = tags_for(recipe, rendered)
    ensure_base(client, recipe, progress)
    cache = previous_image(client, recipe, progress)
    image_id = _build(client, context_tar(files), tags.runtime, progress, cache_from=[cache] if cache else None)
    report = _report(client, image_id, python_in_image(recipe))
    labels = {
        "io.vllm-overlay.torch-cuda": report["torch_cuda"],
        "io.vllm-overlay.nvcc": report["nvcc"],
        # the wheels the locked install put in (name==version sha256:...), or "unknown" when unlocked
        "io.vllm-overlay.installed": report.get("installed", "unknown"),
    }
    dockerfile = f"FROM {image_id}\nLABEL " + " ".join(f"{k}={json.dumps(v)}" for k, v in labels.items()) + "\n"
    image_id = _build(client, context_tar({"Dockerfile": dockerfile.encode()}), tags.runtime, progress)
    image = client.images.get(image_id)
    tag_all(image, tags)
    return image


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _build(client, context: bytes, tag: str, progress: Progress, cache_from: list[str] | None = None) -> str:
    """Run one build, streaming its steps; a failure is one line saying what the failing step said."""
    from docker.errors import APIError

    image_id, said = None, None
    try:
        stream = client.api.build(
            fileobj=io.BytesIO(context),
            custom_context=True,
            tag=tag,
            rm=True,
            forcerm=True,
            network_mode="host",
            decode=True,
            pull=False,
            cache_from=cache_from,
        )
        for chunk in stream:
            if "stream" in chunk:
                text = chunk["stream"]
                from_stderr = text.startswith("\x1b[91m")  # the engine colours a step's stderr
                for line in ANSI.sub("", text).splitlines():
                    if not line.strip():
                        continue
                    progress(line)
                    if line.startswith("Step "):
                        said = None
                    elif from_stderr:
                        said = line.strip().removeprefix("vllm-overlay: ")
            if "error" in chunk:
                detail = chunk.get("errorDetail", {}).get("message") or chunk["error"]
                raise CheckFailed(f"image build failed: {said or detail.strip().splitlines()[-1]}")
            if "aux" in chunk and "ID" in chunk["aux"]:
                image_id = chunk["aux"]["ID"]
    except APIError as exc:
        raise CheckFailed(f"image build failed: {exc.explanation or exc}") from None
    if image_id is None:
        raise CheckFailed("image build finished without an image id")
    return image_id


def _report(client, image_id: str, python: str) -> dict[str, str]:
    """torch's CUDA version and nvcc's, read by running the built image once (no network)."""
    out = client.containers.run(
        image_id, [python, "/opt/vllm-overlay/image_checks.py", "report"], remove=True, network_mode="none"
    )
    return json.loads(out.decode().strip().splitlines()[-1])


def push_tags(client, refs: list[str], progress: Progress = _stderr) -> str | None:
    """Push each reference; return the registry digest of the pushed image (the engine's answer)."""
    digest = None
    for ref in refs:
        repo, tag = ref.rsplit(":", 1)
        progress(f"push {ref}")
        for chunk in client.api.push(repo, tag=tag, stream=True, decode=True):
            if "error" in chunk:
                raise CheckFailed(f"push of {ref} failed: {chunk['error']}")  # the engine tells no reason apart
            if chunk.get("status") in ("Pushed", "Layer already exists"):
                progress(f"  {chunk.get('id', '')}: {chunk['status']}")
            digest = (chunk.get("aux") or {}).get("Digest") or digest
    return digest


def move_tags(tags: Tags, digest: str, progress: Progress = _stderr) -> None:
    """Point the moving and rk- tags at the digest the ik- tag holds, by putting its manifest
    under them in the registry: no layer is pulled or pushed."""
    from builder import registry

    repository, names = tags.image.rsplit(":", 1)[0], [ref.rsplit(":", 1)[1] for ref in (tags.moving, tags.runtime)]
    before = {ref: registry.resolve(ref) for ref in (tags.moving, tags.runtime)}
    registry.retag(f"{repository}@{digest}", names)  # by digest: exactly the manifest that was checked
    for ref, was in before.items():
        said = "already on" if was == digest else f"moved from {was} to" if was else "put on"
        progress(f"{ref}: {said} {digest} (its manifest put in the registry, no layer pulled)")


def produced_row(recipe: Recipe, rendered: RenderedImage, reference: str, digest: str, pushed: bool) -> dict[str, Any]:
    return {
        "recipe": recipe.name,
        "repository": recipe.image.repository,
        "runtime_key": rendered.runtime_key,
        "image_key": rendered.image_key,
        "image": reference,
        "digest": digest,
        "digest_from": "registry" if pushed else "engine",  # a registry manifest digest, or the local image id
        "pins": {"vllm": recipe.vllm.version, "flashinfer": recipe.flashinfer.version},
        "builder": __version__,
        "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


@dataclass(frozen=True)
class Made:
    """What ensure_image did: ``how`` is "engine" or "registry" (found by the image key:
    nothing built) or "built"."""

    reference: str  # REPO:rk-<short runtime key>
    image_key: str
    how: str
    digest: str | None  # the registry digest (found or pushed), else the local image id


def ensure_image(
    recipe: Recipe,
    rendered: RenderedImage,
    files: dict[str, bytes],
    *,
    push: bool = False,
    progress: Progress = _stderr,
) -> Made:
    """The image for ``rendered``'s image key: an image this builder made for it in the
    engine, or its ik- tag in the registry, else a build.  Tagged, pushed if asked (a registry
    skip moves the tags there instead), and recorded in the produced rows (only after success;
    one row per repository and image key, given the registry digest once there is one)."""
    from docker.errors import DockerException
    from requests.exceptions import RequestException

    try:
        return _ensure_image(recipe, rendered, files, push, progress)
    except (DockerException, RequestException) as exc:  # the engine failed mid-way: a service, one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ServiceUnreachable(
            f"Docker engine at {os.environ.get('DOCKER_HOST', 'the default socket')}: {first}"
        ) from None


def _ensure_image(
    recipe: Recipe, rendered: RenderedImage, files: dict[str, bytes], push: bool, progress: Progress
) -> Made:
    tags = tags_for(recipe, rendered)
    client = docker_client()
    built = local_image(client, rendered.image_key)
    found = RegistryImage(None, "")
    if built is None and registry_of(recipe.image.repository):
        try:
            found = registry_image(tags.image, rendered.image_key)
        except RegistryUnreachable as exc:
            progress(f"warning: {exc}; building")
        else:
            if found.digest is None:
                progress(found.reason)
    digest = found.digest
    if built is not None:
        how = "engine"
        progress(f"up to date: an image with image key {rendered.image_key} is in the engine ({built.id})")
        tag_all(built, tags)  # this repository's tags may be missing (another repository built it)
    elif digest is not None:
        how = "registry"
        progress(f"up to date: {found.reason}")
        if push:
            move_tags(tags, digest, progress)
        else:
            progress(f"{tags.moving} and {tags.runtime} left as they are (no --push)")
    else:
        how = "built"
        progress(f"building {tags.runtime} (image key {rendered.image_key})")
        built = build(client, recipe, rendered, files, progress)
    if push and built is not None:
        digest = push_tags(client, tags.all(), progress)
        if digest is None:
            from builder import registry

            digest = registry.resolve(tags.image)  # an engine that did not say: ask the registry
    if digest is not None:
        record_row(produced_row(recipe, rendered, tags.runtime, digest, pushed=True), replace=True)
    elif find_row(rendered.image_key, repository=recipe.image.repository) is None:
        record_row(produced_row(recipe, rendered, tags.runtime, built.id, pushed=False), replace=False)
    return Made(tags.runtime, rendered.image_key, how, digest or (built.id if built is not None else None))
