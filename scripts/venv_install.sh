#!/usr/bin/env bash
# scripts/venv_install.sh PYTHON VENV PIP_ARGS...: pip-install PIP_ARGS into VENV (made with PYTHON when missing).
# The Makefile's installs download a few GB (JetStream's TensorFlow wheel alone is 572 MB), and neither a dropped
# connection nor a failed install may leave a broken venv behind: pip retries and resumes downloads, and an
# install that still fails is started again, up to three times, in a new venv (a half-installed package would
# otherwise count as installed on the next try). Wheels already downloaded come from pip's cache.
set -uo pipefail
python=$1 venv=$2
shift 2
net=(--retries 10 --timeout 60)
for attempt in 1 2 3; do
  if [ "$attempt" -gt 1 ]; then
    echo "installing into $venv failed (attempt $((attempt - 1)) of 3): a new $venv in 30 s" >&2
    sleep 30
    rm -rf "$venv"
  fi
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv" && "$venv/bin/python" -m pip install -q "${net[@]}" --upgrade pip || continue
  fi
  "$venv/bin/python" -m pip install -q "${net[@]}" --resume-retries 30 "$@" && exit 0
done
exit 1
