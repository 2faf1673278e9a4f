"""REST routes of this app, mounted under /api/v1/."""

from django.urls import path, re_path
from rest_framework.routers import SimpleRouter

from controlplane.registry import views

router = SimpleRouter()
router.register("models", views.ModelViewSet, basename="model")
router.register("versions", views.ModelVersionViewSet, basename="version")
router.register("signing-keys", views.SigningKeyViewSet, basename="signing-key")
router.register("eval-suites", views.EvalSuiteViewSet, basename="eval-suite")
router.register("evaluations", views.EvaluationViewSet, basename="evaluation")

urlpatterns = [
    path("artifacts/", views.ArtifactViewSet.as_view({"get": "list"}), name="artifact-list"),
    path("artifacts/folders/", views.ArtifactFolderUploadView.as_view(), name="artifact-folder"),
    re_path(
        r"^artifacts/(?P<digest>[0-9a-f]{64})$",
        views.ArtifactContentView.as_view(),
        name="artifact-content",
    ),
    re_path(
        r"^artifacts/(?P<digest>[0-9a-f]{64})/files/(?P<file_digest>[0-9a-f]{64})$",
        views.ArtifactFolderFileView.as_view(),
        name="artifact-folder-file",
    ),
    *router.urls,
]
