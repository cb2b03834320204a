"""Tags and rows that hold (issue 14, part 3) and pin-base (part 5): builder.registry against
the real local registry and engines, plan's verdicts, the rows file, and the recipe rewrite.

The registry client's auth (the Bearer challenge, Basic, credentials from config.json, a
redirect that must not carry the token) is shown against a small local http.server stub,
the only fake here; everything a user meets runs against the real registry at
127.0.0.1:5000 and the real engines (tools.services.load_service_env()), through the CLI.
Every repository is this run's own (a per-run prefix) and every produced-rows file a
temporary one.  A digest is always checked independently of builder.registry: a plain
HTTP HEAD to the registry, or the engine's own view (the Docker SDK's get_registry_data).
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import docker
import pytest
import yaml

from builder import registry
from builder.errors import RegistryUnreachable
from tests.helpers import run_cli
from tools.image_recipes import changed_overlay, cli_env, made_images, remove_images, write_recipe_copy
from tools.synthetic import DEFAULT_RECIPE, ROOT

RUN_ID = uuid.uuid4().hex[:10]
ACCEPT = ", ".join(registry.MANIFEST_TYPES)
DEFAULT_BASE = yaml.safe_load(DEFAULT_RECIPE.read_text())["image"]["base"]
DEFAULT_REPOSITORY = yaml.safe_load(DEFAULT_RECIPE.read_text())["image"]["repository"]


# ---- helpers ------------------------------------------------------------------


def head_digest(host: str, reference: str) -> str | None:
    """The digest the registry itself reports for name:tag (plain HTTP, not builder.registry)."""
    name, tag = reference.removeprefix(host + "/").rsplit(":", 1)
    request = urllib.request.Request(f"http://{host}/v2/{name}/manifests/{tag}", method="HEAD")
    request.add_header("Accept", ACCEPT)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.headers["Docker-Content-Digest"]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def one_line(proc) -> str:
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm-overlay: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def plan_first_line(recipe: Path, produced: Path, **env: str) -> str:
    proc = run_cli("plan", recipe, env={"VLLM_OVERLAY_PRODUCED": str(produced), "VLLM_OVERLAY_REPOSITORY": "", **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()[0]


def image_key_of(recipe: Path, produced: Path) -> str:
    """The image key plan prints (it needs no tree)."""
    proc = run_cli("plan", recipe, env={"VLLM_OVERLAY_PRODUCED": str(produced), "VLLM_OVERLAY_REPOSITORY": ""})
    assert proc.returncode == 0, proc.stderr
    return next(line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("image key"))


def recipe_copy(path: Path, **image: str) -> Path:
    """The default recipe (its own overlay) with image fields changed: for runs that build nothing."""
    data = yaml.safe_load(DEFAULT_RECIPE.read_text())
    data["image"].update(image)
    data["overlay"] = str(ROOT / "overlay")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def rows(produced: Path) -> list[dict]:
    return (yaml.safe_load(produced.read_text()) or []) if produced.exists() else []


def row_for(ik: str, repository: str, digest: str = "sha256:" + "1" * 64) -> dict:
    return {
        "recipe": "v41-sm120",
        "repository": repository,
        "runtime_key": "rk-" + "0" * 64,
        "image_key": ik,
        "image": f"{repository}:rk-0000000000000000",
        "digest": digest,
        "digest_from": "registry",
        "time": "2026-01-01T00:00:00Z",
    }


# ---- the registry client against a stub: auth and bounds ---------------------------


@dataclass
class Stub:
    """A registry stand-in on 127.0.0.1 that asks for a Bearer token (``stub/``), for Basic
    (``basic/``), redirects blobs to a storage path, and misbehaves on request."""

    user: str = "alice"
    password: str = "s3cret"
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Authorization
    port: int = 0

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def basic(self) -> str:
        return base64.b64encode(f"{self.user}:{self.password}".encode()).decode()


CONFIG = json.dumps({"config": {"Labels": {"io.vllm-overlay.image-key": "ik-stub"}}, "history": [{}]}).encode()
CONFIG_DIGEST = "sha256:" + hashlib.sha256(CONFIG).hexdigest()
MANIFEST = json.dumps(
    {
        "schemaVersion": 2,
        "mediaType": registry.DOCKER_MANIFEST,
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": CONFIG_DIGEST},
        "layers": [],
    }
).encode()
MANIFEST_DIGEST = "sha256:" + hashlib.sha256(MANIFEST).hexdigest()


@pytest.fixture
def stub() -> Iterator[Stub]:
    state = Stub()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def answer(self, code: int, body: bytes = b"", **headers: str) -> None:
            self.send_response(code)
            for name, value in headers.items():
                self.send_header(name.replace("_", "-"), value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            auth = self.headers.get("Authorization")
            state.seen.append((self.command, self.path, auth))
            path = self.path.split("?")[0]
            if path == "/token":
                token = "tok-user" if auth == f"Basic {state.basic}" else "tok-anonymous"
                return self.answer(200, json.dumps({"token": token}).encode())
            if path.startswith("/storage/"):  # where a blob redirect lands: must come without the token
                return self.answer(400 if auth else 200, CONFIG)
            if path.startswith("/v2/stub/"):
                if auth != "Bearer tok-user":
                    realm = f"http://{state.host}/token"
                    challenge = f'Bearer realm="{realm}",service="stub",scope="repository:stub/repo:pull"'
                    return self.answer(401, WWW_Authenticate=challenge)
                if path.endswith(f"/blobs/{CONFIG_DIGEST}"):
                    return self.answer(307, Location=f"http://{state.host}/storage/{CONFIG_DIGEST}")
                return self.answer(
                    200, MANIFEST, Content_Type=registry.DOCKER_MANIFEST, Docker_Content_Digest=MANIFEST_DIGEST
                )
            if path.startswith("/v2/basic/"):
                if auth != f"Basic {state.basic}":
                    return self.answer(401, WWW_Authenticate='Basic realm="stub"')
                return self.answer(200, MANIFEST, Content_Type=registry.DOCKER_MANIFEST)
            if path.startswith("/v2/lie/"):  # a digest header the bytes do not hash to
                return self.answer(
                    200, MANIFEST, Content_Type=registry.DOCKER_MANIFEST, Docker_Content_Digest="sha256:" + "0" * 64
                )
            if path.startswith("/v2/huge/"):
                return self.answer(200, b"{" + b" " * (registry.MANIFEST_LIMIT + 1) + b"}")
            return self.answer(404)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def docker_config(tmp_path: Path, monkeypatch, config: dict) -> Path:
    (tmp_path / "docker").mkdir(exist_ok=True)
    (tmp_path / "docker" / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    return tmp_path / "docker" / "config.json"


def test_bearer_challenge_is_answered_with_config_json_credentials(stub, tmp_path, monkeypatch) -> None:
    docker_config(tmp_path, monkeypatch, {"auths": {stub.host: {"auth": stub.basic}}})
    found = registry.image_config(f"{stub.host}/stub/repo:t")
    assert found is not None and found.digest == MANIFEST_DIGEST
    assert found.labels == {"io.vllm-overlay.image-key": "ik-stub"}
    methods_paths = [(m, p.split("?")[0], a) for m, p, a in stub.seen]
    # anonymous first, then the token endpoint with the Basic credentials, then the token
    assert methods_paths[0] == ("GET", "/v2/stub/repo/manifests/t", None)
    assert methods_paths[1] == ("GET", "/token", f"Basic {stub.basic}")
    token_query = stub.seen[1][1].split("?", 1)[1]
    assert "service=stub" in token_query and "scope=repository%3Astub%2Frepo%3Apull" in token_query
    assert methods_paths[2] == ("GET", "/v2/stub/repo/manifests/t", "Bearer tok-user")
    # the blob's redirect to storage went there without the registry's token
    assert ("GET", f"/storage/{CONFIG_DIGEST}", None) in methods_paths
    assert ("GET", f"/v2/stub/repo/blobs/{CONFIG_DIGEST}", "Bearer tok-user") in methods_paths
    # the token is remembered for the scope: one token request in all
    assert [p for _, p, _ in methods_paths].count("/token") == 1


def test_without_credentials_the_refusal_is_one_line_naming_the_registry(stub, tmp_path, monkeypatch) -> None:
    path = docker_config(tmp_path, monkeypatch, {"auths": {}})
    with pytest.raises(RegistryUnreachable) as refused:
        registry.resolve(f"{stub.host}/stub/repo:t")
    message = str(refused.value)
    assert message.startswith(f"registry {stub.host} refused HEAD stub/repo/manifests/t (HTTP 401)")
    assert f"no credentials for it in {path}" in message and "\n" not in message
    assert refused.value.exit_code == 3


def test_a_credential_helper_only_config_says_it_is_not_read(stub, tmp_path, monkeypatch) -> None:
    docker_config(tmp_path, monkeypatch, {"auths": {stub.host: {}}, "credsStore": "desktop"})
    with pytest.raises(RegistryUnreachable, match=r"credential helper \(desktop\), which vllm-overlay does not read"):
        registry.resolve(f"{stub.host}/stub/repo:t")
    docker_config(tmp_path, monkeypatch, {"credHelpers": {stub.host: "ecr-login"}})
    with pytest.raises(RegistryUnreachable, match=r"credential helper \(ecr-login\)"):
        registry.resolve(f"{stub.host}/basic/repo:t")


def test_basic_challenge_and_docker_hub_style_keys(stub, tmp_path, monkeypatch) -> None:
    docker_config(tmp_path, monkeypatch, {"auths": {f"http://{stub.host}/v1/": {"auth": stub.basic}}})
    assert registry.resolve(f"{stub.host}/basic/repo:t") == MANIFEST_DIGEST  # no digest header: the bytes hashed
    assert stub.seen[-1][2] == f"Basic {stub.basic}"


def test_a_manifest_that_does_not_hash_to_its_digest_is_refused(stub, tmp_path, monkeypatch) -> None:
    docker_config(tmp_path, monkeypatch, {})
    with pytest.raises(RegistryUnreachable, match="does not hash to its digest"):
        registry.image_config(f"{stub.host}/lie/repo:t")


def test_an_answer_larger_than_its_bound_is_refused(stub, tmp_path, monkeypatch) -> None:
    docker_config(tmp_path, monkeypatch, {})
    with pytest.raises(RegistryUnreachable, match=r"answered more than 4096 KiB"):
        registry.image_config(f"{stub.host}/huge/repo:t")


def test_challenge_parsing_and_references(monkeypatch) -> None:
    kind, params = registry.parse_challenge(
        'Bearer realm="https://ghcr.io/token",service="ghcr.io",scope="repository:o/r:pull"'
    )
    assert (kind, params) == (
        "bearer",
        {"realm": "https://ghcr.io/token", "service": "ghcr.io", "scope": "repository:o/r:pull"},
    )
    assert registry.parse_challenge('Basic realm="Registry Realm"') == ("basic", {"realm": "Registry Realm"})
    parse = registry.parse_reference
    assert parse("nvidia/cuda:12.8.1-devel-ubuntu24.04") == registry.Reference(
        "registry-1.docker.io", "nvidia/cuda", "12.8.1-devel-ubuntu24.04"
    )
    assert parse("ubuntu:24.04") == registry.Reference("registry-1.docker.io", "library/ubuntu", "24.04")
    assert parse("docker.io/ubuntu").tag is None and parse("docker.io/ubuntu").repository == "library/ubuntu"
    assert parse("localhost:5000/a/b:t@sha256:" + "a" * 64) == registry.Reference(
        "localhost:5000", "a/b", "t", "sha256:" + "a" * 64
    )
    assert parse("ghcr.io/o/r:ik-1").registry == "ghcr.io"
    monkeypatch.delenv(registry.INSECURE_ENV, raising=False)
    assert [registry.scheme_of(h) for h in ("127.0.0.1:5000", "localhost", "[::1]:5000", "ghcr.io", "reg:5000")] == [
        "http",
        "http",
        "http",
        "https",
        "https",
    ]
    monkeypatch.setenv(registry.INSECURE_ENV, "reg:5000, other")
    assert registry.scheme_of("reg:5000") == "http" and registry.scheme_of("other:443") == "http"


@pytest.mark.parametrize("host", ["127.0.0.1:1", "registry.invalid"])
def test_an_unreachable_registry_is_one_error_naming_it(host) -> None:
    with pytest.raises(RegistryUnreachable, match=rf"^registry {host} cannot be reached: ") as unreachable:
        registry.resolve(f"{host}/x/y:t")
    assert unreachable.value.exit_code == 3


# ---- rows: corrupt files, foreign rows (no registry, no services) ---------------------


CORRUPT_ROWS = {
    "yaml-error": ("- [unclosed\n", "invalid YAML"),
    "a-mapping": ("recipe: v41-sm120\n", "expected a list of produced-image rows"),
    "a-row-not-a-mapping": ("- 1\n", "expected a list of produced-image rows"),
    "a-field-not-a-string": ("- image_key: 5\n", "row 0: image_key: expected a string, got int 5"),
    "a-huge-int": ("- image_key: " + "9" * 5000 + "\n", "invalid YAML"),
    "an-unhashable-key": ("- ? [a, b]\n  : c\n", "invalid YAML: a key that is a list or a mapping"),
    "pins-not-a-mapping": ("- pins: [1]\n", "row 0: pins: expected a mapping"),
    "a-python-tag": ("- image_key: !!python/object/apply:os.system [true]\n", "invalid YAML"),
    "a-duplicate-key": ("- image_key: a\n  image_key: b\n", "duplicate key"),
    "not-utf8": (b"- image: \xff\n", "cannot read produced-image rows"),
}


@pytest.mark.parametrize("command", ["plan", "image"])
@pytest.mark.parametrize("case", sorted(CORRUPT_ROWS))
def test_a_corrupt_rows_file_is_one_line_exit_2(tmp_path, command, case) -> None:
    text, expected = CORRUPT_ROWS[case]
    produced = tmp_path / "produced.yaml"
    produced.write_bytes(text if isinstance(text, bytes) else text.encode())
    before = produced.read_bytes()
    env = {"VLLM_OVERLAY_PRODUCED": str(produced), "VLLM_OVERLAY_REPOSITORY": "", "DOCKER_HOST": "unix:///nonexistent"}
    proc = run_cli(command, DEFAULT_RECIPE, env=env)
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc)
    assert line.startswith(f"vllm-overlay: {produced}: ") and expected in line, line
    assert proc.stdout == "" and produced.read_bytes() == before


def test_only_a_row_of_the_recipes_own_repository_counts_without_a_registry(tmp_path) -> None:
    recipe = recipe_copy(tmp_path / "recipe.yaml")
    produced = tmp_path / "produced.yaml"
    ik = image_key_of(recipe, produced)
    legacy = {k: v for k, v in row_for(ik, DEFAULT_REPOSITORY).items() if k != "repository"}
    produced.write_text(yaml.safe_dump([row_for(ik, "someone/else"), legacy]))
    assert plan_first_line(recipe, produced) == (
        f"rebuild: no produced row for {DEFAULT_REPOSITORY} with this image key (and no registry in its name)"
    )
    produced.write_text(yaml.safe_dump([row_for(ik, "someone/else"), row_for(ik, DEFAULT_REPOSITORY)]))
    assert plan_first_line(recipe, produced).startswith("up-to-date: produced vllm-overlay/v41-sm120:rk-")


def test_plan_with_an_unreachable_registry_says_rebuild_and_why(tmp_path) -> None:
    recipe = recipe_copy(tmp_path / "recipe.yaml", repository="127.0.0.1:1/nowhere/v41")
    produced = tmp_path / "produced.yaml"
    ik = image_key_of(recipe, produced)
    produced.write_text(yaml.safe_dump([row_for(ik, "127.0.0.1:1/nowhere/v41")]))  # a row never suffices
    first = plan_first_line(recipe, produced)
    assert first.startswith("rebuild: the registry cannot tell whether 127.0.0.1:1/nowhere/v41:ik-"), first
    assert "registry 127.0.0.1:1 cannot be reached" in first


# ---- pin-base: unreachable (no services) ----------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1:1", "registry.invalid"])
def test_pin_base_with_an_unreachable_registry_is_one_line_exit_3(tmp_path, host) -> None:
    recipe = tmp_path / "recipe.yaml"
    base = f"{host}/nvidia/cuda:12.8.1-devel-ubuntu24.04"
    recipe.write_text(DEFAULT_RECIPE.read_text().replace(DEFAULT_BASE, base))
    before = recipe.read_bytes()
    proc = run_cli("pin-base", recipe)
    assert proc.returncode == 3, proc.stderr
    assert one_line(proc).startswith(
        f"vllm-overlay: {recipe}: image.base: cannot resolve {base}: registry {host} cannot be reached: "
    )
    assert proc.stdout == "" and recipe.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]  # no temporary left


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:1/cuda/base", "127.0.0.1:1/cuda/base has no tag to resolve (write it as name:tag)"),
        (">-\n    127.0.0.1:1/cuda/base:1.0", "cannot rewrite in place: expected a one-line scalar value"),
    ],
)
def test_pin_base_refuses_what_it_cannot_pin_before_any_request(tmp_path, value, expected) -> None:
    """Bad input, exit 2 (the registry at 127.0.0.1:1 would be exit 3, had it been asked)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(DEFAULT_RECIPE.read_text().replace(DEFAULT_BASE, value))
    before = recipe.read_bytes()
    proc = run_cli("pin-base", recipe)
    assert proc.returncode == 2, proc.stderr
    assert one_line(proc) == f"vllm-overlay: {recipe}: image.base: {expected}"
    assert recipe.read_bytes() == before


