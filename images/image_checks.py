"""Checks that run inside the image build (standard library, Python 3.8+).

    pins VLLM FLASHINFER CUDA [ACCEPTED]     installed versions equal the pins; CUDA majors agree
    stage MANIFEST OVERLAY STAGING           before-hashes of the installed files, then the new
                                             files byte-compiled (to check) and laid out under
                                             STAGING at their absolute paths, for one COPY
    finish MANIFEST                          stale .pyc and deletions removed, then every
                                             after-hash checked where it was installed
    report                                   torch's CUDA version and nvcc's, as JSON (for labels)
    install LOCK [PIP OPTIONS...]            every file of the lock downloaded with its sha256 required,
                                             then installed as it is (no index, no resolution)

Any mismatch prints one line naming the file and exits 1, which stops the build.
"""

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import py_compile
import re
import subprocess
import sys


def fail(message):
    print("vllm-overlay: " + message, file=sys.stderr, flush=True)
    sys.exit(1)


def sha256_of(path):
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def site_root():
    """The directory the installed vllm package lives in (its site-packages)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        fail("vllm is not installed in this image")
    return os.path.dirname(os.path.dirname(spec.origin))


def version_of(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_cuda():
    """torch.version.cuda, read from torch/version.py without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "version.py")
    text = open(path, encoding="utf-8").read() if os.path.isfile(path) else ""
    m = re.search(r"^cuda(?::\s*[^=]+)?\s*=\s*['\"]([0-9.]+)['\"]", text, re.M)
    return m.group(1) if m else None


def vllm_cudart_majors():
    """The libcudart.so.N that vLLM's compiled extensions need (their DT_NEEDED strings)."""
    pkg = os.path.join(site_root(), "vllm")
    majors = set()
    for dirpath, _, files in os.walk(pkg):
        for name in files:
            if name.endswith(".so"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    majors.update(m.decode() for m in re.findall(rb"libcudart\.so\.(\d+)", f.read()))
    return sorted(majors)


def nvcc_version():
    try:
        out = subprocess.run(["nvcc", "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    except OSError:
        return None
    line = [ln for ln in out.stdout.decode(errors="replace").splitlines() if "release" in ln]
    return line[-1].strip() if line else None


def cmd_pins(vllm, flashinfer, cuda, accepted=""):
    for dist, want in (("vllm", vllm), ("flashinfer-python", flashinfer)):
        have = version_of(dist)
        if have is None:
            fail(dist + " is not installed; the recipe pins " + want)
        if have.split("+")[0] != want:
            fail(dist + " " + have + " is installed; the recipe pins " + want)
        print("vllm-overlay: " + dist + " " + have + " matches the pin")
    image_major = cuda.split(".")[0]
    problems = []
    tc = torch_cuda()
    if tc is None:
        problems.append("torch is not installed or has no CUDA build")
    elif tc.split(".")[0] != image_major:
        problems.append("torch is built for CUDA " + tc)
    majors = vllm_cudart_majors()
    if not majors:
        problems.append("vLLM's extensions name no libcudart")
    elif majors != [image_major]:
        problems.append("vLLM's extensions need libcudart.so." + ",".join(majors))
    if problems:
        message = "CUDA mismatch: the image is CUDA " + cuda + " (major " + image_major + "), but " + "; ".join(problems)
        if not accepted:
            fail(message)
        print("vllm-overlay: " + message + " (accepted by the recipe: " + accepted + ")")
    else:
        print("vllm-overlay: CUDA " + cuda + ": torch " + tc + " and libcudart.so." + image_major + " agree")


def cmd_stage(manifest_path, overlay_dir, staging):
    manifest = json.load(open(manifest_path, encoding="utf-8"))
    os.makedirs(staging, exist_ok=True)  # COPY needs it even when the overlay only deletes
    root = site_root()
    for entry in manifest["files"]:
        installed = os.path.join(root, entry["path"])
        have = sha256_of(installed)
        if have != entry["before_sha256"]:
            fail(
                installed + ": installed file differs from the overlay's base (sha256 "
                + str(have or "absent") + ", manifest before " + str(entry["before_sha256"] or "absent") + ")"
            )
        if entry["after_sha256"] is None:
            continue
        source = os.path.join(overlay_dir, entry["path"])
        if sha256_of(source) != entry["after_sha256"]:
            fail(source + ": overlay file does not match the manifest's after sha256")
        target = staging + installed  # the absolute path, under the staging root
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(source, "rb") as src, open(target, "wb") as dst:
            dst.write(src.read())
        os.chmod(target, 0o644)
        if target.endswith(".py"):
            # Byte-compiled here so a module that does not compile stops the build; the .pyc is
            # not shipped (the overlay layer holds only the touched files), Python makes it on import.
            try:
                py_compile.compile(target, cfile=target + "c.check", dfile=installed, doraise=True)
                os.remove(target + "c.check")
            except py_compile.PyCompileError as exc:
                fail(installed + ": does not byte-compile: " + str(exc.msg).strip().splitlines()[-1])
        print("vllm-overlay: staged " + entry["path"])
    # One timestamp for everything staged, so the same overlay gives the same layer bytes.
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    for dirpath, dirnames, filenames in os.walk(staging, topdown=False):
        for name in filenames + dirnames:
            os.utime(os.path.join(dirpath, name), (epoch, epoch))
    os.utime(staging, (epoch, epoch))


def cmd_finish(manifest_path):
    manifest = json.load(open(manifest_path, encoding="utf-8"))
    root = site_root()
    for entry in manifest["files"]:
        installed = os.path.join(root, entry["path"])
        if installed.endswith(".py"):  # bytecode of the replaced source: stale, so not left behind
            stale = importlib.util.cache_from_source(installed)
            if os.path.exists(stale):
                os.remove(stale)
        if entry["after_sha256"] is None and os.path.exists(installed):
            if sha256_of(installed) != entry["before_sha256"]:
                fail(installed + ": installed file differs from the overlay's base; not deleting it")
            os.remove(installed)
        have = sha256_of(installed)
        if have != entry["after_sha256"]:
            fail(installed + ": after the overlay its sha256 is " + str(have or "absent") + ", the manifest says "
                 + str(entry["after_sha256"] or "absent"))
    print("vllm-overlay: " + str(len(manifest["files"])) + " files verified against the manifest (runtime key "
          + manifest["runtime_key"] + ")")


def cmd_install(lock, *pip_options):
    # A minimal install for branch lock's tests; the cuda branch's install replaces it.
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="vllm-overlay-wheels-")
    download = [sys.executable, "-m", "pip", "download", "--require-hashes", "--no-deps", "--only-binary", ":all:",
                "-r", lock, "-d", work] + list(pip_options)
    print("vllm-overlay: " + " ".join(download[2:]), flush=True)
    proc = subprocess.run(download, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    said = proc.stdout.decode(errors="replace")
    print(said, flush=True)
    if proc.returncode != 0:
        m = re.search(r" from (\S+)[^\n]*\n\s+Expected sha256 (\w+)\n\s+Got\s+(\w+)", said)
        if m:
            name = m.group(1).rstrip(":").split("#")[0].rsplit("/", 1)[-1]
            fail(name + ": sha256 " + m.group(3) + " is not the one " + lock + " names (" + m.group(2) + ")")
        lines = [ln.strip() for ln in said.splitlines() if ln.strip()]
        fail("pip download from " + lock + " failed: " + (lines[-1] if lines else "no output"))
    files = sorted(os.listdir(work))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps"]
                   + [os.path.join(work, f) for f in files], check=True)
    installed = [{"file": f, "sha256": sha256_of(os.path.join(work, f))} for f in files]
    with open("/opt/vllm-overlay/installed-wheels.json", "w", encoding="utf-8") as out:
        json.dump({"lock": lock, "wheels": installed}, out, indent=1)
    shutil.rmtree(work)


def cmd_report():
    print(json.dumps({"torch_cuda": torch_cuda() or "none", "nvcc": nvcc_version() or "none"}))


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"pins": cmd_pins, "stage": cmd_stage, "finish": cmd_finish, "report": cmd_report, "install": cmd_install}[command](*args)
