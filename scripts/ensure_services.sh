#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on 127.0.0.1, starting the machine's own
# services when they do not. Used by `make test` (which needs both).
set -euo pipefail

redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }
postgres_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }

if ! postgres_up; then
  echo "PostgreSQL is not answering on 127.0.0.1:5432; starting it" >&2
  if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  fi
  for _ in $(seq 1 30); do postgres_up && break; sleep 1; done
  postgres_up || { echo "PostgreSQL did not start; start it and run again" >&2; exit 1; }
fi

if ! redis_up; then
  echo "Redis is not answering on 127.0.0.1:6379; starting it" >&2
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 1 30); do redis_up && break; sleep 1; done
  redis_up || { echo "Redis did not start; start it and run again" >&2; exit 1; }
fi
echo "services: PostgreSQL and Redis answer"