def test_pin_base_of_the_default_recipe_names_docker_hub(tmp_path) -> None:
    """The default base is on Docker Hub; with no registry reachable from here (this machine),
    the line names the base and registry-1.docker.io."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(DEFAULT_RECIPE.read_text())
    proc = run_cli("pin-base", recipe)
    if proc.returncode == 0:  # a machine that reaches Docker Hub pins it: the value alone changed
        assert recipe.read_text() == DEFAULT_RECIPE.read_text().replace(
            DEFAULT_BASE, f"{DEFAULT_BASE}@{proc.stdout.strip()}"
        )
        return
    assert proc.returncode == 3, proc.stderr
    assert f"cannot resolve {DEFAULT_BASE}: registry registry-1.docker.io" in one_line(proc)
    assert recipe.read_text() == DEFAULT_RECIPE.read_text()


# ---- against the real registry and engines --------------------------------------------


def repository(services: dict[str, str], purpose: str) -> str:
    return f"{services['VLLM_OVERLAY_TEST_REGISTRY']}/vllm-overlay-regtest-{RUN_ID}/{purpose}"


@pytest.fixture(scope="module")
def engines(services) -> Iterator[tuple[docker.DockerClient, docker.DockerClient, list[str]]]:
    """Both engines, and a list of build logs / image ids this run made; at the end this
    run's tags go, and the images only this run made."""
    first = docker.DockerClient(base_url=services["DOCKER_HOST"], timeout=600)
    second = docker.DockerClient(base_url=services["VLLM_OVERLAY_TEST_DOCKER_HOST2"], timeout=600)
    made: list[str] = []
    yield first, second, made
    prefix = f"{services['VLLM_OVERLAY_TEST_REGISTRY']}/vllm-overlay-regtest-{RUN_ID}/"
    for client in (first, second):
        remove_images(client, (prefix,), made)
        client.close()


