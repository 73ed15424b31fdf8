# The README's two commands are `make run` and `make test`; both set up a fresh machine first.
VENV   := .venv
BIN    := $(VENV)/bin
TASK   ?= 1
EPISODE_ARGS ?= --task $(TASK) --policy conf-kv --out runs/readme

.PHONY: setup run test lint
setup: $(VENV)/.setup-stamp

$(VENV)/.setup-stamp: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

run: setup
	$(BIN)/agent-kv run-episode $(EPISODE_ARGS)

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
