# The two entry points of the README: `make serve` and `make test`.
# Both do all set-up first (tools/setup.sh is idempotent and fast when done).
SHELL := /bin/bash
VENV := .venv
PRESET ?= omni-chat
# MODEL: a checkpoint folder for the preset (omni-chat: Qwen2.5-Omni or Qwen3-Omni as the
# hub ships it), or tiny:<name>, e.g. make serve MODEL=tiny:qwen3-omni-tiny
MODEL ?=
REPO := model_repository/build/$(PRESET)$(if $(MODEL),-$(notdir $(subst :,/,$(MODEL))))
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002

.PHONY: setup serve repo test unit lint bench clean

setup:
	@bash tools/setup.sh

repo: setup
	$(VENV)/bin/omni-gen-repo --preset $(PRESET) $(if $(MODEL),--model $(MODEL)) -o $(REPO)

serve: repo
	$(VENV)/bin/tritonserver --model-repository=$(REPO) \
	  --http-port=$(HTTP_PORT) --grpc-port=$(GRPC_PORT) --metrics-port=$(METRICS_PORT)

test: setup
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=30 tests

unit: setup
	$(VENV)/bin/python -m pytest -q tests/unit

lint: setup
	$(VENV)/bin/ruff check backends omni_client tools tests

bench: setup
	$(VENV)/bin/omni-bench all

clean:
	rm -rf model_repository/build
