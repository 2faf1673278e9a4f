"""REST routes of this app, mounted under /api/v1/."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from controlplane.accounts import views

router = SimpleRouter()
router.register("tokens", views.AccessTokenViewSet, basename="access-token")
router.register("users", views.UserViewSet, basename="user")

urlpatterns = [
    path("me/", views.MeView.as_view(), name="me"),
    *router.urls,
]
