# Two entry points for a fresh machine with only python3: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# `make demo PD=1` runs the prefill/decode topology
PD ?=
# `make demo TOKENS=1` runs tokens mode (a render server, tokens-only engines, the router renders)
TOKENS ?=

.PHONY: demo test bench bench-backend install clean

# One recipe, so that any failed (or interrupted) step removes the venv: no half-made .venv is left behind.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "make: session-router needs Python >= 3.11; $(PYTHON) is older (run: make PYTHON=python3.11 ...)" >&2; exit 1; }
	@echo "make: creating $(VENV) and installing session-router with its test extras"
	@trap 'rm -rf $(VENV); exit 130' INT TERM; \
	( $(PYTHON) -m venv $(VENV) \
		&& $(PY) -m pip install -q --upgrade pip \
		&& $(PY) -m pip install -q -e '.[test]' \
		&& touch $(STAMP) ) || \
		{ rm -rf $(VENV); echo "make: installing into $(VENV) failed (see above); removed $(VENV), run make again once fixed" >&2; exit 1; }

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m bench.demo $(if $(PD),--pd) $(if $(TOKENS),--tokens) $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the bench extra (matplotlib, for the PNGs next to bench/RESULTS.md) on top of the test install
BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench]' && touch $(BENCH_STAMP)

# the multi-turn routing benchmark (bench/RESULTS.md, "Multi-turn routing"), every request kept and the PNGs
# drawn into bench/plots; BENCH_ARGS=--quick for a short run
bench: $(BENCH_STAMP)
	$(PY) -m bench.multiturn --markdown --records --plots bench/plots $(BENCH_ARGS)

bench-backend: $(STAMP)
	$(PY) -m bench.backend_throughput

clean:
	rm -rf $(VENV) build *.egg-info