def image_cli(services: dict[str, str], recipe: Path, produced: Path, *args: str, **env: str):
    return run_cli("image", recipe, *args, env=cli_env(services, produced, **env))


def build_small(client: docker.DockerClient, dockerfile: str, tag: str, made: list[str]) -> str:
    image, _ = client.images.build(
        fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True, network_mode="none", pull=False
    )
    made.append(image.id)
    return image.id


def push(client: docker.DockerClient, reference: str) -> None:
    repo, tag = reference.rsplit(":", 1)
    for chunk in client.api.push(repo, tag=tag, stream=True, decode=True):
        assert "error" not in chunk, chunk


@dataclass
class Scenario:
    repo: str
    a: Path
    b: Path
    produced: Path
    a_digest: str
    b_digest: str
    a_ik: str
    b_ik: str
    runs: dict[str, object]


@pytest.fixture(scope="module")
def scenario(services, engines, tmp_path_factory) -> Scenario:
    """The stale-moving-tag story: A built, then pushed; B (one member changed) built and pushed,
    the moving tag on B; then the recipe back at A, on the second engine (a fresh runner that
    holds no image): ``image`` without --push, then with it."""
    first, second, made = engines
    host = services["VLLM_OVERLAY_TEST_REGISTRY"]
    work = tmp_path_factory.mktemp("scenario")
    repo = repository(services, "v41")
    a = write_recipe_copy(work / "a.yaml", services, repo)
    b = write_recipe_copy(
        work / "b.yaml", services, repo, overlay=changed_overlay(work / "overlay", f"registry test {RUN_ID}")
    )
    produced = work / "produced.yaml"
    runs: dict[str, object] = {}
    runs["a"] = image_cli(services, a, produced)
    assert runs["a"].returncode == 0, runs["a"].stderr[-3000:]
    runs["rows-a"] = rows(produced)
    runs["a-push"] = image_cli(services, a, produced, "--push")
    assert runs["a-push"].returncode == 0, runs["a-push"].stderr[-3000:]
    runs["rows-a-push"] = rows(produced)
    a_digest = head_digest(host, f"{repo}:v41-sm120")
    runs["b-push"] = image_cli(services, b, produced, "--push")
    made.extend(made_images(runs["b-push"].stderr))
    assert runs["b-push"].returncode == 0, runs["b-push"].stderr[-3000:]
    b_digest = head_digest(host, f"{repo}:v41-sm120")
    runs["rows-b-push"] = rows(produced)
    fresh = {"DOCKER_HOST": services["VLLM_OVERLAY_TEST_DOCKER_HOST2"]}
    runs["revert-no-push"] = image_cli(services, a, produced, **fresh)
    runs["moving-after-no-push"] = head_digest(host, f"{repo}:v41-sm120")
    runs["revert"] = image_cli(services, a, produced, "--push", **fresh)
    runs["rows-revert"] = rows(produced)
    a_ik, b_ik = (image_key_of(r, work / "none.yaml") for r in (a, b))
    return Scenario(repo, a, b, produced, a_digest, b_digest, a_ik, b_ik, runs)


def test_a_registry_skip_with_push_moves_the_stale_moving_tag_back(services, engines, scenario) -> None:
    first, second, _ = engines
    host, repo, runs = services["VLLM_OVERLAY_TEST_REGISTRY"], scenario.repo, scenario.runs
    assert scenario.a_digest and scenario.b_digest and scenario.a_digest != scenario.b_digest
    assert head_digest(host, f"{repo}:ik-{scenario.a_ik.removeprefix('ik-')[:16]}") == scenario.a_digest

    # Without --push the registry skip leaves the moving tag where it was, and says so.
    quiet = runs["revert-no-push"]
    assert quiet.returncode == 0, quiet.stderr
    assert f"up to date: {repo}:ik-" in quiet.stderr and "(no --push)" in quiet.stderr
    assert runs["moving-after-no-push"] == scenario.b_digest

    # With it: nothing built, the moving tag and rk- tag put on A's digest by its manifest.
    revert = runs["revert"]
    assert revert.returncode == 0, revert.stderr
    assert "Step " not in revert.stderr and "building" not in revert.stderr, revert.stderr
    assert f"{repo}:v41-sm120: moved from {scenario.b_digest} to {scenario.a_digest}" in revert.stderr
    assert "no layer pulled" in revert.stderr
    assert revert.stdout.strip() == runs["a-push"].stdout.strip()  # A's rk- reference
    # Checked apart from builder.registry: the registry's own answer, and the engine's.
    assert head_digest(host, f"{repo}:v41-sm120") == scenario.a_digest
    assert head_digest(host, revert.stdout.strip()) == scenario.a_digest
    assert first.images.get_registry_data(f"{repo}:v41-sm120").id == scenario.a_digest
    # The fresh engine pulled nothing: it holds no image of this repository, nor any with the key.
    assert not [i for i in second.images.list(all=True) if any(t.startswith(repo) for t in i.tags)]
    assert not second.images.list(filters={"label": f"io.vllm-overlay.image-key={scenario.a_ik}"})


