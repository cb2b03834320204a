"""Checks that run inside the image build (standard library, Python 3.8+).

    install LOCK [PIP_OPTION ...]            the lock's files downloaded with their hashes
                                             required, installed as they are (no resolution)
                                             and recorded in installed-wheels.json, beside
                                             this script (/opt/vllm-overlay in the image)
    pins --vllm V --flashinfer F --cuda C [--accept REASON] [--sha256 DIST=HEX ...]
                                             installed versions equal the pins, their wheels
                                             the expected sha256 and their files their RECORD;
                                             every package that names a CUDA major agrees with
                                             the image's (or the recipe's accepted reason shows)
    stage MANIFEST OVERLAY STAGING           before-hashes of the installed files, then the new
                                             files byte-compiled (to check) and laid out under
                                             STAGING at their absolute paths, for one COPY
    finish MANIFEST                          stale .pyc and deletions removed, then every
                                             after-hash checked where it was installed
    report                                   torch's CUDA version, nvcc's and the installed vLLM
                                             and FlashInfer wheels, as JSON (for labels)

Any mismatch prints one line naming the file and exits 1, which stops the build.
"""

import argparse
import base64
import csv
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import py_compile
import re
import shutil
import struct
import subprocess
import sys
import tempfile

INSTALLED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "installed-wheels.json")
CHECKED = ("vllm", "flashinfer-python")  # the distributions whose wheels and files are verified
# Distributions whose version's major is the CUDA major they are built for.
CUDA_VERSIONED = ("nvidia-cuda-runtime", "cuda-python", "cuda-bindings")


def fail(message):
    print("vllm-overlay: " + message, file=sys.stderr, flush=True)
    sys.exit(1)


def sha256_of(path):
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def digest_of(path, algorithm):
    """The file's digest, read in pieces (vLLM's largest extensions are hundreds of MB)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h


def site_root():
    """The directory the installed vllm package lives in (its site-packages)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        fail("vllm is not installed in this image")
    return os.path.dirname(os.path.dirname(spec.origin))


def normalize(name):
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_dists():
    """Every installed distribution by normalized name; the first on sys.path wins, as for imports."""
    dists = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and normalize(name) not in dists:
            dists[normalize(name)] = dist
    return dists


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


