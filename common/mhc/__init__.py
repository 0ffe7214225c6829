"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): weights, collapse, mix and head, batch-invariant."""
from .naive import hc_collapse_ref, hc_head_ref, hc_mix_ref, hc_weights_ref
from .op import (hc_collapse_bwd, hc_collapse_fwd, hc_head_fwd, hc_mix, hc_mix_bwd, hc_mix_fwd, hc_weights_bwd,
                 hc_weights_fwd, hyper_connection, hyper_head)

__all__ = ["hyper_connection", "hc_mix", "hyper_head", "hc_weights_fwd", "hc_collapse_fwd", "hc_mix_fwd",
           "hc_head_fwd", "hc_weights_bwd", "hc_collapse_bwd", "hc_mix_bwd", "hc_weights_ref", "hc_collapse_ref",
           "hc_mix_ref", "hc_head_ref"]
