"""images/image_checks.py: the hash-locked install and the checks `pins` makes.

The logic runs against fake site-packages trees (dist-info METADATA and RECORD, tiny
shared objects built with gcc against a fake libcudart.so.12 or .13, so their DT_NEEDED
is real), with this machine's Python and `-S` so only the fake tree is installed.  The
install runs against the local package index into a throwaway venv, and once inside an
image on the local engine over the real vLLM 0.30.0 wheel.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest

from tools.synthetic import ROOT

CHECKS = ROOT / "images" / "image_checks.py"
VLLM, FLASHINFER = "0.30.0", "0.6.18.post1"
VLLM_WHEEL = "vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl"
FLASHINFER_WHEEL = "flashinfer_python-0.6.18.post1-py3-none-any.whl"
# nvidia-cutlass-dsl 4.7.1's Requires-Dist, as its PyPI wheel's METADATA has them (vLLM 0.30.0
# requires nvidia-cutlass-dsl[cu13]==4.7.1).
CUTLASS_REQUIRES = [
    "nvidia-cutlass-dsl-libs-base==4.7.1",
    "nvidia-cutlass-dsl-libs-cu12==4.7.1",
    'nvidia-cutlass-dsl-libs-cu13==4.7.1; extra == "cu13"',
]
# FlashInfer 0.6.18.post1's (a part): its cu12 extra asks for nothing it does not always need.
FLASHINFER_REQUIRES = [
    "cuda-python>=12.0",
    "nvidia-cutlass-dsl>=4.6.2a0",
    "torch",
    'nvidia-cutlass-dsl>=4.6.2a0; extra == "cu12"',
    'nvidia-cutlass-dsl[cu13]>=4.6.2a0; extra == "cu13"',
]


# ---- fake site-packages trees ---------------------------------------------------


@pytest.fixture(scope="session")
def elf(tmp_path_factory) -> dict[str, bytes]:
    """Tiny real shared objects: fake libcudart.so.12/.13 (with their soname) and extensions
    linked against each, plus one that needs no libcudart."""
    work = tmp_path_factory.mktemp("elf")
    (work / "x.c").write_text("int vllm_overlay_test_symbol(void) { return 1; }\n")

    def gcc(out: str, *args: str) -> bytes:
        cmd = ["gcc", "-shared", "-fPIC", "-o", str(work / out), str(work / "x.c"), *args]
        subprocess.run(cmd, check=True, capture_output=True)
        return (work / out).read_bytes()

    built = {}
    for major in ("12", "13"):
        built[f"libcudart.so.{major}"] = gcc(f"libcudart.so.{major}", f"-Wl,-soname,libcudart.so.{major}")
        # --no-as-needed: the extension uses no symbol of it, and it must still be DT_NEEDED
        built[f"ext{major}"] = gcc(f"ext{major}.so", f"-L{work}", "-Wl,--no-as-needed", f"-l:libcudart.so.{major}")
    built["plain"] = gcc("plain.so")
    readelf = subprocess.run(["readelf", "-d", str(work / "ext13.so")], capture_output=True, text=True).stdout
    assert "Shared library: [libcudart.so.13]" in readelf, readelf
    return built


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def add_dist(site: Path, name: str, version: str, files: dict[str, bytes], requires: list[str] = ()) -> Path:
    """An installed distribution as pip leaves it: its files, METADATA and a RECORD of them."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {**files, f"{info.name}/METADATA": metadata.encode()}
    rows = []
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
        rows.append(f"{rel},{record_hash(data)},{len(data)}")
    rows.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(rows) + "\n")
    return info


