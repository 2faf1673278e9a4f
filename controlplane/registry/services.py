import json
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from contracts import engines
from contracts.engines import EngineArgumentError, combination_problem, engine_args_validate
from contracts.signing import SignatureError, load_public_key, verify_signature
from controlplane.audit.services import Actor, acting_user, audit_event_record
from controlplane.core.errors import Conflict, DomainError
from controlplane.registry import store
from controlplane.registry.footprint import version_footprint
from controlplane.registry.models import (
    DEPLOYABLE_STATUSES,
    Artifact,
    ArtifactFormat,
    EvalSuite,
    Evaluation,
    Model,
    ModelVersion,
    SigningKey,
    VersionStatus,
)
from controlplane.registry.serving import serving_config_validate

# Models.


@transaction.atomic
def model_create(*, actor: Actor, name: str, task: str, description: str = "") -> Model:
    if Model.objects.filter(name=name).exists():
        raise Conflict("model_exists", f"A model named {name!r} exists.", fields={"name": [name]})
    model = Model.objects.create(name=name, task=task, description=description)
    audit_event_record(
        actor=actor,
        action="model.create",
        object_type="model",
        object_id=model.pk,
        object_repr=name,
        after={"name": name, "task": task},
    )
    return model


# Artifacts.


def artifact_store(
    *, actor: Actor, chunks: Iterable[bytes], declared_digest: str, max_bytes: int | None = None
) -> tuple[Artifact, bool]:
    """Stream an artifact into the store and record it; (artifact, created).

    The server computes the digest and refuses a mismatch with the declared one.
    """
    stored = store.store_stream(
        chunks=chunks,
        declared_digest=declared_digest,
        max_bytes=settings.ARTIFACT_MAX_BYTES if max_bytes is None else max_bytes,
    )
    return _artifact_record(
        actor=actor,
        digest=stored.digest,
        artifact_format=stored.format,
        size_bytes=stored.size_bytes,
    )


def _artifact_record(
    *,
    actor: Actor,
    digest: str,
    artifact_format: str,
    size_bytes: int,
    manifest: list[dict[str, Any]] | None = None,
) -> tuple[Artifact, bool]:
    """The row of what the store now holds; (artifact, created). Audited when created."""
    with transaction.atomic():
        artifact, created = Artifact.objects.get_or_create(
            digest=digest,
            defaults={
                "format": artifact_format,
                "size_bytes": size_bytes,
                "manifest": manifest,
                "created_by": acting_user(actor),
            },
        )
        if created:
            after: dict[str, Any] = {"format": artifact_format, "size_bytes": size_bytes}
            if manifest is not None:
                after["files"] = len(manifest)
            audit_event_record(
                actor=actor,
                action="artifact.store",
                object_type="artifact",
                object_id=artifact.digest,
                object_repr=f"sha256:{artifact.digest}",
                after=after,
            )
    return artifact, created


def _folder_record(*, actor: Actor, stored: store.StoredFolder) -> tuple[Artifact, bool]:
    return _artifact_record(
        actor=actor,
        digest=stored.digest,
        artifact_format=ArtifactFormat.HF_SAFETENSORS,
        size_bytes=stored.size_bytes,
        manifest=[file.to_json() for file in stored.files],
    )


def artifact_store_archive(
    *,
    actor: Actor,
    stream: IO[bytes],
    declared_digest: str = "",
    max_bytes: int | None = None,
) -> tuple[Artifact, bool]:
    """Store a folder sent as an uncompressed tar; (artifact, created).

    Its digest is its manifest's, computed by the server; a declared one must match.
    """
    limit = settings.ARTIFACT_MAX_BYTES if max_bytes is None else max_bytes
    expected = store.digest_parse(declared_digest) if declared_digest else None
    stored = store.store_folder(members=store.tar_members(stream, max_bytes=limit), max_bytes=limit)
    if expected is not None and stored.digest != expected:
        raise store.ArtifactRefused(
            "digest_mismatch",
            f"The folder's manifest digest is {stored.digest}, not the declared {expected}.",
            fields={"digest": [f"sha256:{expected}"]},
        )
    return _folder_record(actor=actor, stored=stored)


