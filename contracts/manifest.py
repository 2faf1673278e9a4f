"""A folder artifact's manifest: each file's relative path, size and SHA-256.

The manifest's canonical JSON (`{"files": [{"path", "sha256", "size"}, ...]}`, files sorted
by path, keys sorted, no whitespace, ASCII) is what the registry stores and serves as the
folder artifact itself: its SHA-256 is the artifact's digest, which a version's signature
covers, so the signature covers every file. The registry builds a manifest from an upload;
an agent checks every file of its copy against it before it starts an engine.

Paths are relative POSIX paths of a few safe characters: never absolute, never `..`, no
backslashes, no links, at most MAX_DEPTH folders deep; only the file types a model folder
needs (weights as safetensors, configuration and tokenizer files), never code or pickles.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

MAX_FILES = 256
MAX_PATH_LENGTH = 255
MAX_DEPTH = 4
PATH_PART = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
# What HF model folders hold besides code: weights, configuration, tokenizers, chat
# templates, model cards. Code (.py: "remote code") and pickles (.bin, .pt, .pkl) are refused.
ALLOWED_SUFFIXES = frozenset(
    {".safetensors", ".json", ".txt", ".model", ".md", ".jinja", ".tiktoken"}
)
ALLOWED_NAMES = frozenset({"LICENSE", "NOTICE", ".gitattributes"})
CHUNK_BYTES = 1024 * 1024


class ManifestError(ValueError):
    """A manifest or a folder is refused; `reason` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ManifestFile:
    path: str
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "size": self.size}


def path_check(raw: str) -> str:
    """The normalised relative path (a leading "./" dropped), or ManifestError."""
    path = raw[2:] if raw.startswith("./") else raw
    if not path or "\\" in path or "\0" in path:
        raise ManifestError("unsafe_path", f"{raw!r} is not a relative POSIX path")
    if path.startswith("/"):
        raise ManifestError("unsafe_path", f"{raw!r} is absolute")
    if len(path) > MAX_PATH_LENGTH:
        raise ManifestError("unsafe_path", f"{raw[:80]!r}... is longer than {MAX_PATH_LENGTH}")
    parts = path.split("/")
    if len(parts) > MAX_DEPTH + 1:
        raise ManifestError("unsafe_path", f"{raw!r} is more than {MAX_DEPTH} folders deep")
    for part in parts:
        if part in ("", ".", ".."):
            raise ManifestError("unsafe_path", f"{raw!r} has an empty, '.' or '..' part")
        if not PATH_PART.match(part):
            raise ManifestError(
                "unsafe_path", f"{raw!r}: a path part is letters, digits, '.', '_' or '-'"
            )
    name = parts[-1]
    if name not in ALLOWED_NAMES and PurePosixPath(name).suffix.lower() not in ALLOWED_SUFFIXES:
        raise ManifestError(
            "file_type_not_allowed",
            f"{path!r}: a model folder holds only {', '.join(sorted(ALLOWED_SUFFIXES))} files "
            f"(and {', '.join(sorted(ALLOWED_NAMES))}); code and pickles are refused",
        )
    return path


def manifest_build(files: Iterable[ManifestFile]) -> tuple[ManifestFile, ...]:
    """The files sorted by path, each path checked; duplicates, too many or none refused."""
    seen: dict[str, str] = {}
    checked = []
    for file in files:
        path = path_check(file.path)
        folded = path.casefold()  # one file system's two names are another's one
        if folded in seen:
            raise ManifestError("duplicate_path", f"{path!r} appears twice")
        if any(parent.casefold() in seen for parent in _parents(path)) or any(
            other.startswith(folded + "/") for other in seen
        ):
            raise ManifestError("duplicate_path", f"{path!r} is both a file and a folder")
        seen[folded] = path
        if len(seen) > MAX_FILES:
            raise ManifestError("too_many_files", f"a folder holds at most {MAX_FILES} files")
        if isinstance(file.size, bool) or not isinstance(file.size, int) or file.size < 0:
            raise ManifestError("invalid_manifest", f"{path!r}: size must be an integer >= 0")
        if not isinstance(file.sha256, str) or not SHA256_PATTERN.match(file.sha256):
            raise ManifestError("invalid_manifest", f"{path!r}: sha256 must be 64 lowercase hex")
        checked.append(ManifestFile(path=path, size=file.size, sha256=file.sha256))
    if not checked:
        raise ManifestError("empty_folder", "the folder holds no files")
    return tuple(sorted(checked, key=lambda file: file.path))


def _parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:end]) for end in range(1, len(parts))]


def manifest_bytes(files: Iterable[ManifestFile]) -> bytes:
    """The canonical JSON of a built manifest: the bytes its digest is taken of."""
    payload = {"files": [file.to_json() for file in files]}
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("ascii")


def manifest_digest(files: Iterable[ManifestFile]) -> str:
    return hashlib.sha256(manifest_bytes(files)).hexdigest()


def manifest_parse(data: bytes) -> tuple[ManifestFile, ...]:
    """A manifest from its canonical bytes; ManifestError unless they are exactly canonical
    (so that one folder has one digest)."""
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ManifestError("invalid_manifest", "the manifest is not JSON") from exc
    entries = payload.get("files") if isinstance(payload, dict) else None
    if not isinstance(entries, list) or set(payload) != {"files"}:
        raise ManifestError("invalid_manifest", 'a manifest is {"files": [...]}')
    files = []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"path", "sha256", "size"}:
            raise ManifestError("invalid_manifest", "each file is {path, sha256, size}")
        if not isinstance(entry["path"], str):
            raise ManifestError("invalid_manifest", "a file's path is a string")
        files.append(ManifestFile(path=entry["path"], size=entry["size"], sha256=entry["sha256"]))
    built = manifest_build(files)
    if manifest_bytes(built) != data:
        raise ManifestError("invalid_manifest", "the manifest is not in its canonical form")
    return built


def file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()


def folder_verify(folder: Path, files: Iterable[ManifestFile]) -> None:
    """Every file of `folder` is in the manifest with its size and SHA-256, and every file
    of the manifest is there; ManifestError otherwise, its reason one of
    artifact_file_unsafe (a link or a special file), artifact_file_extra,
    artifact_file_missing, artifact_file_changed."""
    expected = {file.path: file for file in files}
    found = set()
    for root, folders, names in os.walk(folder, followlinks=False):
        for name in [*folders, *names]:
            entry = Path(root) / name
            relative = entry.relative_to(folder).as_posix()
            mode = entry.lstat().st_mode
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise ManifestError(
                    "artifact_file_unsafe", f"{relative}: not a regular file (a link?)"
                )
            if relative not in expected:
                raise ManifestError("artifact_file_extra", f"{relative}: not in the manifest")
            found.add(relative)
    for path, file in sorted(expected.items()):
        if path not in found:
            raise ManifestError("artifact_file_missing", f"{path}: missing")
        size = (folder / path).stat().st_size
        if size != file.size:
            raise ManifestError(
                "artifact_file_changed", f"{path}: {size} bytes, the manifest says {file.size}"
            )
        actual = file_sha256(folder / path)
        if actual != file.sha256:
            raise ManifestError(
                "artifact_file_changed",
                f"{path}: sha256 {actual}, the manifest says {file.sha256}",
            )
