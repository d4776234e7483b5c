# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv, install torch==2.13.0 FIRST (the CPU build; an unpinned torch
# would pull gigabytes of CUDA wheels), then this package with its test extras.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# one thread per rank: ranks share the 2 cores of the CI machine
export OMP_NUM_THREADS ?= 1
export DS_BUILD_OPS ?= 0
# the Hugging Face tests build their small models here: nothing is downloaded
export HF_HUB_OFFLINE ?= 1

.PHONY: install demo test test-fast bench clean

$(STAMP): setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(STAMP)

# The main job: GPT "tiny" on 4 CPU ranks, 4 pipeline stages, partition_method "profiled" (ds.json).
demo: install
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/deepspeed --num_gpus 4 train.py --deepspeed_config ds.json --steps 5
	$(VENV)/bin/ds-pipe-ext partition --model tiny --stages 4 --micro-batch 4 --micro-batches 4
	@echo; echo "== the plugin's point: the profiled pipeline against DeepSpeed's uniform split and ZeRO-3 (2 ranks)"
	rm -rf runs/demo-compare
	PATH=$(abspath $(VENV))/bin:$$PATH launch_scripts/compare_zero3.sh 2 compare-cpu --micro-batch 8 --steps 3 \
		--out runs/demo-compare --png runs/demo-compare/compare.png

# three test workers on the CI machine's two cores: a launch spends most of its time starting interpreters and
# polling, which the other workers' tests fill (3: 528 s, 2: 654 s, 1: 1,191 s here; test ports are free ports,
# profiles are cached atomically, the machine's measurements once under a lock: costs.cache)
TEST_WORKERS ?= 3

# The layer-timing check first and alone (tests/test_analytic_vs_profile.py: profiles need the cores to themselves).
TIMED := tests/test_analytic_vs_profile.py

test: install
	$(PY) -m pytest -q -p no:xdist $(TIMED)
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 \
		--ignore=$(TIMED) tests

# the pure tests only (no process launches)
test-fast: install
	$(PY) -m pytest -q -p no:xdist $(TIMED)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not multiprocess" --ignore=$(TIMED) tests

clean:
	rm -rf $(VENV) .ds_pipe_ext_cache .pytest_cache .hypothesis *.egg-info
