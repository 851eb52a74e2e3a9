# The device machine's set-up, shared by tests/gpu/*.sh: source it from the checkout root
# (`source tests/gpu/env.sh`), then call what the script needs. The GPU image lacks some wheels
# (pyzmq, msgspec, fastapi, ...): they travel in a carried .whl/ and install with pip into a
# --target folder; the checkout itself is the package, imported as `pagedserve` through a
# symlink. Without .whl/ (this machine, a CPU dry run) nothing installs: the caller's environment
# serves. A failing install does not stop a `set -e` script (each step then fails on its own).
#   ps_wheels           .whl/*.whl into /tmp/site, put first on PYTHONPATH
#   ps_wheels_apart DIR .whl/*.whl into DIR once per machine (DIR/.done), left off PYTHONPATH:
#                       for a script that runs another stack beside ours (tests/gpu/vllm_anchor.sh)
#   ps_link             /tmp/pkg/pagedserve -> this checkout (PYTHONPATH left alone)
#   ps_tree             ps_link, and /tmp/pkg first on PYTHONPATH
#   ps_setup            ps_wheels, ps_tree and PYTHONUNBUFFERED=1: what most scripts want
# (bash only; it sets no shell options)

_ps_pip() {  # _ps_pip DIR: install the carried wheels into DIR
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$1" .whl/*.whl
}

ps_wheels() {
  [ -d .whl ] || return 0
  if _ps_pip /tmp/site; then export PYTHONPATH=/tmp/site:${PYTHONPATH:-}; fi
}

ps_wheels_apart() {
  if [ -d .whl ] && [ ! -f "$1/.done" ]; then
    if _ps_pip "$1"; then touch "$1/.done"; fi
  fi
}

ps_link() {
  mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pagedserve
}

ps_tree() {
  if ps_link; then export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}; fi
}

ps_setup() {
  ps_wheels
  ps_tree
  export PYTHONUNBUFFERED=1
}
