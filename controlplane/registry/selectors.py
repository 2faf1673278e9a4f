from django.db.models import QuerySet

from controlplane.registry.models import (
    Artifact,
    EvalSuite,
    Evaluation,
    Model,
    ModelVersion,
    SigningKey,
)


def model_list() -> QuerySet[Model]:
    return Model.objects.all()


def version_list() -> QuerySet[ModelVersion]:
    return ModelVersion.objects.select_related(
        "model", "artifact", "signing_key", "base_version", "created_by"
    )


def artifact_list() -> QuerySet[Artifact]:
    return Artifact.objects.select_related("created_by")


def artifact_get(*, digest: str) -> Artifact | None:
    return Artifact.objects.filter(digest=digest).first()


def signing_key_list() -> QuerySet[SigningKey]:
    return SigningKey.objects.all()


def eval_suite_list() -> QuerySet[EvalSuite]:
    return EvalSuite.objects.all()


def evaluation_list() -> QuerySet[Evaluation]:
    return Evaluation.objects.select_related(
        "version", "version__model", "suite", "baseline_version", "created_by"
    )