def test_the_row_takes_the_registry_digest_after_a_push_without_a_duplicate(services, engines, scenario) -> None:
    first, _, _ = engines
    runs, repo = scenario.runs, scenario.repo
    [built] = runs["rows-a"]
    assert built["repository"] == repo and built["image_key"] == scenario.a_ik
    assert (built["digest"], built["digest_from"]) == (first.images.get(built["image"]).id, "engine")
    [pushed] = runs["rows-a-push"]  # replaced, not appended
    assert (pushed["repository"], pushed["image_key"], pushed["image"]) == (repo, scenario.a_ik, built["image"])
    assert (pushed["digest"], pushed["digest_from"]) == (scenario.a_digest, "registry")
    assert [(r["image_key"], r["digest"]) for r in runs["rows-b-push"]] == [
        (scenario.a_ik, scenario.a_digest),
        (scenario.b_ik, scenario.b_digest),
    ]
    assert runs["rows-revert"] == runs["rows-b-push"]  # the revert found A's row as it was


def test_plan_believes_the_registry_with_no_engine(services, scenario, tmp_path) -> None:
    produced = tmp_path / "rows.yaml"  # none: the answer is the registry's
    for recipe, ik in ((scenario.a, scenario.a_ik), (scenario.b, scenario.b_ik)):
        first = plan_first_line(recipe, produced, DOCKER_HOST="unix:///nonexistent")
        tag = f"{scenario.repo}:ik-{ik.removeprefix('ik-')[:16]}"
        assert (
            first.startswith(f"up-to-date: {tag} is in the registry (sha256:")
            and "labelled with the image key" in first
        )


