"""Accounts API: who am I, personal access tokens, and (admins) users and their roles."""

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts import selectors, services
from controlplane.accounts.models import AccessToken
from controlplane.accounts.serializers import (
    AccessTokenCreatedSerializer,
    AccessTokenCreateSerializer,
    AccessTokenSerializer,
    EmptySerializer,
    MembershipSetSerializer,
    UserCreateSerializer,
    UserSerializer,
)
from controlplane.core import access
from controlplane.core.errors import NotFound
from controlplane.core.permissions import allows


class MeView(APIView):
    @extend_schema(responses=UserSerializer)
    def get(self, request: Request) -> Response:
        return Response(UserSerializer(request.user).data)


class AccessTokenViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """One's own personal tokens for `Authorization: Bearer <token>`."""

    permission_classes = [allows(access.can_manage_own_tokens)]
    serializer_class = AccessTokenSerializer
    filterset_fields = ["name"]
    ordering_fields = ["created_at", "name"]

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return AccessToken.objects.none()
        return selectors.access_token_list(user=self.request.user).select_related("user")

    def get_object(self) -> Any:
        pk = str(self.kwargs["pk"])
        token = self.get_queryset().filter(pk=pk).first() if pk.isdigit() else None
        if token is None:
            raise NotFound("No such token.")
        return token

    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(AccessTokenSerializer(self.get_object()).data)

    @extend_schema(
        request=AccessTokenCreateSerializer, responses={201: AccessTokenCreatedSerializer}
    )
    def create(self, request: Request) -> Response:
        serializer = AccessTokenCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        created = services.access_token_create(user=request.user, **serializer.validated_data)
        body = AccessTokenSerializer(created.token).data | {"token": created.raw_token}
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=EmptySerializer, responses={200: AccessTokenSerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str) -> Response:
        token = self.get_object()
        EmptySerializer(data=request.data).is_valid(raise_exception=True)
        token = services.access_token_revoke(actor=request.user, token=token)
        return Response(AccessTokenSerializer(token).data)


class UserViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Admins: users and their one role each."""

    permission_classes = [allows(access.can_manage_users)]
    serializer_class = UserSerializer
    filterset_fields = ["username", "membership__role", "membership__tenant"]
    ordering_fields = ["username"]

    def get_queryset(self):
        return selectors.user_list()

    @extend_schema(request=UserCreateSerializer, responses={201: UserSerializer})
    def create(self, request: Request) -> Response:
        serializer = UserCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        user = services.user_create(actor=request.user, **serializer.validated_data)
        return Response(UserSerializer(user).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=MembershipSetSerializer, responses={200: UserSerializer})
    @action(detail=True, methods=["post"])
    def role(self, request: Request, pk: str) -> Response:
        user = self.get_object()
        serializer = MembershipSetSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.membership_set(actor=request.user, user=user, **serializer.validated_data)
        return Response(UserSerializer(selectors.user_list().get(pk=user.pk)).data)
