"""REST routes of this app, mounted under /api/v1/."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from controlplane.tenants import views

router = SimpleRouter()
router.register("tenants", views.TenantViewSet, basename="tenant")
router.register(r"tenants/(?P<tenant_pk>[^/.]+)/api-keys", views.ApiKeyViewSet, basename="api-key")

urlpatterns = [
    path("tenants/<str:tenant_pk>/usage/", views.UsageView.as_view(), name="tenant-usage"),
    *router.urls,
]
