# Set-up is implicit: each target installs what it needs into .venv/ when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# fairseq (translation) runs in its own Python 3.10 environment: fairseq 0.12.2 imports on 3.10
# only. It is made from pyenv's 3.10 or a python3.10 on PATH; without one, its tests are skipped.
FAIRSEQ_VENV ?= .venv-fairseq
FAIRSEQ_STAMP := $(FAIRSEQ_VENV)/.installed
PYTHON310 ?= $(shell for p in $(wildcard $(HOME)/.pyenv/versions/3.10*/bin/python3.10) python3.10; do \
	"$$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' 2>/dev/null && { command -v "$$p"; break; }; done)

# mmdetection (detection's second backend) shares .venv's torch; mmcv's ops are compiled once
# (about 20 min on 2 cores) into a wheel cached under ~/.cache/unnorm/wheels.
MMDET_STAMP := $(VENV)/.mmdet-installed

# The suite runs on one worker per core (at most 4: each holds its own torch), the slow
# end-to-end runs first; `make test-fast` leaves those out while you work.
PYTEST := $(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadgroup

.PHONY: run test test-fast bench fairseq-env mmdet
run: $(STAMP)  ## the main job, on embedded data at CPU scale
	$(PY) scripts/train.py +exp=swin_t_un scale=cpu

test: $(STAMP) $(MMDET_STAMP) $(if $(PYTHON310),$(FAIRSEQ_STAMP))  ## the test suite (what CI runs)
	$(PYTEST)

test-fast: $(STAMP)  ## the suite without the slow end-to-end runs
	$(PYTEST) -m "not slow"

bench: $(STAMP)
	$(PY) scripts/bench_norms.py

$(STAMP): pyproject.toml constraints.txt requirements/data.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[all]"
	$(PY) -m pip install -q --no-deps -r requirements/data.txt
	touch $@

mmdet: $(MMDET_STAMP)  ## mmcv (compiled ops), mmengine and mmdet into .venv

$(MMDET_STAMP): $(STAMP) scripts/install_mmdet.sh requirements/mmdet.txt
	scripts/install_mmdet.sh $(PY)
	touch $@

fairseq-env: $(FAIRSEQ_STAMP)  ## the Python 3.10 environment for translation

$(FAIRSEQ_STAMP): requirements/fairseq.txt pyproject.toml
	@test -n "$(PYTHON310)" || { echo "no Python 3.10 found: install one (pyenv install 3.10, or" \
		"apt/conda), or pass PYTHON310=/path/to/python3.10" >&2; exit 1; }
	test -x $(FAIRSEQ_VENV)/bin/python || $(PYTHON310) -m venv $(FAIRSEQ_VENV)
	$(FAIRSEQ_VENV)/bin/python -m pip install -q "pip>=23,<24.1"
	$(FAIRSEQ_VENV)/bin/python -m pip install -q -r requirements/fairseq.txt -e .
	touch $@
