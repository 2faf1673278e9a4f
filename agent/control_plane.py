"""The control plane's HTTP API as the agent uses it: registration and artifact download
(a file, or a folder's manifest and then each of its files)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import httpx

from contracts.manifest import ManifestError, ManifestFile, file_sha256, manifest_parse

logger = logging.getLogger(__name__)

REGISTER_PATH = "/api/v1/fleet/agents/register/"
ENROL_PATH = "/api/v1/fleet/agents/enrol/"
ARTIFACT_PATH = "/api/v1/artifacts/{digest}"
ARTIFACT_FILE_PATH = "/api/v1/artifacts/{digest}/files/{file_digest}"
CHUNK_BYTES = 1024 * 1024


class ControlPlaneError(RuntimeError):
    pass


class ArtifactError(RuntimeError):
    """The artifact could not be fetched (`is_not_found`: the server has no such file), or
    its bytes are not the ones that were signed (`is_mismatch`)."""

    def __init__(
        self, message: str, *, is_mismatch: bool = False, is_not_found: bool = False
    ) -> None:
        super().__init__(message)
        self.is_mismatch = is_mismatch
        self.is_not_found = is_not_found


class EnrolmentRefused(ControlPlaneError):
    """The control plane answered and said no (a used, expired or unknown token)."""


def enrol(*, base_url: str, token: str, timeout_s: float) -> dict[str, Any]:
    """Trade a one-time enrolment token for this agent's credentials."""
    try:
        with httpx.Client(base_url=base_url.rstrip("/"), timeout=httpx.Timeout(timeout_s)) as c:
            response = c.post(ENROL_PATH, json={"token": token})
    except httpx.HTTPError as exc:
        raise ControlPlaneError(f"control plane unreachable: {exc}") from exc
    if response.status_code in (400, 401, 403):
        raise EnrolmentRefused(
            f"enrolment refused: HTTP {response.status_code} {response.text[:300]}"
        )
    if response.status_code != 201:
        raise ControlPlaneError(
            f"enrolment failed: HTTP {response.status_code} {response.text[:300]}"
        )
    body = response.json()
    if not isinstance(body, dict):
        raise ControlPlaneError("enrolment answer is not a JSON object")
    return body


class ControlPlaneClient:
    def __init__(self, *, base_url: str, token: str, timeout_s: float) -> None:
        self._base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._timeout = httpx.Timeout(timeout_s)

    def _client(self) -> httpx.Client:
        return httpx.Client(base_url=self._base_url, headers=self._headers, timeout=self._timeout)

    def register(self, registration: dict[str, Any]) -> dict[str, Any]:
        try:
            with self._client() as client:
                response = client.post(REGISTER_PATH, json=registration)
        except httpx.HTTPError as exc:
            raise ControlPlaneError(f"control plane unreachable: {exc}") from exc
        if response.status_code not in (200, 201):
            raise ControlPlaneError(
                f"registration refused: HTTP {response.status_code} {response.text[:300]}"
            )
        body = response.json()
        if not isinstance(body, dict):
            raise ControlPlaneError("registration answer is not a JSON object")
        return body

    def fetch_artifact(self, *, digest: str, suffix: str, cache_dir: Path) -> Path:
        """The verified local copy of a file artifact: downloaded (resuming a partial
        download with Range), its SHA-256 checked against `digest`. Raises ArtifactError
        otherwise."""
        cache_dir.mkdir(parents=True, exist_ok=True)
        return self._download(
            ARTIFACT_PATH.format(digest=digest), digest, cache_dir / f"{digest}{suffix}"
        )

    def fetch_folder(
        self, *, digest: str, cache_dir: Path
    ) -> tuple[Path, tuple[ManifestFile, ...]]:
        """A folder artifact's local copy and its manifest, whose SHA-256 is `digest`.

        Each file missing from the copy is downloaded and checked against the manifest as it
        arrives (into a staging folder, renamed into place once complete). A copy already in
        place is not checked here: the caller checks every file (`folder_verify`) before it
        starts anything, and `folder_discard`s a copy that fails.
        """
        cache_dir.mkdir(parents=True, exist_ok=True)
        manifest_path = self._download(
            ARTIFACT_PATH.format(digest=digest), digest, cache_dir / f"{digest}.manifest.json"
        )
        try:
            files = manifest_parse(manifest_path.read_bytes())
        except ManifestError as exc:
            raise ArtifactError(f"artifact_manifest_invalid: {exc}") from exc
        folder = cache_dir / digest
        if folder.is_dir():
            return folder, files
        staging = cache_dir / f"{digest}.staging"
        for file in files:
            target = staging / file.path  # checked relative paths (contracts/manifest.py)
            if target.is_file():
                continue  # completed by an earlier attempt; verified with the rest below
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._download(
                    ARTIFACT_FILE_PATH.format(digest=digest, file_digest=file.sha256),
                    file.sha256,
                    target,
                )
            except ArtifactError as exc:
                if exc.is_mismatch:
                    raise ArtifactError(f"artifact_file_changed: {file.path}: {exc}") from exc
                if exc.is_not_found:
                    raise ArtifactError(f"artifact_file_missing: {file.path}: {exc}") from exc
                raise  # unreachable, refused: the next attempt resumes
        staging.replace(folder)
        return folder, files

    def _download(self, url_path: str, digest: str, final: Path) -> Path:
        """`final`, holding the bytes whose SHA-256 is `digest`: kept if already there and
        right, else downloaded (resuming `final`.part with Range)."""
        if final.exists():
            if file_sha256(final) == digest:
                return final
            logger.warning("cached artifact does not match its digest; fetching again")
            final.unlink()
        partial = final.with_name(final.name + ".part")
        hasher = hashlib.sha256()
        offset = 0
        if partial.exists():
            offset = _hash_into(partial, hasher)
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        try:
            with (
                self._client() as client,
                client.stream("GET", url_path, headers=headers) as r,
            ):
                if r.status_code == 200 and offset:  # the server ignored Range: start over
                    hasher, offset = hashlib.sha256(), 0
                    partial.unlink(missing_ok=True)
                elif r.status_code not in (200, 206):
                    raise ArtifactError(
                        f"artifact download refused: HTTP {r.status_code}",
                        is_not_found=r.status_code == 404,
                    )
                announced = r.headers.get("X-Artifact-Digest")
                if announced and announced != f"sha256:{digest}":
                    raise ArtifactError(
                        f"artifact server announced {announced}, expected sha256:{digest}",
                        is_mismatch=True,
                    )
                with open(partial, "ab") as out:
                    for chunk in r.iter_bytes(CHUNK_BYTES):
                        out.write(chunk)
                        hasher.update(chunk)
        except httpx.HTTPError as exc:
            # The partial file stays: the next attempt resumes where this one stopped.
            raise ArtifactError(f"artifact download failed: {exc}") from exc
        received = hasher.hexdigest()
        if received != digest:
            partial.unlink(missing_ok=True)
            raise ArtifactError(
                f"artifact digest mismatch: expected sha256:{digest}, received sha256:{received}",
                is_mismatch=True,
            )
        os.chmod(partial, 0o444)
        partial.replace(final)
        return final


def folder_discard(folder: Path) -> None:
    """Remove a folder copy that failed its check, so that the next load fetches it anew."""
    if folder.is_dir():
        shutil.rmtree(folder, ignore_errors=True)


def _hash_into(path: Path, hasher: Any) -> int:
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            hasher.update(chunk)
            size += len(chunk)
    return size
