"""Under pytest-xdist (``make test`` runs two workers) each worker takes an equal share of
the cores, for torch here and for the scripts the tests start, so the workers do not
oversubscribe the machine."""
import os

import torch

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)


def pytest_collection_modifyitems(config, items):
    """The slow end-to-end runs (``@pytest.mark.slow``) first: with several workers the long
    ones start at once and the short ones fill in around them, which keeps the workers' loads
    even (``make test-fast`` leaves them out while you work)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
