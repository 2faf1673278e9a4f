"""An artifact's local copy for a load, every byte checked against the signed digest."""

from __future__ import annotations

from pathlib import Path

from agent.control_plane import ArtifactError, ControlPlaneClient, folder_discard
from contracts import engines
from contracts.commands import LoadPayload
from contracts.manifest import ManifestError, folder_verify

ARTIFACT_SUFFIXES = {"gguf": ".gguf", "safetensors": ".safetensors"}


def artifact_fetch(
    control_plane: ControlPlaneClient, load: LoadPayload, *, cache_dir: Path
) -> Path:
    """A file's copy checked as it is fetched, a folder's files against its manifest just
    before the engine starts. Raises ArtifactError with the reason; a folder copy that
    fails its check is removed first, so that the next load fetches it anew."""
    if load.format != engines.FORMAT_HF_FOLDER:
        return control_plane.fetch_artifact(
            digest=load.digest,
            suffix=ARTIFACT_SUFFIXES.get(load.format, ""),
            cache_dir=cache_dir,
        )
    folder, files = control_plane.fetch_folder(digest=load.digest, cache_dir=cache_dir)
    try:
        folder_verify(folder, files)
    except ManifestError as exc:
        folder_discard(folder)
        raise ArtifactError(f"{exc.reason}: {exc}", is_mismatch=True) from exc
    return folder
