"""Registry API: thin views that parse, fetch by id, call one service and serialize."""

import io
import re
from typing import Any

from django.conf import settings
from django.http import FileResponse, StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.core import access
from controlplane.core.errors import DomainError, NotFound
from controlplane.core.permissions import allows, allows_by_method
from controlplane.registry import selectors, services, store
from controlplane.registry.filters import ArtifactFilter, EvaluationFilter, ModelVersionFilter
from controlplane.registry.serializers import (
    ArtifactSerializer,
    EvalSuiteCreateSerializer,
    EvalSuiteSerializer,
    EvaluationRecordSerializer,
    EvaluationSerializer,
    ModelCreateSerializer,
    ModelSerializer,
    ModelVersionSerializer,
    ReasonSerializer,
    RequiredReasonSerializer,
    SigningKeyCreateSerializer,
    SigningKeySerializer,
    SigningKeyTrustSerializer,
    VersionRegisterSerializer,
    VersionVerifySerializer,
)

ReadRegistryManageVersions = allows_by_method(
    read=access.can_view_registry, write=access.can_manage_versions
)


class ModelViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Models (a name and a task); their versions are under /versions/."""

    permission_classes = [ReadRegistryManageVersions]
    serializer_class = ModelSerializer
    filterset_fields = ["task", "name"]
    ordering_fields = ["name", "created_at"]

    def get_queryset(self):
        return selectors.model_list()

    @extend_schema(request=ModelCreateSerializer, responses={201: ModelSerializer})
    def create(self, request: Request) -> Response:
        serializer = ModelCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        model = services.model_create(actor=request.user, **serializer.validated_data)
        return Response(ModelSerializer(model).data, status=status.HTTP_201_CREATED)


class ModelVersionViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    """Versions: registered -> verified -> evaluated -> approved -> deprecated / revoked."""

    permission_classes = [ReadRegistryManageVersions]
    serializer_class = ModelVersionSerializer
    filterset_class = ModelVersionFilter
    ordering_fields = ["created_at", "label", "status"]

    def get_queryset(self):
        return selectors.version_list()

    def _respond(self, version: Any) -> Response:
        version = selectors.version_list().get(pk=version.pk)
        return Response(ModelVersionSerializer(version).data)

    def _transition(self, request: Request, serializer_class: type, service: Any) -> Response:
        """Parse the body, run one status-changing service on this version, answer with it."""
        version = self.get_object()
        serializer = serializer_class(data=request.data)
        serializer.is_valid(raise_exception=True)
        return self._respond(
            service(actor=request.user, version=version, **serializer.validated_data)
        )

    @extend_schema(request=VersionRegisterSerializer, responses={201: ModelVersionSerializer})
    def create(self, request: Request) -> Response:
        serializer = VersionRegisterSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        version = services.version_register(actor=request.user, **serializer.validated_data)
        version = selectors.version_list().get(pk=version.pk)
        return Response(ModelVersionSerializer(version).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=VersionVerifySerializer, responses={200: ModelVersionSerializer})
    @action(detail=True, methods=["post"])
    def verify(self, request: Request, pk: str) -> Response:
        """Verify with an ed25519 signature over the digest and serving config (trusted key)."""
        return self._transition(request, VersionVerifySerializer, services.version_verify)

    @extend_schema(request=RequiredReasonSerializer, responses={200: ModelVersionSerializer})
    @action(
        detail=True,
        methods=["post"],
        url_path="override-verification",
        permission_classes=[allows(access.can_override_verification)],
    )
    def override_verification(self, request: Request, pk: str) -> Response:
        """Admin only: mark verified without a signature; the reason is audited."""
        return self._transition(request, RequiredReasonSerializer, services.version_verify_override)

    @extend_schema(request=ReasonSerializer, responses={200: ModelVersionSerializer})
    @action(detail=True, methods=["post"])
    def approve(self, request: Request, pk: str) -> Response:
        return self._transition(request, ReasonSerializer, services.version_approve)

    @extend_schema(request=ReasonSerializer, responses={200: ModelVersionSerializer})
    @action(detail=True, methods=["post"])
    def deprecate(self, request: Request, pk: str) -> Response:
        return self._transition(request, ReasonSerializer, services.version_deprecate)

    @extend_schema(request=RequiredReasonSerializer, responses={200: ModelVersionSerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str) -> Response:
        return self._transition(request, RequiredReasonSerializer, services.version_revoke)


class SigningKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Ed25519 public keys; only trusted ones verify versions. Admins manage them."""

    permission_classes = [
        allows_by_method(read=access.can_view_registry, write=access.can_manage_signing_keys)
    ]
    serializer_class = SigningKeySerializer
    filterset_fields = ["is_trusted", "key_id"]
    ordering_fields = ["key_id", "created_at"]

    def get_queryset(self):
        return selectors.signing_key_list().select_related("created_by")

    @extend_schema(request=SigningKeyCreateSerializer, responses={201: SigningKeySerializer})
    def create(self, request: Request) -> Response:
        serializer = SigningKeyCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key = services.signing_key_create(actor=request.user, **serializer.validated_data)
        return Response(SigningKeySerializer(key).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=SigningKeyTrustSerializer, responses={200: SigningKeySerializer})
    @action(detail=True, methods=["post"])
    def trust(self, request: Request, pk: str) -> Response:
        """Trust or distrust a key (audited)."""
        key = self.get_object()
        serializer = SigningKeyTrustSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key = services.signing_key_set_trust(
            actor=request.user, key=key, **serializer.validated_data
        )
        return Response(SigningKeySerializer(key).data)


class EvalSuiteViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    permission_classes = [ReadRegistryManageVersions]
    serializer_class = EvalSuiteSerializer
    filterset_fields = ["kind", "name"]
    ordering_fields = ["name", "created_at"]

    def get_queryset(self):
        return selectors.eval_suite_list()

    @extend_schema(request=EvalSuiteCreateSerializer, responses={201: EvalSuiteSerializer})
    def create(self, request: Request) -> Response:
        serializer = EvalSuiteCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        suite = services.eval_suite_create(actor=request.user, **serializer.validated_data)
        return Response(EvalSuiteSerializer(suite).data, status=status.HTTP_201_CREATED)


class EvaluationViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Evaluation results; a passing one moves a verified version to evaluated."""

    permission_classes = [ReadRegistryManageVersions]
    serializer_class = EvaluationSerializer
    filterset_class = EvaluationFilter
    ordering_fields = ["created_at"]

    def get_queryset(self):
        return selectors.evaluation_list()

    @extend_schema(request=EvaluationRecordSerializer, responses={201: EvaluationSerializer})
    def create(self, request: Request) -> Response:
        serializer = EvaluationRecordSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        evaluation = services.evaluation_record(actor=request.user, **serializer.validated_data)
        evaluation = selectors.evaluation_list().get(pk=evaluation.pk)
        return Response(EvaluationSerializer(evaluation).data, status=status.HTTP_201_CREATED)


class ArtifactViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Artifact metadata. A file: PUT and GET on /artifacts/<hex>; a folder: POST a tar to
    /artifacts/folders/, GET its manifest on /artifacts/<hex> and its files under it."""

    permission_classes = [allows(access.can_view_registry)]
    serializer_class = ArtifactSerializer
    filterset_class = ArtifactFilter
    ordering_fields = ["created_at", "size_bytes"]

    def get_queryset(self):
        return selectors.artifact_list()


class IgnoreAcceptHeader(BaseContentNegotiation):
    """Downloads are bytes whatever the client accepts; errors still render as JSON."""

    def select_parser(self, request: Request, parsers: list) -> Any:
        return parsers[0] if parsers else None

    def select_renderer(self, request: Request, renderers: list, format_suffix: Any = None) -> Any:
        return (renderers[0], renderers[0].media_type)


class RangeNotSatisfiable(DomainError):
    def __init__(self, size: int) -> None:
        super().__init__(
            "range_not_satisfiable",
            f"The range is outside the artifact ({size} bytes).",
            status_code=status.HTTP_416_REQUESTED_RANGE_NOT_SATISFIABLE,
        )
        self.size = size


