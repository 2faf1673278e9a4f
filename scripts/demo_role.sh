#!/usr/bin/env bash
# `scripts/demo_role.sh ROLE COMMAND...`: run one demo process with its role's Redis user
# only (the Procfile's lines go through it). Roles: web (the control plane's user, the
# gateway's, and the admin user for agent enrolment), controlplane (worker, beat, story),
# ingest, none (agents, which use their own enrolled user, and the load generator).
set -euo pipefail
role="$1"; shift
admin="$REDIS_ADMIN_URL" controlplane="$REDIS_CONTROLPLANE_URL"
ingest="$REDIS_INGEST_URL" gateway="$REDIS_GATEWAY_URL"
unset REDIS_ADMIN_URL REDIS_CONTROLPLANE_URL REDIS_INGEST_URL REDIS_GATEWAY_URL \
  REDIS_URL GATEWAY_REDIS_URL INGEST_REDIS_URL \
  REDIS_ADMIN_PASSWORD REDIS_CONTROLPLANE_PASSWORD REDIS_INGEST_PASSWORD REDIS_GATEWAY_PASSWORD
case "$role" in
  web) export REDIS_URL="$controlplane" GATEWAY_REDIS_URL="$gateway" REDIS_ADMIN_URL="$admin" ;;
  controlplane) export REDIS_URL="$controlplane" ;;
  ingest) export REDIS_URL="$ingest" ;;
  none) ;;
  *) echo "demo_role.sh: unknown role $role" >&2; exit 2 ;;
esac
exec "$@"
