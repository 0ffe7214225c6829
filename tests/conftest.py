import os

import pytest
import torch


def pytest_configure(config):
    # One CPU thread unless OMP_NUM_THREADS asks: OpenMP's spinning second thread made model tests 5-8x slower on a
    # busy 2-core machine (the ladder: 48 s on two, 6 s on one), and no bit depends on the thread count.
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=[pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    """Every contract test runs on the CPU (CI) and, gpu-marked, on CUDA."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
