#!/usr/bin/env bash
# `make demo`: migrate the demo database, seed it, and run every process of the
# product with honcho. Ctrl-C stops them all.
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBUG="${DEBUG:-1}"
export WEB_PORT="${WEB_PORT:-8000}"
export DEMO_DIR="${DEMO_DIR:-$PWD/.demo}"
export LOG_FORMAT="${LOG_FORMAT:-text}"
export PYTHONUNBUFFERED=1
mkdir -p "$DEMO_DIR"

command -v redis-server >/dev/null || {
  echo "The demo runs its own Redis and needs redis-server (apt-get install redis-server)." >&2
  exit 1
}
# shellcheck source=scripts/demo_redis.sh
. scripts/demo_redis.sh
export REDIS_URL="$REDIS_CONTROLPLANE_URL"  # migrate and seed run as the control plane

# A new demo database must not meet streams, routing tables and queued tasks left
# in Redis by an earlier demo whose database was removed.
if [ -z "${DATABASE_URL:-}" ] && [ ! -f "$DEMO_DIR/controlplane.sqlite3" ]; then
  echo "demo: new demo database; emptying the demo's Redis"
  redis-cli -u "$REDIS_ADMIN_URL" --no-auth-warning flushdb >/dev/null
fi

echo "demo: migrating ${DATABASE_URL:-the SQLite file in $DEMO_DIR}"
.venv/bin/python manage.py migrate --noinput
.venv/bin/python manage.py redis_users
.venv/bin/python manage.py seed_demo

cat <<MSG

  Dashboard:  http://127.0.0.1:${WEB_PORT}/
  REST API:   http://127.0.0.1:${WEB_PORT}/api/docs/
  Readiness:  http://127.0.0.1:${WEB_PORT}/readyz
  (credentials above; Ctrl-C stops every process)

MSG
trap demo_redis_stop EXIT
unset REDIS_URL
.venv/bin/honcho start -f Procfile