def artifact_store_folder(
    *, actor: Actor, path: Path, declared_digest: str | None = None
) -> tuple[Artifact, bool]:
    """Store a server-side model folder (admin command, demo seed); a stored one is not
    copied again. A declared digest must be the folder's (its manifest's)."""
    if not path.is_dir():
        raise DomainError("not_a_folder", f"{path} is not a readable folder.")
    digest = store.folder_manifest_digest(path)
    if declared_digest and store.digest_parse(declared_digest) != digest:
        raise store.ArtifactRefused(
            "digest_mismatch",
            f"The folder's manifest digest is {digest}, not the declared {declared_digest}.",
            fields={"digest": [declared_digest]},
        )
    existing = Artifact.objects.filter(digest=digest).first()
    if existing is not None and store.artifact_path(digest).is_file():
        return existing, False
    stored = store.store_folder(
        members=store.folder_members(path), max_bytes=settings.ARTIFACT_MAX_BYTES
    )
    return _folder_record(actor=actor, stored=stored)


# Versions.


def _folder_config(artifact: Artifact) -> dict[str, Any]:
    """A stored folder's config.json (present: the store checked it)."""
    [config] = [file for file in artifact.manifest or [] if file["path"] == "config.json"]
    try:
        loaded = json.loads(store.artifact_path(config["sha256"]).read_bytes())
    except (OSError, ValueError, RecursionError):
        loaded = None
    if not isinstance(loaded, dict):
        raise DomainError(
            "engine_cannot_load", "The folder's config.json is not a readable JSON object."
        )
    return loaded


def _combination_check(
    *, engine: str, artifact: Artifact | None, task: str, serving_config: dict[str, Any]
) -> None:
    """Refuse an engine, artifact and task that cannot load together, with the reason."""
    artifact_format = artifact.format if artifact is not None else engines.NO_ARTIFACT
    problem = combination_problem(engine=engine, artifact_format=artifact_format, task=task)
    if problem is not None:
        code, reason = problem
        raise DomainError(
            code, f"This version cannot be served: {reason}.", fields={"engine": [engine]}
        )
    if serving_config["dtype"] == "int8" and engine not in engines.INT8_ENGINES:
        raise DomainError(
            "engine_dtype_mismatch",
            f"{engine} does not store weights as int8; choose float32 or bfloat16.",
            fields={"serving_config": {"dtype": ["int8"]}},
        )
    if engine == engines.BUILTIN and artifact is not None and artifact.is_folder:
        model_type = _folder_config(artifact).get("model_type")
        loadable = engines.BUILTIN_FOLDER_MODEL_TYPES[task]
        if model_type not in loadable:
            raise DomainError(
                "engine_cannot_load",
                f"The built-in engine serves {task} models of type "
                f"{', '.join(sorted(loadable))} from a folder; config.json says {model_type!r}.",
                fields={"engine": [engine]},
            )


@transaction.atomic
def version_register(
    *,
    actor: Actor,
    model: Model,
    label: str,
    artifact_digest: str | None,
    serving_config: dict[str, Any],
    engine: str = engines.BUILTIN,
    engine_args: dict[str, Any] | None = None,
    source: str = "",
    base_version: ModelVersion | None = None,
    notes: str = "",
) -> ModelVersion:
    artifact = None
    if artifact_digest:
        digest = store.digest_parse(artifact_digest)
        artifact = Artifact.objects.filter(digest=digest).first()
        if artifact is None:
            raise DomainError(
                "unknown_artifact",
                "No artifact with this digest is stored; upload it first.",
                fields={"artifact_digest": [f"sha256:{digest}"]},
            )
    config = serving_config_validate(serving_config)
    try:
        arguments = engine_args_validate(engine, engine_args)
    except EngineArgumentError as exc:
        raise DomainError(
            "invalid_engine_args",
            f"The {engine} engine arguments are not valid: {exc}",
            fields={"engine_args": {name: [problem] for name, problem in exc.errors.items()}},
        ) from exc
    _combination_check(engine=engine, artifact=artifact, task=model.task, serving_config=config)
    if ModelVersion.objects.filter(model=model, label=label).exists():
        raise Conflict(
            "version_exists",
            f"{model.name} already has a version {label!r}.",
            fields={"label": [label]},
        )
    if base_version is not None and base_version.model_id != model.pk:
        raise DomainError(
            "invalid_base_version",
            "The base version must belong to the same model.",
            fields={"base_version": [str(base_version.pk)]},
        )
    footprint, footprint_error = version_footprint(
        artifact=artifact, serving_config=config, engine=engine, engine_args=arguments
    )
    version = ModelVersion.objects.create(
        model=model,
        label=label,
        artifact=artifact,
        serving_config=config,
        engine=engine,
        engine_args=arguments,
        footprint=footprint,
        footprint_error=footprint_error,
        source=source,
        base_version=base_version,
        notes=notes,
        created_by=acting_user(actor),
    )
    audit_event_record(
        actor=actor,
        action="version.register",
        object_type="model_version",
        object_id=version.pk,
        object_repr=f"{model.name}:{label}",
        after=version.snapshot(),
    )
    return version


