"""REST routes of this app, mounted under /api/v1/."""

from rest_framework.routers import SimpleRouter

from controlplane.audit import views

router = SimpleRouter()
router.register("audit-events", views.AuditEventViewSet, basename="audit-event")

urlpatterns = router.urls
