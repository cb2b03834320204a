# vllm-overlay: make setup | image | check | key | members | overlay | dockerfile | probe | gate-local | test | test-fast | bench
PYTHON ?= python3
RECIPE ?= recipes/v41-sm120.yaml
VO = $(PYTHON) -m builder
OUT ?= out
# The rank's vllm serve argv for `make probe` (a checkpoint directory holding config.json).
SERVE_ARGV ?= $(OUT)/checkpoint-v41 --headless -tp 4
# The same with compressed layers all of ratio 2 (compressed pages of 64): tells the > 64-token routes apart.
SERVE_ARGV_RATIO2 ?= $(OUT)/checkpoint-v41-ratio2 --headless -tp 4

# The engine `make setup` started, unless DOCKER_HOST names another (ssh:// works too).
ifeq ($(DOCKER_HOST),)
DOCKER_HOST := $(shell sed -n 's/^DOCKER_HOST=//p' /run/vllm-overlay/env 2>/dev/null)
endif
ifneq ($(DOCKER_HOST),)
export DOCKER_HOST
endif

.PHONY: setup image check key members overlay dockerfile probe probe-venv gate-local test test-fast bench

setup:            ## fresh machine: Python deps, Debian packages, local services (needs root)
	bash .ci/setup

image:            ## build (or find) the recipe's image, tag it by runtime key
	$(VO) image $(RECIPE)

check:            ## does every member apply to the unpatched pinned tree?
	$(VO) check $(RECIPE)

key:              ## the recipe's runtime key
	$(VO) key $(RECIPE)

members:          ## write each member made from a source file (overlay/<name>.py) from it
	$(VO) members $(RECIPE)

overlay:          ## touched files + manifest.json in $(OUT)/overlay
	$(VO) apply $(RECIPE) --out $(OUT)/overlay

dockerfile:       ## the image build context in $(OUT)/context
	$(VO) dockerfile $(RECIPE) --out $(OUT)/context

probe-venv:       ## the cached venv with the pinned vLLM (CPU torch) the probe runs in
	$(PYTHON) -c 'from builder.probe_env import ensure_probe_venv; print(ensure_probe_venv())'

probe:            ## the self-test's four-arm route table on two checkpoints (static: no SM120 device here)
	$(PYTHON) -c 'from tools.checkpoints import write_v41_checkpoint as w; w("$(OUT)/checkpoint-v41"); w("$(OUT)/checkpoint-v41-ratio2", compress_ratios=(0, 2, 2))'
	$(VO) probe $(RECIPE) --static -- $(SERVE_ARGV)
	$(VO) probe $(RECIPE) --static -- $(SERVE_ARGV_RATIO2)

gate-local:       ## the launch gate (--static) on the two local test engines: recipe, checkpoint, profile, receipt in $(OUT)/gate-local
	$(PYTHON) -m tools.local_gate $(OUT)/gate-local
	VLLM_OVERLAY_PRODUCED=$(OUT)/gate-local/produced.yaml $(VO) image $(OUT)/gate-local/recipe.yaml --push
	VLLM_OVERLAY_PRODUCED=$(OUT)/gate-local/produced.yaml VLLM_OVERLAY_RECEIPTS=$(OUT)/gate-local/receipts \
	  $(VO) gate $(OUT)/gate-local/profile.yaml --static

test:             ## the whole suite, real components included (what CI runs)
	$(PYTHON) -m pytest

test-fast:        ## everything that needs no wheel, probe venv or local services (< 60 s)
	$(PYTHON) -m pytest -m "not wheel and not probe and not services"

bench:            ## speed and size figures beside the comparisons the issues name
	$(PYTHON) bench/run.py