def test_forged_and_foreign_rows_do_not_make_plan_say_up_to_date(services, scenario, tmp_path) -> None:
    repo = scenario.repo
    # Forged: a row (this repository, the image key, a real digest) for an image never pushed.
    # A member changed anew: another image key, never built.
    overlay = changed_overlay(tmp_path / "overlay", f"forged {RUN_ID}")
    forged = write_recipe_copy(tmp_path / "forged.yaml", services, repo, overlay=overlay)
    produced = tmp_path / "produced.yaml"
    ik = image_key_of(forged, produced)
    assert ik not in (scenario.a_ik, scenario.b_ik)
    produced.write_text(yaml.safe_dump([row_for(ik, repo, scenario.a_digest)]))
    first = plan_first_line(forged, produced)
    assert first.startswith(f"rebuild: {repo}:ik-{ik.removeprefix('ik-')[:16]} is not in the registry"), first
    assert "a produced row names it, but for a registry repository only the registry counts" in first

    # Foreign: A's genuine rows (another repository's) for a recipe whose repository never had it.
    elsewhere = repository(services, "elsewhere")
    foreign = write_recipe_copy(tmp_path / "foreign.yaml", services, elsewhere)
    first = plan_first_line(foreign, scenario.produced)
    assert first.startswith(f"rebuild: {elsewhere}:ik-") and "is not in the registry" in first, first
    assert "a produced row" not in first  # the foreign row is not even taken for one