def cuda_tree(tmp_path: Path, elf: dict[str, bytes], major: str = "12", vllm_extension: str = "") -> Path:
    """A consistent CUDA `major` install: vLLM with an extension needing libcudart.so.<major>,
    FlashInfer, torch built for it and the runtime that provides libcudart."""
    site = tmp_path / "site"
    add_dist(site, "vllm", VLLM, {"vllm/__init__.py": b"", "vllm/_C.abi3.so": elf[vllm_extension or f"ext{major}"]})
    flashinfer = {"flashinfer/__init__.py": b"", "flashinfer/jit.so": elf["plain"]}
    add_dist(site, "flashinfer-python", FLASHINFER, flashinfer, FLASHINFER_REQUIRES)
    torch_version = f"cuda = '{major}.8'\n" if major == "12" else f"cuda: Optional[str] = '{major}.0'\n"
    add_dist(site, "torch", "2.13.0", {"torch/__init__.py": b"", "torch/version.py": torch_version.encode()})
    runtime = "nvidia/cuda_runtime/lib/" if major == "12" else "nvidia/cu13/lib/"
    add_dist(
        site,
        f"nvidia-cuda-runtime-cu{major}" if major == "12" else "nvidia-cuda-runtime",
        f"{major}.8.90" if major == "12" else "13.0.96",
        {runtime + f"libcudart.so.{major}": elf[f"libcudart.so.{major}"]},
    )
    # cutlass with its cu13 extra's requirement absent (on CUDA 12): the extra is not installed
    add_dist(site, "nvidia-cutlass-dsl", "4.7.1", {"cutlass/__init__.py": b""}, CUTLASS_REQUIRES)
    add_dist(site, "nvidia-cutlass-dsl-libs-base", "4.7.1", {"cutlass_libs_base/__init__.py": b""})
    add_dist(site, "nvidia-cutlass-dsl-libs-cu12", "4.7.1", {"cutlass_libs_cu12/__init__.py": b""})
    if major == "13":  # the extra vLLM asks for, installed
        add_dist(site, "nvidia-cutlass-dsl-libs-cu13", "4.7.1", {"cutlass_libs_cu13/__init__.py": b""})
    return site


def checks_copy(tmp_path: Path) -> Path:
    """The script where the image keeps it: its installed-wheels.json lands beside it."""
    opt = tmp_path / "opt"
    opt.mkdir(exist_ok=True)
    shutil.copy(CHECKS, opt / "image_checks.py")
    return opt / "image_checks.py"


