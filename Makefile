# Set-up and checks. `make test` and `make doctor` create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
CONSTRAINTS ?= constraints/cpu.txt
PY  := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install test doctor demo clean

# .venv/.installed is rewritten whenever the package's install inputs change.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(PIP) install --quiet -c $(CONSTRAINTS) "$$(grep -E '^torch==' $(CONSTRAINTS))"
	$(PIP) install --quiet -c $(CONSTRAINTS) -e ".[test]"
	# the native CPU codec, built with this machine's C++ compiler into the user cache (a failed build
	# is not fatal: the codec then falls back at run time, with one warning naming the reason)
	$(PY) -m hilore_verl.kernels.cpu_native build || true
	# the tiny CPU task recipes/grpo/tiny_cpu.yaml names (model, tokenizer, data; written here, no download)
	$(VENV)/bin/hilore-verl tiny-task --out .tiny_cpu
	# verl's own CPU tests, which its wheel does not carry: from the sdist of the installed release
	$(PY) -m tests.harness.verl_suite fetch .verl_suite
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

doctor: $(VENV)/.installed
	$(VENV)/bin/hilore-verl doctor

demo: $(VENV)/.installed
	mkdir -p outputs/demo
	OMP_NUM_THREADS=1 $(VENV)/bin/hilore-verl demo --json outputs/demo/demo.json --plot outputs/demo/demo.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .verl_suite
