# Two commands do all set-up on a fresh machine:
#   make demo   — install everything, then run the four-tenant demo on a local Dask cluster
#   make test   — install everything, then run the test suite
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nexus-installed

.PHONY: demo test setup lint clean
setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml scripts/install_system.sh scripts/constraints.txt
	bash scripts/install_system.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0   # the CPU wheel on local disk; pinned so no CUDA build is pulled
	$(BIN)/pip install -q -c scripts/constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/nexus demo

test: $(STAMP)
	$(BIN)/ruff check nexus tests experiments datasets examples scripts
	$(BIN)/pytest -q -ra

lint: $(STAMP)
	$(BIN)/ruff check nexus tests experiments datasets examples scripts

clean:
	rm -rf runs test-artifacts .pytest_cache
