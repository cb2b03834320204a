"""The base tree read in place from a wheel: entries, the RECORD hashes a manifest's before hashes come from."""

from __future__ import annotations

import base64
import hashlib
import random
import zipfile

from builder.apply import apply_members
from builder.members import load_member
from builder.tree import WheelTree
from tools.synthetic import git_diff, member_text


def test_record_hashes_are_the_entries_own(vllm_wheel, wheel_zip):
    tree = WheelTree(vllm_wheel)
    files = [i.filename for i in wheel_zip.infolist() if not i.is_dir() and i.file_size < 2_000_000]
    sample = random.Random(7).sample(files, 300)
    for name in sample:
        if name.endswith(".dist-info/RECORD"):
            continue
        assert tree.recorded_sha256(name) == hashlib.sha256(wheel_zip.read(name)).hexdigest(), name
    assert tree.recorded_sha256("vllm-0.30.0.dist-info/RECORD") is None  # RECORD does not hash itself
    assert tree.recorded_sha256("vllm/no_such_file.py") is None


def test_without_a_record_the_before_hash_is_computed(tmp_path):
    wheel = tmp_path / "tiny-1.0-py3-none-any.whl"
    body = b"x = 1\ny = 2\n"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("tiny/mod.py", body)
    member_file = tmp_path / "edit.patch"
    member_file.write_text(member_text(git_diff({"tiny/mod.py": body}, {"tiny/mod.py": b"x = 1\ny = 3\n"})))
    tree = WheelTree(wheel)
    assert tree.recorded_sha256("tiny/mod.py") is None
    (change,) = apply_members(tree, [load_member(member_file)]).changes
    assert change.before_sha256 == hashlib.sha256(body).hexdigest()
    assert change.after == b"x = 1\ny = 3\n"


def test_a_record_hash_is_used_as_the_before_hash(tmp_path):
    """A RECORD entry is what the manifest reports: shown with a RECORD that disagrees (which
    pip would refuse at install, and the image's pin check too)."""
    wheel = tmp_path / "tiny-1.0-py3-none-any.whl"
    body = b"x = 1\ny = 2\n"
    recorded = hashlib.sha256(b"what RECORD claims").digest()
    entry = base64.urlsafe_b64encode(recorded).rstrip(b"=").decode()
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("tiny/mod.py", body)
        z.writestr(
            "tiny-1.0.dist-info/RECORD", f"tiny/mod.py,sha256={entry},{len(body)}\ntiny-1.0.dist-info/RECORD,,\n"
        )
    member_file = tmp_path / "edit.patch"
    member_file.write_text(member_text(git_diff({"tiny/mod.py": body}, {"tiny/mod.py": b"x = 1\ny = 3\n"})))
    (change,) = apply_members(WheelTree(wheel), [load_member(member_file)]).changes
    assert change.before_sha256 == recorded.hex()


def test_entries_with_a_long_extra_field_or_stored_are_read_whole(tmp_path):
    """An entry is read with its local header in one go, guessing the extra field short;
    a longer one is read again, and a stored (uncompressed) entry comes back as bytes."""
    wheel = tmp_path / "odd-1.0-py3-none-any.whl"
    body = b"".join(b"line %d\n" % i for i in range(2000))
    long_extra = zipfile.ZipInfo("odd/long_extra.py")
    long_extra.compress_type = zipfile.ZIP_DEFLATED
    long_extra.extra = b"\xfe\xca" + (300).to_bytes(2, "little") + b"x" * 300  # an unknown 300-byte field
    stored = zipfile.ZipInfo("odd/stored.py")
    stored.compress_type = zipfile.ZIP_STORED
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(long_extra, body)
        z.writestr(stored, body[:500])
    tree = WheelTree(wheel)
    assert tree.read("odd/long_extra.py") == body
    data = tree.read("odd/stored.py")
    assert type(data) is bytes and data == body[:500]
