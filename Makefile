# Two entry points for a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
OUT    := out

.PHONY: demo test setup clean

$(VENV)/.installed: pyproject.toml
	@echo "--- setup: a virtual environment in $(VENV) (once; about 40 s, most of it installing torch's CPU wheel)"
	$(PYTHON) -m venv $(VENV)
	@echo "--- setup: pip install torch==2.13.0 (CPU wheel)"
	@$(PY) -m pip install --quiet --upgrade pip
	@# torch==2.13.0 is the CPU wheel; a bare `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0"
	@echo "--- setup: pip install -e .[dev,test] (libcst, python-minifier, pytest, pyarrow, ...)"
	@# setuptools says "Editable installation." on every editable install (InformationOnly): not news.
	PYTHONWARNINGS="ignore:Editable installation:UserWarning" $(PY) -m pip install --quiet -e ".[dev,test]"
	@touch $@
	@echo "--- setup: done; the command is $(VENV)/bin/patch-prefetch"

setup: $(VENV)/.installed

demo: setup
	@mkdir -p $(OUT)
	@echo "--- patch a bundled fixture (a parameter-golf-shaped train_gpt.py)"
	$(VENV)/bin/patch-prefetch fixtures/tokenstream_readable.py -o $(OUT)/train_gpt_patched.py
	@echo "--- diff stat (original -> patched)"
	@git diff --no-index --stat fixtures/tokenstream_readable.py $(OUT)/train_gpt_patched.py || true
	@echo "--- check: original and patched train on synthetic shards, losses compared bit for bit"
	$(PY) -m patcher.demo fixtures/tokenstream_readable.py $(OUT)/train_gpt_patched.py

# Two processes, each test file in one of them (module fixtures train the fixtures once).
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache
