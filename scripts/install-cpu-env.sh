#!/usr/bin/env bash
# Create (or reuse) the CPU test environment: a venv holding the real sglang 0.5.23 without its
# GPU stack, a CPU torch, and this package installed editable with its test extras.
# Why --no-deps for sglang: its ~80 declared dependencies pull torch CUDA, flashinfer and
# sglang-kernel (several GB) that a CPU machine cannot use. The list below is what
# `import sglang.srt.layers.attention.triton_backend`, the launcher's argument parsing and
# SGLang's attention test kit need (see ../shared/docs/cpu-test-environment.md).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${KDTREE_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip >/dev/null
# torch first, alone, pinned: the CPU build that lies on this kind of machine's disk.
"${pip[@]}" torch==2.13.0
# torchvision: sglang imports it. PyPI's build is CUDA-only; the shim (.pth) below lets it import.
"${pip[@]}" --no-deps torchvision==0.28.0
"${pip[@]}" --no-deps sglang==0.5.23
"${pip[@]}" triton==3.8.0 numpy orjson psutil pybase64 requests packaging pillow starlette \
  msgspec pydantic pyzmq tqdm ipython aiohttp dill einops gguf partial-json-parser \
  transformers==5.19.0 tokenizers==0.23.2 sentencepiece==0.2.1 apache-tvm-ffi==0.1.11 \
  compressed-tensors==0.18.0 openai==2.8.0 uvicorn fastapi setproctitle uvloop \
  pytest pytest-timeout structlog prometheus-client matplotlib \
  jsonschema==4.26.0 xgrammar==0.2.7 soundfile==0.13.1 python-multipart==0.0.34
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$root/scripts/cpu_env/kdtree_cpu_torchvision_shim.py" "$site/"
echo "import kdtree_cpu_torchvision_shim" > "$site/kdtree_cpu_torchvision_shim.pth"
"${pip[@]}" -e "$root[test]"
echo "venv ready: $venv"
