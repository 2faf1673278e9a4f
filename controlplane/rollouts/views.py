"""Rollouts API: thin views that parse, fetch by id, call one service and serialize.

Reads: staff (admin, release manager, on-call, viewer). Create, promote, resume, abort,
retry: release managers and admins (`can_steer_rollouts`). Pause and roll back: also
on-call (`can_pause_or_rollback`); so is a deployment's undo (`can_undo_deployment`).
Webhooks: release managers and admins.
"""

from typing import Any

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.core import access
from controlplane.core.permissions import allows, allows_by_method
from controlplane.rollouts import deployments, selectors, transitions, webhooks
from controlplane.rollouts.replicas import deployment_replicas_set
from controlplane.rollouts.serializers import (
    AnalysisRunSerializer,
    DeploymentCreateSerializer,
    DeploymentRevisionSerializer,
    DeploymentSerializer,
    PromoteSerializer,
    ReplicasSerializer,
    RolloutCreateSerializer,
    RolloutSerializer,
    ScalingDecisionSerializer,
    TransitionSerializer,
    UndoResultSerializer,
    UndoSerializer,
    WebhookDeliverySerializer,
    WebhookEndpointCreateSerializer,
    WebhookEndpointSerializer,
)
from controlplane.rollouts.undo import deployment_undo

ReadStaffSteer = allows_by_method(read=access.is_staff_reader, write=access.can_steer_rollouts)


class DeploymentViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Deployments by name: /api/v1/deployments/{name}/."""

    permission_classes = [ReadStaffSteer]
    serializer_class = DeploymentSerializer
    filterset_fields = ["name"]
    ordering_fields = ["name", "created_at"]
    lookup_field = "name"
    lookup_value_regex = r"[a-z0-9._-]{1,100}"

    def get_queryset(self):
        return selectors.deployment_list()

    @extend_schema(request=DeploymentCreateSerializer, responses={201: DeploymentSerializer})
    def create(self, request: Request) -> Response:
        serializer = DeploymentCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        deployment = deployments.deployment_create(actor=request.user, **serializer.validated_data)
        return Response(DeploymentSerializer(deployment).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        request=UndoSerializer,
        responses={
            200: UndoResultSerializer,
            400: OpenApiResponse(description="reason_required, reason_too_long"),
            404: OpenApiResponse(description="not_found: no such deployment"),
            409: OpenApiResponse(
                description="rollout_in_progress (roll it back or abort it instead),"
                " no_previous_stable, previous_version_revoked, previous_version_not_deployable"
            ),
        },
    )
    @action(detail=True, methods=["post"], permission_classes=[allows(access.can_undo_deployment)])
    def undo(self, request: Request, name: str) -> Response:
        """Put the previous stable version back at once, without a rollout or its gate."""
        serializer = UndoSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        result = deployment_undo(
            actor=request.user, deployment_name=name, reason=serializer.validated_data["reason"]
        )
        deployment = selectors.deployment_list().get(pk=result.deployment.pk)
        return Response(
            UndoResultSerializer(
                {"deployment": deployment, "revision": result.revision, "switch": result.switch}
            ).data
        )

    @extend_schema(responses={200: DeploymentRevisionSerializer(many=True)})
    @action(detail=True, methods=["get"])
    def revisions(self, request: Request, name: str) -> Response:
        """Every change of the stable version (created, promoted, undone), newest first."""
        deployment = self.get_object()
        page = self.paginate_queryset(selectors.deployment_revision_list(deployment=deployment))
        return self.get_paginated_response(DeploymentRevisionSerializer(page, many=True).data)

    @extend_schema(
        request=ReplicasSerializer,
        responses={
            200: DeploymentSerializer,
            400: OpenApiResponse(
                description="invalid_replicas, invalid_autoscaling, reason_required,"
                " reason_too_long"
            ),
        },
    )
    @action(detail=True, methods=["post"])
    def replicas(self, request: Request, name: str) -> Response:
        """Set the stable version's replica bounds and, optionally, its autoscaling policy."""
        deployment = self.get_object()
        serializer = ReplicasSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        deployment_replicas_set(
            actor=request.user,
            deployment=deployment,
            stable_min=data["stable_replicas_min"],
            stable_max=data["stable_replicas_max"],
            autoscaling=data["autoscaling"],
            reason=data["reason"],
        )
        return Response(
            DeploymentSerializer(selectors.deployment_list().get(pk=deployment.pk)).data
        )

    @extend_schema(responses={200: ScalingDecisionSerializer(many=True)})
    @action(detail=True, methods=["get"], url_path="scaling-decisions")
    def scaling_decisions(self, request: Request, name: str) -> Response:
        """Every change of desired replicas, with its reason and figures, newest first."""
        deployment = self.get_object()
        page = self.paginate_queryset(selectors.scaling_decision_list(deployment=deployment))
        return self.get_paginated_response(ScalingDecisionSerializer(page, many=True).data)


class RolloutViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Rollouts: pending -> gating -> running (stages) -> promoted; see docs/rollouts.md."""

    permission_classes = [ReadStaffSteer]
    serializer_class = RolloutSerializer
    filterset_fields = ["state", "deployment__name", "candidate"]
    ordering_fields = ["created_at", "state"]

    def get_queryset(self):
        return selectors.rollout_list()

    def _respond(self, rollout: Any) -> Response:
        return Response(RolloutSerializer(selectors.rollout_list().get(pk=rollout.pk)).data)

    @extend_schema(request=RolloutCreateSerializer, responses={201: RolloutSerializer})
    def create(self, request: Request) -> Response:
        serializer = RolloutCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        rollout = deployments.rollout_create(actor=request.user, **serializer.service_arguments())
        rollout = selectors.rollout_list().get(pk=rollout.pk)
        return Response(RolloutSerializer(rollout).data, status=status.HTTP_201_CREATED)

    def _transition(
        self, request: Request, pk: str, service: Any, serializer_class: Any
    ) -> Response:
        rollout = self.get_object()
        serializer = serializer_class(data=request.data)
        serializer.is_valid(raise_exception=True)
        result = service(actor=request.user, rollout_id=rollout.pk, **serializer.validated_data)
        return self._respond(result)

    @extend_schema(request=PromoteSerializer, responses={200: RolloutSerializer})
    @action(detail=True, methods=["post"])
    def promote(self, request: Request, pk: str) -> Response:
        """Next stage (or promoted after the last); `full: true` promotes at once."""
        return self._transition(request, pk, transitions.rollout_advance, PromoteSerializer)

    @extend_schema(request=TransitionSerializer, responses={200: RolloutSerializer})
    @action(
        detail=True, methods=["post"], permission_classes=[allows(access.can_pause_or_rollback)]
    )
    def pause(self, request: Request, pk: str) -> Response:
        return self._transition(request, pk, transitions.rollout_pause, TransitionSerializer)

    @extend_schema(request=TransitionSerializer, responses={200: RolloutSerializer})
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, pk: str) -> Response:
        return self._transition(request, pk, transitions.rollout_resume, TransitionSerializer)

    @extend_schema(request=TransitionSerializer, responses={200: RolloutSerializer})
    @action(
        detail=True,
        methods=["post"],
        url_path="rollback",
        permission_classes=[allows(access.can_pause_or_rollback)],
    )
    def rollback(self, request: Request, pk: str) -> Response:
        return self._transition(request, pk, transitions.rollout_rollback, TransitionSerializer)

    @extend_schema(request=TransitionSerializer, responses={200: RolloutSerializer})
    @action(detail=True, methods=["post"])
    def abort(self, request: Request, pk: str) -> Response:
        return self._transition(request, pk, transitions.rollout_abort, TransitionSerializer)

    @extend_schema(request=TransitionSerializer, responses={200: RolloutSerializer})
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str) -> Response:
        return self._transition(request, pk, transitions.rollout_retry, TransitionSerializer)

    @extend_schema(responses={200: AnalysisRunSerializer(many=True)})
    @action(detail=True, methods=["get"], url_path="analysis-runs")
    def analysis_runs(self, request: Request, pk: str) -> Response:
        rollout = self.get_object()
        page = self.paginate_queryset(selectors.analysis_run_list(rollout=rollout))
        return self.get_paginated_response(AnalysisRunSerializer(page, many=True).data)


class WebhookEndpointViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    permission_classes = [ReadStaffSteer]
    serializer_class = WebhookEndpointSerializer

    def get_queryset(self):
        return selectors.webhook_endpoint_list()

    @extend_schema(
        request=WebhookEndpointCreateSerializer, responses={201: WebhookEndpointSerializer}
    )
    def create(self, request: Request) -> Response:
        serializer = WebhookEndpointCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        endpoint = webhooks.webhook_endpoint_create(actor=request.user, **serializer.validated_data)
        return Response(WebhookEndpointSerializer(endpoint).data, status=status.HTTP_201_CREATED)

    def destroy(self, request: Request, pk: str) -> Response:
        webhooks.webhook_endpoint_delete(actor=request.user, endpoint=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(responses={200: WebhookDeliverySerializer(many=True)})
    @action(detail=True, methods=["get"])
    def deliveries(self, request: Request, pk: str) -> Response:
        endpoint = self.get_object()
        page = self.paginate_queryset(selectors.webhook_delivery_list().filter(endpoint=endpoint))
        return self.get_paginated_response(WebhookDeliverySerializer(page, many=True).data)
