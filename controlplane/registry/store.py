"""The content-addressed artifact store: a folder of files named by their SHA-256.

Layout: ARTIFACT_ROOT/sha256/<first two hex>/<hex>. Uploads stream into a temporary file
in ARTIFACT_ROOT/tmp (same file system) and are renamed into place only once their digest,
size and format check out, so a half-written or refused upload never appears in the store.

Only GGUF and safetensors are accepted, recognised by their headers. Pickle-based formats
(PyTorch .bin/.pt, .pkl; zip or pickle magic) are refused: loading them can run code.
"""

import hashlib
import json
import os
import re
import struct
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from django.conf import settings
from rest_framework import status

from controlplane.core.errors import DomainError
from controlplane.registry.models import ArtifactFormat

DIGEST_PATTERN = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})$")
GGUF_MAGIC = b"GGUF"
ZIP_MAGIC = b"PK\x03\x04"
PICKLE_PROTOCOLS = range(2, 6)  # b"\x80" then the protocol byte
SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit
SNIFF_BYTES = 9  # enough to tell every accepted and refused format apart


class ArtifactRefused(DomainError):
    pass


def digest_parse(value: str) -> str:
    """'sha256:<hex>' or '<hex>' to lowercase hex; DomainError otherwise."""
    match = DIGEST_PATTERN.match(value.strip()) if value else None
    if match is None:
        raise ArtifactRefused(
            "invalid_digest",
            "A digest is 'sha256:' followed by 64 hex digits.",
            fields={"digest": [value]},
        )
    return match.group(1).lower()


def artifact_path(digest: str) -> Path:
    return Path(settings.ARTIFACT_ROOT) / "sha256" / digest[:2] / digest


def _unsafe_format(kind: str) -> ArtifactRefused:
    return ArtifactRefused(
        "unsafe_format",
        f"This is a {kind} file: pickle-based formats (.bin, .pt, .pkl) can run arbitrary code "
        "when loaded, so the registry refuses them. Convert the weights to safetensors or GGUF.",
        status_code=status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
    )


def _unknown_format() -> ArtifactRefused:
    return ArtifactRefused(
        "unknown_format",
        "The file is neither GGUF nor safetensors (checked by its header, not its name).",
        status_code=status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
    )


def _could_be_safetensors(head: bytes) -> bool:
    return len(head) >= SNIFF_BYTES and head[8:9] == b"{"


def sniff_refuse_early(head: bytes) -> None:
    """Refuse pickle and zip as soon as the first bytes show them, before the rest arrives."""
    if _could_be_safetensors(head) or head.startswith(GGUF_MAGIC):
        return
    if head.startswith(ZIP_MAGIC):
        raise _unsafe_format("zip (PyTorch checkpoint)")
    if len(head) >= 2 and head[0] == 0x80 and head[1] in PICKLE_PROTOCOLS:
        raise _unsafe_format("pickle")


def detect_format(file: IO[bytes], size: int) -> str:
    """The format of a complete file, from its header; ArtifactRefused if not an accepted one."""
    file.seek(0)
    head = file.read(SNIFF_BYTES)
    if head.startswith(GGUF_MAGIC) and len(head) >= 8:
        (version,) = struct.unpack("<I", head[4:8])
        if version in (1, 2, 3):
            return ArtifactFormat.GGUF
    if _could_be_safetensors(head):
        (header_length,) = struct.unpack("<Q", head[:8])
        if header_length <= min(SAFETENSORS_MAX_HEADER, size - 8):
            file.seek(8)
            try:
                header = json.loads(file.read(header_length))
            except (ValueError, RecursionError):  # not JSON, or nested past the limit
                header = None
            if isinstance(header, dict):
                return ArtifactFormat.SAFETENSORS
    sniff_refuse_early(head)
    raise _unknown_format()


@dataclass(frozen=True, slots=True)
class StoredFile:
    digest: str
    format: str
    size_bytes: int


def store_stream(
    *,
    chunks: Iterable[bytes],
    declared_digest: str,
    max_bytes: int,
) -> StoredFile:
    """Stream chunks into the store, hashing as they come; nothing is kept in memory.

    Refuses (and leaves nothing behind) on: more than max_bytes, a digest other than the
    declared one, a pickle/zip or unknown format. Storing an existing digest again is a no-op.
    """
    expected = digest_parse(declared_digest)
    temp_dir = Path(settings.ARTIFACT_ROOT) / "tmp"
    temp_dir.mkdir(parents=True, exist_ok=True)
    sha256 = hashlib.sha256()
    size = 0
    head = b""
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 - renamed or removed below
        dir=temp_dir, prefix="upload-", suffix=".part", delete=False
    )
    temp_path = Path(handle.name)
    try:
        with handle:
            for chunk in chunks:
                if not chunk:
                    continue
                size += len(chunk)
                if size > max_bytes:
                    raise ArtifactRefused(
                        "artifact_too_large",
                        f"The artifact is larger than the limit of {max_bytes} bytes.",
                        status_code=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
                    )
                if len(head) < SNIFF_BYTES:
                    head += chunk[: SNIFF_BYTES - len(head)]
                    if len(head) >= SNIFF_BYTES:
                        sniff_refuse_early(head)
                sha256.update(chunk)
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
            actual = sha256.hexdigest()
            if actual != expected:
                raise ArtifactRefused(
                    "digest_mismatch",
                    f"The content's SHA-256 is {actual}, not the declared {expected}.",
                    fields={"digest": [f"sha256:{expected}"]},
                )
            artifact_format = detect_format(handle, size)
        final = artifact_path(actual)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(temp_path, 0o444)
        os.replace(temp_path, final)  # atomic on one file system
    finally:
        temp_path.unlink(missing_ok=True)
    return StoredFile(digest=actual, format=artifact_format, size_bytes=size)


def read_chunks(file: BinaryIO, *, start: int = 0, length: int | None = None) -> Iterator[bytes]:
    """Read `length` bytes (all when None) from `start`, a chunk at a time, closing the file."""
    chunk_size = settings.ARTIFACT_CHUNK_BYTES
    try:
        file.seek(start)
        remaining = length
        while remaining is None or remaining > 0:
            want = chunk_size if remaining is None else min(chunk_size, remaining)
            chunk = file.read(want)
            if not chunk:
                break
            if remaining is not None:
                remaining -= len(chunk)
            yield chunk
    finally:
        file.close()


def file_digest(path: Path) -> str:
    sha256 = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(settings.ARTIFACT_CHUNK_BYTES), b""):
            sha256.update(chunk)
    return sha256.hexdigest()
