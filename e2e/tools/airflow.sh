#!/usr/bin/env bash
# Installs a real Apache Airflow the Airflow tests run into its own virtualenv, cached outside the
# repository keyed by the pins and the Python version, so its dependencies never meet vramshare's.
# A warm cache makes this a no-op. Flavours: airflow (Airflow 3, pinned in airflow/requirements.txt)
# and airflow2 (Airflow 2, pinned in airflow2/requirements.txt; the pool sync's REST API v1 tests).
#
# Usage: e2e/tools/airflow.sh [airflow|airflow2]   Prints nothing on stdout but the virtualenv's bin
# directory.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
flavour=${1:-airflow}
[[ -f "$here/$flavour/requirements.txt" ]] || { echo "unknown Airflow flavour: $flavour" >&2; exit 2; }
cache_root=${VRAMSHARE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vramshare}
python=${PYTHON:-python3}
py_version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key=$(cat "$here/$flavour/requirements.txt" "$0" | sha256sum | cut -c1-12)
venv="$cache_root/$flavour-py$py_version-$key"

log() { printf '[vramshare airflow] %s\n' "$*" >&2; }

if [[ ! -f "$venv/.installed" ]]; then
  log "installing $(grep -v '^#' "$here/$flavour/requirements.txt" | xargs) into $venv (once; about 2 minutes)"
  start=$SECONDS
  # Built where it stays (a virtualenv's scripts name its path); .installed marks it complete.
  rm -rf "$venv"
  mkdir -p "$cache_root"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/$flavour/requirements.txt" >&2
  "$venv/bin/airflow" version >/dev/null
  touch "$venv/.installed"
  log "installed in $((SECONDS - start)) s"
  # Older keyed installs are dead weight.
  find "$cache_root" -maxdepth 1 -name "$flavour-py*" ! -path "$venv" -exec rm -rf {} + 2>/dev/null || true
fi
echo "$venv/bin"
