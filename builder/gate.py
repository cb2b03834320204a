"""The gate and the launch: the self-test inside the produced image on every rank's own engine,
with that rank's exact argv, a receipt of what it saw, and containers started only after it passed.

Stages (README, "Launch"):

1. the keys: the profile's recipe's runtime key and image key, computed as ``plan`` does; no
   produced-image row with them is a refusal (``image is stale: ...``, exit 2) before any engine
   is asked anything;
2. on each rank's engine, concurrently: connect, find the row's image (by its digest, pulled
   from its registry when missing), and read its ``io.vllm-overlay.runtime-key`` and
   ``io.vllm-overlay.image-key`` labels; an image with other keys is the same refusal, before
   any container starts.  An engine that does not answer fails that rank only;
3. on each rank's engine, concurrently: one container runs the self-test module with the
   rank's argv (checkpoint bind-mounted read-only, the rank's GPUs requested); its last stdout
   line is the verdict.  A run past the timeout is killed and fails;
4. the receipt, written atomically in a ``finally``: an interrupted or failed gate leaves one.

``launch up`` runs the gate and, when every rank passed in that run, starts each rank's
container from the image the gate ran on that engine, with the argv it tested as the
container's entrypoint (byte for byte), labelled with the profile key, runtime key, receipt
and rank; ``launch status`` and ``launch down`` find containers by the profile key label.

Engines are reached through ``EngineSeam`` objects made by ``connect_engine`` (the Docker SDK);
the unit tests pass their own factory.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from builder import __version__
from builder.cache import atomic_write
from builder.errors import InputError, OverlayError, ServiceUnreachable, StorageFailed, first_line
from builder.launch import Profile, Rank, profile_key, rank_argv
from builder.probe import SELFTEST_MODULE, SelftestRun

Progress = Callable[[str], None]

DEFAULT_TIMEOUT = 900.0  # seconds a rank's self-test may run (the real one takes ~20-60 s on a CPU)
RECEIPT_FORMAT = 1
DEFAULT_RECEIPTS = Path(__file__).resolve().parent.parent / "receipts"
LABEL = "io.vllm-overlay"
ROLE_SELFTEST, ROLE_SERVE = "selftest", "serve"
# What run_selftest (builder/probe.py) sets beside the module: vLLM's logs off stdout, no hub.
SELFTEST_ENV = {"VLLM_LOGGING_STREAM": "ext://sys.stderr", "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def _quiet(line: str) -> None:
    pass


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _iso(moment: datetime.datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class TimedOutRun(SelftestRun):
    """A self-test killed at the timeout: its output so far is kept, its verdict is the timeout
    (whatever line it had printed last)."""

    timeout: float = 0.0

    @property
    def verdict(self) -> str:
        return f"SELFTEST FAIL: did not finish within {self.timeout:g} s"


class RankFailed(Exception):
    """A rank failed without a verdict (its engine, image, GPUs or checkpoint): one line."""


# ---------------------------------------------------------------- what a rank runs


@dataclass(frozen=True)
class RankJob:
    """One rank's part of a gate: its engine, its argv, and how the self-test is run."""

    rank: Rank
    argv: tuple[str, ...]  # the rank's exact argv, "vllm serve <checkpoint> ..."
    checkpoint: str
    python: str  # the interpreter in the image (builder.render.python_in_image)
    static: bool
    timeout: float

    @property
    def name(self) -> str:
        return self.rank.name

    @property
    def engine(self) -> str:
        return self.rank.engine

    def selftest_command(self) -> list[str]:
        """The self-test module with ``--json [--static] --`` and the argv after ``vllm serve``."""
        flags = ["--json", "--static"] if self.static else ["--json"]
        return [self.python, "-m", SELFTEST_MODULE, *flags, "--", *self.argv[2:]]

    def selftest_env(self) -> dict[str, str]:
        """run_selftest's environment; VLLM_TARGET_DEVICE=cpu only when the rank requests no GPU
        (vLLM cannot infer a device without one)."""
        env = dict(SELFTEST_ENV)
        if not self.rank.gpus:
            env["VLLM_TARGET_DEVICE"] = "cpu"
        return env


