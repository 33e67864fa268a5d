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
	@$(VENV)/bin/megatron-jreg train --help >/dev/null  # builds the kept help once, so the first --help is quick
	@touch $@

test: venv
	$(PY) -m pytest -q -x --durations=15 tests

# The unit tier: no training, no rank processes, no megatron-core subprocesses (markers: pyproject.toml).
test-fast: venv
	$(PY) -m pytest -q -x -m "not slow and not multirank" tests

lint: venv
	$(PY) -m ruff check megatron_jreg tools tests benchmarks examples experiments
	$(VENV)/bin/lint-imports

demo: venv
	$(PY) examples/demo.py --output $(DEMO_OUT)

clean:
	rm -rf $(VENV) build *.egg-info $(DEMO_OUT)

# What the lent GPU machine lacks (Python 3.12, torch, triton, transformers, ... but no megatron-core and no
# registry), into .whl/ (git-ignored, 2.5 MB; the device tool's `carry: [".whl"]`, docs/gpu.md): megatron-core
# (constraints.txt's pin) and einops, for manylinux x86-64 / CPython 3.12, into .whl/gpu; Megatron-LM's
# pretrain_gpt.py, gpt_builders.py and model_provider.py at core_v0.19.0 (not in the wheel; the GPU check's
# reference) into .whl/megatron-lm, from a local clone (MEGATRON_LM=/path/to/Megatron-LM) or from GitHub.
GPU_WHEELS ?= .whl/gpu
GPU_MEGATRON_LM ?= .whl/megatron-lm
MEGATRON_LM ?=
MEGATRON_LM_TAG := core_v0.19.0
.PHONY: gpu-wheels
gpu-wheels: venv
	$(PY) -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.12 \
		--implementation cp --abi cp312 -c constraints.txt -d $(GPU_WHEELS) megatron-core einops==0.8.2
	@mkdir -p $(GPU_MEGATRON_LM)
	@for f in pretrain_gpt.py gpt_builders.py model_provider.py; do \
		if [ -n "$(MEGATRON_LM)" ]; then git -C "$(MEGATRON_LM)" show $(MEGATRON_LM_TAG):$$f > $(GPU_MEGATRON_LM)/$$f; \
		else curl -fsSL -o $(GPU_MEGATRON_LM)/$$f \
			https://raw.githubusercontent.com/NVIDIA/Megatron-LM/$(MEGATRON_LM_TAG)/$$f; fi || exit 1; \
	done
	@ls -l $(GPU_WHEELS) $(GPU_MEGATRON_LM)
