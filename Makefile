# The README's commands. Each sets up .venv (once; later runs reuse it) and then runs:
#   make demo        the offline GRPO demo (SmolLM2-135M-Instruct, 2 CPU cores); ARGS="--seed 1" passes recipe flags
#   make test        the default test suite;                                       ARGS="-k loss" passes pytest flags
#   make check       ruff (lint and format) and the figures check (python -m benchmarks.tools.render_figures --check)
#   make gpu-check   the GPU checks on one CUDA GPU (scripts/gpu_check.py; without one it says so and exits 0)
#   make clean       removes .venv, .venv-vllm, an HF_RLLOSS_VENV this made, and outputs/
# Options (environment or make variables): HF_RLLOSS_TORCH=auto|cpu|cuda|skip|<pip requirement>,
# HF_RLLOSS_VENV=<dir> (an existing environment, e.g. "$CONDA_PREFIX", is used as it is), HF_RLLOSS_DRY_RUN=1 (print
# what would run), PYTHON=<a Python >= 3.10> (default python3; an older one hands over to the newest python3.1x).
# Without make: python3 scripts/bootstrap.py demo|test|check|gpu-check|setup|clean.
PYTHON ?= python3
ARGS ?=

.PHONY: demo test check gpu-check setup clean

demo:
	$(PYTHON) scripts/bootstrap.py demo $(ARGS)

test:
	$(PYTHON) scripts/bootstrap.py test $(ARGS)

check:
	$(PYTHON) scripts/bootstrap.py check

gpu-check:
	$(PYTHON) scripts/bootstrap.py gpu-check $(ARGS)

setup:
	$(PYTHON) scripts/bootstrap.py setup test

clean:
	$(PYTHON) scripts/bootstrap.py clean
