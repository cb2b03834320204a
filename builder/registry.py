"""Registry: the few calls of the registry HTTP API (OCI distribution, Docker Registry v2) the
builder needs, on urllib, with no Docker engine: a tag's manifest digest, a manifest's bytes
and media type, an image's config labels, and a manifest PUT under another tag (a retag that
moves no layer).

Where: a reference's first component is its registry when it looks like a host (a dot, a
port, ``localhost``); anything else is Docker Hub (``registry-1.docker.io``, ``library/``
before a single name).  https, except http for localhost, 127.0.0.1 and ::1 and for the
hosts listed (comma-separated ``host[:port]``) in $VLLM_OVERLAY_INSECURE_REGISTRIES.

Auth: anonymous first; on a 401 the registry's challenge is answered (Bearer: a token from
its token endpoint; Basic), with the Basic credentials of ``auths.<registry>.auth`` in
$DOCKER_CONFIG/config.json (default ~/.docker/config.json) when there are some.  Credentials
kept only by a credential helper (``credsStore``/``credHelpers``) are not read; a refusal
says so.

Every digest is checked against the bytes it names; every request times out after
TIMEOUT seconds and reads at most a bounded number of bytes.  A registry that cannot be
reached (or refuses, or answers out of protocol) is RegistryUnreachable, one line naming
it; a tag or repository that is not there is None.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.cache import KIB, MIB, read_regular
from builder.errors import InputError, RegistryUnreachable, first_line

INSECURE_ENV = "VLLM_OVERLAY_INSECURE_REGISTRIES"
DOCKER_HUB = "registry-1.docker.io"
HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}
TIMEOUT = 30  # seconds, each request
MANIFEST_LIMIT = 4 * MIB  # distribution refuses larger manifests itself
CONFIG_LIMIT = 16 * MIB  # an image config: labels, env, history
TOKEN_LIMIT = 256 * KIB
ERROR_LIMIT = 16 * KIB  # what is read of an error answer (never shown whole)

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MANIFEST_TYPES = (OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Reference:
    """``registry/repository[:tag][@digest]``, with the registry host spelled out."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        return text + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")


def parse_reference(text: str) -> Reference:
    """A reference as the engine reads it: Docker Hub unless the first component is a host."""
    name, _, digest = text.partition("@")
    tag = None
    if name.rfind(":") > name.rfind("/"):
        name, tag = name.rsplit(":", 1)
    first, slash, rest = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        host, path = first, rest
    else:
        host, path = DOCKER_HUB, name
    if host in HUB_ALIASES:
        host = DOCKER_HUB
        path = path if "/" in path else f"library/{path}"
    return Reference(host, path, tag, digest or None)


def scheme_of(host: str) -> str:
    """http for this machine and the hosts $VLLM_OVERLAY_INSECURE_REGISTRIES names; else https."""
    insecure = {h.strip() for h in os.environ.get(INSECURE_ENV, "").split(",") if h.strip()}
    bare = host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") else host
    return "http" if {host, bare} & (insecure | LOCAL_HOSTS) else "https"


@dataclass(frozen=True)
class Manifest:
    data: bytes  # exactly as the registry holds it (its digest is these bytes' sha256)
    media_type: str
    digest: str

    def json(self) -> dict[str, Any]:
        return json.loads(self.data)


@dataclass(frozen=True)
class ImageConfig:
    """What a tag's image config says: labels, and the last step of its history."""

    digest: str  # the tag's manifest digest (an index's, when the tag names one)
    labels: dict[str, str]
    last_step: str


# ---------------------------------------------------------------- credentials


def docker_config_path() -> Path:
    return Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker") / "config.json"


@dataclass(frozen=True)
class Credentials:
    basic: str | None  # base64 "user:password", as config.json keeps it
    note: str  # where they came from, or why there are none (for a refusal's message)