RANGE_PATTERN = re.compile(r"^bytes=(\d*)-(\d*)$")


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) for one satisfiable range; None to send the whole file.

    Raises DomainError 416 when the range cannot be satisfied.
    """
    match = RANGE_PATTERN.match(header.strip())
    if match is None:
        return None  # malformed or several ranges: RFC 9110 lets us ignore the header
    first, last = match.groups()
    if not first and not last:
        return None
    if not first:  # suffix: the last N bytes
        length = int(last)
        if length == 0 or size == 0:
            raise RangeNotSatisfiable(size)
        return max(0, size - length), size - 1
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or (last and int(last) < start):
        raise RangeNotSatisfiable(size)
    return start, end


def blob_response(request: Request, digest: str) -> Any:
    """The stored blob `digest`, whole or the one range asked for."""
    path = store.artifact_path(digest)
    if not path.is_file():
        raise NotFound("No artifact with this digest.")
    size = path.stat().st_size
    byte_range = parse_range(request.headers.get("Range", ""), size)
    file = path.open("rb")
    if byte_range is None:
        response: Any = FileResponse(file, content_type="application/octet-stream")
    else:
        start, end = byte_range
        response = StreamingHttpResponse(
            store.read_chunks(file, start=start, length=end - start + 1),
            status=status.HTTP_206_PARTIAL_CONTENT,
            content_type="application/octet-stream",
        )
        response["Content-Range"] = f"bytes {start}-{end}/{size}"
        response["Content-Length"] = str(end - start + 1)
    response["Accept-Ranges"] = "bytes"
    response["X-Artifact-Digest"] = f"sha256:{digest}"
    response["ETag"] = f'"{digest}"'
    return response


BLOB_SCHEMA = extend_schema(
    parameters=[
        OpenApiParameter("Range", OpenApiTypes.STR, OpenApiParameter.HEADER, required=False)
    ],
    responses={
        (200, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY),
        (206, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY),
        416: OpenApiResponse(description="Range not satisfiable"),
    },
)


class BlobView(APIView):
    """Bytes whatever the client accepts; a refused range names the size."""

    content_negotiation_class = IgnoreAcceptHeader

    def handle_exception(self, exc: Exception) -> Response:
        response = super().handle_exception(exc)
        if isinstance(exc, RangeNotSatisfiable):
            response["Content-Range"] = f"bytes */{exc.size}"
        return response


class ArtifactContentView(BlobView):
    """GET/HEAD downloads an artifact by digest (admins, agents); PUT uploads one file."""

    permission_classes = [
        allows_by_method(read=access.can_download_artifact, write=access.can_manage_versions)
    ]

    @BLOB_SCHEMA
    def get(self, request: Request, digest: str) -> Any:
        """A file's bytes, or a folder's manifest (canonical JSON, whose SHA-256 is the
        digest); a folder's files are under /artifacts/<digest>/files/<file sha256>."""
        if selectors.artifact_get(digest=digest) is None:
            raise NotFound("No artifact with this digest.")
        return blob_response(request, digest)

    @extend_schema(
        request={"application/octet-stream": OpenApiTypes.BINARY},
        responses={201: ArtifactSerializer, 200: ArtifactSerializer},
    )
    def put(self, request: Request, digest: str) -> Response:
        """Upload: the raw bytes as the body, streamed to disk and hashed by the server."""
        # Refuse at once what declares itself too large; the stream is counted as well.
        declared_length = request.headers.get("Content-Length", "")
        if declared_length.isdigit() and int(declared_length) > settings.ARTIFACT_MAX_BYTES:
            raise store.too_large_error("The artifact", settings.ARTIFACT_MAX_BYTES)
        stream = request.stream
        chunk_size = settings.ARTIFACT_CHUNK_BYTES
        chunks = iter(lambda: stream.read(chunk_size), b"") if stream is not None else iter(())
        artifact, created = services.artifact_store(
            actor=request.user, chunks=chunks, declared_digest=digest
        )
        return Response(
            ArtifactSerializer(artifact).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


class ArtifactFolderFileView(BlobView):
    """GET/HEAD downloads one file of a folder artifact by the file's own digest."""

    permission_classes = [allows(access.can_download_artifact)]

    @BLOB_SCHEMA
    def get(self, request: Request, digest: str, file_digest: str) -> Any:
        artifact = selectors.artifact_get(digest=digest)
        files = artifact.manifest if artifact is not None else None
        if not files or not any(file["sha256"] == file_digest for file in files):
            raise NotFound("No folder artifact with this digest holds a file with that one.")
        return blob_response(request, file_digest)


class ArtifactFolderUploadView(APIView):
    """POST uploads a model folder as an uncompressed tar (Content-Type: application/x-tar)."""

    permission_classes = [allows(access.can_manage_versions)]

    @extend_schema(
        request={"application/x-tar": OpenApiTypes.BINARY},
        parameters=[
            OpenApiParameter(
                "X-Artifact-Digest",
                OpenApiTypes.STR,
                OpenApiParameter.HEADER,
                required=False,
                description="sha256:<hex> of the manifest the folder must have; refused if not.",
            )
        ],
        responses={201: ArtifactSerializer, 200: ArtifactSerializer},
    )
    def post(self, request: Request) -> Response:
        """Each file is stored by its digest, the folder by its manifest's (in the answer)."""
        content_type = request.content_type.split(";")[0].strip().lower()
        if content_type != "application/x-tar":
            raise DomainError(
                "unsupported_media_type",
                "Send the folder as an uncompressed tar with Content-Type: application/x-tar.",
                status_code=status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
            )
        declared_length = request.headers.get("Content-Length", "")
        limit = store.archive_limit(settings.ARTIFACT_MAX_BYTES)
        if declared_length.isdigit() and int(declared_length) > limit:
            raise store.too_large_error("The archive", limit)
        artifact, created = services.artifact_store_archive(
            actor=request.user,
            stream=request.stream or io.BytesIO(),
            declared_digest=request.headers.get("X-Artifact-Digest", ""),
        )
        return Response(
            ArtifactSerializer(artifact).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )
