# Two commands on a fresh machine: `make test` and `make demo`. Each installs what it needs first.
# torch is pinned on every pip line: here pip takes the CPU build from local disk; unpinned, a
# dependency could pull a multi-GB CUDA build.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH  := torch==2.13.0
EXTRAS := learner,rollout,reward,dev
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: install redis test lint bench schema demo clean

install: $(VENV)/.installed redis

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install $(TORCH) -e ".[$(EXTRAS)]"
	touch $@

redis:
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y redis-server; }

test: install
	$(VENV)/bin/pytest -q

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: install
	$(PY) bench/loss_bench.py

# The tiny model is built once and cached in .cache/ (~30 s); the run ends by itself and prints a summary.
demo: install
	$(VENV)/bin/sparkrl build-tiny-model --out .cache
	$(VENV)/bin/sparkrl up --preset demo --run-dir runs/demo

schema: install
	$(PY) -m sparkrl.proto.schema

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
