# The README's two commands. Each sets up .venv (once; later runs reuse it) and then runs:
#   make demo   the offline GRPO demo (SmolLM2-135M-Instruct, 2 CPU cores); ARGS="--seed 1" passes recipe flags
#   make test   the default test suite;                                       ARGS="-k loss" passes pytest flags
# Options (environment or make variables): HF_RLLOSS_TORCH=auto|cpu|cuda|skip|<pip requirement>, HF_RLLOSS_VENV=<dir>.
# Without make: python3 scripts/bootstrap.py demo|test|setup.
PYTHON ?= python3
ARGS ?=

.PHONY: demo test setup clean

demo:
	$(PYTHON) scripts/bootstrap.py demo $(ARGS)

test:
	$(PYTHON) scripts/bootstrap.py test $(ARGS)

setup:
	$(PYTHON) scripts/bootstrap.py setup test

clean:
	rm -rf .venv outputs
