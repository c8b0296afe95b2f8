# The two set-up commands of the README. Both work on a fresh machine: they build .venv first.
#   make serve   install, fetch the default model pair (first run only), run the server
#   make test    install with dev and cluster extras, fetch the pair, lint, run the whole test suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: install install-dev pull serve test lint

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0

install: $(BIN)/python
	$(BIN)/pip install --quiet -e .

install-dev: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,cluster]'

pull: install
	$(BIN)/specdec pull

serve: pull
	$(BIN)/specdec serve

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install-dev pull lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