def run_checks(script: Path, site: Path, *args: str) -> subprocess.CompletedProcess:
    """The script under this machine's Python without its site-packages (-S): only `site` is installed."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-S", str(script), *args], capture_output=True, text=True, env=env)


def pins(script: Path, site: Path, *extra: str, cuda: str = "12.8.1") -> subprocess.CompletedProcess:
    return run_checks(script, site, "pins", "--vllm", VLLM, "--flashinfer", FLASHINFER, "--cuda", cuda, *extra)


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The failure: exit 1 and one stderr line, prefixed like every line of the script's."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr)
    assert lines[0].startswith("vllm-overlay: ")
    return lines[0]


# ---- pins: the CUDA check over every package ---------------------------------------


def test_a_consistent_cuda_12_install_passes(tmp_path, elf):
    site = cuda_tree(tmp_path, elf)
    proc = pins(checks_copy(tmp_path), site)
    assert proc.returncode == 0, proc.stderr
    assert "CUDA 12.8.1: torch 12.8, 1 extensions' libcudart and every package that names a CUDA major agree" in (
        proc.stdout
    )
    assert "wheel sha256 not checked" in proc.stdout  # no installed-wheels.json: said, not hidden


def test_each_package_of_another_cuda_major_is_named_in_one_line(tmp_path, elf):
    site = cuda_tree(tmp_path, elf)
    # vLLM 0.30.0's PyPI closure on a CUDA 12.8 image: cutlass with its cu13 extra installed,
    # an unbounded cuda-python, torch and vLLM's extensions built for CUDA 13 ...
    add_dist(site, "nvidia-cutlass-dsl-libs-cu13", "4.7.1", {"cutlass_libs_cu13/__init__.py": b""})
    add_dist(site, "cuda-python", "13.0.1", {"cuda/__init__.py": b""})
    add_dist(site, "cuda-bindings", "13.0.1", {"cuda/bindings/__init__.py": b""})
    # extras told apart by their requirements' versions: only the cu13 one is met
    demo = ['cuda-python>=12,<13; extra == "cu12"', 'cuda-python~=13.0; extra == "cu13"']
    add_dist(site, "demo-kernels", "1.0", {"demo_kernels/__init__.py": b""}, demo)
    add_dist(site, "nvidia-cuda-runtime", "13.0.96", {"nvidia/cu13/lib/libcudart.so.13": elf["libcudart.so.13"]})
    add_dist(site, "torchvision", "0.28.0+cu130", {"torchvision/__init__.py": b""})
    (site / "torch/version.py").write_text("cuda: Optional[str] = '13.0'\n")
    (site / "vllm/_moe_C.abi3.so").write_bytes(elf["ext13"])
    (site / "vllm/vllm_flash_attn").mkdir()
    (site / "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so").write_bytes(elf["ext13"])
    # ... and a package's own library needing CUDA 13's runtime, outside vllm/
    (site / "deep_ep").mkdir()
    (site / "deep_ep/deep_ep_cpp.cpython-311-x86_64-linux-gnu.so").write_bytes(elf["ext13"])
    # neither of these names a CUDA major: a linker script named .so, and a library needing none
    (site / "vllm/libnote.so").write_text("/* GNU ld script */ INPUT(libc.so.6)\n")
    (site / "vllm/libplain.so.1").write_bytes(elf["plain"])
    for extra in ([], ["--sha256", "vllm=" + "0" * 64]):  # no installed-wheels.json: no sha256 to compare
        line = one_line(pins(checks_copy(tmp_path), site, *extra))
        assert line.startswith("vllm-overlay: CUDA mismatch: the image is CUDA 12.8.1 (major 12), but ")
        named = line.split(", but ", 1)[1].split("; ")
        assert sorted(named) == sorted(
            [
                "cuda-bindings 13.0.1 is CUDA 13",
                "cuda-python 13.0.1 is CUDA 13",
                "nvidia-cuda-runtime 13.0.96 is CUDA 13",
                "nvidia-cutlass-dsl-libs-cu13 4.7.1 is CUDA 13",
                "nvidia-cutlass-dsl[cu13] 4.7.1 is CUDA 13",
                "flashinfer-python[cu13] 0.6.18.post1 is CUDA 13",
                "demo-kernels[cu13] 1.0 is CUDA 13",
                "torchvision 0.28.0+cu130 is CUDA 13",
                "torch 2.13.0 is built for CUDA 13.0",
                "deep_ep/deep_ep_cpp.cpython-311-x86_64-linux-gnu.so needs libcudart.so.13",
                "vllm/_moe_C.abi3.so needs libcudart.so.13",
                "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so needs libcudart.so.13",
            ]
        ), line
    # the libraries that provide libcudart are no offenders: the packages they come with are
    assert "nvidia/cu13/lib" not in line and "cuda_runtime/lib" not in line


def test_an_accepted_mismatch_passes_and_says_so(tmp_path, elf):
    site = cuda_tree(tmp_path, elf, major="13")
    reason = "CPU-only test image; the CUDA 13 wheels are wanted"
    proc = pins(checks_copy(tmp_path), site, "--accept", reason)
    assert proc.returncode == 0, proc.stderr
    accepted = [line for line in proc.stdout.splitlines() if "CUDA mismatch" in line]
    assert len(accepted) == 1 and accepted[0].endswith(f"(accepted by the recipe: {reason})")
    assert "nvidia-cuda-runtime 13.0.96 is CUDA 13" in accepted[0]
    assert "vllm/_C.abi3.so needs libcudart.so.13" in accepted[0]
    # For a CUDA 13 image the one package of another major is cutlass's CUDA 12 libraries,
    # which nvidia-cutlass-dsl 4.7.1 requires whatever its extra; without them the tree agrees.
    line = one_line(pins(checks_copy(tmp_path), site, cuda="13.0.1"))
    assert line.endswith("(major 13), but nvidia-cutlass-dsl-libs-cu12 4.7.1 is CUDA 12")
    shutil.rmtree(site / "nvidia_cutlass_dsl_libs_cu12-4.7.1.dist-info")
    assert pins(checks_copy(tmp_path), site, cuda="13.0.1").returncode == 0


def test_a_cpu_build_of_vllm_and_torch_fails_closed(tmp_path, elf):
    site = cuda_tree(tmp_path, elf, vllm_extension="plain")
    (site / "torch/version.py").write_text("cuda = None\n")
    line = one_line(pins(checks_copy(tmp_path), site))
    assert "torch 2.13.0 has no CUDA build" in line
    assert "no vLLM extension needs a libcudart (a CPU build?)" in line


def test_an_unreadable_shared_object_is_named(tmp_path, elf):
    site = cuda_tree(tmp_path, elf)
    (site / "vllm/_broken.abi3.so").write_bytes(elf["ext12"][:200])  # ELF header, then cut off
    line = one_line(pins(checks_copy(tmp_path), site))
    assert re.search(r"vllm/_broken\.abi3\.so \(truncated at byte \d+\): unreadable ELF", line), line


# ---- pins: the installed vLLM and FlashInfer ------------------------------------


def test_installed_files_that_differ_from_the_record_are_named(tmp_path, elf):
    site = cuda_tree(tmp_path, elf)
    (site / "vllm/__init__.py").write_text("tampered = True\n")
    (site / "vllm/_C.abi3.so").unlink()
    line = one_line(pins(checks_copy(tmp_path), site))
    have = record_hash(b"tampered = True\n").removeprefix("sha256=")
    empty = record_hash(b"").removeprefix("sha256=")
    assert line == (
        "vllm-overlay: vllm 0.30.0: 2 installed files differ from its RECORD: "
        f"vllm/__init__.py (sha256 {have}, RECORD {empty}), vllm/_C.abi3.so (absent)"
    )


def test_record_entries_outside_site_packages_are_not_checked(tmp_path, elf):
    """A console script (../../../bin/vllm in vLLM's RECORD) is not part of the tree the overlay
    patches, and a base that copied site-packages alone (the gate tests' image) lacks it."""
    site = cuda_tree(tmp_path, elf)
    [record] = site.glob("vllm-*.dist-info/RECORD")
    script_hash = record_hash(b"#!/bin/sh\n")
    record.write_text(record.read_text() + f"../../../bin/vllm,{script_hash},10\n")
    proc = pins(checks_copy(tmp_path), site, "--accept", "test")
    assert "vllm: every file in its RECORD has its recorded hash" in proc.stdout, proc.stderr
    (site / "vllm/__init__.py").write_text("tampered = True\n")  # while a file inside still counts
    assert "1 installed files differ from its RECORD: vllm/__init__.py" in one_line(pins(checks_copy(tmp_path), site))


def test_the_installed_wheels_must_have_the_expected_sha256(tmp_path, elf):
    site = cuda_tree(tmp_path, elf)
    script = checks_copy(tmp_path)
    record = {
        "vllm": {"version": VLLM, "file": VLLM_WHEEL, "sha256": "a" * 64},
        "flashinfer-python": {"version": FLASHINFER, "file": FLASHINFER_WHEEL, "sha256": "b" * 64},
    }
    (script.parent / "installed-wheels.json").write_text(json.dumps(record))
    good = ["--sha256", "vllm=" + "a" * 64, "--sha256", "flashinfer_python=" + "b" * 64]
    proc = pins(script, site, *good)
    assert proc.returncode == 0, proc.stderr
    assert f"flashinfer-python: installed {FLASHINFER_WHEEL} sha256 {'b' * 64}" in proc.stdout
    line = one_line(pins(script, site, "--sha256", "flashinfer-python=" + "c" * 64))
    assert line == (
        f"vllm-overlay: flashinfer-python: the installed {FLASHINFER_WHEEL} has sha256 {'b' * 64}, expected {'c' * 64}"
    )
    del record["vllm"]
    (script.parent / "installed-wheels.json").write_text(json.dumps(record))
    line = one_line(pins(script, site, *good))
    assert line.endswith(f"installed-wheels.json: no wheel of vllm was installed; expected sha256 {'a' * 64}")


def test_report_names_the_installed_wheels(tmp_path, elf):
    site = cuda_tree(tmp_path, elf)
    script = checks_copy(tmp_path)
    report = json.loads(run_checks(script, site, "report").stdout)
    assert report == {"torch_cuda": "12.8", "nvcc": report["nvcc"], "installed": "unknown"}
    record = {
        "flashinfer-python": {"version": FLASHINFER, "file": FLASHINFER_WHEEL, "sha256": "b" * 64},
        "vllm": {"version": VLLM, "file": VLLM_WHEEL, "sha256": "a" * 64},
        "torch": {"version": "2.13.0", "file": "torch.whl", "sha256": "c" * 64},
    }
    (script.parent / "installed-wheels.json").write_text(json.dumps(record))
    report = json.loads(run_checks(script, site, "report").stdout)
    assert report["installed"] == f"vllm==0.30.0 sha256:{'a' * 64}; flashinfer-python==0.6.18.post1 sha256:{'b' * 64}"


# ---- pins over vLLM 0.30.0's real PyPI closure (the probe venv, with CPU torch) ------------


def offenders(line: str) -> set[str]:
    """The offenders a CUDA-mismatch line names, versions left out (the probe venv's closure is resolved when built)."""
    named = set()
    for item in line.split(", but ", 1)[1].split("; "):
        m = re.fullmatch(r"(\S+) \S+ is CUDA ([0-9]+)", item)
        named.add(f"{m.group(1)}: CUDA {m.group(2)}" if m else item)
    return named


def test_pins_over_vllms_real_pypi_closure_names_its_cuda_13_pieces(probe_python, tmp_path):
    """What the issue found by reading metadata, found by the check: on a CUDA 12.8 claim,
    vLLM 0.30.0's closure from PyPI is CUDA 13 in eight packages and fourteen extensions."""
    script = checks_copy(tmp_path)  # no installed-wheels.json: the venv was not installed from a lock
    base = [str(probe_python), str(script), "pins", "--vllm", VLLM, "--flashinfer", FLASHINFER]
    proc = subprocess.run([*base, "--cuda", "12.8.1"], capture_output=True, text=True)
    named = offenders(one_line(proc))
    cuda13 = {
        f"vllm/{p} needs libcudart.so.13" for p in ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so")
    }
    assert cuda13 <= named, named
    assert len([n for n in named if n.startswith("vllm/")]) == 14, named
    assert {n for n in named if not n.startswith("vllm/")} == {
        "cuda-bindings: CUDA 13",
        "cuda-python: CUDA 13",
        "flashinfer-python[cu13]: CUDA 13",
        "humming-kernels[cu13]: CUDA 13",
        "nvidia-cuda-runtime: CUDA 13",
        "nvidia-cutlass-dsl[cu13]: CUDA 13",
        "nvidia-cutlass-dsl-libs-cu13: CUDA 13",
        "quack-kernels[cu13]: CUDA 13",
        "torch 2.13.0+cpu has no CUDA build",
    }, named
    assert "vllm: every file in its RECORD has its recorded hash" in proc.stdout
    # On a CUDA 13 claim only cutlass's CUDA 12 libraries (nvidia-cutlass-dsl requires them
    # whatever its extra) and the CPU torch remain.
    named = offenders(one_line(subprocess.run([*base, "--cuda", "13.0.2"], capture_output=True, text=True)))
    assert named == {"nvidia-cutlass-dsl-libs-cu12: CUDA 12", "torch 2.13.0+cpu has no CUDA build"}, named


# ---- install: against the local index ---------------------------------------------


def index_files(index: str) -> dict[str, str]:
    """The index's vllm and flashinfer files: name -> URL."""
    found = {}
    for project in ("vllm", "flashinfer-python"):
        page = urllib.request.urlopen(index + project + "/", timeout=30).read().decode()
        for href in re.findall(r'href="([^"#]+)', page):
            url = urllib.request.urljoin(index + project + "/", href)
            found[url.rsplit("/", 1)[1]] = url
    return found


@pytest.fixture(scope="module")
def real_sha256(services) -> dict[str, str]:
    """sha256 of the index's two wheels, by file name, hashed here (not by the code under test)."""
    digests = {}
    for name, url in index_files(services["VLLM_OVERLAY_TEST_INDEX"]).items():
        h = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=120) as response:
            for block in iter(lambda: response.read(1 << 20), b""):
                h.update(block)
        digests[name] = h.hexdigest()
    assert set(digests) == {VLLM_WHEEL, FLASHINFER_WHEEL}
    return digests


def lock_text(flashinfer_sha256: list[str], vllm_sha256: list[str]) -> str:
    """A lock as `uv pip compile --generate-hashes` writes it."""

    def hashes(digests: list[str]) -> str:
        return " \\\n".join(f"    --hash=sha256:{d}" for d in digests)

    return (
        "# This file was autogenerated by uv via the following command:\n"
        "#    uv pip compile requirements.in --generate-hashes\n"
        f"flashinfer-python==0.6.18.post1 \\\n{hashes(flashinfer_sha256)}\n    # via vllm\n"
        f"vllm==0.30.0 \\\n{hashes(vllm_sha256)}\n    # via -r requirements.in\n"
    )


def venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def install(python: Path, script: Path, lock: Path, index: str, tmp: Path) -> subprocess.CompletedProcess:
    """`install` as the Dockerfile runs it; pip's own configuration (this machine's finds links
    elsewhere) is kept out, and its temporary directory is one the test can look into."""
    env = {"PATH": os.environ["PATH"], "PIP_CONFIG_FILE": os.devnull, "TMPDIR": str(tmp)}
    cmd = [str(python), str(script), "install", str(lock), "--index-url", index]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def installed_venv(services, real_sha256, tmp_path_factory):
    """vLLM 0.30.0 and FlashInfer installed from a right lock into a new venv (about a minute)."""
    work = tmp_path_factory.mktemp("install")
    python = venv(work / "venv")
    script = checks_copy(work)
    lock = work / "requirements.lock"
    lock.write_text(lock_text([real_sha256[FLASHINFER_WHEEL]], [real_sha256[VLLM_WHEEL]]))
    (work / "tmp").mkdir()
    proc = install(python, script, lock, services["VLLM_OVERLAY_TEST_INDEX"], work / "tmp")
    return python, script, work, proc


def test_a_right_lock_installs_and_records_the_wheels(installed_venv, real_sha256):
    python, script, work, proc = installed_venv
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "Downloading http://127.0.0.1" in proc.stdout or "Saved " in proc.stdout  # pip's output, streamed
    assert json.loads((script.parent / "installed-wheels.json").read_text()) == {
        "flashinfer-python": {"version": FLASHINFER, "file": FLASHINFER_WHEEL, "sha256": real_sha256[FLASHINFER_WHEEL]},
        "vllm": {"version": VLLM, "file": VLLM_WHEEL, "sha256": real_sha256[VLLM_WHEEL]},
    }
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True)
    versions = {d["name"]: d["version"] for d in json.loads(listed.stdout)}
    assert versions["vllm"] == VLLM and versions["flashinfer-python"] == FLASHINFER
    assert "torch" not in versions, "no resolution: only the lock's files"
    assert list((work / "tmp").iterdir()) == [], "the downloaded wheels are removed"


