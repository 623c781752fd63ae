#!/bin/sh
# Installs a quillcache wheel with its online extra (the gateway, the engine simulator)
# into a new virtual environment, pinned by the project's lock: the image's runtime
# stage runs it (deploy/Dockerfile), and tests/deploy runs it to try the image's
# commands from a fresh venv of the same wheel where there is no Docker daemon.
# Usage: install-wheel.sh VENV_DIR WHEEL LOCK_FILE   (PYTHON: the interpreter, python3)
set -eu
venv=${1:?usage: install-wheel.sh VENV_DIR WHEEL LOCK_FILE}
wheel=${2:?usage: install-wheel.sh VENV_DIR WHEEL LOCK_FILE}
lock=${3:?usage: install-wheel.sh VENV_DIR WHEEL LOCK_FILE}
case "$wheel" in
  *.whl) ;;
  *) echo "install-wheel.sh: $wheel is not a wheel (*.whl)" >&2; exit 2 ;;
esac
[ -f "$wheel" ] || { echo "install-wheel.sh: no such wheel: $wheel" >&2; exit 2; }
[ -f "$lock" ] || { echo "install-wheel.sh: no such lock file: $lock" >&2; exit 2; }
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-cache-dir --disable-pip-version-check \
  -c "$lock" "${wheel}[online]"
"$venv/bin/quillcache" --version
