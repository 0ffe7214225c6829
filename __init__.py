"""alignzoo: aligned train/serve pairs for LLM reinforcement learning.

The trainer and the sampling server of each model compute the same bits: the
FP32 log-probability of every chosen token is bitwise identical on both sides
(K3 == 0), whatever the batch composition.  See README.md and docs/DESIGN.md.

The foundation layer lives in ``alignzoo.common`` (batch-invariant primitives,
each with a Triton kernel, a CPU path invariant by construction and a float64
reference).  Models register themselves in ``alignzoo.models`` once they pass
their contract; ``list_models()`` names only those.
"""
__version__ = "0.1.0"


from .common.sampling.params import SamplingParams  # noqa: E402  (DESIGN §6: alignzoo.SamplingParams)


def list_models() -> list[str]:
    """Names of the models whose aligned pair works in this version."""
    from .models import available_models

    return available_models()


__all__ = ["__version__", "list_models", "SamplingParams"]