def test_an_ik_tag_on_an_image_without_the_key_does_not_count(services, engines, scenario, tmp_path) -> None:
    first, _, made = engines
    short = scenario.a_ik.removeprefix("ik-")[:16]
    produced = tmp_path / "produced.yaml"
    cases = {}
    # the base image (no label at all) pushed under A's ik- tag
    unlabelled = repository(services, "unlabelled")
    first.images.get(services["VLLM_OVERLAY_TEST_BASE_IMAGE"]).tag(unlabelled, f"ik-{short}")
    push(first, f"{unlabelled}:ik-{short}")
    cases[unlabelled] = "but its image has no image-key label"
    # B's image (another image key) pushed under A's ik- tag
    other = repository(services, "other-key")
    first.images.get(scenario.runs["b-push"].stdout.strip()).tag(other, f"ik-{short}")
    push(first, f"{other}:ik-{short}")
    cases[other] = f"but its image is labelled with image key {scenario.b_ik}"
    # an image built FROM A (every label inherited, the key's included)
    derived = repository(services, "derived")
    a_image = scenario.runs["a-push"].stdout.strip()
    build_small(first, f"FROM {a_image}\nRUN touch /derived\n", f"{derived}:ik-{short}", made)
    push(first, f"{derived}:ik-{short}")
    cases[derived] = "but its image was built FROM the overlay image, not by vllm-overlay"
    for repo, why in cases.items():
        recipe = write_recipe_copy(tmp_path / "r.yaml", services, repo)
        produced.write_text(yaml.safe_dump([row_for(scenario.a_ik, repo, scenario.a_digest)]))
        line = plan_first_line(recipe, produced, DOCKER_HOST="unix:///nonexistent")
        assert line.startswith(f"rebuild: {repo}:ik-{short} is in the registry (sha256:") and why in line, line


# ---- pin-base against the real registry ----------------------------------------------


