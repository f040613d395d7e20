#!/usr/bin/env bash
# Install Prometheus (Debian's `prometheus` package: `prometheus` and `promtool`) for the dashboard's
# end-to-end test (tests/system/test_dashboards.py), which starts its own server on a free loopback
# port. Idempotent: does nothing when both binaries are already on PATH. Never fails the caller:
# where it cannot install (not root, no apt-get, no network), it says why and exits 0, and that test
# skips.
set -uo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "install-prometheus: already installed: $(prometheus --version 2>&1 | head -n 1)"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-prometheus: not root, not installing; the Prometheus end-to-end test will skip"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-prometheus: no apt-get here, not installing; the Prometheus end-to-end test will skip"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# The package's maintainer scripts would start a server on :9090 where an init system runs; the
# test starts its own, so keep the package from starting services while it installs.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created_policy=1
fi
status=0
apt-get update -qq || status=$?
if [ "$status" -eq 0 ]; then
    apt-get install -y -qq --no-install-recommends prometheus || status=$?
fi
if [ "$created_policy" -eq 1 ]; then
    rm -f "$policy"
fi
if [ "$status" -ne 0 ]; then
    echo "install-prometheus: apt-get failed (exit $status); the Prometheus end-to-end test will skip"
    exit 0
fi
# Where systemd runs, the unit may have started anyway: stop it, the test needs no shared server.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    systemctl stop prometheus >/dev/null 2>&1 || true
    systemctl disable prometheus >/dev/null 2>&1 || true
fi
echo "install-prometheus: installed: $(prometheus --version 2>&1 | head -n 1)"