def test_pins_over_the_real_wheels_names_vllms_cuda_13_extensions(installed_venv, real_sha256):
    """The real vLLM 0.30.0 PyPI wheel on a CUDA 12.8 claim: its files match RECORD, its wheel
    the lock, and its extensions need libcudart.so.13, each named."""
    python, script, _, _ = installed_venv
    want = [
        "--sha256",
        f"vllm={real_sha256[VLLM_WHEEL]}",
        "--sha256",
        f"flashinfer-python={real_sha256[FLASHINFER_WHEEL]}",
    ]
    args = ["pins", "--vllm", VLLM, "--flashinfer", FLASHINFER, "--cuda", "12.8.1", *want]
    proc = subprocess.run([str(python), str(script), *args], capture_output=True, text=True)
    line = one_line(proc)
    assert "vllm: every file in its RECORD has its recorded hash" in proc.stdout
    assert "flashinfer-python: every file in its RECORD has its recorded hash" in proc.stdout
    for name in ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so", "vllm_flash_attn/_vllm_fa2_C.abi3.so"):
        assert f"vllm/{name} needs libcudart.so.13" in line, line
    assert len(re.findall(r"vllm/\S+ needs libcudart\.so\.13", line)) == 14, line
    assert "torch is not installed" in line


@pytest.fixture(scope="module")
def empty_venv(services, tmp_path_factory) -> Path:
    """A venv for the installs that must fail: nothing may land in it."""
    python = venv(tmp_path_factory.mktemp("empty") / "venv")
    yield python
    site = python.parent.parent / "lib"
    assert not list(site.glob("python*/site-packages/vllm*")), "a failed install installed vllm"
    assert not list(site.glob("python*/site-packages/flashinfer*")), "a failed install installed flashinfer"


