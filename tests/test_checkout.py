"""The suite runs in a clone whatever its folder is named.

The repository root is the package ``alignzoo``; a clone unpacked as ``alignzoo-main`` or ``my-clone`` (not
identifiers) must collect and pass the same tests as one named ``repo``.  Each case lays out the files pytest's
collection reads (``pyproject.toml``, the root ``__init__.py``, ``tests/conftest.py``) in a folder of that name,
adds one test, and runs pytest there in a subprocess.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import os
import sys

import alignzoo

ROOT_INIT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "__init__.py")


def test_root_is_not_imported_under_the_folder_name():
    copies = [name for name, mod in list(sys.modules.items()) if getattr(mod, "__file__", None) == ROOT_INIT]
    assert copies == [] and "__init__" not in sys.modules, copies
    assert alignzoo.SamplingParams is not None
"""


@pytest.mark.parametrize("folder", ["alignzoo-main", "my-clone", "repo"])
def test_suite_collects_in_a_clone_named(folder, tmp_path):
    clone = tmp_path / folder
    (clone / "tests").mkdir(parents=True)
    for rel in ("pyproject.toml", "__init__.py", "tests/conftest.py"):
        shutil.copyfile(ROOT / rel, clone / rel)
    (clone / "tests" / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_probe.py"],
                         cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout
