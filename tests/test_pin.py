"""Pin: fetch from a real HTTP server on 127.0.0.1, verify, cache once, remember hashes."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import builder.pin
from builder.errors import InputError
from builder.pin import pinned_wheel
from builder.recipe import WheelPin
from tests.helpers import run_cli
from tools.synthetic import write_recipe

NAME = "demo-1.0-py3-none-any.whl"


def make_wheel() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("vllm/__init__.py", "x = 1\n" * 5000)
    return buf.getvalue()


WHEEL = make_wheel()
SHA = hashlib.sha256(WHEEL).hexdigest()


class Server:
    """Serves /good, /truncated (short body, full Content-Length), /notzip and a PEP 691 index."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.hits.append(self.path)
                if self.path == "/simple/demo/":
                    body = json.dumps({"files": [{"filename": NAME, "url": "../../good"}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                body = {"/good": WHEEL, "/truncated": WHEEL, "/notzip": b"not a zip" * 100}.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2] if self.path == "/truncated" else body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.httpd.shutdown()


def pin(url: str | None = None, sha: str = SHA, index: str | None = None) -> WheelPin:
    extra = {"index": index} if index else {}
    return WheelPin("demo", "1.0", NAME, sha, url=url, **extra)


def cache_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_download_once_verified_and_content_addressed(server, tmp_path, capsys):
    got = pinned_wheel(pin(f"{server.url}/good"), root=tmp_path)
    assert got == tmp_path / "wheels" / SHA / NAME
    assert got.read_bytes() == WHEEL
    assert "done" in capsys.readouterr().err
    hits = len(server.hits)
    assert pinned_wheel(pin(f"{server.url}/good"), root=tmp_path) == got
    assert len(server.hits) == hits  # never downloaded twice


def test_index_resolution(server, tmp_path):
    got = pinned_wheel(pin(index=f"{server.url}/simple"), root=tmp_path)
    assert got.read_bytes() == WHEEL
    assert "/simple/demo/" in server.hits


@pytest.mark.parametrize(
    ("path", "sha", "message"),
    [
        ("/good", "0" * 64, f"has sha256 {SHA}, the pin says {'0' * 64}"),
        ("/truncated", SHA, "is truncated"),
        ("/notzip", hashlib.sha256(b"not a zip" * 100).hexdigest(), "not a valid wheel (zip)"),
    ],
)
def test_bad_downloads_leave_nothing(server, tmp_path, path, sha, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pinned_wheel(pin(f"{server.url}{path}", sha=sha), root=tmp_path)
    assert cache_files(tmp_path) == []


def test_warm_run_does_not_hash_again(server, tmp_path, monkeypatch):
    got = pinned_wheel(pin(f"{server.url}/good"), root=tmp_path)

    def no_hashing(path):
        raise AssertionError(f"hashed {path} again")

    monkeypatch.setattr(builder.pin, "sha256_file", no_hashing)
    assert pinned_wheel(pin(f"{server.url}/good"), root=tmp_path) == got
    monkeypatch.undo()
    # a changed file (new mtime and size) is hashed again, found damaged, and fetched anew
    got.write_bytes(b"damaged")
    assert pinned_wheel(pin(f"{server.url}/good"), root=tmp_path).read_bytes() == WHEEL


def test_check_command_downloads_with_progress(server, tmp_path):
    recipe = write_recipe(
        tmp_path, {}, [], vllm={"url": f"{server.url}/good", "sha256": SHA, "wheel": NAME, "version": "1.0"}
    )
    proc = run_cli("check", recipe, env={"VLLM_OVERLAY_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert f"download vllm 1.0 ({NAME}):" in proc.stderr
    assert (tmp_path / "cache" / "wheels" / SHA / NAME).read_bytes() == WHEEL
