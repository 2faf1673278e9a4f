import django_filters

from controlplane.registry.models import Artifact, Evaluation, ModelVersion, VersionStatus


class ModelVersionFilter(django_filters.FilterSet):
    status = django_filters.MultipleChoiceFilter(choices=VersionStatus.choices)
    artifact_digest = django_filters.CharFilter(method="filter_digest")
    model_name = django_filters.CharFilter(field_name="model__name")

    class Meta:
        model = ModelVersion
        fields = ["model", "status", "label"]

    def filter_digest(self, queryset, name, value):
        return queryset.filter(artifact_id=value.removeprefix("sha256:").lower())


class ArtifactFilter(django_filters.FilterSet):
    digest = django_filters.CharFilter(method="filter_digest")

    class Meta:
        model = Artifact
        fields = ["format"]

    def filter_digest(self, queryset, name, value):
        return queryset.filter(digest=value.removeprefix("sha256:").lower())


class EvaluationFilter(django_filters.FilterSet):
    class Meta:
        model = Evaluation
        fields = ["version", "suite", "passed", "baseline_version"]
