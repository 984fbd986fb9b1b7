#!/usr/bin/env bash
# Installs the Debian packages the test suite needs and makes sure PostgreSQL is up.
# Idempotent and quiet when everything is already there.
set -euo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v pg_isready >/dev/null || need+=(postgresql-15)
# The dashboard page's browser test (tests/e2e/test_web_ui.py) drives the distribution's Chromium through Playwright;
# `playwright install` (a browser download) is never needed.
command -v chromium >/dev/null || need+=(chromium fonts-dejavu-core)
# The one-pass checksum kernel (agent/attnchecker/kernels/fused_pass.c) is compiled on first use; its tests need a compiler.
command -v cc >/dev/null || need+=(gcc libc6-dev)
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # policy-rc.d keeps the packages' services from starting: the tests start their own Prometheus.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -qq --no-install-recommends $(printf '%s\n' "${need[@]}" | sort -u) >/dev/null
  rm -f /usr/sbin/policy-rc.d
fi
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg_ctlcluster --skip-systemctl-redirect 15 main start || pg_ctlcluster 15 main start
  for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
