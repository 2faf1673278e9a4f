"""The gateway alone, for a separate `gateway` process:

    uvicorn controlplane.gateway.asgi:application --host 0.0.0.0 --port 8001

Same code as the /v1/ mount inside `web`, plus /healthz, /readyz and /metrics
(controlplane/gateway/probes.py); everything else outside /v1/ answers 404.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django

django.setup()

from contracts.tracing import tracing_configure  # noqa: E402
from controlplane.gateway.app import Gateway  # noqa: E402
from controlplane.gateway.probes import with_probes  # noqa: E402

tracing_configure("gateway")
application = with_probes(Gateway())