@pytest.mark.parametrize("direct", [False, True], ids=["pinned", "direct-url"])
def test_a_lock_with_one_wrong_hash_fails_naming_the_file(services, empty_venv, real_sha256, tmp_path, direct):
    script = checks_copy(tmp_path)
    lock = tmp_path / "requirements.lock"
    wrong = "0" * 64
    text = lock_text([wrong, "1" * 64], [real_sha256[VLLM_WHEEL]])
    requirement = "flashinfer-python==0.6.18.post1"
    if direct:  # a `name @ URL` line, as uv writes for a recipe's wheel URL
        url = index_files(services["VLLM_OVERLAY_TEST_INDEX"])[FLASHINFER_WHEEL]
        text, requirement = text.replace(requirement, f"flashinfer-python @ {url}"), "flashinfer-python"
    lock.write_text(text)
    (tmp_path / "tmp").mkdir()
    line = one_line(install(empty_venv, script, lock, services["VLLM_OVERLAY_TEST_INDEX"], tmp_path / "tmp"))
    assert line == (
        f"vllm-overlay: {lock}: hash mismatch: {FLASHINFER_WHEEL} ({requirement}, lock line 3): "
        f"expected sha256 {wrong} or {'1' * 64}, got {real_sha256[FLASHINFER_WHEEL]}"
    )
    assert not (script.parent / "installed-wheels.json").exists()
    assert list((tmp_path / "tmp").iterdir()) == [], "the downloads are removed"


