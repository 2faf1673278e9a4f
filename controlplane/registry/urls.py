"""REST routes of this app, mounted under /api/v1/."""

urlpatterns: list = []