@dataclass(frozen=True)
class ImageRef:
    """The produced image the gate runs: the row's tag reference and digest."""

    reference: str  # REPO:rk-<short runtime key>
    digest: str  # the registry digest when pushed, else the local image id (both sha256:...)
    runtime_key: str
    image_key: str

    @property
    def repository(self) -> str:
        repo, _, tag = self.reference.rpartition(":")
        return repo if repo and "/" not in tag else self.reference

    @property
    def by_digest(self) -> str:
        return f"{self.repository}@{self.digest}"


@dataclass(frozen=True)
class FoundImage:
    id: str
    labels: dict[str, str]


class EngineSeam(Protocol):
    """What the gate asks of one rank's engine.  Each method raises RankFailed with one line."""

    def find_image(self, image: ImageRef, progress: Progress) -> FoundImage: ...

    def run_selftest(self, job: RankJob, image_id: str, labels: dict[str, str]) -> SelftestRun: ...

    def start(self, job: RankJob, image_id: str, labels: dict[str, str]) -> dict[str, str]: ...

    def containers(self, labels: dict[str, str]) -> list[dict[str, str]]: ...

    def remove(self, container_id: str) -> None: ...

    def cancel(self) -> None: ...


# ---------------------------------------------------------------- results


@dataclass
class RankResult:
    name: str
    engine: str
    gpus: tuple[int, ...]
    argv: list[str]
    command: list[str]
    image_id: str | None = None
    run: SelftestRun | None = None
    failure: str | None = None  # a line when the rank failed without a verdict
    start: datetime.datetime | None = None
    end: datetime.datetime | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None and self.run is not None and self.run.passed

    @property
    def verdict(self) -> str:
        if self.failure is not None:
            return f"SELFTEST FAIL: {self.failure}"
        if self.run is None:
            return "SELFTEST FAIL: not run"
        return self.run.verdict

    @property
    def reason(self) -> str:
        """The first reason (the verdict's first '; '-separated part), or the pass line."""
        verdict = self.verdict
        if verdict.startswith("SELFTEST PASS"):
            return verdict
        return verdict.split(": ", 1)[1].split("; ")[0] if ": " in verdict else verdict

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "engine": self.engine,
            "gpus": list(self.gpus),
            "argv": self.argv,
            "command": self.command,
            "image_id": self.image_id,
            "exit_code": None if self.run is None else self.run.returncode,
            "verdict": self.verdict,
            "passed": self.passed,
            "failure": self.failure,
            "stdout": None if self.run is None else self.run.stdout,
            "stderr": None if self.run is None else self.run.stderr,
            "start": _iso(self.start),
            "end": _iso(self.end),
        }


@dataclass
class GateResult:
    profile: Profile
    profile_key: str
    image: ImageRef
    static: bool
    ranks: list[RankResult]
    receipt: Path | None = None
    start: datetime.datetime = field(default_factory=now)
    end: datetime.datetime | None = None
    # "pass", "fail", "refused" (an image with other keys), "interrupted", "up" (launch up started it)
    outcome: str = "running"
    error: str | None = None  # the line of an error that ended the run (a refusal, a failed launch)
    containers: list[dict[str, str]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Every rank's self-test passed in this run."""
        return bool(self.ranks) and all(rank.passed for rank in self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {
            "receipt": RECEIPT_FORMAT,
            "tool": f"vllm-overlay {__version__}",
            "profile": {"name": self.profile.name, "path": str(self.profile.path), "key": self.profile_key},
            "recipe": self.profile.recipe.name,
            "runtime_key": self.image.runtime_key,
            "image_key": self.image.image_key,
            "image": {"reference": self.image.reference, "digest": self.image.digest},
            "static": self.static,
            "outcome": self.outcome,
            "passed": self.passed,
            "error": self.error,
            "start": _iso(self.start),
            "end": _iso(self.end),
            "ranks": [rank.to_json() for rank in self.ranks],
            "containers": self.containers,
        }

    def table(self) -> str:
        return render_table(self)


def render_table(result: GateResult) -> str:
    """A header naming the profile, keys and static flag, then one row per rank."""
    mode = "static (--static: kernel calls not run)" if result.static else "full (kernel calls run)"
    head = [
        f"gate {result.profile.name}: {mode}",
        f"profile key {result.profile_key}",
        f"image {result.image.reference} ({result.image.digest}), runtime key {result.image.runtime_key}",
    ]
    rows = [("rank", "engine", "verdict", "first reason")]
    for rank in result.ranks:
        rows.append((rank.name, rank.engine, "PASS" if rank.passed else "FAIL", rank.reason))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)), row[3]]) for row in rows]
    return "\n".join(head + [line.rstrip() for line in lines])


