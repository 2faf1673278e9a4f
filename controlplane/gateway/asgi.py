"""The gateway alone, for a separate `gateway` process:

    uvicorn controlplane.gateway.asgi:application --host 0.0.0.0 --port 8001

Same code as the /v1/ mount inside `web`; everything outside /v1/ answers 404.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django

django.setup()

from controlplane.gateway.app import Gateway  # noqa: E402

application = Gateway()