def version_footprints_fill() -> int:
    """Reckon the footprint of every version registered before footprints were (null, no
    reason recorded); how many it reckoned. Footprints are derived figures, not audited."""
    count = 0
    pending = ModelVersion.objects.filter(
        footprint__isnull=True, footprint_error="", artifact__isnull=False
    ).select_related("artifact")
    for version in pending:
        version.footprint, version.footprint_error = version_footprint(
            artifact=version.artifact,
            serving_config=version.serving_config,
            engine=version.engine,
            engine_args=version.engine_args,
        )
        version.save(update_fields=["footprint", "footprint_error", "updated_at"])
        count += 1
    return count


def _locked(version: ModelVersion, expected: Collection[str]) -> ModelVersion:
    """The version under a row lock, or Conflict unless its status is one of `expected`."""
    locked = ModelVersion.objects.select_for_update().select_related("model").get(pk=version.pk)
    if locked.status not in expected:
        raise Conflict(
            "invalid_status",
            f"The version is {locked.status}; this needs one of: {', '.join(sorted(expected))}.",
            fields={"status": [locked.status]},
        )
    return locked


def _transition(
    *,
    actor: Actor,
    version: ModelVersion,
    expected: Collection[str],
    new_status: str,
    action: str,
    reason: str = "",
    changes: dict[str, Any] | None = None,
) -> ModelVersion:
    locked = _locked(version, expected)
    before = locked.snapshot()
    locked.status = new_status
    for field, value in (changes or {}).items():
        setattr(locked, field, value)
    locked.save(update_fields=["status", *(changes or {}), "updated_at"])
    audit_event_record(
        actor=actor,
        action=action,
        object_type="model_version",
        object_id=locked.pk,
        object_repr=str(locked),
        before=before,
        after=locked.snapshot(),
        reason=reason,
    )
    return locked


@transaction.atomic
def version_verify(
    *, actor: Actor, version: ModelVersion, key_id: str, signature: str
) -> ModelVersion:
    """registered -> verified, with a valid signature from a trusted key."""
    locked = _locked(version, {VersionStatus.REGISTERED})
    key = SigningKey.objects.filter(key_id=key_id).first()
    if key is None:
        raise DomainError("unknown_key", f"No signing key {key_id!r}.", fields={"key_id": [key_id]})
    if not key.is_trusted:
        raise DomainError(
            "untrusted_key", f"The key {key_id!r} is not trusted.", fields={"key_id": [key_id]}
        )
    try:
        verify_signature(
            public_key_b64=key.public_key,
            signature_b64=signature,
            digest=locked.artifact_digest,
            serving_config=locked.serving_config,
            engine=locked.engine,
            engine_args=locked.engine_args,
        )
    except SignatureError as exc:
        raise DomainError("bad_signature", str(exc), fields={"signature": [str(exc)]}) from exc
    return _transition(
        actor=actor,
        version=locked,
        expected={VersionStatus.REGISTERED},
        new_status=VersionStatus.VERIFIED,
        action="version.verify",
        changes={"signature": signature, "signing_key": key, "verified_at": timezone.now()},
    )