# ---------------------------------------------------------------- keys and receipts


def current_image(profile: Profile) -> ImageRef:
    """The produced image whose row has the recipe's current keys, else the stale refusal."""
    from builder.key import runtime_key
    from builder.members import load_recipe_members
    from builder.produced import find_row
    from builder.render import render_image

    recipe = profile.recipe
    rk = runtime_key(recipe, load_recipe_members(recipe))
    ik = render_image(recipe, rk, revision="").image_key  # as plan: the revision never enters the key
    row = find_row(ik, repository=recipe.image.repository)  # another repository's row never counts
    if row is None or row.get("runtime_key") != rk or not row.get("digest") or not row.get("image"):
        raise stale(rk, ik, f"no produced-image row of {recipe.image.repository} has them")
    return ImageRef(row["image"], row["digest"], rk, ik)


def stale(rk: str, ik: str, why: str) -> InputError:
    return InputError(f"image is stale: recipe key {rk}, image key {ik} ({why}); run make image")


def receipts_dir() -> Path:
    return Path(os.environ.get("VLLM_OVERLAY_RECEIPTS") or DEFAULT_RECEIPTS)


def receipt_path(profile: Profile, moment: datetime.datetime, directory: Path | None = None) -> Path:
    """``<dir>/<profile name>-<YYYYmmddTHHMMSSZ>.json``; ``-2``, ``-3``... when that second is taken."""
    directory = directory or receipts_dir()
    stem = f"{profile.name}-{moment.strftime('%Y%m%dT%H%M%SZ')}"
    path, n = directory / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = directory / f"{stem}-{n}.json"
    return path


def write_receipt(result: GateResult) -> None:
    assert result.receipt is not None
    data = (json.dumps(result.to_json(), indent=2, ensure_ascii=False) + "\n").encode()
    try:
        atomic_write(result.receipt, data)
    except OSError as exc:
        raise StorageFailed(f"cannot write the receipt: {exc.strerror or exc}", file=result.receipt) from None


# ---------------------------------------------------------------- the gate


EngineFactory = Callable[[str], EngineSeam]


class _Engines:
    """One seam per engine URL (ranks sharing an engine share its connection)."""

    def __init__(self, factory: EngineFactory) -> None:
        self.factory, self.made, self.lock = factory, {}, threading.Lock()

    def __call__(self, url: str) -> EngineSeam:
        with self.lock:
            if url not in self.made:
                self.made[url] = self.factory(url)
            return self.made[url]

    def cancel_all(self) -> None:
        for engine in list(self.made.values()):
            try:
                engine.cancel()
            except Exception:  # best effort on the way out of an interrupt
                pass


def _jobs(profile: Profile, static: bool, timeout: float) -> list[RankJob]:
    from builder.render import python_in_image

    python = python_in_image(profile.recipe)
    return [
        RankJob(rank, tuple(rank_argv(profile, rank.name)), profile.checkpoint, python, static, timeout)
        for rank in profile.ranks
    ]


def run_gate(
    profile: Profile,
    *,
    static: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    engines: EngineFactory | None = None,
    receipts: Path | None = None,
    progress: Progress = _quiet,
    then: Callable[[GateResult, _Engines, list[RankJob]], None] | None = None,
) -> GateResult:
    """Gate the profile; ``then`` (launch up) runs after a passing gate, before the receipt's
    last write, so the receipt also records what it started."""
    if timeout <= 0:
        raise InputError(f"the timeout must be positive, got {timeout}", field="--timeout")
    image = current_image(profile)  # refused here: nothing asked of any engine yet
    progress = _serialized(progress)  # rank threads report at once: one whole line each
    seams = _Engines(engines or connect_engine)
    jobs = _jobs(profile, static, timeout)
    result = GateResult(
        profile,
        profile_key(profile),
        image,
        static,
        [RankResult(j.name, j.engine, j.rank.gpus, list(j.argv), j.selftest_command()) for j in jobs],
    )
    # From here on engines are asked: whatever happens, the receipt is written (in the finally).
    result.receipt = receipt_path(profile, result.start, receipts)
    pool = ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="gate")
    try:
        try:
            found = _find_images(pool, seams, jobs, result, progress)
        except InputError:
            result.outcome = "refused"
            raise
        _run_selftests(pool, seams, jobs, found, result, progress)
        result.outcome = "pass" if result.passed else "fail"
        if then is not None and result.passed:
            then(result, seams, jobs)
    except KeyboardInterrupt:
        result.outcome = "interrupted"
        seams.cancel_all()
        raise
    except OverlayError as exc:
        result.error = str(exc)
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if result.receipt is not None:
            result.end = now()
            if result.outcome == "running":  # an error on the way: the receipt says so
                result.outcome = "fail"
            for rank in result.ranks:
                if rank.run is None and rank.failure is None:
                    rank.failure = {"interrupted": "interrupted", "refused": "not run: the image is stale"}.get(
                        result.outcome, "not finished"
                    )
                    rank.end = rank.end or result.end
            write_receipt(result)
    return result


def _serialized(progress: Progress) -> Progress:
    lock = threading.Lock()

    def report(line: str) -> None:
        with lock:
            progress(line)

    return report


def _find_images(
    pool: ThreadPoolExecutor, seams: _Engines, jobs: list[RankJob], result: GateResult, progress: Progress
) -> dict[str, FoundImage]:
    """Each rank's image on its engine; a rank whose engine fails is marked failed; an image
    with other keys is the stale refusal (nothing started anywhere)."""

    def find(job: RankJob) -> FoundImage:
        return seams(job.engine).find_image(result.image, progress)

    futures = {job.name: pool.submit(find, job) for job in jobs}
    found: dict[str, FoundImage] = {}
    for job, rank in zip(jobs, result.ranks, strict=True):
        try:
            found[job.name] = futures[job.name].result()
        except RankFailed as exc:
            rank.failure, rank.start, rank.end = f"rank {job.name}: {exc}", now(), now()
    for job in jobs:
        image = found.get(job.name)
        if image is None:
            continue
        rk, ik = image.labels.get(f"{LABEL}.runtime-key"), image.labels.get(f"{LABEL}.image-key")
        if rk != result.image.runtime_key or ik != result.image.image_key:
            raise stale(
                result.image.runtime_key,
                result.image.image_key,
                f"rank {job.name}'s engine {job.engine} has {result.image.by_digest} with runtime key {rk},"
                f" image key {ik}",
            )
    return found


def _run_selftests(
    pool: ThreadPoolExecutor,
    seams: _Engines,
    jobs: list[RankJob],
    found: dict[str, FoundImage],
    result: GateResult,
    progress: Progress,
) -> None:
    labels = {
        f"{LABEL}.role": ROLE_SELFTEST,
        f"{LABEL}.profile": result.profile.name,
        f"{LABEL}.profile-key": result.profile_key,
        f"{LABEL}.runtime-key": result.image.runtime_key,
    }
    ranks = {rank.name: rank for rank in result.ranks}

    def run(job: RankJob) -> None:
        rank = ranks[job.name]
        rank.image_id = found[job.name].id
        rank.start = now()
        progress(f"gate: rank {job.name}: self-test on {job.engine}")
        try:
            rank.run = seams(job.engine).run_selftest(job, rank.image_id, {**labels, f"{LABEL}.rank": job.name})
        except RankFailed as exc:
            rank.failure = f"rank {job.name}: {exc}"
        finally:
            rank.end = now()
        progress(f"gate: rank {job.name}: {rank.verdict}")

    futures = [pool.submit(run, job) for job in jobs if job.name in found]
    for future in futures:
        future.result()


