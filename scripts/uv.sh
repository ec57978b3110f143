# Sourced by the set-up scripts: puts uv on PATH, installing it if needed, without touching the
# system Python (PEP 668: Debian's and Ubuntu's python3 refuse `pip install` and `--user`).
# uv goes into its own virtual environment in the cache, so a fresh machine needs only python3
# with its venv module (installed with apt-get when missing, as on a bare Ubuntu).
if ! command -v uv >/dev/null 2>&1; then
  _uv_home="${XDG_CACHE_HOME:-$HOME/.cache}/fleet-controlplane/uv"
  if [[ ! -x "$_uv_home/bin/uv" ]]; then
    echo "setup: installing uv into $_uv_home"
    if ! "${PYTHON:-python3}" -m venv --clear "$_uv_home" >/dev/null 2>&1; then
      echo "setup: python3 cannot make a virtual environment; installing python3-venv with apt-get"
      if ((EUID == 0)); then
        _as_root=()
      elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        _as_root=(sudo -n)
      else
        echo "setup: not root and no passwordless sudo: run \`sudo apt-get install python3-venv\`, then this again" >&2
        return 1
      fi
      "${_as_root[@]}" apt-get update -qq &&
        "${_as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
      "${PYTHON:-python3}" -m venv --clear "$_uv_home"
    fi
    "$_uv_home/bin/python" -m pip install -q --disable-pip-version-check uv
  fi
  export PATH="$_uv_home/bin:$PATH"
fi
