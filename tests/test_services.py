"""tools/services.py: what `.ci/services.sh` asks of Python (port picking, the package
index's wheels and pages, JSON fields), with no services running.  The wheels are small
fakes built here; pip runs for real, against a local directory or a server of our own."""

from __future__ import annotations

import errno
import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.parse
import zipfile
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from tools.services import (
    DEFAULT_RECIPE,
    ROOT,
    IndexPin,
    ServicesError,
    json_field,
    pick_port,
    port_free,
    prepare_index,
    recipe_pins,
)

# The default recipe's pins, as its YAML says them.
RECIPE = yaml.safe_load(DEFAULT_RECIPE.read_text())
VLLM_PIN, FLASHINFER_PIN = RECIPE["vllm"], RECIPE["flashinfer"]

# --------------------------------------------------------------------- helpers


def fake_wheel(directory: Path, project: str, version: str) -> tuple[Path, str]:
    """A small but real wheel (pip reads its metadata); returns its path and sha256."""
    dist = project.replace("-", "_")
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/__init__.py", f"VERSION = {version!r}\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def pin_of(path: Path, sha: str, project: str, version: str) -> IndexPin:
    return IndexPin(project=project, version=version, wheel=path.name, sha256=sha)


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs)["href"]

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self.links.append((self._href, data))
            self._href = None


def links(page: Path) -> list[tuple[str, str]]:
    parser = Links()
    parser.feed(page.read_text())
    return parser.links


def offline_pip(monkeypatch: pytest.MonkeyPatch, find_links: Path | None) -> None:
    """pip sees no index: only ``find_links`` (or nothing at all)."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    if find_links is None:
        monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    else:
        monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))


said: list[str] = []  # the progress lines of the last prepare_index() calls


def quiet(message: str) -> None:
    said.append(message)


@pytest.fixture(autouse=True)
def _clear_said() -> Iterator[None]:
    said.clear()
    yield


# ----------------------------------------------------------------------- ports


def test_pick_port_skips_a_port_held_by_a_listening_server() -> None:
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as dockerd's registry would
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not port_free(port)
        got = pick_port(port)
        assert port < got < port + 100
        assert port_free(got)
        assert all(not port_free(p) for p in range(port, got))  # the first free one above


def test_pick_port_keeps_a_free_preferred_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert pick_port(port) == port


def test_a_port_held_only_by_time_wait_is_free() -> None:
    """The servers bind with SO_REUSEADDR (Go's net package, http.server), so after one of
    them stops, a port whose last connection is in TIME_WAIT is usable again; a plain bind
    would call it taken."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()  # the server side closes first: its end (our port) goes to TIME_WAIT
        client.recv(1)
        client.close()
    with socket.socket() as plain, pytest.raises(OSError) as exc:
        plain.bind(("127.0.0.1", port))
    assert exc.value.errno == errno.EADDRINUSE
    assert port_free(port)
    assert pick_port(port) == port


def test_no_free_port_is_one_line() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ServicesError, match=rf"^no free port on 127\.0\.0\.1 in {port}\.\.{port}$"):
            pick_port(port, span=1)


def test_pick_port_refuses_a_non_port() -> None:
    with pytest.raises(ServicesError, match="not a TCP port"):
        pick_port(70000)


# ------------------------------------------------------------------------ JSON


def test_json_field_reads_docker_info() -> None:
    info = json.dumps({"ID": "x", "Driver": "overlay2", "DriverStatus": [["Backing Filesystem", "extfs"]]})
    assert json_field(info, "Driver") == "overlay2"


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "is not JSON"), ("<html>", "is not JSON"), ("[1]", "not a JSON object"), ('{"a": 1}', "no field 'Driver'")],
)
def test_json_field_refuses(text: str, message: str) -> None:
    with pytest.raises(ServicesError, match=message):
        json_field(text, "Driver")


# ------------------------------------------------------------------------ pins


def test_recipe_pins_are_the_default_recipes() -> None:
    vllm, flashinfer = recipe_pins(DEFAULT_RECIPE)
    assert (vllm.project, vllm.version, vllm.wheel, vllm.sha256) == (
        "vllm",
        VLLM_PIN["version"],
        VLLM_PIN["wheel"],
        VLLM_PIN["sha256"],
    )
    assert (flashinfer.project, flashinfer.version, flashinfer.wheel, flashinfer.sha256) == (
        "flashinfer-python",
        FLASHINFER_PIN["version"],
        FLASHINFER_PIN["wheel"],
        FLASHINFER_PIN["sha256"],
    )


def test_recipe_pins_refuse_a_bad_recipe(tmp_path: Path) -> None:
    bad = tmp_path / "r.yaml"
    bad.write_text(DEFAULT_RECIPE.read_text().replace(VLLM_PIN["sha256"], "ef52"))
    with pytest.raises(ServicesError, match=r"vllm\.sha256"):
        recipe_pins(bad)


# ----------------------------------------------------------------------- index


