"""Websocket routes."""

from django.urls import path

from controlplane.dashboard.consumers import LiveUpdatesConsumer

websocket_urlpatterns = [
    path("ws/live/", LiveUpdatesConsumer.as_asgi()),
]
