# Two commands from a fresh clone, with only python3 (and make) on the machine:
#   make train    the main job: a small GPT on 2 ranks, the loss falling; keeps the model and
#                 its metrics in runs/gpt_small and ends with a greedy sample of it
#   make sample PROMPT="def "   text from that model, on the same grid
#   make test     every test: serial, then mpirun -n 2 and -n 4
#   make check    the quick tier before a commit (at most 3 minutes)
# Each creates .venv and installs pipeflow into it on first use. On a GPU machine keep your
# own torch: `make test CONSTRAINTS=` (drops the CPU pin).
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= -c constraints/cpu.txt
CONFIG ?= examples/gpt_small.toml
NP ?= 2
# The save_dir of $(CONFIG): where `make sample` reads the model.
RUN ?= runs/gpt_small
PROMPT ?= def
BIN := $(VENV)/bin
STAMP := $(VENV)/.pipeflow-installed

.PHONY: train sample test check timings install pictures clean-venv

train: $(STAMP)
	OMP_NUM_THREADS=1 PATH="$(CURDIR)/$(BIN):$$PATH" mpirun -n $(NP) pipeflow train $(CONFIG)

sample: $(STAMP)
	OMP_NUM_THREADS=1 PATH="$(CURDIR)/$(BIN):$$PATH" mpirun -n $(NP) pipeflow sample $(RUN) \
	  --prompt "$(PROMPT)"

test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash tests/run_all.sh

# The quick tier (at most 3 minutes): one grid per schedule family and a row per class of
# error, before each commit. `make test` is the whole suite.
check: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash tests/check.sh

# The whole suite with each job's JUnit XML kept, then tests/README.md's table of times.
timings: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python tests/timings.py --run

install: $(STAMP)

# The README's pictures: a schedule, a measured step (each with its legend), a run's panels
# (loss raw, smoothed and validation, lr, tokens/s, grad norm) (matplotlib, in [test]).
IMG := docs/img
pictures: $(STAMP)
	mkdir -p $(IMG) runs/pictures
	$(BIN)/pipeflow schedule -p 4 -m 8 --png $(IMG)/schedule.png > /dev/null
	OMP_NUM_THREADS=1 PATH="$(CURDIR)/$(BIN):$$PATH" mpirun -n $(NP) pipeflow train $(CONFIG) \
	  --save-dir runs/pictures --set train.log_every=5 --set train.eval_every=50 \
	  --trace runs/pictures/trace.json
	$(BIN)/pipeflow trace runs/pictures/trace.json --png $(IMG)/trace.png
	$(BIN)/pipeflow plot runs/pictures/metrics.jsonl --png $(IMG)/loss.png

# Reinstalled when pyproject.toml changes (new dependencies or extras).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e ".[test]" $(CONSTRAINTS)
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
