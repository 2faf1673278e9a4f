#!/usr/bin/env bash
# `make demo`: migrate the demo database, seed it, and run every process of the
# product with honcho. Ctrl-C stops them all.
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBUG="${DEBUG:-1}"
# The demo keeps to a Redis database of its own, so that it can start clean.
DEMO_OWNS_REDIS=0
if [ -z "${REDIS_URL:-}" ]; then DEMO_OWNS_REDIS=1; fi
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/3}"
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

# A new demo database must not meet streams, routing tables and queued tasks left
# in Redis by an earlier demo whose database was removed.
if [ -z "${DATABASE_URL:-}" ] && [ ! -f "$DEMO_DIR/controlplane.sqlite3" ] && [ "$DEMO_OWNS_REDIS" = 1 ]; then
  echo "demo: new demo database; emptying the demo's Redis database ($REDIS_URL)"
  .venv/bin/python -c "import redis, sys; redis.Redis.from_url(sys.argv[1]).flushdb()" "$REDIS_URL"
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
