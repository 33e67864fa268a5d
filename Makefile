# `make test` and `make demo` work on a fresh machine: they create .venv with Python 3.12 when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON312 ?= $(shell for p in python3.12 $$(ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null) \
	/usr/bin/python3.12 /usr/local/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo "$$p"; break; }; done)
DEMO_OUT ?= demo_output

.PHONY: venv test lint demo clean

venv: $(VENV)/.installed

$(VENV)/.installed: setup.py constraints.txt
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found; install it or run 'make PYTHON312=/path/to/python3.12 ...'"; exit 1; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@touch $@

test: venv
	$(PY) -m pytest -q -x tests

lint: venv
	$(PY) -m ruff check megatron_jreg tools tests benchmarks examples

demo: venv
	$(PY) examples/demo.py --output $(DEMO_OUT)

clean:
	rm -rf $(VENV) build *.egg-info $(DEMO_OUT)