@transaction.atomic
def version_verify_override(*, actor: Actor, version: ModelVersion, reason: str) -> ModelVersion:
    """registered -> verified without a signature: an admin's explicit, audited decision."""
    if not reason.strip():
        raise DomainError(
            "reason_required", "An override needs a reason.", fields={"reason": ["Required."]}
        )
    return _transition(
        actor=actor,
        version=version,
        expected={VersionStatus.REGISTERED},
        new_status=VersionStatus.VERIFIED,
        action="version.verify_override",
        reason=reason,
        changes={"is_verification_override": True, "verified_at": timezone.now()},
    )


@transaction.atomic
def version_approve(*, actor: Actor, version: ModelVersion, reason: str = "") -> ModelVersion:
    """evaluated -> approved: ready to be rolled out."""
    return _transition(
        actor=actor,
        version=version,
        expected={VersionStatus.EVALUATED},
        new_status=VersionStatus.APPROVED,
        action="version.approve",
        reason=reason,
    )


@transaction.atomic
def version_deprecate(*, actor: Actor, version: ModelVersion, reason: str = "") -> ModelVersion:
    return _transition(
        actor=actor,
        version=version,
        expected=DEPLOYABLE_STATUSES,
        new_status=VersionStatus.DEPRECATED,
        action="version.deprecate",
        reason=reason,
    )


@transaction.atomic
def version_revoke(*, actor: Actor, version: ModelVersion, reason: str) -> ModelVersion:
    """Any status -> revoked: the version must never be served again."""
    if not reason.strip():
        raise DomainError(
            "reason_required", "A revocation needs a reason.", fields={"reason": ["Required."]}
        )
    return _transition(
        actor=actor,
        version=version,
        expected=set(VersionStatus.values) - {VersionStatus.REVOKED},
        new_status=VersionStatus.REVOKED,
        action="version.revoke",
        reason=reason,
    )


# Signing keys.


@transaction.atomic
def signing_key_create(
    *, actor: Actor, key_id: str, public_key: str, is_trusted: bool = False, description: str = ""
) -> SigningKey:
    try:
        load_public_key(public_key)
    except SignatureError as exc:
        raise DomainError(
            "invalid_public_key", str(exc), fields={"public_key": [str(exc)]}
        ) from exc
    if SigningKey.objects.filter(key_id=key_id).exists():
        raise Conflict("key_exists", f"A key {key_id!r} exists.", fields={"key_id": [key_id]})
    key = SigningKey.objects.create(
        key_id=key_id,
        public_key=public_key,
        is_trusted=is_trusted,
        description=description,
        created_by=acting_user(actor),
    )
    audit_event_record(
        actor=actor,
        action="signing_key.create",
        object_type="signing_key",
        object_id=key.pk,
        object_repr=key_id,
        after={"key_id": key_id, "public_key": public_key, "is_trusted": is_trusted},
    )
    return key


@transaction.atomic
def signing_key_set_trust(
    *, actor: Actor, key: SigningKey, is_trusted: bool, reason: str = ""
) -> SigningKey:
    key = SigningKey.objects.select_for_update().get(pk=key.pk)
    if key.is_trusted == is_trusted:
        return key
    key.is_trusted = is_trusted
    key.save(update_fields=["is_trusted"])
    audit_event_record(
        actor=actor,
        action="signing_key.trust" if is_trusted else "signing_key.distrust",
        object_type="signing_key",
        object_id=key.pk,
        object_repr=key.key_id,
        before={"is_trusted": not is_trusted},
        after={"is_trusted": is_trusted},
        reason=reason,
    )
    return key


# Evaluations.


def _metrics_validate(metrics: Any) -> list[dict[str, Any]]:
    if not isinstance(metrics, list) or not metrics:
        raise DomainError("invalid", "metrics must be a non-empty list.", fields={"metrics": []})
    normalised = []
    names = set()
    for index, metric in enumerate(metrics):
        problem = None
        if not isinstance(metric, dict) or set(metric) - {"name", "threshold", "higher_is_better"}:
            problem = "Each metric is {name, threshold, higher_is_better}."
        elif not isinstance(metric.get("name"), str) or not metric["name"]:
            problem = "name must be a non-empty string."
        elif isinstance(metric.get("threshold"), bool) or not isinstance(
            metric.get("threshold"), int | float
        ):
            problem = "threshold must be a number."
        elif not isinstance(metric.get("higher_is_better", True), bool):
            problem = "higher_is_better must be a boolean."
        elif metric["name"] in names:
            problem = f"duplicate metric {metric['name']!r}."
        if problem:
            raise DomainError("invalid", problem, fields={"metrics": {str(index): [problem]}})
        names.add(metric["name"])
        normalised.append(
            {
                "name": metric["name"],
                "threshold": metric["threshold"],
                "higher_is_better": metric.get("higher_is_better", True),
            }
        )
    return normalised


