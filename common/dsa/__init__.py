"""DeepSeek Sparse Attention's indexer: scores Σ_h w_h · ReLU(q_h · k) and the top-k selection, in one order."""
from .naive import index_scores_ref, index_topk_ref
from .op import index_key_norm, index_scores, index_select, index_topk, paged_index_select_fwd

__all__ = ["index_key_norm", "index_scores", "index_scores_ref", "index_select", "index_topk", "index_topk_ref",
           "paged_index_select_fwd"]
