"""Fleet API: thin views that parse, fetch by name or id, call one service and serialize."""

from datetime import timedelta
from typing import Any

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics, status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.core import access
from controlplane.core.permissions import allows, allows_by_method
from controlplane.fleet import enrolment, selectors, services
from controlplane.fleet.serializers import (
    AgentCommandSerializer,
    AgentSerializer,
    CommandRequestSerializer,
    EnrolledSerializer,
    EnrolmentCreatedSerializer,
    EnrolmentCreateSerializer,
    EnrolSerializer,
    HistoryBucketSerializer,
    HistoryQuerySerializer,
    RegistrationSerializer,
)

DEFAULT_HISTORY = timedelta(hours=1)


class AgentListView(generics.ListAPIView):
    """Every agent with its state and latest figures."""

    permission_classes = [allows(access.can_view_fleet)]
    serializer_class = AgentSerializer
    filterset_fields = ["state"]
    ordering_fields = ["name", "state", "last_seen"]

    def get_queryset(self) -> Any:
        return selectors.agent_list()


class AgentDetailView(APIView):
    permission_classes = [allows(access.can_view_fleet)]

    @extend_schema(responses=AgentSerializer)
    def get(self, request: Request, name: str) -> Response:
        return Response(AgentSerializer(selectors.agent_get(name=name)).data)


class AgentHistoryView(APIView):
    """10-second buckets of one agent, `since`..`until` (default: the last hour)."""

    permission_classes = [allows(access.can_view_fleet)]

    @extend_schema(
        parameters=[
            OpenApiParameter("since", str, description="ISO 8601; default an hour ago"),
            OpenApiParameter("until", str, description="ISO 8601; default now"),
        ],
        responses=HistoryBucketSerializer(many=True),
    )
    def get(self, request: Request, name: str) -> Response:
        query = HistoryQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        agent = selectors.agent_get(name=name)
        until = query.validated_data.get("until") or timezone.now()
        since = query.validated_data.get("since") or until - DEFAULT_HISTORY
        history = selectors.agent_history(agent=agent, since=since, until=until)
        return Response(
            {
                "agent": agent.name,
                "bucket_seconds": 10,
                "buckets": HistoryBucketSerializer(history, many=True).data,
            }
        )


class AgentCommandListView(generics.ListAPIView):
    """GET: the agent's commands, newest first. POST: send one (audited)."""

    permission_classes = [
        allows_by_method(read=access.can_view_fleet, write=access.can_command_agents)
    ]
    serializer_class = AgentCommandSerializer

    def get_queryset(self) -> Any:
        return selectors.agent_command_list(agent=selectors.agent_get(name=self.kwargs["name"]))

    @extend_schema(request=CommandRequestSerializer, responses={202: AgentCommandSerializer})
    def post(self, request: Request, name: str) -> Response:
        serializer = CommandRequestSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        command = services.agent_command_send(
            actor=request.user, agent_name=name, **serializer.validated_data
        )
        return Response(AgentCommandSerializer(command).data, status=status.HTTP_202_ACCEPTED)


class CommandDetailView(APIView):
    permission_classes = [allows(access.can_view_fleet)]

    @extend_schema(responses=AgentCommandSerializer)
    def get(self, request: Request, command_id: str) -> Response:
        return Response(AgentCommandSerializer(selectors.command_get(command_id=command_id)).data)


class AgentRegisterView(APIView):
    """An agent registers itself (agent service account): created 201, refreshed 200."""

    permission_classes = [allows(access.can_register_agent)]

    @extend_schema(request=RegistrationSerializer, responses={200: AgentSerializer})
    def post(self, request: Request) -> Response:
        serializer = RegistrationSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        agent, created = services.agent_register(
            actor=request.user,
            name=data["name"],
            host=data["host"],
            endpoint=data["endpoint"],
            advertise_host=data["advertise_host"],
            ports=data["ports"],
            inventory=data["inventory"],
            energy_source=data["energy_source"],
        )
        agent = selectors.agent_get(name=agent.name)
        return Response(
            AgentSerializer(agent).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


class EnrolmentCreateView(APIView):
    """An admin issues a one-time enrolment token for an agent name (shown once)."""

    permission_classes = [allows(access.can_enrol_agents)]

    @extend_schema(request=EnrolmentCreateSerializer, responses={201: EnrolmentCreatedSerializer})
    def post(self, request: Request) -> Response:
        serializer = EnrolmentCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        created = enrolment.agent_enrolment_create(actor=request.user, **serializer.validated_data)
        body = {
            "agent_name": created.enrolment.agent_name,
            "token": created.raw_token,
            "expires_at": created.enrolment.expires_at,
        }
        return Response(EnrolmentCreatedSerializer(body).data, status=status.HTTP_201_CREATED)


class AgentEnrolView(APIView):
    """An agent trades its enrolment token, once, for its own credentials; the token is
    the credential, so no other authentication is asked."""

    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    @extend_schema(request=EnrolSerializer, responses={201: EnrolledSerializer})
    def post(self, request: Request) -> Response:
        serializer = EnrolSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        credentials = enrolment.agent_enrol(token=serializer.validated_data["token"])
        return Response(EnrolledSerializer(credentials).data, status=status.HTTP_201_CREATED)
