# `make test` and `make demo` work on a fresh machine: they create .venv with Python 3.12 when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON312 ?= $(shell for p in python3.12 $$(ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null) \
	/usr/bin/python3.12 /usr/local/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo "$$p"; break; }; done)
DEMO_OUT ?= demo_output

.PHONY: venv test test-fast lint demo clean

venv: $(VENV)/.installed

$(VENV)/.installed: setup.py constraints.txt
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found; install it or run 'make PYTHON312=/path/to/python3.12 ...'"; exit 1; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@touch $@

test: venv
	$(PY) -m pytest -q -x tests

# The unit tier: no training, no rank processes, no megatron-core subprocesses (markers: pyproject.toml).
test-fast: venv
	$(PY) -m pytest -q -x -m "not slow and not multirank" tests

lint: venv
	$(PY) -m ruff check megatron_jreg tools tests benchmarks examples
	$(VENV)/bin/lint-imports

demo: venv
	$(PY) examples/demo.py --output $(DEMO_OUT)

clean:
	rm -rf $(VENV) build *.egg-info $(DEMO_OUT)

# Wheels that the lent GPU machine lacks (Python 3.12, torch, triton, transformers, ... but no megatron-core
# and no registry): megatron-core (constraints.txt's pin) and einops, for manylinux x86-64 / CPython 3.12, into
# .whl/gpu (git-ignored, 2.4 MB); benchmarks/gpu_check.sh installs them on that machine (docs/gpu.md).
GPU_WHEELS ?= .whl/gpu
.PHONY: gpu-wheels
gpu-wheels: venv
	$(PY) -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.12 \
		--implementation cp --abi cp312 -c constraints.txt -d $(GPU_WHEELS) megatron-core einops==0.8.2
	@ls -l $(GPU_WHEELS)
