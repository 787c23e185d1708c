# `make demo` and `make test` do the whole set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/lightning-efficient fit   # the packaged default: lightning_efficient/demo/default.yaml

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info lightning_logs
