# The README's two commands are `make run` and `make test`; both set up a fresh machine first.
VENV   := .venv
BIN    := $(VENV)/bin
# The main job: a recall task (scripted navigation, free answer) whose first page passes
# CONF-KV's budget, so the cache evicts while the agent answers from it (README, "Two commands").
TASK   ?= 424
EPISODE_ARGS ?= --task $(TASK) --mode scripted --policy conf-kv --budget 160 --prefill-chunk 128 \
	--out runs/readme

.PHONY: setup run test lint docs
setup: $(VENV)/.setup-stamp

$(VENV)/.setup-stamp: pyproject.toml scripts/setup.sh agent_kv/runtime/models/bundled_models.py
	bash scripts/setup.sh
	touch $@

run: setup
	$(BIN)/agent-kv run-episode $(EPISODE_ARGS)

# Two workers (pytest-xdist), each taking whole test files (a file's model, servers and browser
# are set up once); the tests run torch on one thread, so two use both cores of a 2-core CI box.
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# The pages written from the code: docs/layout.md (module docstrings) and the policy table of
# docs/policies.md; tests/test_generated_docs.py fails while either is stale.
docs: setup
	$(BIN)/python -m scripts.write_docs
