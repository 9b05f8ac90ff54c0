"""Small OCI images written without a registry, a daemon or buildah: one layer from files given here,
as an OCI image layout tarball that `ctr images import` loads into a node's containerd.

Used for the node's sandbox (pause) image and the GPU task image of the real-node tests; both hold one
static binary, so they need no base image.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class File:
    data: bytes = b""
    mode: int = 0o755
    link: str = ""
    """A symbolic link to this target instead of a regular file."""


@dataclass(frozen=True, kw_only=True)
class Image:
    reference: str
    """e.g. "registry.k8s.io/pause:3.10" or "vramshare.local/task:1"."""
    files: Mapping[str, File]
    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    user: str = ""


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def _layer(files: Mapping[str, File]) -> bytes:
    """An uncompressed layer tar, deterministic (fixed times and owners), with parent directories."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({str(Path(p).parent) for p in files} - {"/", "."})
        seen: set[str] = set()
        for d in dirs:
            parts = Path(d.lstrip("/")).parts
            for i in range(1, len(parts) + 1):
                sub = "/".join(parts[:i])
                if sub not in seen:
                    seen.add(sub)
                    info = tarfile.TarInfo(sub)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
        for path, f in sorted(files.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            if f.link:
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, f.link, 0o777
                tar.addfile(info)
            else:
                info.size, info.mode = len(f.data), f.mode
                tar.addfile(info, io.BytesIO(f.data))
    return out.getvalue()


def write_layout(image: Image, target: Path) -> Path:
    """Write `image` as an OCI image layout tarball at `target` (annotated with its reference); the
    file appears whole (written beside it, then renamed), as parallel test workers may both write it."""
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    layer = _layer(image.files)
    settings: dict[str, object] = {
        "Entrypoint": list(image.entrypoint),
        "Cmd": list(image.cmd),
        "Env": [f"{k}={v}" for k, v in image.env.items()],
        "User": image.user,
    }
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {k: v for k, v in settings.items() if v},  # an empty value is left out
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
    }
    with tarfile.open(partial, mode="w") as tar:
        layer_digest = _blob(tar, layer)
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_digest = _blob(tar, config_bytes)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": config_digest,
                    "size": len(config_bytes),
                },
                "layers": [
                    {
                        "mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": layer_digest,
                        "size": len(layer),
                    }
                ],
            },
            sort_keys=True,
        ).encode()
        manifest_digest = _blob(tar, manifest)
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "org.opencontainers.image.ref.name": image.reference,
                        "io.containerd.image.name": image.reference,
                    },
                }
            ],
        }
        for name, data in (
            ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
            ("index.json", json.dumps(index, sort_keys=True).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    partial.replace(target)
    return target
