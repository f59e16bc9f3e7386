# Set-up is implicit: each target installs what it needs into .venv/ when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench
run: $(STAMP)  ## the main job, on embedded data at CPU scale
	$(PY) scripts/train.py +exp=swin_t_un scale=cpu

test: $(STAMP)  ## the test suite
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) scripts/bench_norms.py

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[all]"
	touch $@
