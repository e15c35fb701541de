# meshforge developer entry points. TORCH_SPEC picks the PyTorch build:
# the default pins the CPU wheel; on a GPU machine use e.g. TORCH_SPEC='torch>=2.6'.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.meshforge-installed
DOCS_STAMP := $(VENV)/.meshforge-docs-installed

.PHONY: setup demo test test-fast lint format bench clean image docs

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/meshforge train examples/gpt-tiny.yaml --nproc 2 --run-dir runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 tests

# The unit tier only: no test in it starts a process (tests/unit/conftest.py refuses one).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q --durations=10 tests/unit

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples scripts
	$(BIN)/ruff format --check src tests benchmarks examples scripts
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks examples scripts
	$(BIN)/ruff check --fix src tests benchmarks examples scripts

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

# The documentation site (mkdocs.yml, docs/) into site/; fails on a dead link, an anchor
# that is not there, a page missing from the nav or a config field with no description.
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The training image (Dockerfile); tag it for your registry with IMAGE=REGISTRY/meshforge:TAG.
VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= meshforge:$(VERSION)

image:
	docker build -t $(IMAGE) .

clean:
	rm -rf $(VENV) runs .pytest_cache
