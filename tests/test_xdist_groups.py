"""``make test``'s ``--dist loadgroup`` keeps an ``xdist_group`` on one worker, so the group's
module-scoped runs (tests/test_fairseq.py, test_lm_fsdp.py, test_sync.py) are made once.
pytest 9.2 with xdist 3.8 drops the groups silently (pytest-dev/pytest-xdist#1386): every worker
then trains the shared runs again (constraints.txt pins pytest 9.1.1)."""
from __future__ import annotations

import os
import subprocess
import sys

GROUPED = '''
import os

import pytest

pytestmark = pytest.mark.xdist_group("shared")


@pytest.fixture(scope="module")
def shared_run():
    with open("made.log", "a") as log:
        log.write(f"{os.getpid()}\\n")


@pytest.mark.parametrize("case", range(6))
def test_grouped(case, shared_run):
    with open("ran.log", "a") as log:
        log.write(f"{os.getpid()}\\n")
'''
ALONE = '''
import pytest


@pytest.mark.parametrize("case", range(6))
def test_alone(case):
    pass
'''


def test_a_group_runs_on_one_worker_that_makes_its_shared_fixture_once(tmp_path):
    """Two workers, a group of six tests collected first (a plain load would deal them out
    round robin) beside six ungrouped ones."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # this folder alone, not the project's
    (tmp_path / "test_a_grouped.py").write_text(GROUPED)
    (tmp_path / "test_b_alone.py").write_text(ALONE)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                           "-p", "no:cacheprovider"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = (tmp_path / "ran.log").read_text().split()
    made = (tmp_path / "made.log").read_text().split()
    assert len(ran) == 6 and len(set(ran)) == 1 and made == ran[:1], (
        f"the group's tests ran in processes {ran}, its module fixture was made in {made}: "
        f"xdist_group is ignored (pytest-dev/pytest-xdist#1386 with pytest 9.2); install "
        f"constraints.txt's pytest (`make test` does)")
