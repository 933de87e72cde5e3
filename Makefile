# Two entry points for a fresh machine with only python3: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# `make demo PD=1` runs the prefill/decode topology
PD ?=

.PHONY: demo test bench bench-backend install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m bench.demo $(if $(PD),--pd) $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the multi-turn routing benchmark (bench/RESULTS.md, "Multi-turn routing"); BENCH_ARGS=--quick for a short run
bench: $(STAMP)
	$(PY) -m bench.multiturn --markdown $(BENCH_ARGS)

bench-backend: $(STAMP)
	$(PY) -m bench.backend_throughput

clean:
	rm -rf $(VENV) build *.egg-info
