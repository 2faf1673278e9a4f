#!/usr/bin/env bash
# Sourced by scripts/demo.sh: the demo's own Redis, with ACLs and the default user off.
#
# Passwords are made once and kept in $DEMO_DIR/redis.env (mode 0600); the server keeps its
# users in $DEMO_DIR/redis/users.acl, so enrolled agents keep theirs across restarts. Exports
# the URL of each role's user for scripts/demo_role.sh.

DEMO_REDIS_PORT="${DEMO_REDIS_PORT:-6380}"
redis_dir="$DEMO_DIR/redis"
mkdir -p "$redis_dir"

if [ ! -f "$DEMO_DIR/redis.env" ]; then
  (
    umask 077
    for role in ADMIN CONTROLPLANE INGEST GATEWAY; do
      echo "REDIS_${role}_PASSWORD=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')"
    done > "$DEMO_DIR/redis.env"
  )
fi
set -a
# shellcheck disable=SC1091
. "$DEMO_DIR/redis.env"
set +a

if [ ! -f "$redis_dir/users.acl" ]; then
  admin_hash=$(printf %s "$REDIS_ADMIN_PASSWORD" | sha256sum | cut -d' ' -f1)
  (umask 077; printf 'user default off\nuser admin on #%s ~* &* +@all\n' "$admin_hash" \
    > "$redis_dir/users.acl")
fi

redis_at() { echo "redis://$1:$2@127.0.0.1:$DEMO_REDIS_PORT/0"; }
export REDIS_ADMIN_URL; REDIS_ADMIN_URL=$(redis_at admin "$REDIS_ADMIN_PASSWORD")
export REDIS_CONTROLPLANE_URL; REDIS_CONTROLPLANE_URL=$(redis_at controlplane "$REDIS_CONTROLPLANE_PASSWORD")
export REDIS_INGEST_URL; REDIS_INGEST_URL=$(redis_at ingest "$REDIS_INGEST_PASSWORD")
export REDIS_GATEWAY_URL; REDIS_GATEWAY_URL=$(redis_at gateway "$REDIS_GATEWAY_PASSWORD")
# Agents are given the server only: they connect as the user their enrolment made.
export AGENT_REDIS_URL="redis://127.0.0.1:$DEMO_REDIS_PORT/0"

admin_ping() { redis-cli -u "$REDIS_ADMIN_URL" --no-auth-warning ping 2>/dev/null | grep -q PONG; }

if ! admin_ping; then
  if redis-cli -p "$DEMO_REDIS_PORT" ping >/dev/null 2>&1 || \
     (exec 3<>"/dev/tcp/127.0.0.1/$DEMO_REDIS_PORT") 2>/dev/null; then
    echo "demo: port $DEMO_REDIS_PORT is taken by another server; set DEMO_REDIS_PORT" >&2
    exit 1
  fi
  echo "demo: starting the demo's Redis on 127.0.0.1:$DEMO_REDIS_PORT (ACLs on, default user off)"
  redis-server --daemonize yes --port "$DEMO_REDIS_PORT" --bind 127.0.0.1 \
    --save "" --appendonly no --dir "$redis_dir" --aclfile "$redis_dir/users.acl" \
    --pidfile "$redis_dir/redis.pid" --logfile "$redis_dir/redis.log"
  for _ in $(seq 1 50); do admin_ping && break; sleep 0.1; done
  admin_ping || { echo "demo: Redis did not start; see $redis_dir/redis.log" >&2; exit 1; }
fi

demo_redis_stop() {
  redis-cli -u "$REDIS_ADMIN_URL" --no-auth-warning shutdown nosave >/dev/null 2>&1 || true
}
