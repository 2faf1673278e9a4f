"""Settings, read from the environment.

Every knob an operator turns is an environment variable: DATABASE_URL, REDIS_URL,
SECRET_KEY, DEBUG, ALLOWED_HOSTS, ARTIFACT_ROOT. Outside DEBUG the defaults are
the secure ones and a missing SECRET_KEY is an error.
"""

import hmac
import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from contracts.logs import logging_config

BASE_DIR = Path(__file__).resolve().parent.parent


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    if value.lower() in {"1", "true", "yes", "on"}:
        return True
    if value.lower() in {"0", "false", "no", "off", ""}:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (1/0, true/false), got {value!r}")


def env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def env_key(name: str, *, label: bytes, secret_key: str) -> bytes:
    """A key between the parts: `name` from the environment (at least 32 bytes, e.g.
    `openssl rand -hex 32`), else derived from SECRET_KEY under `label`, which keeps it
    apart from SECRET_KEY's other uses (fine wherever every process shares SECRET_KEY)."""
    if name in os.environ:
        key = os.environ[name].encode()
        if len(key) < 32:
            raise ImproperlyConfigured(f"{name} must be at least 32 bytes")
        return key
    return hmac.digest(secret_key.encode(), label, "sha256")


DEBUG = env_bool("DEBUG", default=False)

SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off")
    SECRET_KEY = "insecure-development-key-only-for-debug"  # noqa: S105

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]" if DEBUG else "")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", "")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI and Redoc served from our static files, no CDN
    "channels",
    "controlplane.core",
    "controlplane.accounts",
    "controlplane.audit",
    "controlplane.registry",
    "controlplane.tenants",
    "controlplane.fleet",
    "controlplane.rollouts",
    "controlplane.gateway",
    "controlplane.telemetry",
    "controlplane.dashboard",
    "controlplane.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

if not DEBUG:
    # Serves STATIC_ROOT before any other middleware runs; under DEBUG staticfiles' own view
    # serves the source folders (dashboard/urls.py) and there is no STATIC_ROOT to read.
    MIDDLEWARE.insert(1, "whitenoise.middleware.WhiteNoiseMiddleware")

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# The demo runs on a SQLite file; everything else (tests included) on PostgreSQL.
DEMO_DIR = Path(os.environ.get("DEMO_DIR", BASE_DIR / ".demo"))
DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", f"sqlite:///{DEMO_DIR / 'controlplane.sqlite3'}"),
        conn_max_age=int(os.environ.get("DATABASE_CONN_MAX_AGE", "60")),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes share the demo file: wait for the write lock instead of failing.
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Each process connects as its role's Redis user (contracts/redis_roles.py): REDIS_URL is
# this process's own; a web process that also serves the gateway, and tests that run every
# role in one process, name the gateway's and ingest's users apart. REDIS_ADMIN_URL
# manages users (`manage.py redis_users`, agent enrolment) and nothing else.
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
GATEWAY_REDIS_URL = os.environ.get("GATEWAY_REDIS_URL", REDIS_URL)
INGEST_REDIS_URL = os.environ.get("INGEST_REDIS_URL", REDIS_URL)
REDIS_ADMIN_URL = os.environ.get("REDIS_ADMIN_URL", REDIS_URL)
# Timeouts of the control plane's Redis clients (core/redis_clients.py), in seconds.
REDIS_SOCKET_TIMEOUT_S = float(os.environ.get("REDIS_SOCKET_TIMEOUT_S", "5"))
REDIS_CONNECT_TIMEOUT_S = float(os.environ.get("REDIS_CONNECT_TIMEOUT_S", "2"))
REDIS_STREAM_TIMEOUT_S = float(os.environ.get("REDIS_STREAM_TIMEOUT_S", "10"))
GATEWAY_REDIS_TIMEOUT_S = float(os.environ.get("GATEWAY_REDIS_TIMEOUT_S", "2"))

