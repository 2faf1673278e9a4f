"""Tenants API. A tenant member sees only their own tenant; any other is 404, never 403."""

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import generics, mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.core import access
from controlplane.core.errors import Forbidden, NotFound
from controlplane.core.permissions import allows
from controlplane.tenants import selectors, services
from controlplane.tenants.models import ApiKey
from controlplane.tenants.serializers import (
    ApiKeyCreatedSerializer,
    ApiKeyCreateSerializer,
    ApiKeyRevokeSerializer,
    ApiKeySerializer,
    TenantCreateSerializer,
    TenantSerializer,
    TenantUpdateSerializer,
    UsageBucketSerializer,
    UsageQuerySerializer,
)


class TenantViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    permission_classes = [allows(access.can_list_tenants)]
    serializer_class = TenantSerializer
    filterset_fields = ["slug", "is_active", "prompt_logging"]
    ordering_fields = ["slug", "created_at"]

    def get_queryset(self):
        return selectors.tenant_list(user=self.request.user)

    def get_object(self) -> Any:
        return selectors.tenant_get_visible(user=self.request.user, tenant_id=self.kwargs["pk"])

    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(TenantSerializer(self.get_object()).data)

    @extend_schema(request=TenantCreateSerializer, responses={201: TenantSerializer})
    def create(self, request: Request) -> Response:
        if not access.can_manage_tenants(request.user):
            raise Forbidden()
        serializer = TenantCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        tenant = services.tenant_create(actor=request.user, **serializer.validated_data)
        return Response(TenantSerializer(tenant).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=TenantUpdateSerializer, responses={200: TenantSerializer})
    def partial_update(self, request: Request, pk: str) -> Response:
        tenant = self.get_object()
        if not access.can_manage_tenants(request.user):
            raise Forbidden()
        serializer = TenantUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        tenant = services.tenant_update(
            actor=request.user, tenant=tenant, **serializer.validated_data
        )
        return Response(
            TenantSerializer(selectors.tenant_list(user=request.user).get(pk=tenant.pk)).data
        )


class TenantScopedMixin:
    """Resolves the tenant of the URL, answering 404 when the user may not learn of it."""

    request: Request
    kwargs: dict[str, Any]

    def get_tenant(self) -> Any:
        if not hasattr(self, "_tenant"):
            self._tenant = selectors.tenant_get_visible(
                user=self.request.user, tenant_id=self.kwargs["tenant_pk"]
            )
        return self._tenant


class ApiKeyViewSet(TenantScopedMixin, mixins.ListModelMixin, viewsets.GenericViewSet):
    """A tenant's API keys for the gateway: created (shown once), listed, revoked."""

    permission_classes = [allows(access.can_list_tenants)]
    serializer_class = ApiKeySerializer
    filterset_fields = ["name", "prefix"]
    ordering_fields = ["created_at", "name"]

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return ApiKey.objects.none()
        return selectors.api_key_list(tenant=self.get_tenant())

    def get_object(self) -> Any:
        key = (
            self.get_queryset().filter(pk=self.kwargs["pk"]).first()
            if str(self.kwargs["pk"]).isdigit()
            else None
        )
        if key is None:
            raise NotFound("No such API key.")
        return key

    def retrieve(self, request: Request, tenant_pk: str, pk: str) -> Response:
        return Response(ApiKeySerializer(self.get_object()).data)

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: ApiKeyCreatedSerializer})
    def create(self, request: Request, tenant_pk: str) -> Response:
        tenant = self.get_tenant()
        if not access.can_manage_api_keys(request.user, tenant):
            raise Forbidden()
        serializer = ApiKeyCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        created = services.api_key_create(
            actor=request.user, tenant=tenant, **serializer.validated_data
        )
        body = ApiKeySerializer(created.key).data | {"key": created.raw_key}
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=ApiKeyRevokeSerializer, responses={200: ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, tenant_pk: str, pk: str) -> Response:
        key = self.get_object()
        if not access.can_manage_api_keys(request.user, self.get_tenant()):
            raise Forbidden()
        serializer = ApiKeyRevokeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key = services.api_key_revoke(actor=request.user, key=key, **serializer.validated_data)
        return Response(ApiKeySerializer(key).data)


class UsageView(TenantScopedMixin, generics.ListAPIView):
    """A tenant's usage summed per hour or day, model and version (newest first)."""

    permission_classes = [allows(access.can_list_tenants)]
    serializer_class = UsageBucketSerializer
    filter_backends: list = []

    @extend_schema(parameters=[UsageQuerySerializer])
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)

    def get_queryset(self):
        query = UsageQuerySerializer(data=self.request.query_params.dict())
        query.is_valid(raise_exception=True)
        options = {
            key: value
            for key, value in query.validated_data.items()
            if key not in {"limit", "offset", "model", "version"}
        }
        return selectors.usage_aggregate(
            tenant=self.get_tenant(),
            model_id=query.validated_data["model"],
            version_id=query.validated_data["version"],
            **options,
        )