def test_pages_link_each_wheel_with_its_sha256(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    vllm, vsha = fake_wheel(cache / "wheels" / "x", "vllm", "1.0")
    fi, fsha = fake_wheel(tmp_path / "dl", "flashinfer-python", "2.0.post1")
    # vllm from the pin cache, flashinfer through pip (from a local directory: no network).
    (cache / "wheels" / vsha).mkdir(parents=True)
    vllm = vllm.rename(cache / "wheels" / vsha / vllm.name)
    offline_pip(monkeypatch, tmp_path / "dl")
    pins = [pin_of(vllm, vsha, "vllm", "1.0"), pin_of(fi, fsha, "flashinfer-python", "2.0.post1")]
    root = tmp_path / "index"

    prepare_index(root, pins, cache, pip_log=tmp_path / "pip.log", say=quiet)

    assert links(root / "simple" / "index.html") == [("vllm/", "vllm"), ("flashinfer-python/", "flashinfer-python")]
    for pin in pins:
        page = root / "simple" / pin.project / "index.html"
        [(href, text)] = links(page)
        assert text == pin.wheel
        url = urllib.parse.urljoin(f"http://h/simple/{pin.project}/", href)
        parts = urllib.parse.urlsplit(url)
        assert parts.path == f"/files/{pin.wheel}"
        assert parts.fragment == f"sha256={pin.sha256}"
        served = root / parts.path.lstrip("/")
        assert hashlib.sha256(served.read_bytes()).hexdigest() == pin.sha256
    assert os.path.samefile(root / "files" / vllm.name, vllm)  # linked, not downloaded
    assert said == [
        f"index: {vllm.name} taken from the pin cache {vllm}",
        f"index: {vllm.name} cached, sha256 ok",
        "index: downloading flashinfer-python==2.0.post1 with pip",
        said[3],
    ]
    assert said[3].startswith(f"index: {fi.name} downloaded in ") and said[3].endswith("s, sha256 ok")


def test_pages_are_the_bytes_pip_and_the_scripts_index_used(tmp_path: Path) -> None:
    """The layout the shell version wrote, byte for byte."""
    wheel, sha = fake_wheel(tmp_path / "cache" / "wheels" / "s", "vllm", "1.0")
    (tmp_path / "cache" / "wheels" / sha).mkdir()
    wheel.rename(tmp_path / "cache" / "wheels" / sha / wheel.name)
    root = tmp_path / "index"
    prepare_index(root, [IndexPin("vllm", "1.0", wheel.name, sha)], tmp_path / "cache", say=quiet)
    assert (root / "simple" / "index.html").read_text() == (
        '<!DOCTYPE html><html><body>\n<a href="vllm/">vllm</a><br>\n</body></html>\n'
    )
    assert (root / "simple" / "vllm" / "index.html").read_text() == (
        "<!DOCTYPE html><html><body>\n"
        f'<a href="../../files/{wheel.name}#sha256={sha}">{wheel.name}</a><br>\n'
        "</body></html>\n"
    )


def test_a_second_run_keeps_the_verified_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel, sha = fake_wheel(tmp_path / "dl", "vllm", "1.0")
    offline_pip(monkeypatch, tmp_path / "dl")
    pins = [IndexPin("vllm", "1.0", wheel.name, sha)]
    prepare_index(tmp_path / "index", pins, tmp_path / "cache", say=quiet)
    offline_pip(monkeypatch, None)  # pip could not fetch it now
    said.clear()
    prepare_index(tmp_path / "index", pins, tmp_path / "cache", say=quiet)
    assert said == [f"index: {wheel.name} cached, sha256 ok"]


def test_a_changed_file_is_fetched_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel, sha = fake_wheel(tmp_path / "dl", "vllm", "1.0")
    offline_pip(monkeypatch, tmp_path / "dl")
    (tmp_path / "index" / "files").mkdir(parents=True)
    (tmp_path / "index" / "files" / wheel.name).write_bytes(b"not the wheel")
    prepare_index(tmp_path / "index", [IndexPin("vllm", "1.0", wheel.name, sha)], tmp_path / "cache", say=quiet)
    assert (tmp_path / "index" / "files" / wheel.name).read_bytes() == wheel.read_bytes()
    bad = hashlib.sha256(b"not the wheel").hexdigest()
    assert said[0] == f"index: {wheel.name} cached with sha256 {bad}, expected {sha}; downloading again"


def test_a_wrong_copy_in_the_pin_cache_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel, sha = fake_wheel(tmp_path / "dl", "vllm", "1.0")
    wrong = tmp_path / "cache" / "wheels" / sha / wheel.name
    wrong.parent.mkdir(parents=True)
    wrong.write_bytes(b"truncated")
    offline_pip(monkeypatch, tmp_path / "dl")
    prepare_index(tmp_path / "index", [IndexPin("vllm", "1.0", wheel.name, sha)], tmp_path / "cache", say=quiet)
    assert not os.path.samefile(tmp_path / "index" / "files" / wheel.name, wrong)
    assert (tmp_path / "index" / "files" / wheel.name).read_bytes() == wheel.read_bytes()
    assert not any("pin cache" in line for line in said)


def test_a_wrong_sha256_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel, sha = fake_wheel(tmp_path / "dl", "vllm", "1.0")
    offline_pip(monkeypatch, tmp_path / "dl")
    pinned = "0" * 64
    root = tmp_path / "index"
    with pytest.raises(ServicesError) as exc:
        prepare_index(root, [IndexPin("vllm", "1.0", wheel.name, pinned)], tmp_path / "cache", say=quiet)
    assert str(exc.value) == f"{wheel.name} from pip download has sha256 {sha}, expected {pinned}"
    assert list((root / "files").iterdir()) == []  # nothing put in place, no download dir left
    assert sorted(p.name for p in root.iterdir()) == ["files", "simple"]
    assert list((root / "simple").iterdir()) == []  # no page names an unverified wheel


def test_a_failed_download_names_pips_last_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_pip(monkeypatch, tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    pin = IndexPin("vllm", "1.0", "vllm-1.0-py3-none-any.whl", "0" * 64)
    with pytest.raises(ServicesError, match=r"^pip download vllm==1\.0 failed: .*vllm==1\.0") as exc:
        prepare_index(tmp_path / "index", [pin], tmp_path / "cache", pip_log=tmp_path / "pip.log", say=quiet)
    assert "\n" not in str(exc.value)


def test_pip_installs_from_the_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pages work for pip as the index serves them: over http.server, hash fragment checked."""
    wheel, sha = fake_wheel(tmp_path / "dl", "flashinfer-python", "2.0")
    offline_pip(monkeypatch, tmp_path / "dl")
    root = tmp_path / "index"
    prepare_index(root, [IndexPin("flashinfer-python", "2.0", wheel.name, sha)], tmp_path / "cache", say=quiet)

    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(root))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_address[1]}/simple/"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir"]
        ok = subprocess.run(
            [*cmd, "-d", str(tmp_path / "got"), "--index-url", index, "flashinfer-python==2.0"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert ok.returncode == 0, ok.stderr
        assert (tmp_path / "got" / wheel.name).read_bytes() == wheel.read_bytes()
        # The fragment is what pip checks: a page naming another sha256 is refused.
        page = root / "simple" / "flashinfer-python" / "index.html"
        page.write_text(page.read_text().replace(sha, "1" * 64))
        bad = subprocess.run(
            [*cmd, "-d", str(tmp_path / "bad"), "--index-url", index, "flashinfer-python==2.0"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert bad.returncode != 0
        assert "HASHES" in bad.stderr or "hash" in bad.stderr.lower()
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------- CLI


def cli(*args: str, env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.services", *args], cwd=ROOT, env=env, input=stdin, capture_output=True, text=True
    )


def test_cli_pick_port() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = cli("pick-port", str(port))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > port


def test_cli_json_field() -> None:
    out = cli("json-field", "Driver", stdin='{"Driver": "vfs"}')
    assert (out.returncode, out.stdout) == (0, "vfs\n")
    out = cli("json-field", "Driver", stdin="")
    assert out.returncode == 1
    assert out.stderr.startswith("services: error: stdin is not JSON") and out.stderr.count("\n") == 1


def test_cli_prepare_index_reads_the_recipes_pins(tmp_path: Path) -> None:
    """The CLI serves what the recipe pins: a recipe with other pins gets other pages, and a
    wheel whose bytes do not match its pin is refused with one line and exit code 1."""
    vllm, vsha = fake_wheel(tmp_path / "dl", "vllm", "1.0")
    fi, fsha = fake_wheel(tmp_path / "dl", "flashinfer-python", "2.0")
    raw = yaml.safe_load(DEFAULT_RECIPE.read_text())  # a copy to change
    raw["vllm"].update(version="1.0", wheel=vllm.name, sha256=vsha)
    raw["flashinfer"].update(version="2.0", wheel=fi.name, sha256=fsha)
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path / "dl"))
    args = ["prepare-index", "--cache", str(tmp_path / "cache"), "--recipe", str(recipe)]

    ok = cli(*args, env=env)
    assert ok.returncode == 0, ok.stderr
    assert all(line.startswith("services: index: ") for line in ok.stderr.splitlines())
    assert (tmp_path / "cache" / "index" / "files" / vllm.name).read_bytes() == vllm.read_bytes()
    [(href, _)] = links(tmp_path / "cache" / "index" / "simple" / "flashinfer-python" / "index.html")
    assert href == f"../../files/{fi.name}#sha256={fsha}"

    raw["flashinfer"]["sha256"] = "f" * 64
    recipe.write_text(yaml.safe_dump(raw))
    bad = cli(*args, "--root", str(tmp_path / "other"), env=env)
    assert bad.returncode == 1
    errors = [line for line in bad.stderr.splitlines() if not line.startswith("services: index: ")]
    assert errors == [f"services: error: {fi.name} from pip download has sha256 {fsha}, expected {'f' * 64}"]
    assert not (tmp_path / "other" / "files" / fi.name).exists()
