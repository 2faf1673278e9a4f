#!/usr/bin/env bash
# `make demo`: migrate the demo database, seed it, and run every process of the
# product with honcho. Ctrl-C stops them all.
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBUG="${DEBUG:-1}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
export WEB_PORT="${WEB_PORT:-8000}"
export DEMO_DIR="${DEMO_DIR:-$PWD/.demo}"
export LOG_FORMAT="${LOG_FORMAT:-plain}"
export PYTHONUNBUFFERED=1
mkdir -p "$DEMO_DIR"

if ! .venv/bin/python - "$REDIS_URL" <<'PY'
import sys, redis
try:
    redis.Redis.from_url(sys.argv[1], socket_connect_timeout=2).ping()
except redis.RedisError as exc:
    sys.exit(f"{exc}")
PY
then
  cat >&2 <<MSG

The demo needs Redis and none answers at REDIS_URL=$REDIS_URL.
Start one, then run 'make demo' again:
    redis-server --daemonize yes --port 6379
or point REDIS_URL at an existing server (e.g. REDIS_URL=redis://host:6379/0 make demo).
MSG
  exit 1
fi

echo "demo: migrating ${DATABASE_URL:-the SQLite file in $DEMO_DIR}"
.venv/bin/python manage.py migrate --noinput
.venv/bin/python manage.py seed_demo

cat <<MSG

  Dashboard:  http://127.0.0.1:${WEB_PORT}/
  REST API:   http://127.0.0.1:${WEB_PORT}/api/docs/
  Readiness:  http://127.0.0.1:${WEB_PORT}/readyz
  (credentials above; Ctrl-C stops every process)

MSG
exec .venv/bin/honcho start -f Procfile
