"""A version's memory footprint, reckoned once at registration from its stored artifact
(contracts/capacity.py does the arithmetic; this module finds the files it reads)."""

from __future__ import annotations

import json
import logging
from typing import Any

from contracts import capacity, engines
from controlplane.registry import store
from controlplane.registry.models import Artifact

logger = logging.getLogger(__name__)


def _shape(artifact: Artifact) -> capacity.ModelShape:
    if artifact.format == engines.FORMAT_GGUF:
        return capacity.gguf_shape(store.artifact_path(artifact.digest))
    if artifact.is_folder:
        files = {file["path"]: file["sha256"] for file in artifact.manifest or []}
        try:
            config = json.loads(store.artifact_path(files["config.json"]).read_bytes())
        except (KeyError, OSError, ValueError, RecursionError) as exc:
            raise capacity.CapacityError("the folder has no readable config.json") from exc
        if not isinstance(config, dict):
            raise capacity.CapacityError("the folder's config.json is not a JSON object")
        weights = [
            store.artifact_path(digest)
            for path, digest in sorted(files.items())
            if path.endswith(".safetensors")
        ]
        return capacity.folder_shape(config, weights)
    raise capacity.CapacityError(f"no engine serves a bare {artifact.format} file")


def version_footprint(
    *,
    artifact: Artifact | None,
    serving_config: dict[str, Any],
    engine: str,
    engine_args: dict[str, Any],
) -> tuple[dict[str, Any] | None, str]:
    """(footprint, "") or (None, why it is unknown). An openai version's memory is its
    endpoint's, not an agent's: it needs none here."""
    if artifact is None:
        return None, "an openai version is served from its endpoint: no agent memory"
    try:
        shape = _shape(artifact)
    except capacity.CapacityError as exc:
        logger.warning("footprint unknown", extra={"artifact": artifact.digest, "error": str(exc)})
        return None, str(exc)[:500]
    footprint = capacity.footprint_compute(
        shape, serving_config=serving_config, engine=engine, engine_args=engine_args
    )
    return footprint.to_dict(), ""
