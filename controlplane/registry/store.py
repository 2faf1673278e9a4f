"""The content-addressed artifact store: a folder of files named by their SHA-256.

Layout: ARTIFACT_ROOT/sha256/<first two hex>/<hex>. Uploads stream into a temporary file
in ARTIFACT_ROOT/tmp (same file system) and are renamed into place only once their digest,
size and format check out, so a half-written or refused upload never appears in the store.

Only GGUF and safetensors are accepted, recognised by their headers. Pickle-based formats
(PyTorch .bin/.pt, .pkl; zip or pickle magic) are refused: loading them can run code.

A folder (an HF model: safetensors weights, config and tokenizer files) arrives as an
uncompressed tar or, server-side, as a folder; each of its files is stored by its own
digest, and its manifest (contracts/manifest.py) by the manifest's digest, which names the
folder artifact. Nothing is ever extracted by the name an archive gives.
"""

import hashlib
import json
import os
import re
import struct
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, cast

from django.conf import settings
from rest_framework import status

from contracts.manifest import (
    MAX_FILES,
    ManifestError,
    ManifestFile,
    manifest_build,
    manifest_bytes,
    manifest_digest,
    path_check,
)
from controlplane.core.errors import DomainError
from controlplane.registry.models import ArtifactFormat

DIGEST_PATTERN = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})$")
GGUF_MAGIC = b"GGUF"
ZIP_MAGIC = b"PK\x03\x04"
PICKLE_PROTOCOLS = range(2, 6)  # b"\x80" then the protocol byte
SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit
SNIFF_BYTES = 9  # enough to tell every accepted and refused format apart
CHUNK_READ_BYTES = 1024 * 1024
EXTENDED_HEADER_TYPES = frozenset(
    {tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE}
    | {tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK}
)
MAX_EXTENDED_HEADER_BYTES = 64 * 1024


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