def credentials_for(host: str) -> Credentials:
    """``auths.<host>.auth`` from the Docker client's config.json; a helper-only config is noted."""
    path = docker_config_path()
    try:
        config = json.loads(read_regular(path, 1 * MIB, "the Docker client config"))
    except FileNotFoundError:
        return Credentials(None, f"no credentials for it ({path} does not exist)")
    except (OSError, ValueError, RecursionError) as exc:
        raise InputError(f"cannot read the Docker client config: {str(exc).splitlines()[0]}", file=path) from None
    if not isinstance(config, dict):
        raise InputError("expected a JSON object", file=path)
    hub = host == DOCKER_HUB
    for key, entry in (config.get("auths") or {}).items():
        key_host = urllib.parse.urlsplit(key).netloc if "://" in key else key.split("/", 1)[0]
        if (key_host == host or (hub and key_host in HUB_ALIASES)) and isinstance(entry, dict) and entry.get("auth"):
            return Credentials(str(entry["auth"]), f"with the credentials for {key_host} in {path}")
    helpers = config.get("credHelpers") or {}
    helper = (helpers.get(host) if isinstance(helpers, dict) else None) or config.get("credsStore")
    if helper:
        return Credentials(
            None,
            f"{path} keeps its credentials in a credential helper ({helper}), which vllm-overlay does not read;"
            f" add a base64 user:password `auth` under auths.{host}",
        )
    return Credentials(None, f"no credentials for it in {path}")


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="…",service="…",scope="…"`` -> ("bearer", {realm, service, scope})."""
    kind, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'([A-Za-z]+)="([^"]*)"', rest)}
    return kind.lower(), params


# ---------------------------------------------------------------- the client


@dataclass
class Registry:
    """One registry, spoken to over HTTP; remembers the authorization each scope was given."""

    host: str
    timeout: float = TIMEOUT
    _auth: dict[str, str] = field(default_factory=dict, repr=False)
    _credentials: Credentials | None = field(default=None, repr=False)

    @property
    def base(self) -> str:
        return f"{scheme_of(self.host)}://{self.host}/v2/"

    # -- transport

    def _send(
        self, method: str, url: str, headers: dict[str, str], data: bytes | None, limit: int
    ) -> tuple[int, Any, bytes]:
        request = urllib.request.Request(url, data=data, method=method)
        for name, value in headers.items():
            # unredirected: a blob's redirect to a storage host must not carry the registry's token
            request.add_unredirected_header(name, value)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, response.headers, _read(response, limit, self.host)
        except urllib.error.HTTPError as exc:
            with exc:
                exc.read(ERROR_LIMIT)
            return exc.code, exc.headers, b""
        except urllib.error.URLError as exc:
            reason = exc.reason if isinstance(exc.reason, str) else first_line(exc.reason)
            raise RegistryUnreachable(f"registry {self.host} cannot be reached: {reason}") from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise RegistryUnreachable(f"registry {self.host} cannot be reached: {first_line(exc)}") from None

    def _request(
        self,
        method: str,
        path: str,
        scope: str,
        *,
        headers: dict[str, str] | None = None,
        data: bytes | None = None,
        limit: int = MANIFEST_LIMIT,
    ) -> tuple[int, Any, bytes]:
        """One request, anonymous first; a 401 is answered once with the registry's challenge."""
        url = self.base + path
        headers = dict(headers or {})
        if scope in self._auth:
            headers["Authorization"] = self._auth[scope]
        status, got, body = self._send(method, url, headers, data, limit)
        if status == 401 and scope not in self._auth:
            self._auth[scope] = headers["Authorization"] = self._authorize(got.get("WWW-Authenticate", ""), scope)
            status, got, body = self._send(method, url, headers, data, limit)
        if status in (401, 403):
            creds = self._creds()
            raise RegistryUnreachable(
                f"registry {self.host} refused {method} {path} (HTTP {status}): the repository does not exist"
                f" or needs credentials; {creds.note}"
            )
        return status, got, body

    def _creds(self) -> Credentials:
        if self._credentials is None:
            self._credentials = credentials_for(self.host)
        return self._credentials

    def _authorize(self, challenge: str, scope: str) -> str:
        kind, params = parse_challenge(challenge)
        creds = self._creds()
        if kind == "basic":
            if creds.basic is None:
                raise RegistryUnreachable(f"registry {self.host} asks for a password: {creds.note}")
            return f"Basic {creds.basic}"
        if kind != "bearer" or not params.get("realm", "").startswith(("https://", "http://")):
            raise RegistryUnreachable(f"registry {self.host} answered 401 without a usable challenge ({challenge!r})")
        realm = urllib.parse.urlsplit(params["realm"])
        query = [(k, params[k]) for k in ("service",) if params.get(k)] + [("scope", params.get("scope") or scope)]
        url = params["realm"] + ("&" if realm.query else "?") + urllib.parse.urlencode(query)
        headers = {}
        # credentials go only where they cannot be read on the way: https, or this machine
        if creds.basic is not None and (realm.scheme == "https" or scheme_of(realm.netloc) == "http"):
            headers["Authorization"] = f"Basic {creds.basic}"
        status, _, body = self._send("GET", url, headers, None, TOKEN_LIMIT)
        if status != 200:
            raise RegistryUnreachable(f"registry {self.host}: its token endpoint refused (HTTP {status}); {creds.note}")
        try:
            answer = json.loads(body)
            token = answer.get("token") or answer.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise RegistryUnreachable(f"registry {self.host}: its token endpoint answered no token")
        return f"Bearer {token}"

    # -- the API

    def head_digest(self, repository: str, tag: str) -> str | None:
        """The digest the tag resolves to, or None when the tag (or repository) is not there."""
        status, got, _ = self._request(
            "HEAD", f"{repository}/manifests/{tag}", _pull(repository), headers={"Accept": ", ".join(MANIFEST_TYPES)}
        )
        if status == 404:
            return None
        self._expect(status, (200,), "HEAD", f"{repository}/manifests/{tag}")
        digest = got.get("Docker-Content-Digest", "")
        if DIGEST_RE.fullmatch(digest):
            return digest
        found = self.manifest(repository, tag)  # a registry that does not say: hash the bytes
        return None if found is None else found.digest

    def manifest(self, repository: str, reference: str) -> Manifest | None:
        """A manifest's exact bytes, media type and (checked) digest; None when not there."""
        path = f"{repository}/manifests/{reference}"
        status, got, body = self._request("GET", path, _pull(repository), headers={"Accept": ", ".join(MANIFEST_TYPES)})
        if status == 404:
            return None
        self._expect(status, (200,), "GET", path)
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        said = got.get("Docker-Content-Digest")
        if (said and said != digest) or (DIGEST_RE.fullmatch(reference) and reference != digest):
            raise RegistryUnreachable(f"registry {self.host}: the manifest of {path} does not hash to its digest")
        media_type = (got.get("Content-Type") or "").split(";")[0].strip()
        if media_type not in MANIFEST_TYPES:
            media_type = _json(body, self.host, path).get("mediaType", media_type)
        if media_type not in MANIFEST_TYPES:
            raise RegistryUnreachable(f"registry {self.host}: {path} is a {media_type or 'untyped'} manifest")
        return Manifest(body, media_type, digest)

    def blob(self, repository: str, digest: str, limit: int) -> bytes:
        path = f"{repository}/blobs/{digest}"
        status, _, body = self._request("GET", path, _pull(repository), limit=limit)
        self._expect(status, (200,), "GET", path)
        if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise RegistryUnreachable(f"registry {self.host}: the blob {path} does not hash to its digest")
        return body

    def put_manifest(self, repository: str, tag: str, manifest: Manifest) -> str:
        """Put the manifest's exact bytes under ``tag`` (its blobs must be in the repository)."""
        path = f"{repository}/manifests/{tag}"
        status, got, _ = self._request(
            "PUT",
            path,
            f"repository:{repository}:pull,push",
            headers={"Content-Type": manifest.media_type},
            data=manifest.data,
        )
        self._expect(status, (200, 201), "PUT", path)
        said = got.get("Docker-Content-Digest")
        if said and said != manifest.digest:
            raise RegistryUnreachable(f"registry {self.host}: PUT {path} stored {said}, not {manifest.digest}")
        return manifest.digest

    def image_config(self, repository: str, tag: str) -> ImageConfig | None:
        """The labels and last history step of the tag's image (an index's linux/amd64 entry)."""
        top = self.manifest(repository, tag)
        if top is None:
            return None
        manifest = top
        if top.media_type in INDEX_TYPES:
            entry = _platform_entry(top.json(), "linux", "amd64")
            if entry is None:
                raise RegistryUnreachable(f"registry {self.host}: {repository}:{tag} has no linux/amd64 image")
            manifest = self.manifest(repository, entry)
            if manifest is None:
                raise RegistryUnreachable(f"registry {self.host}: {repository}@{entry} is listed but not there")
        where = f"{repository}/manifests/{manifest.digest}"
        config_digest = (_json(manifest.data, self.host, where).get("config") or {}).get("digest", "")
        if not isinstance(config_digest, str) or not DIGEST_RE.fullmatch(config_digest):
            raise RegistryUnreachable(f"registry {self.host}: {where} names no sha256 config")
        config = _json(self.blob(repository, config_digest, CONFIG_LIMIT), self.host, config_digest)
        labels = (config.get("config") or {}).get("Labels") or {}
        history = config.get("history") or [{}]
        last = history[-1] if isinstance(history, list) and isinstance(history[-1], dict) else {}
        return ImageConfig(
            top.digest,
            {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {},
            str(last.get("created_by") or ""),
        )

    def _expect(self, status: int, ok: tuple[int, ...], method: str, path: str) -> None:
        if status not in ok:
            raise RegistryUnreachable(f"registry {self.host} answered HTTP {status} to {method} {path}")


def _pull(repository: str) -> str:
    return f"repository:{repository}:pull"


def _read(response: Any, limit: int, host: str) -> bytes:
    body = response.read(limit + 1)
    if len(body) > limit:
        raise RegistryUnreachable(f"registry {host} answered more than {limit // KIB} KiB where at most that was due")
    return body


def _json(data: bytes, host: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise RegistryUnreachable(f"registry {host}: {what} is not a JSON object")
    return value


def _platform_entry(index: dict[str, Any], os_name: str, arch: str) -> str | None:
    for entry in index.get("manifests") or []:
        platform = (entry.get("platform") if isinstance(entry, dict) else None) or {}
        if isinstance(platform, dict) and platform.get("os") == os_name and platform.get("architecture") == arch:
            digest = entry.get("digest", "")
            return digest if isinstance(digest, str) and DIGEST_RE.fullmatch(digest) else None
    return None


# ---------------------------------------------------------------- by reference


def _tagged(reference: str) -> tuple[Registry, Reference]:
    ref = parse_reference(reference)
    if not ref.tag:
        raise InputError(f"{reference}: expected a tag (name:tag)")
    return Registry(ref.registry), ref


def resolve(reference: str) -> str | None:
    """The digest ``name:tag`` resolves to in its registry, or None when it is not there."""
    registry, ref = _tagged(reference)
    return registry.head_digest(ref.repository, ref.tag)


def image_config(reference: str) -> ImageConfig | None:
    """The labels (and last history step) of the image ``name:tag`` names, or None."""
    registry, ref = _tagged(reference)
    return registry.image_config(ref.repository, ref.tag)


def retag(source: str, tags: list[str]) -> str:
    """Put the manifest ``source`` names (``name:tag`` or ``name@sha256:...``, the digest checked)
    under each tag of the same repository, without pulling a layer; returns its digest.  A source
    that is not there is RegistryUnreachable (it was just seen there)."""
    ref = parse_reference(source)
    if not (ref.digest or ref.tag):
        raise InputError(f"{source}: expected a tag or a digest")
    registry = Registry(ref.registry)
    manifest = registry.manifest(ref.repository, ref.digest or ref.tag)
    if manifest is None:
        raise RegistryUnreachable(f"registry {registry.host}: {source} is no longer there")
    for tag in tags:
        registry.put_manifest(ref.repository, tag, manifest)
    return manifest.digest