@transaction.atomic
def eval_suite_create(
    *, actor: Actor, name: str, kind: str, dataset: str, metrics: Any, description: str = ""
) -> EvalSuite:
    definitions = _metrics_validate(metrics)
    if EvalSuite.objects.filter(name=name).exists():
        raise Conflict("suite_exists", f"A suite named {name!r} exists.", fields={"name": [name]})
    suite = EvalSuite.objects.create(
        name=name, kind=kind, dataset=dataset, metrics=definitions, description=description
    )
    audit_event_record(
        actor=actor,
        action="eval_suite.create",
        object_type="eval_suite",
        object_id=suite.pk,
        object_repr=name,
        after={"kind": kind, "dataset": dataset, "metrics": definitions},
    )
    return suite


def evaluation_passes(*, suite: EvalSuite, metrics: dict[str, float]) -> bool:
    """Every metric of the suite meets its threshold (>= if higher is better, else <=)."""
    for definition in suite.metrics:
        value = metrics[definition["name"]]
        if definition["higher_is_better"] and value < definition["threshold"]:
            return False
        if not definition["higher_is_better"] and value > definition["threshold"]:
            return False
    return True


@transaction.atomic
def evaluation_record(
    *,
    actor: Actor,
    version: ModelVersion,
    suite: EvalSuite,
    metrics: dict[str, Any],
    baseline_version: ModelVersion | None = None,
    notes: str = "",
) -> Evaluation:
    """Record a result; a passing one moves a verified version to evaluated."""
    expected_names = {definition["name"] for definition in suite.metrics}
    if not isinstance(metrics, dict) or set(metrics) != expected_names:
        raise DomainError(
            "invalid_metrics",
            f"Metrics must be exactly the suite's: {', '.join(sorted(expected_names))}.",
            fields={"metrics": sorted(expected_names)},
        )
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise DomainError(
                "invalid_metrics", f"{name} must be a number.", fields={"metrics": {name: [value]}}
            )
    locked = _locked(version, DEPLOYABLE_STATUSES)
    if baseline_version is not None and baseline_version.pk == locked.pk:
        raise DomainError("invalid_baseline", "A version is not its own baseline.")
    passed = evaluation_passes(suite=suite, metrics=metrics)
    evaluation = Evaluation.objects.create(
        version=locked,
        suite=suite,
        baseline_version=baseline_version,
        metrics=metrics,
        passed=passed,
        notes=notes,
        created_by=acting_user(actor),
    )
    audit_event_record(
        actor=actor,
        action="evaluation.record",
        object_type="evaluation",
        object_id=evaluation.pk,
        object_repr=f"{suite.name} on {locked}",
        after={"version": locked.pk, "suite": suite.name, "metrics": metrics, "passed": passed},
    )
    if passed and locked.status == VersionStatus.VERIFIED:
        _transition(
            actor=actor,
            version=locked,
            expected={VersionStatus.VERIFIED},
            new_status=VersionStatus.EVALUATED,
            action="version.evaluated",
            reason=f"passed {suite.name}",
        )
    return evaluation


def artifact_store_file(
    *, actor: Actor, path: Path, declared_digest: str | None = None
) -> tuple[Artifact, bool]:
    """Store a server-side file (admin command, demo seed); a stored digest is not copied again."""
    if not path.is_file():
        raise DomainError("not_a_file", f"{path} is not a readable file.")
    digest = store.digest_parse(declared_digest) if declared_digest else store.file_digest(path)
    existing = Artifact.objects.filter(digest=digest).first()
    if existing is not None and store.artifact_path(digest).is_file():
        return existing, False
    with path.open("rb") as file:
        return artifact_store(actor=actor, chunks=store.read_chunks(file), declared_digest=digest)
