# Two commands do all set-up on a fresh machine:
#   make demo   — install everything, then run the four-tenant demo on a local Dask cluster
#   make test   — install everything, then run the test suite
PY ?= python3.11
# empty: torch from the configured index (here the CPU wheel on local disk); the Dockerfile passes
# https://download.pytorch.org/whl/cpu or .../cu128 (a CUDA build)
TORCH_INDEX ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nexus-installed

.PHONY: demo test setup lint docs clean
setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml scripts/install_system.sh scripts/constraints.txt
	bash scripts/install_system.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))   # pinned: no CUDA build unless asked
	$(BIN)/pip install -q -c scripts/constraints.txt -e '.[test]'
	# openpi-client (the robots' side of openpi's policy server) declares numpy<2 but runs on ours: --no-deps too
	$(BIN)/pip install -q -c scripts/constraints.txt --no-deps openpi-client==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/nexus demo

test: $(STAMP)
	$(BIN)/ruff check nexus tests experiments datasets examples scripts
	$(BIN)/pytest -q -ra

# the documentation site (mkdocs + material) into site/; strict: a broken link or reference fails
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check nexus tests experiments datasets examples scripts

clean:
	rm -rf runs test-artifacts .pytest_cache site