# ---------------------------------------------------------------- launch up, status, down


def launch_up(profile: Profile, **gate_options: Any) -> GateResult:
    """The gate, then (only when every rank passed in it) each rank's serving container."""
    return run_gate(profile, then=_start_all, **gate_options)


def serve_labels(result: GateResult, rank: str) -> dict[str, str]:
    return {
        f"{LABEL}.role": ROLE_SERVE,
        f"{LABEL}.profile": result.profile.name,
        f"{LABEL}.profile-key": result.profile_key,
        f"{LABEL}.runtime-key": result.image.runtime_key,
        f"{LABEL}.receipt": str(result.receipt),
        f"{LABEL}.rank": rank,
    }


def _start_all(result: GateResult, seams: _Engines, jobs: list[RankJob]) -> None:
    """Start each rank's container, in profile order; one that cannot start removes those this
    run started (a partial multi-node launch serves nothing) and fails the launch."""
    existing = [c for url in _distinct(job.engine for job in jobs) for c in seams(url).containers(_key_filter(result))]
    if existing:
        raise InputError(
            f"profile {result.profile.name} is already up ({len(existing)} containers with profile key"
            f" {result.profile_key}); run launch down first"
        )
    ranks = {rank.name: rank for rank in result.ranks}
    try:
        for job in jobs:
            started = seams(job.engine).start(job, ranks[job.name].image_id or "", serve_labels(result, job.name))
            result.containers.append({"rank": job.name, "engine": job.engine, **started})
    except RankFailed as exc:
        for container in result.containers:
            try:
                seams(container["engine"]).remove(container["id"])
                container["removed"] = "after a failed launch"
            except RankFailed:
                pass
        raise ServiceUnreachable(f"launch: {exc}; the containers it started were removed") from None
    result.outcome = "up"


def _key_filter(result_or_key: GateResult | str) -> dict[str, str]:
    key = result_or_key if isinstance(result_or_key, str) else result_or_key.profile_key
    return {f"{LABEL}.profile-key": key, f"{LABEL}.role": ROLE_SERVE}


def _distinct(urls) -> list[str]:
    return list(dict.fromkeys(urls))


@dataclass(frozen=True)
class EngineContainers:
    engine: str
    containers: list[dict[str, str]]
    failure: str | None = None


def launch_status(profile: Profile, *, engines: EngineFactory | None = None) -> list[EngineContainers]:
    """The serving containers labelled with the profile's key, on each of its engines."""
    seams = _Engines(engines or connect_engine)
    key = profile_key(profile)
    order = {rank.name: i for i, rank in enumerate(profile.ranks)}
    out = []
    for url in _distinct(rank.engine for rank in profile.ranks):
        try:
            found = seams(url).containers(_key_filter(key))
            out.append(EngineContainers(url, sorted(found, key=lambda c: order.get(c.get("rank", ""), len(order)))))
        except RankFailed as exc:
            out.append(EngineContainers(url, [], str(exc)))
    return out


def launch_down(profile: Profile, *, engines: EngineFactory | None = None) -> list[EngineContainers]:
    """Stop and remove exactly the serving containers labelled with the profile's key."""
    seams = _Engines(engines or connect_engine)
    out = []
    for found in launch_status(profile, engines=seams):
        if found.failure is not None:
            out.append(found)
            continue
        removed, failure = [], None
        for container in found.containers:
            try:
                seams(found.engine).remove(container["id"])
                removed.append(container)
            except RankFailed as exc:
                failure = str(exc)
        out.append(EngineContainers(found.engine, removed, failure))
    return out


# ---------------------------------------------------------------- the Docker engine


