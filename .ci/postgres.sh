#!/usr/bin/env bash
# Start a real PostgreSQL server for the ledger tests (Debian package). Prints its URL as the only
# line on stdout; everything else goes to stderr.
set -euo pipefail
{
  if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$(pg_lsclusters -h 2>/dev/null)" ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq postgresql
  fi
  read -r ver cluster _ <<<"$(pg_lsclusters -h | head -n 1)"
  pg_ctlcluster "$ver" "$cluster" start || true
  for _ in $(seq 1 30); do
    su postgres -c "psql -tAc 'select 1'" >/dev/null 2>&1 && break
    sleep 1
  done
  su postgres -c "psql -tAc \"SELECT 1 FROM pg_roles WHERE rolname='privalign'\"" | grep -q 1 ||
    su postgres -c "psql -qc \"CREATE ROLE privalign LOGIN SUPERUSER PASSWORD 'privalign'\""
  su postgres -c "psql -tAc \"SELECT 1 FROM pg_database WHERE datname='privalign'\"" | grep -q 1 ||
    su postgres -c "createdb -O privalign privalign"
} >&2
echo "postgresql://privalign:privalign@127.0.0.1:5432/privalign"