def too_large_error(what: str, max_bytes: int) -> ArtifactRefused:
    """413: `what` (an artifact, a folder, an archive) is larger than `max_bytes`."""
    return ArtifactRefused(
        "artifact_too_large",
        f"{what} is larger than the limit of {max_bytes} bytes.",
        status_code=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
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


def _write_temp(*, chunks: Iterable[bytes], max_bytes: int) -> tuple[Path, str, int, str | None]:
    """Stream chunks into a temporary file in the store, hashing as they come; nothing is
    kept in memory. (path, hex digest, size, format or None when it is neither GGUF nor
    safetensors); refuses pickle and zip at their first bytes, and more than max_bytes.
    The caller renames the file into place (`_commit`) or removes it."""
    temp_dir = Path(settings.ARTIFACT_ROOT) / "tmp"
    temp_dir.mkdir(parents=True, exist_ok=True)
    sha256 = hashlib.sha256()
    size = 0
    head = b""
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 - renamed or removed by the caller
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
                    raise too_large_error("The artifact", max_bytes)
                if len(head) < SNIFF_BYTES:
                    head += chunk[: SNIFF_BYTES - len(head)]
                    if len(head) >= SNIFF_BYTES:
                        sniff_refuse_early(head)
                sha256.update(chunk)
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
            try:
                artifact_format: str | None = detect_format(handle, size)
            except ArtifactRefused as refused:
                if refused.code != "unknown_format":
                    raise
                artifact_format = None
    except BaseException:
        temp_path.unlink(missing_ok=True)
        raise
    return temp_path, sha256.hexdigest(), size, artifact_format


def _commit(temp_path: Path, digest: str) -> None:
    final = artifact_path(digest)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(temp_path, 0o444)
    os.replace(temp_path, final)  # atomic on one file system


def store_stream(
    *,
    chunks: Iterable[bytes],
    declared_digest: str,
    max_bytes: int,
) -> StoredFile:
    """Stream one file's chunks into the store.

    Refuses (and leaves nothing behind) on: more than max_bytes, a digest other than the
    declared one, a pickle/zip or unknown format. Storing an existing digest again is a no-op.
    """
    expected = digest_parse(declared_digest)
    temp_path, actual, size, artifact_format = _write_temp(chunks=chunks, max_bytes=max_bytes)
    try:
        if actual != expected:
            raise ArtifactRefused(
                "digest_mismatch",
                f"The content's SHA-256 is {actual}, not the declared {expected}.",
                fields={"digest": [f"sha256:{expected}"]},
            )
        if artifact_format is None:
            raise _unknown_format()
        _commit(temp_path, actual)
    finally:
        temp_path.unlink(missing_ok=True)
    return StoredFile(digest=actual, format=artifact_format, size_bytes=size)


# Folders.


@dataclass(frozen=True, slots=True)
class FolderMember:
    """One file of an uploaded folder: its path as given, and its bytes."""

    path: str
    chunks: Iterable[bytes]


@dataclass(frozen=True, slots=True)
class StoredFolder:
    digest: str  # of the manifest
    files: tuple[ManifestFile, ...]

    @property
    def size_bytes(self) -> int:
        return sum(file.size for file in self.files)


def _manifest_refused(error: ManifestError) -> ArtifactRefused:
    return ArtifactRefused(error.reason, str(error))


def folder_problem(files: tuple[ManifestFile, ...]) -> ArtifactRefused | None:
    """An HF model folder has its config.json and safetensors weights at the top."""
    paths = {file.path for file in files}
    if "config.json" not in paths or not any(
        "/" not in path and path.endswith(".safetensors") for path in paths
    ):
        return ArtifactRefused(
            "incomplete_folder",
            "A model folder holds config.json and its *.safetensors weights at its top.",
        )
    return None


def store_folder(*, members: Iterable[FolderMember], max_bytes: int) -> StoredFolder:
    """Store every file of a folder by its own digest, then its manifest as the folder.

    Each file is checked as it streams (its path, its type: weights must be safetensors,
    nothing may be a pickle or zip), the folder as a whole (no duplicates, at most
    MAX_FILES files and max_bytes in all, config.json and weights present). Nothing enters
    the store unless all of it is accepted. Storing the same folder again is a no-op.
    """
    staged: list[tuple[Path, str]] = []
    files: list[ManifestFile] = []
    total = 0
    try:
        for member in members:
            try:
                path = path_check(member.path)
            except ManifestError as error:
                raise _manifest_refused(error) from error
            if len(files) >= MAX_FILES:
                raise ArtifactRefused(
                    "too_many_files", f"A folder holds at most {MAX_FILES} files."
                )
            try:
                temp_path, digest, size, file_format = _write_temp(
                    chunks=member.chunks, max_bytes=max_bytes - total
                )
            except ArtifactRefused as refused:
                if refused.code == "artifact_too_large":
                    raise too_large_error("The folder", max_bytes) from refused
                raise
            staged.append((temp_path, digest))
            total += size
            if path.endswith(".safetensors") and file_format != ArtifactFormat.SAFETENSORS:
                raise ArtifactRefused(
                    "unknown_format",
                    f"{path!r} is named .safetensors but is not a safetensors file.",
                    status_code=status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                )
            files.append(ManifestFile(path=path, size=size, sha256=digest))
        try:
            built = manifest_build(files)
        except ManifestError as error:
            raise _manifest_refused(error) from error
        problem = folder_problem(built)
        if problem is not None:
            raise problem
        manifest = manifest_bytes(built)
        temp_path, digest, _, _ = _write_temp(chunks=[manifest], max_bytes=len(manifest))
        staged.append((temp_path, digest))
        for temp_path, file_digest in staged:
            _commit(temp_path, file_digest)
    finally:
        for temp_path, _ in staged:
            temp_path.unlink(missing_ok=True)
    return StoredFolder(digest=digest, files=built)


def folder_members(folder: Path) -> Iterator[FolderMember]:
    """The files under a server-side folder (admin command, demo seed); links refused."""
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() or not (path.is_dir() or path.is_file()):
            raise ArtifactRefused("unsafe_member", f"{path} is a link or a special file.")
        if path.is_file():
            relative = path.relative_to(folder).as_posix()
            yield FolderMember(path=relative, chunks=read_chunks(path.open("rb")))


def folder_manifest_digest(folder: Path) -> str:
    """The digest a server-side folder would be stored under (its files hashed in place)."""
    files = [
        ManifestFile(
            path=path.relative_to(folder).as_posix(),
            size=path.stat().st_size,
            sha256=file_digest(path),
        )
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.is_symlink()
    ]
    try:
        return manifest_digest(manifest_build(files))
    except ManifestError as error:
        raise _manifest_refused(error) from error


class _BoundedTarInfo(tarfile.TarInfo):
    """Refuses extended headers (pax, GNU long names) larger than a path could need:
    tarfile reads them into memory whole."""

    def _proc_member(self, archive: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in EXTENDED_HEADER_TYPES and self.size > MAX_EXTENDED_HEADER_BYTES:
            raise ArtifactRefused(
                "invalid_archive", "The archive has an extended header larger than 64 KiB."
            )
        return super()._proc_member(archive)  # type: ignore[misc]


class _CountingReader:
    """A read-only stream that refuses to give more than `limit` bytes."""

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        self.stream, self.limit, self.count = stream, limit, 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size if size >= 0 else CHUNK_READ_BYTES)
        self.count += len(data)
        if self.count > self.limit:
            raise too_large_error("The archive", self.limit)
        return data


def archive_limit(max_bytes: int) -> int:
    """The largest tar of a folder of at most max_bytes: its files, a header and padding
    for each, the end blocks."""
    return max_bytes + MAX_FILES * 3 * tarfile.BLOCKSIZE + tarfile.RECORDSIZE


def _file_chunks(file: IO[bytes]) -> Iterator[bytes]:
    while chunk := file.read(CHUNK_READ_BYTES):
        yield chunk


def tar_members(stream: IO[bytes], *, max_bytes: int) -> Iterator[FolderMember]:
    """The regular files of an uncompressed tar read as a stream (nothing is extracted by
    name: each file's bytes go to the store by their digest). Folders are skipped; links,
    devices, FIFOs and sparse files are refused."""
    reader = _CountingReader(stream, archive_limit(max_bytes))
    try:
        archive = tarfile.open(  # noqa: SIM115 - read member by member below
            fileobj=cast(IO[bytes], reader), mode="r|", tarinfo=_BoundedTarInfo
        )
        for member in archive:
            if member.isdir():
                continue
            if not member.isreg() or member.issparse():
                raise ArtifactRefused(
                    "unsafe_member",
                    f"{member.name!r} is a link, a device or a sparse file; "
                    "a folder artifact holds regular files only.",
                )
            extracted = archive.extractfile(member)
            assert extracted is not None  # a regular file
            yield FolderMember(path=member.name, chunks=_file_chunks(extracted))
    except (tarfile.TarError, EOFError, UnicodeDecodeError) as error:
        raise ArtifactRefused(
            "invalid_archive", f"The body is not an uncompressed tar archive: {error}"
        ) from error


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