def engine_client(url: str, timeout: int = 120):
    """A Docker SDK client for an engine URL: ``unix://`` as is, ``ssh://`` through the system
    ssh client, ``tcp://`` with TLS from DOCKER_CERT_PATH (ca.pem, cert.pem, key.pem; default
    ~/.docker) when DOCKER_TLS_VERIFY or DOCKER_CERT_PATH is set, as the docker CLI reads them."""
    import docker
    from docker.utils import kwargs_from_env

    tls = kwargs_from_env().get("tls") if url.startswith("tcp://") else None
    return docker.DockerClient(base_url=url, use_ssh_client=url.startswith("ssh://"), tls=tls or False, timeout=timeout)


def _is_reference_error(exc: BaseException) -> bool:
    from docker.errors import APIError, InvalidRepository

    return isinstance(exc, InvalidRepository) or (isinstance(exc, APIError) and exc.status_code == 400)


GPU_REFUSAL = "could not select device driver"  # dockerd without the NVIDIA runtime, at start


class DockerEngine:
    """One engine through the Docker SDK.  ``connect`` makes the client (tests pass a fake)."""

    def __init__(self, url: str, connect: Callable[[str], Any] = engine_client) -> None:
        self.url, self.connect = url, connect
        self._client: Any = None
        self._lock, self._pulling = threading.Lock(), threading.Lock()
        self.running: set[str] = set()  # self-test containers not yet removed (killed on interrupt)

    @property
    def client(self):
        from docker.errors import DockerException
        from requests.exceptions import RequestException

        with self._lock:
            if self._client is None:
                try:
                    client = self.connect(self.url)
                    client.ping()
                except (DockerException, RequestException, OSError) as exc:
                    raise RankFailed(f"engine {self.url} cannot be reached: {first_line(exc)}") from None
                self._client = client
            return self._client

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        from docker.errors import DockerException
        from requests.exceptions import RequestException

        try:
            return fn()
        except (DockerException, RequestException, OSError) as exc:
            raise RankFailed(f"engine {self.url}: {what}: {first_line(exc)}") from None

    def find_image(self, image: ImageRef, progress: Progress) -> FoundImage:
        """The row's image in this engine (its local id, or pulled by digest before), else
        pulled by digest from its registry."""

        client = self.client
        with self._pulling:  # ranks sharing this engine look (and pull) once
            return self._find_image(client, image, progress)

    def _find_image(self, client, image: ImageRef, progress: Progress) -> FoundImage:
        from docker.errors import NotFound

        for ref in (image.digest, image.by_digest):
            try:
                got = client.images.get(ref)
                return FoundImage(got.id, dict(got.labels or {}))
            except NotFound:
                pass
            except Exception as exc:  # a malformed reference is "not here"; the engine, below
                if not _is_reference_error(exc):
                    raise RankFailed(f"engine {self.url}: image lookup: {first_line(exc)}") from None
        progress(f"gate: pull {image.by_digest} into {self.url}")
        got = self._call(
            f"{image.by_digest} is not there and cannot be pulled", lambda: client.images.pull(image.by_digest)
        )
        return FoundImage(got.id, dict(got.labels or {}))

    def _mounts(self, job: RankJob, jit_cache: Any = None) -> list[Any]:
        from docker.types import Mount

        mounts = [Mount(job.checkpoint, job.checkpoint, type="bind", read_only=True)]
        return mounts + ([jit_cache] if jit_cache is not None else [])

    def _jit_cache(self, image_id: str) -> Any:
        """A named volume at the image's FlashInfer JIT directory, one per image key, so kernels
        FlashInfer compiles at the first start are there at the next (the image names the directory)."""
        from docker.types import Mount

        labels = self._call("inspect the image", lambda: self.client.images.get(image_id)).labels or {}
        target, image_key = labels.get(f"{LABEL}.flashinfer-jit-cache"), labels.get(f"{LABEL}.image-key", "")
        if not target or not image_key:
            return None
        return Mount(target, f"vllm-overlay-flashinfer-{image_key.removeprefix('ik-')[:16]}", type="volume")

    def _gpus(self, job: RankJob) -> list[Any]:
        from docker.types import DeviceRequest

        if not job.rank.gpus:
            return []
        return [DeviceRequest(device_ids=[str(g) for g in job.rank.gpus], capabilities=[["gpu"]])]

    def _create_and_start(self, job: RankJob, image_id: str, jit_cache: Any = None, **options: Any):
        from docker.errors import APIError, DockerException
        from requests.exceptions import RequestException

        client = self.client
        try:
            container = client.containers.create(
                image_id,
                mounts=self._mounts(job, jit_cache),
                device_requests=self._gpus(job),
                network_mode="host",
                **options,
            )
        except APIError as exc:
            line = first_line(exc)
            if "bind source path does not exist" in line:
                raise RankFailed(f"checkpoint {job.checkpoint} is not on engine {self.url}'s host") from None
            raise RankFailed(f"engine {self.url}: create: {line}") from None
        except (DockerException, RequestException, OSError) as exc:
            raise RankFailed(f"engine {self.url}: create: {first_line(exc)}") from None
        try:
            container.start()
        except (DockerException, RequestException, OSError) as exc:
            self._remove_quietly(container.id)
            line = first_line(exc)
            if GPU_REFUSAL in line:
                gpus = ",".join(map(str, job.rank.gpus))
                raise RankFailed(
                    f"engine {self.url} has no NVIDIA runtime, but the rank requests GPUs {gpus} ({line})"
                ) from None
            raise RankFailed(f"engine {self.url}: start: {line}") from None
        return container

    def run_selftest(self, job: RankJob, image_id: str, labels: dict[str, str]) -> SelftestRun:
        from requests.exceptions import RequestException

        container = self._create_and_start(
            job, image_id, entrypoint=job.selftest_command(), environment=job.selftest_env(), labels=labels
        )
        self.running.add(container.id)
        try:
            try:
                status = container.wait(timeout=job.timeout)
            except RequestException:  # the read timed out: the run did not finish in time
                self._call("kill", container.kill)
                out, err = self._logs(container)
                return TimedOutRun(124, out, err, job.timeout)
            code = int(status.get("StatusCode", -1))
            out, err = self._logs(container)
            return SelftestRun(code, out, err)
        finally:
            self._remove_quietly(container.id)
            self.running.discard(container.id)

    def _logs(self, container) -> tuple[str, str]:
        out = self._call("logs", lambda: container.logs(stdout=True, stderr=False))
        err = self._call("logs", lambda: container.logs(stdout=False, stderr=True))
        return out.decode("utf-8", "replace"), err.decode("utf-8", "replace")

    def _remove_quietly(self, container_id: str) -> None:
        try:
            self.client.api.remove_container(container_id, force=True)
        except Exception:  # already gone, or the engine went away: nothing to keep
            pass

    def start(self, job: RankJob, image_id: str, labels: dict[str, str]) -> dict[str, str]:
        """The rank's serving container: the gated argv as its entrypoint (no image entrypoint or
        command around it), the host's IPC namespace (vLLM's workers share memory through it)
        and network (multi-node), the rank's GPUs, the checkpoint read-only."""
        container = self._create_and_start(
            job, image_id, self._jit_cache(image_id), entrypoint=list(job.argv), ipc_mode="host", labels=labels
        )
        return {"id": container.id, "name": container.name}

    def containers(self, labels: dict[str, str]) -> list[dict[str, str]]:
        client = self.client
        filters = {"label": [f"{k}={v}" for k, v in labels.items()]}
        found = self._call("list containers", lambda: client.containers.list(all=True, filters=filters))
        return [
            {
                "id": c.id,
                "name": c.name,
                "status": c.status,
                "rank": (c.labels or {}).get(f"{LABEL}.rank", ""),
                "receipt": (c.labels or {}).get(f"{LABEL}.receipt", ""),
            }
            for c in found
        ]

    def remove(self, container_id: str) -> None:
        client = self.client
        self._call("stop", lambda: client.api.stop(container_id, timeout=10))
        self._call("remove", lambda: client.api.remove_container(container_id, force=True))

    def cancel(self) -> None:
        for container_id in list(self.running):
            self._remove_quietly(container_id)


def connect_engine(url: str) -> EngineSeam:
    return DockerEngine(url)