def test_a_requirement_the_index_lacks_gives_pips_last_error(services, empty_venv, tmp_path):
    script = checks_copy(tmp_path)
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"vllm==0.29.0 \\\n    --hash=sha256:{'0' * 64}\n")
    (tmp_path / "tmp").mkdir()
    line = one_line(install(empty_venv, script, lock, services["VLLM_OVERLAY_TEST_INDEX"], tmp_path / "tmp"))
    assert line == f"vllm-overlay: {lock}: pip download failed: No matching distribution found for vllm==0.29.0"
    assert not (script.parent / "installed-wheels.json").exists()


# ---- on the engine: the image's own Python and pip ----------------------------------


def test_in_an_image_the_locked_install_and_the_cuda_check_name_vllms_extensions(services, real_sha256):
    """A tiny image on the local engine: the Debian base's Python 3.11 and pip 23.0.1 install
    the lock; `pins` with a CUDA 12.8 claim fails naming vLLM's libcudart.so.13 extensions."""
    import docker

    from builder.errors import CheckFailed
    from builder.image import _build
    from builder.render import context_tar

    index = services["VLLM_OVERLAY_TEST_INDEX"]
    want = f"--sha256 vllm={real_sha256[VLLM_WHEEL]} --sha256 flashinfer-python={real_sha256[FLASHINFER_WHEEL]}"
    dockerfile = (
        f"FROM {services['VLLM_OVERLAY_TEST_BASE_IMAGE']}\n"
        "RUN python3 -m venv /opt/venv\n"
        "COPY image_checks.py requirements.lock /opt/vllm-overlay/\n"
        f"RUN /opt/venv/bin/python /opt/vllm-overlay/image_checks.py install /opt/vllm-overlay/requirements.lock"
        f" --index-url {index}\n"
        "RUN /opt/venv/bin/python /opt/vllm-overlay/image_checks.py pins --vllm 0.30.0 --flashinfer 0.6.18.post1"
        f" --cuda {{cuda}} {want}{{accept}}\n"
    )
    lock = lock_text([real_sha256[FLASHINFER_WHEEL]], [real_sha256[VLLM_WHEEL]])
    client = docker.DockerClient(base_url=services["DOCKER_HOST"], timeout=600)
    tag = f"vllm-overlay-itest/image-checks:{uuid.uuid4().hex[:12]}"
    log: list[str] = []

    def build(cuda: str, accept: str) -> str:
        files = {
            "Dockerfile": dockerfile.format(cuda=cuda, accept=accept).encode(),
            "image_checks.py": CHECKS.read_bytes(),
            "requirements.lock": lock.encode(),
        }
        return _build(client, context_tar(files), tag, log.append)

    try:
        with pytest.raises(CheckFailed) as failed:
            build("12.8.1", "")
        message = str(failed.value)
        assert message.startswith("image build failed: CUDA mismatch: the image is CUDA 12.8.1 (major 12), but "), (
            message
        )
        assert len(re.findall(r"vllm/\S+ needs libcudart\.so\.13", message)) == 14, message
        assert "vllm/_C_stable_libtorch.abi3.so needs libcudart.so.13" in message
        assert any("vllm-overlay: installed 2 files from /opt/vllm-overlay/requirements.lock" in ln for ln in log)
        # Accepted, the image builds (the install layers come from the cache) and reports the wheels it installed.
        image_id = build("12.8.1", ' --accept "CPU-only test image"')
        out = client.containers.run(
            image_id, ["/opt/venv/bin/python", "/opt/vllm-overlay/image_checks.py", "report"], remove=True
        )
        installed = json.loads(out.decode().strip().splitlines()[-1])["installed"]
        assert installed == (
            f"vllm==0.30.0 sha256:{real_sha256[VLLM_WHEEL]}; "
            f"flashinfer-python==0.6.18.post1 sha256:{real_sha256[FLASHINFER_WHEEL]}"
        )
        assert any("vllm: every file in its RECORD has its recorded hash" in ln for ln in log)
    finally:
        try:
            client.images.remove(tag, noprune=False)
        except docker.errors.ImageNotFound:
            pass
        client.close()
