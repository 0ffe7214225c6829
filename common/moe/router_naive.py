"""Float64 references of the MoE routers, written plainly from transformers'
modules with torch.softmax / sigmoid / softplus / topk on float64, for
accuracy and gradient checks (differentiable with autograd w.r.t. the logits).

Ties aside (float64 topk breaks them its own way), each returns what its
router in ``router.py`` returns: (weights (T, k) float64, ids (T, k) int64),
the slots in probability order (the unbiased score descending, the smaller
id first).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    x = logits.double()
    if scoring == "softmax":
        return torch.softmax(x, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(x)
    return F.softplus(x).sqrt()  # transformers' ACT2FN["sqrtsoftplus"]: beta 1, threshold 20


def _in_order(s: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Slots sorted by s descending, ties to the smaller id (a stable sort of id-sorted slots)."""
    ids = ids.sort(dim=-1).values
    order = torch.sort(s.detach().gather(1, ids), dim=-1, descending=True, stable=True).indices
    return ids.gather(1, order)


def router_weights_ref(logits, ids, scoring, routed_scaling_factor=1.0, normalize=True) -> torch.Tensor:
    """Float64 weights of the slots ``ids``: softmax p / sum p; sigmoid and
    sqrt-softplus s / (sum s + 1e-20) * scale."""
    w = _scores(logits, scoring).gather(1, ids.long())
    if scoring == "softmax":
        return w / w.sum(-1, keepdim=True) if normalize else w
    if normalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * routed_scaling_factor


def softmax_topk_ref(logits, top_k, normalize=True):
    p = _scores(logits, "softmax")
    ids = torch.topk(p.detach(), top_k, dim=-1).indices
    ids = _in_order(p, ids)
    return router_weights_ref(logits, ids, "softmax", normalize=normalize), ids


def sigmoid_topk_ref(logits, bias, top_k, n_group=1, topk_group=1, routed_scaling_factor=1.0, normalize=True):
    s = _scores(logits, "sigmoid")
    choice = s.detach() + (0.0 if bias is None else bias.double())
    if n_group > 1:
        T, E = choice.shape
        group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
        group_idx = torch.topk(group_scores, topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        choice = choice.masked_fill(~group_mask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = _in_order(s, torch.topk(choice, top_k, dim=-1).indices)
    return router_weights_ref(logits, ids, "sigmoid", routed_scaling_factor, normalize), ids


def sqrtsoftplus_topk_ref(logits, bias, top_k, routed_scaling_factor=1.0):
    s = _scores(logits, "sqrtsoftplus")
    choice = s.detach() + (0.0 if bias is None else bias.double())
    ids = _in_order(s, torch.topk(choice, top_k, dim=-1).indices)
    return router_weights_ref(logits, ids, "sqrtsoftplus", routed_scaling_factor), ids


def hash_route_ref(logits, input_ids, tid2eid, routed_scaling_factor=1.0):
    s = _scores(logits, "sqrtsoftplus")
    ids = _in_order(s, tid2eid[input_ids.long()].long())
    return router_weights_ref(logits, ids, "sqrtsoftplus", routed_scaling_factor), ids
