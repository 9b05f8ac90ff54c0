"""The OCI image layouts the real nodes import: content-addressed, the reference where containerd's
import looks for it, the files (and links) in one layer."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

from vramshare_e2e.oci import File, Image, write_layout


def test_a_layout_is_content_addressed_and_names_its_reference(tmp_path: Path) -> None:
    image = Image(
        reference="vramshare.local/task:1",
        files={"/bin/busybox": File(data=b"\x7fELF..."), "/bin/sh": File(link="busybox")},
        cmd=("/bin/sh",),
        env={"NVIDIA_VISIBLE_DEVICES": "all"},
    )
    path = write_layout(image, tmp_path / "task.tar")
    with tarfile.open(path) as tar:
        blobs = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    for name, data in blobs.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    assert json.loads(blobs["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    (entry,) = json.loads(blobs["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "vramshare.local/task:1"
    manifest = json.loads(blobs[f"blobs/sha256/{entry['digest'].split(':')[1]}"])
    config = json.loads(blobs[f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"])
    assert config["config"] == {"Cmd": ["/bin/sh"], "Env": ["NVIDIA_VISIBLE_DEVICES=all"]}
    (layer,) = manifest["layers"]
    data = blobs[f"blobs/sha256/{layer['digest'].split(':')[1]}"]
    assert config["rootfs"]["diff_ids"] == [layer["digest"]]  # uncompressed: the diff ID is the digest
    with tarfile.open(fileobj=io.BytesIO(data)) as files:
        members = {m.name: m for m in files.getmembers()}
    assert members["bin"].isdir()
    assert members["bin/busybox"].mode == 0o755
    assert members["bin/sh"].issym()
    assert members["bin/sh"].linkname == "busybox"
    assert not list(tmp_path.glob(".task.tar.*"))  # written beside, then renamed
