"""Whether a model whose ``model_cases`` row still says ``cuda_graphs=False`` captures decode graphs with the bits
of eager decode: runs ``test_models.py::test_cuda_graph_decode_matches_eager`` with that row flipped.

    python benchmarks/experiments/graphs_try.py glm5_sparse_fp8 deepseek_v4_mhc_mxfp4
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path.insert(0, str(TESTS))
import model_cases  # noqa: E402


def main() -> int:
    names = sys.argv[1:]
    for n in names:
        model_cases.CASES[n] = replace(model_cases.case(n), cuda_graphs=True)
    pick = " or ".join(names)
    return pytest.main(["-q", "-p", "no:cacheprovider", str(TESTS / "test_models.py"), "-k",
                        f"cuda_graph and ({pick})"])


if __name__ == "__main__":
    sys.exit(main())