def elf_needed(path):
    """The DT_NEEDED names of an ELF file, read from its dynamic segment as the loader reads
    it (the headers and a few strings, not the file); None for a file that is not ELF."""
    with open(path, "rb") as f:

        def read(offset, size):
            f.seek(offset)
            data = f.read(size)
            if len(data) != size:
                raise ValueError("truncated at byte " + str(offset))
            return data

        ident = f.read(16)
        if len(ident) < 16 or ident[:4] != b"\x7fELF":
            return None
        if ident[4] not in (1, 2) or ident[5] not in (1, 2):
            raise ValueError("unknown ELF class or byte order")
        wide, order = ident[4] == 2, "<" if ident[5] == 1 else ">"
        header = struct.unpack(order + ("HHIQQQIHHHHHH" if wide else "HHIIIIIHHHHHH"), read(16, 48 if wide else 36))
        phoff, phentsize, phnum = header[4], header[8], header[9]
        # program headers: type, offset, vaddr, filesz (the fields' places differ by class)
        phdr, fields = (order + "IIQQQQQQ", (0, 2, 3, 5)) if wide else (order + "IIIIIIII", (0, 1, 2, 4))
        segments = []
        for i in range(phnum):
            entry = struct.unpack(phdr, read(phoff + i * phentsize, struct.calcsize(phdr)))
            segments.append(tuple(entry[k] for k in fields))
        dynamic = [s for s in segments if s[0] == 2]  # PT_DYNAMIC
        if not dynamic:
            return []  # statically linked: needs nothing
        _, dyn_offset, _, dyn_size = dynamic[0]
        dyn = order + ("qQ" if wide else "iI")
        step = struct.calcsize(dyn)
        needed_offsets, strtab = [], None
        for i in range(dyn_size // step):
            tag, value = struct.unpack(dyn, read(dyn_offset + i * step, step))
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED: an offset into the string table
                needed_offsets.append(value)
            elif tag == 5:  # DT_STRTAB: the string table's address, mapped to the file below
                strtab = value
        if not needed_offsets:
            return []
        loads = [s for s in segments if s[0] == 1 and s[2] <= (strtab or 0) < s[2] + s[3]]  # PT_LOAD
        if strtab is None or not loads:
            raise ValueError("its string table is in no loaded segment")
        base = loads[0][1] + strtab - loads[0][2]
        names = []
        for offset in needed_offsets:
            f.seek(base + offset)
            raw = f.read(4096)
            if b"\0" not in raw:
                raise ValueError("unterminated DT_NEEDED name")
            names.append(raw[: raw.index(b"\0")].decode("utf-8", "replace"))
        return names


SHARED_OBJECT = re.compile(r"\.so(\.[0-9]+)*$")


def cudart_needs(sites):
    """(site directory, path relative to it, libcudart major) for every shared object under
    the site directories that needs a libcudart.so.N; unreadable ELF files are listed apart."""
    needs, unreadable, seen = [], [], set()
    for site in sites:
        for dirpath, dirnames, files in os.walk(site):
            dirnames.sort()
            for name in sorted(files):
                path = os.path.join(dirpath, name)
                if not SHARED_OBJECT.search(name) or os.path.islink(path) or os.path.realpath(path) in seen:
                    continue
                seen.add(os.path.realpath(path))
                try:
                    needed = elf_needed(path)
                except (OSError, ValueError, struct.error) as exc:
                    unreadable.append(os.path.relpath(path, site) + " (" + str(exc) + ")")
                    continue
                for lib in needed or ():
                    m = re.fullmatch(r"libcudart\.so\.([0-9]+)(\.[0-9]+)*", lib)
                    if m:
                        needs.append((site, os.path.relpath(path, site), m.group(1)))
    return needs, unreadable


REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?\s*\(?([^;()]*)\)?\s*(?:;(.*))?$")
EXTRA_MARKER = re.compile(r"""\(?\s*extra\s*==\s*['"]([^'"]+)['"]\s*\)?""")


def requirements_of(dist):
    """A distribution's Requires-Dist as dicts: name, extras, specifier, the extra it belongs
    to (None: always), and whether its marker has other conditions (not evaluated here)."""
    found = []
    for text in dist.requires or ():
        m = REQUIREMENT.match(text)
        if not m:
            continue
        name, extras, spec, marker = m.groups()
        extra = EXTRA_MARKER.search(marker or "")
        rest = re.sub(r"\b(and|or)\b", "", EXTRA_MARKER.sub("", marker or "")).strip()
        found.append({
            "name": normalize(name),
            "extras": {normalize(x) for x in (extras or "").split(",") if x.strip()},
            "spec": spec.strip(),
            "extra": normalize(extra.group(1)) if extra else None,
            "conditional": bool(rest),
        })
    return found


def release(version):
    m = re.match(r"\s*v?([0-9]+(?:\.[0-9]+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def satisfies(version, specifier):
    """Whether a version meets a specifier, by release numbers (enough to tell CUDA majors
    apart); a clause this does not read counts as met, so a doubtful extra counts as installed."""
    have = release(version)
    for clause in (c.strip() for c in specifier.split(",")):
        m = re.fullmatch(r"(~=|==|!=|<=|>=|<|>)\s*(\S+)", clause)
        if not m:
            continue
        op, text = m.groups()
        if text.endswith(".*"):
            prefix = release(text[:-2])
            if (have[: len(prefix)] == prefix) != (op == "=="):
                return False
            continue
        want = release(text)
        width = max(len(have), len(want))
        a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        ok = {"==": a == b, "!=": a != b, "<=": a <= b, ">=": a >= b, "<": a < b, ">": a > b,
              "~=": a >= b and have[: len(want) - 1] == want[: len(want) - 1]}[op]
        if not ok:
            return False
    return True


def extra_installed(dists, name, extra, seen=frozenset()):
    """Installed metadata does not record the extras asked for, so an extra counts as installed
    when its requirements are all met and at least one of them is more than the distribution
    requires anyway (flashinfer-python[cu12] asks only for what flashinfer-python always needs)."""
    if (name, extra) in seen:
        return True
    reqs = requirements_of(dists[name])
    base = [r for r in reqs if r["extra"] is None]
    own = [r for r in reqs if r["extra"] == extra and not r["conditional"]]
    beyond = [r for r in own if not any(b["name"] == r["name"] and r["extras"] <= b["extras"] for b in base)]
    seen = seen | {(name, extra)}
    return bool(beyond) and all(requirement_met(dists, r, seen) for r in own)


def requirement_met(dists, req, seen):
    dist = dists.get(req["name"])
    return (dist is not None and satisfies(dist.version, req["spec"])
            and all(extra_installed(dists, req["name"], e, seen) for e in req["extras"]))


def named_majors(dists):
    """(label, CUDA major) for every installed distribution whose name, version, or an
    installed extra names a CUDA major."""
    found = []
    for name in sorted(dists):
        dist = dists[name]
        version = dist.version
        label = name + " " + version
        m = re.search(r"-cu([0-9]+)$", name)
        if m:
            found.append((label, m.group(1)))
        elif name in CUDA_VERSIONED:
            found.append((label, version.split(".")[0]))
        m = re.search(r"\+(?:.*\.)?cu([0-9]+)(?:\.|$)", version)  # a local label like +cu128: CUDA 12.8
        if m and len(m.group(1)) > 1:
            found.append((label, m.group(1)[:-1]))
        extras = sorted({r["extra"] for r in requirements_of(dist) if r["extra"] and re.fullmatch(r"cu[0-9]+", r["extra"])})
        for extra in extras:
            if extra_installed(dists, name, extra):
                found.append((name + "[" + extra + "] " + version, extra[2:]))
    return found


def record_differences(dist):
    """The files of an installed distribution that differ from its RECORD (wheel spec:
    urlsafe base64 digests without padding); entries without a hash (RECORD, .pyc) are skipped,
    and so are those outside site-packages (../../../bin/vllm: a console script, which an image
    whose base copied site-packages alone does not have; the overlay never touches them)."""
    text = dist.read_text("RECORD")
    if text is None:
        return ["its RECORD is missing"]
    differ = []
    for row in csv.reader(text.splitlines()):
        if len(row) < 2 or not row[1] or row[0].startswith("../"):
            continue
        algorithm, _, want = row[1].partition("=")
        path = str(dist.locate_file(row[0]))
        if not os.path.isfile(path):
            differ.append(row[0] + " (absent)")
            continue
        try:
            have = base64.urlsafe_b64encode(digest_of(path, algorithm).digest()).rstrip(b"=").decode()
        except ValueError:
            differ.append(row[0] + " (unknown hash " + algorithm + ")")
            continue
        if have != want:
            differ.append(row[0] + " (" + algorithm + " " + have + ", RECORD " + want + ")")
    return differ


def installed_wheels():
    """What `install` recorded, or None after an install that did not go through it."""
    if not os.path.isfile(INSTALLED):
        return None
    with open(INSTALLED, encoding="utf-8") as f:
        return json.load(f)


def nvcc_version():
    try:
        out = subprocess.run(["nvcc", "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    except OSError:
        return None
    line = [ln for ln in out.stdout.decode(errors="replace").splitlines() if "release" in ln]
    return line[-1].strip() if line else None


def run_pip(args):
    """Run pip with its output streamed to stdout (stderr stays for this script's one line);
    return its exit code and its output lines."""
    proc = subprocess.Popen([sys.executable, "-m", "pip"] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    for raw in proc.stdout:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        lines.append(line)
        print(line, flush=True)
    return proc.wait(), lines


def hash_mismatches(lines):
    """pip's "THESE PACKAGES DO NOT MATCH THE HASHES" block (pip 23 and 24 word it alike):
    one (requirement, expected sha256 list, actual) per package named under it."""
    found, inside = [], False
    for line in lines:
        text = line.strip()
        if "THESE PACKAGES DO NOT MATCH THE HASHES" in line:
            inside = True
        elif not inside or not text:
            continue
        elif not line.startswith(" "):
            inside = False  # the next heading or message
        elif text.startswith("Expected"):
            found[-1][1].append(text.split()[-1])
        elif text.startswith("Got") and found:
            found[-1][2] = text.split()[-1]
        elif text.endswith(":"):
            found.append([text[:-1], [], None])
    return found


def describe_mismatch(requirement, expected, got):
    """pip names "NAME==V from URL (from -r LOCK (line N))"; the file is the URL's last part."""
    url = re.search(r"[a-z+]+://\S+", requirement)
    line = re.search(r"\(line ([0-9]+)\)", requirement)
    spec = re.sub(r"\s*@\s*\S+$", "", requirement.split(" from ")[0])  # "name @ URL": the URL is named below
    what = url.group(0).split("#")[0].rstrip("/").rsplit("/", 1)[-1] if url else spec
    where = spec + (", lock line " + line.group(1) if line else "")
    shown = " or ".join(expected[:3]) + (" (or " + str(len(expected) - 3) + " more)" if len(expected) > 3 else "")
    return what + " (" + where + "): expected sha256 " + shown + ", got " + str(got)


def last_error(lines):
    errors = [ln for ln in lines if ln.startswith("ERROR: ")]
    if errors:
        return errors[-1][len("ERROR: "):].strip()
    rest = [ln.strip() for ln in lines if ln.strip()]
    return rest[-1] if rest else "no output"


def wheel_name_version(filename):
    """(normalized name, version) from a wheel's or an sdist's file name."""
    if filename.endswith(".whl"):
        name, version = filename.split("-")[:2]
    else:
        stem = re.sub(r"\.(tar\.gz|tar\.bz2|zip)$", "", filename)
        name, _, version = stem.rpartition("-")
    return normalize(name), version


def cmd_install(lock, pip_options):
    if not os.path.isfile(lock):
        fail(lock + ": no such lock file")
    tmp = tempfile.mkdtemp(prefix="vllm-overlay-wheels-")
    try:
        code, lines = run_pip(["download", "--require-hashes", "--no-deps", "--dest", tmp, "-r", lock] + pip_options)
        if code != 0:
            mismatches = hash_mismatches(lines)
            if mismatches:
                fail(lock + ": hash mismatch: " + "; ".join(describe_mismatch(*m) for m in mismatches))
            fail(lock + ": pip download failed: " + last_error(lines))
        files = sorted(os.listdir(tmp))
        if not files:
            fail(lock + ": pip downloaded nothing")
        record = {}
        for name in files:
            dist, version = wheel_name_version(name)
            record[dist] = {"version": version, "file": name, "sha256": sha256_of(os.path.join(tmp, name))}
        # The downloaded files as they are: no index, no dependency resolution.
        code, lines = run_pip(["install", "--no-index", "--no-deps"] + [os.path.join(tmp, n) for n in files])
        if code != 0:
            fail(lock + ": pip install failed: " + last_error(lines))
        os.makedirs(os.path.dirname(INSTALLED), exist_ok=True)
        with open(INSTALLED, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.write("\n")
        print("vllm-overlay: installed " + str(len(files)) + " files from " + lock + ", recorded in " + INSTALLED)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pins_arguments(argv):
    parser = argparse.ArgumentParser(prog="image_checks.py pins")
    parser.add_argument("--vllm", required=True, help="the pinned vLLM version")
    parser.add_argument("--flashinfer", required=True, help="the pinned FlashInfer version")
    parser.add_argument("--cuda", required=True, help="the image's CUDA version (its major must agree)")
    parser.add_argument("--accept", default="", help="the recipe's reason to accept a CUDA mismatch")
    parser.add_argument("--sha256", action="append", default=[], metavar="DIST=HEX", help="an installed wheel's sha256")
    args = parser.parse_args(argv)
    expected = {}
    for item in args.sha256:
        dist, _, hexdigest = item.partition("=")
        if not re.fullmatch(r"[0-9a-f]{64}", hexdigest):
            parser.error("--sha256 " + item + ": expected DIST=<64 hex digits>")
        expected[normalize(dist)] = hexdigest
    args.sha256 = expected
    return args


def cmd_pins(argv):
    args = pins_arguments(argv)
    dists = installed_dists()
    for dist, want in (("vllm", args.vllm), ("flashinfer-python", args.flashinfer)):
        have = version_of(dist)
        if have is None:
            fail(dist + " is not installed; the recipe pins " + want)
        if have.split("+")[0] != want:
            fail(dist + " " + have + " is installed; the recipe pins " + want)
        print("vllm-overlay: " + dist + " " + have + " matches the pin")
    check_wheels(args.sha256)
    for name in CHECKED:
        differ = record_differences(dists[name])
        if differ:
            fail(name + " " + dists[name].version + ": " + str(len(differ)) + " installed files differ from its RECORD: "
                 + ", ".join(differ[:5]) + (" and " + str(len(differ) - 5) + " more" if len(differ) > 5 else ""))
        print("vllm-overlay: " + name + ": every file in its RECORD has its recorded hash")
    check_cuda(args.cuda, args.accept, dists)


def check_wheels(expected):
    """The installed vLLM and FlashInfer wheels are the expected ones (by `install`'s record)."""
    record = installed_wheels()
    if record is None:
        print("vllm-overlay: no " + INSTALLED + " (not installed from a lock): wheel sha256 not checked")
        return
    for dist, want in sorted(expected.items()):
        entry = record.get(dist)
        if entry is None:
            fail(INSTALLED + ": no wheel of " + dist + " was installed; expected sha256 " + want)
        if entry["sha256"] != want:
            fail(dist + ": the installed " + entry["file"] + " has sha256 " + entry["sha256"] + ", expected " + want)
        print("vllm-overlay: " + dist + ": installed " + entry["file"] + " sha256 " + want)


def check_cuda(cuda, accepted, dists):
    """Every installed package that names a CUDA major agrees with the image's."""
    image_major = cuda.split(".")[0]
    sites = sorted({os.path.realpath(str(d.locate_file(""))) for d in dists.values()})
    problems = [label + " is CUDA " + major for label, major in named_majors(dists) if major != image_major]
    tc = torch_cuda()
    if tc is None:
        torch = version_of("torch")
        problems.append("torch " + torch + " has no CUDA build" if torch else "torch is not installed")
    elif tc.split(".")[0] != image_major:
        problems.append("torch " + (version_of("torch") or "?") + " is built for CUDA " + tc)
    needs, unreadable = cudart_needs(sites)
    vllm_dir = os.path.join(os.path.realpath(site_root()), "vllm", "")
    if not any(os.path.join(site, path).startswith(vllm_dir) for site, path, _ in needs):
        problems.append("no vLLM extension needs a libcudart (a CPU build?)")
    problems += [path + " needs libcudart.so." + major for _, path, major in needs if major != image_major]
    problems += [path + ": unreadable ELF" for path in unreadable]
    if problems:
        message = "CUDA mismatch: the image is CUDA " + cuda + " (major " + image_major + "), but " + "; ".join(problems)
        if not accepted:
            fail(message)
        print("vllm-overlay: " + message + " (accepted by the recipe: " + accepted + ")")
    else:
        print("vllm-overlay: CUDA " + cuda + ": torch " + tc + ", " + str(len(needs)) + " extensions' libcudart and every"
              " package that names a CUDA major agree")


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



def cmd_report():
    record = installed_wheels() or {}
    installed = "; ".join(d + "==" + record[d]["version"] + " sha256:" + record[d]["sha256"] for d in CHECKED if d in record)
    print(json.dumps({"torch_cuda": torch_cuda() or "none", "nvcc": nvcc_version() or "none", "installed": installed or "unknown"}))


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "install":
        if not args:
            fail("install needs LOCK [PIP_OPTION ...]")
        cmd_install(args[0], args[1:])
    elif command == "pins":
        cmd_pins(args)
    else:
        {"stage": cmd_stage, "finish": cmd_finish, "report": cmd_report}[command](*args)