CHANNELS_PREFIX = os.environ.get("CHANNELS_PREFIX", "asgi")
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            "hosts": [REDIS_URL],
            "prefix": CHANNELS_PREFIX,
            "capacity": 1000,
            "expiry": 30,
        },
    }
}

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", REDIS_URL)
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_QUEUE", "controlplane")
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_EXPIRES = 3600
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 600}
CELERY_TIMEZONE = "UTC"
# Periodic tasks; each domain block below adds its own entries.
CELERY_BEAT_SCHEDULE: dict[str, dict] = {}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT", BASE_DIR / ".static-collected"))
# Outside DEBUG files are served from STATIC_ROOT (`manage.py collectstatic`, run when the
# image is built) under content-hashed names, cached for good, compressed copies alongside;
# under DEBUG (the demo and the tests) straight from the source folders, no collectstatic.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        if DEBUG
        else "whitenoise.storage.CompressedManifestStaticFilesStorage"
    },
}

LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

ARTIFACT_ROOT = Path(os.environ.get("ARTIFACT_ROOT", DEMO_DIR / "artifacts"))

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # First, so an unauthenticated request is answered 401 with WWW-Authenticate: Bearer.
        "controlplane.accounts.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": [
        "controlplane.core.parsers.JSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "controlplane.core.errors.api_exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Fleet control plane API",
    "DESCRIPTION": "Model registry, tenants, fleet and rollouts.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # The drf-spectacular-sidecar package's copies, so /api/docs/ loads nothing from elsewhere.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# Secure defaults; DEBUG (the local demo over plain HTTP) relaxes the transport ones.
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = False  # the dashboard's htmx reads it to send X-CSRFToken
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SECURE_REFERRER_POLICY = "same-origin"
if not DEBUG:
    SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", True)
    CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", True)
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SECURE_HSTS_SECONDS = int(os.environ.get("SECURE_HSTS_SECONDS", "31536000"))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    # Health probes come from load balancers over plain HTTP.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]

# One JSON object per line by default (LOG_FORMAT=text for people), as every process logs:
# contracts/logs.py. A bad LOG_FORMAT or LOG_LEVEL stops the process with its name.
LOGGING_CONFIG = "contracts.logs.logging_apply"
LOGGING = logging_config()
LOGGING["loggers"]["django.db.backends"] = {"level": "WARNING"}

# Registry and tenants
# The largest artifact an upload (or register_artifact) accepts, in bytes.
ARTIFACT_MAX_BYTES = int(os.environ.get("ARTIFACT_MAX_BYTES", str(8 * 1024**3)))
# Chunk size for streaming artifacts in and out.
ARTIFACT_CHUNK_BYTES = 1024 * 1024
# Name the registry's, tenants' and accounts' choice sets in the OpenAPI schema, so that other
# apps' fields of the same name ("status", "kind") never collide with them.
SPECTACULAR_SETTINGS["ENUM_NAME_OVERRIDES"] = {
    "ModelTaskEnum": "controlplane.registry.models.Task",
    "ArtifactFormatEnum": "controlplane.registry.models.ArtifactFormat",
    "VersionStatusEnum": "controlplane.registry.models.VersionStatus",
    "EvalKindEnum": "controlplane.registry.models.EvalKind",
    "PromptLoggingEnum": "controlplane.tenants.models.PromptLogging",
    "ApiKeyScopeEnum": "controlplane.tenants.models.ApiKeyScope",
    "RoleEnum": "controlplane.core.roles.Role",
    "EngineFailureEnum": "contracts.streams.EngineFailure",
}

# Gateway
# Key grants and routing tables are cached in memory; pub/sub invalidates them at once and
# these TTLs bound how stale a cache can be when a message is lost.
GATEWAY_KEY_CACHE_TTL_S = float(os.environ.get("GATEWAY_KEY_CACHE_TTL_S", "30"))
# Failed authentications per client address and minute before unknown keys from it are
# refused without a database lookup (auth_throttle.py).
GATEWAY_AUTH_FAILURES_PER_MINUTE = int(os.environ.get("GATEWAY_AUTH_FAILURES_PER_MINUTE", "20"))
GATEWAY_ROUTING_REFRESH_S = float(os.environ.get("GATEWAY_ROUTING_REFRESH_S", "5"))
GATEWAY_UPSTREAM_CONNECT_TIMEOUT_S = float(
    os.environ.get("GATEWAY_UPSTREAM_CONNECT_TIMEOUT_S", "2")
)
GATEWAY_UPSTREAM_READ_TIMEOUT_S = float(os.environ.get("GATEWAY_UPSTREAM_READ_TIMEOUT_S", "300"))
GATEWAY_MAX_BODY_BYTES = int(os.environ.get("GATEWAY_MAX_BODY_BYTES", str(4 * 1024 * 1024)))
# Requests-stream entries that cannot be written to Redis wait in this bounded spool.
GATEWAY_SPOOL_DIR = Path(os.environ.get("GATEWAY_SPOOL_DIR", DEMO_DIR / "gateway-spool"))
GATEWAY_SPOOL_MAX_BYTES = int(os.environ.get("GATEWAY_SPOOL_MAX_BYTES", str(64 * 1024 * 1024)))
GATEWAY_SPOOL_RETRY_S = float(os.environ.get("GATEWAY_SPOOL_RETRY_S", "2"))
# Only ingest trims the requests stream (below what it acknowledged); while the stream holds
# this many entries (about 220 bytes each in Redis), gateways spool new ones instead.
GATEWAY_REQUESTS_STREAM_MAX_LENGTH = int(
    os.environ.get("GATEWAY_REQUESTS_STREAM_MAX_LENGTH", "5000000")
)
if GATEWAY_REQUESTS_STREAM_MAX_LENGTH < 1:
    raise ImproperlyConfigured("GATEWAY_REQUESTS_STREAM_MAX_LENGTH must be at least 1")
# The key gateways sign requests-stream entries with and ingest verifies (the entry's
# `mac`), the same for every gateway and ingest process.
TELEMETRY_RECORD_KEY = env_key(
    "TELEMETRY_RECORD_KEY", label=b"controlplane.telemetry.record-key", secret_key=SECRET_KEY
)
# Copies of requests mirrored to shadow versions at once per gateway process; one beyond
# is dropped (gateway_shadow_requests_total{outcome="dropped"}).
GATEWAY_SHADOW_MAX_IN_FLIGHT = int(os.environ.get("GATEWAY_SHADOW_MAX_IN_FLIGHT", "32"))
if GATEWAY_SHADOW_MAX_IN_FLIGHT < 0:
    raise ImproperlyConfigured("GATEWAY_SHADOW_MAX_IN_FLIGHT must be 0 or more")
# Tokens reserved against tokens_per_minute for a request without max_tokens.
GATEWAY_DEFAULT_COMPLETION_TOKENS = int(os.environ.get("GATEWAY_DEFAULT_COMPLETION_TOKENS", "256"))
# Settled fleet energy rollups are attributed to tenants by tokens this often.
CELERY_BEAT_SCHEDULE["telemetry-attribute-energy"] = {
    "task": "telemetry.attribute_energy",
    "schedule": 30.0,
}
# Tenants' prompt records and request samples past their retention_days, in batches.
CELERY_BEAT_SCHEDULE["telemetry-apply-retention"] = {
    "task": "telemetry.apply_retention",
    "schedule": 3600.0,
}

# Fleet and telemetry
# Agents heartbeat every FLEET_HEARTBEAT_INTERVAL_S; ingest marks one `lost` after
# FLEET_LOST_AFTER_S without a heartbeat (three missed), keeps 10-second rollups for
# FLEET_SAMPLE_RETENTION_S.
FLEET_HEARTBEAT_INTERVAL_S = float(os.environ.get("FLEET_HEARTBEAT_INTERVAL_S", "1.0"))
# A heartbeat sent further than this ahead of ingest's clock, or behind the time Redis
# took it, is refused (fleet_heartbeats_refused_total): agents' clocks must be in sync.
FLEET_HEARTBEAT_MAX_SKEW_S = float(os.environ.get("FLEET_HEARTBEAT_MAX_SKEW_S", "10"))
FLEET_LOST_AFTER_S = float(
    os.environ.get("FLEET_LOST_AFTER_S", str(3 * FLEET_HEARTBEAT_INTERVAL_S))
)
FLEET_SAMPLE_RETENTION_S = int(os.environ.get("FLEET_SAMPLE_RETENTION_S", str(7 * 24 * 3600)))
FLEET_COMMAND_TTL_S = float(os.environ.get("FLEET_COMMAND_TTL_S", "300"))
# An agent enrolment token is good for this long (and once).
FLEET_ENROLMENT_TTL_S = float(os.environ.get("FLEET_ENROLMENT_TTL_S", str(24 * 3600)))
# The key engine secrets are derived from (controlplane.fleet.engine_secrets).
FLEET_ENGINE_KEY = env_key("FLEET_ENGINE_KEY", label=b"fleet-engine-key", secret_key=SECRET_KEY)
# The key (its SHA-256 is the seed) of the Ed25519 key pair every command is signed with
# (controlplane.fleet.command_signing); agents hold its public key.
FLEET_COMMAND_SIGNING_KEY = env_key(
    "FLEET_COMMAND_SIGNING_KEY", label=b"fleet-command-signing-key", secret_key=SECRET_KEY
)
# The key each agent's stream key is derived from (controlplane.fleet.stream_keys).
FLEET_AGENT_KEY = env_key("FLEET_AGENT_KEY", label=b"fleet-agent-key", secret_key=SECRET_KEY)

# Rollouts
# Canary analysis runs every this many seconds (10 in the demo).
ROLLOUTS_ANALYSIS_INTERVAL_S = int(os.environ.get("ROLLOUTS_ANALYSIS_INTERVAL_S", "10"))
# The reconciler's periodic pass (it also runs on every change).
ROLLOUTS_RECONCILE_INTERVAL_S = int(os.environ.get("ROLLOUTS_RECONCILE_INTERVAL_S", "5"))
ROLLOUTS_RECONCILE_LOCK_S = 30
# An agent is routable only if its last heartbeat is this recent.
ROLLOUTS_AGENT_FRESH_S = float(os.environ.get("ROLLOUTS_AGENT_FRESH_S", "5"))
# A load or drain command not finished after this long is sent again.
ROLLOUTS_COMMAND_WAIT_S = float(os.environ.get("ROLLOUTS_COMMAND_WAIT_S", "300"))
# A spare agent whose load of a version failed is tried last for that version this long.
ROLLOUTS_LOAD_FAILED_AVOID_S = float(os.environ.get("ROLLOUTS_LOAD_FAILED_AVOID_S", "120"))
# An agent whose version nobody routes to is drained after this grace period.
ROLLOUTS_DRAIN_GRACE_S = float(os.environ.get("ROLLOUTS_DRAIN_GRACE_S", "10"))
# After a promotion (or an undo) the version it replaced stays loaded on a spare agent,
# unrouted, for this long, so that an undo switches back at once (0: not kept).
ROLLOUTS_PREVIOUS_STABLE_WARM_S = float(os.environ.get("ROLLOUTS_PREVIOUS_STABLE_WARM_S", "600"))
ROLLOUTS_WEBHOOK_TIMEOUT_S = float(os.environ.get("ROLLOUTS_WEBHOOK_TIMEOUT_S", "5"))
# Networks (CIDRs, comma-separated) webhook targets may resolve to although they are
# loopback, private or link-local; by default none (rollouts/webhook_targets.py).
ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS = env_list("ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS", "")
CELERY_BEAT_SCHEDULE["rollouts-webhook-sweep"] = {
    "task": "rollouts.webhook_sweep",
    "schedule": 60.0,
}
CELERY_BEAT_SCHEDULE["rollouts-analyze"] = {
    "task": "rollouts.analyze_all",
    "schedule": float(ROLLOUTS_ANALYSIS_INTERVAL_S),
}
# How often deployments with an autoscaling policy are measured and scaled.
ROLLOUTS_AUTOSCALE_INTERVAL_S = float(os.environ.get("ROLLOUTS_AUTOSCALE_INTERVAL_S", "5"))
CELERY_BEAT_SCHEDULE["rollouts-autoscale"] = {
    "task": "rollouts.autoscale",
    "schedule": ROLLOUTS_AUTOSCALE_INTERVAL_S,
}
CELERY_BEAT_SCHEDULE["rollouts-reconcile"] = {
    "task": "rollouts.reconcile_all",
    "schedule": float(ROLLOUTS_RECONCILE_INTERVAL_S),
}
