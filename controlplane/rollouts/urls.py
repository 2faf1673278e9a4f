"""REST routes of this app, mounted under /api/v1/."""

from rest_framework.routers import SimpleRouter

from controlplane.rollouts import views

router = SimpleRouter()
router.register("deployments", views.DeploymentViewSet, basename="deployment")
router.register("rollouts", views.RolloutViewSet, basename="rollout")
router.register("webhooks", views.WebhookEndpointViewSet, basename="webhook")

urlpatterns = router.urls
