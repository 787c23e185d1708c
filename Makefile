# `make demo` and `make test` do the whole set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed

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

# two pytest-xdist workers for most tests, then the `serial` ones alone (timing-based or 2-process DDP:
# see SERIAL in tests/conftest.py); both parts always run, and either failing fails the target
test: setup
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile -m "not serial"; first=$$?; \
	$(PY) -m pytest -q --durations=25 -m serial; second=$$?; \
	test $$first -eq 0 -a $$second -eq 0

# benchmark-only peer: Cut Cross-Entropy (the `tokens` case). --no-deps because its dependencies
# add triton, which only its GPU kernels need; the benchmark uses its torch_compile implementation
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps "cut-cross-entropy==25.1.1"
	touch $(BENCH_STAMP)

bench: setup $(BENCH_STAMP)
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info lightning_logs
