"""ASGI entry point: /v1/ to the gateway, other HTTP to Django, websockets to Channels."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.core.asgi import get_asgi_application

django_application = get_asgi_application()

from contracts.tracing import tracing_configure  # noqa: E402
from controlplane.gateway.app import gateway_mount  # noqa: E402
from controlplane.routing import websocket_urlpatterns  # noqa: E402

tracing_configure("web")

# The gateway is a raw ASGI app: no Django middleware runs on the tenants' hot path.
http_application = gateway_mount(django_application)

application = ProtocolTypeRouter(
    {
        "http": http_application,
        "lifespan": http_application,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        ),
    }
)
