import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


class _RootIsNoTestPackage:
    """The repository root is the package ``alignzoo`` (its ``__init__.py`` installs as ``alignzoo/__init__.py``).
    pytest would collect it as a test package named after the clone's folder and import its ``__init__.py`` under
    that name: a second copy of the package in a folder named ``repo``, and an ImportError on every test in one
    named ``alignzoo-main`` (not an identifier).  It is collected as a plain directory instead; tests import the
    installed ``alignzoo``."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path, parent):
        if path.resolve() == ROOT:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config):
    # Registered as a plugin, not a conftest hook: a conftest's directory hooks see only paths under tests/.
    config.pluginmanager.register(_RootIsNoTestPackage(), "alignzoo-root-is-no-test-package")
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