VARIANTS = {
    "block": lambda base: DEFAULT_RECIPE.read_text().replace(DEFAULT_BASE, base),
    "single-quoted-with-comment": lambda base: DEFAULT_RECIPE.read_text().replace(
        f"base: {DEFAULT_BASE}", f"base: '{base}'   # the CUDA devel base"
    ),
    "double-quoted-crlf": lambda base: (
        DEFAULT_RECIPE.read_text().replace(f"base: {DEFAULT_BASE}", f'base: "{base}"').replace("\n", "\r\n")
    ),
}


@pytest.fixture(scope="module")
def pushed_base(services, engines) -> str:
    """The test base image, pushed to this run's repository: name:tag."""
    first, _, _ = engines
    ref = f"{repository(services, 'base')}:bookworm"
    first.images.get(services["VLLM_OVERLAY_TEST_BASE_IMAGE"]).tag(*ref.rsplit(":", 1))
    push(first, ref)
    return ref


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pin_base_writes_the_registry_digest_and_nothing_else(services, pushed_base, tmp_path, variant) -> None:
    digest = head_digest(services["VLLM_OVERLAY_TEST_REGISTRY"], pushed_base)
    assert digest
    recipe = tmp_path / "recipe.yaml"
    original = VARIANTS[variant](pushed_base)
    recipe.write_bytes(original.encode())
    recipe.chmod(0o640)
    proc = run_cli("pin-base", recipe)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{digest}\n"
    assert proc.stderr == f"pinned {pushed_base} at {digest} in {recipe}\n"
    assert recipe.read_bytes() == original.replace(pushed_base, f"{pushed_base}@{digest}").encode()
    assert recipe.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]
    # Again: already pinned at the tag's digest, nothing written.
    again = run_cli("pin-base", recipe)
    assert again.returncode == 0 and again.stdout == f"{digest}\n", again.stderr
    assert "is pinned at its tag's current digest" in again.stderr
    assert recipe.read_bytes() == original.replace(pushed_base, f"{pushed_base}@{digest}").encode()


def test_pin_base_reports_a_moved_tag_and_updates_only_when_asked(services, engines, tmp_path) -> None:
    first, _, made = engines
    host = services["VLLM_OVERLAY_TEST_REGISTRY"]
    ref = f"{repository(services, 'moving-base')}:bookworm"
    first.images.get(services["VLLM_OVERLAY_TEST_BASE_IMAGE"]).tag(*ref.rsplit(":", 1))
    push(first, ref)
    old = head_digest(host, ref)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(DEFAULT_RECIPE.read_text().replace(DEFAULT_BASE, ref))
    assert run_cli("pin-base", recipe).returncode == 0
    pinned = recipe.read_bytes()
    # the tag moves to another image
    build_small(first, f"FROM {services['VLLM_OVERLAY_TEST_BASE_IMAGE']}\nLABEL moved={RUN_ID}\n", ref, made)
    push(first, ref)
    new = head_digest(host, ref)
    assert new != old
    moved = run_cli("pin-base", recipe)
    assert moved.returncode == 1, moved.stderr
    assert moved.stderr == (
        f"{ref} moved: the recipe pins {old}, the tag is now {new}; run pin-base --update to pin it\n"
    )
    assert moved.stdout == f"{old}\n" and recipe.read_bytes() == pinned
    updated = run_cli("pin-base", recipe, "--update")
    assert updated.returncode == 0 and updated.stdout == f"{new}\n", updated.stderr
    assert f"{ref} moved from {old}; pinned at {new}" in updated.stderr
    assert recipe.read_text() == DEFAULT_RECIPE.read_text().replace(DEFAULT_BASE, f"{ref}@{new}")


def test_pin_base_of_a_tag_the_registry_lacks_is_bad_input(services, pushed_base, tmp_path) -> None:
    recipe = tmp_path / "recipe.yaml"
    missing = pushed_base.rsplit(":", 1)[0] + ":no-such-tag"
    recipe.write_text(DEFAULT_RECIPE.read_text().replace(DEFAULT_BASE, missing))
    before = recipe.read_bytes()
    proc = run_cli("pin-base", recipe)
    assert proc.returncode == 2, proc.stderr
    host = services["VLLM_OVERLAY_TEST_REGISTRY"]
    assert one_line(proc) == f"vllm-overlay: {recipe}: image.base: {missing}: no such tag in registry {host}"
    assert recipe.read_bytes() == before
