"""Float64 reference of the sampling transforms: a plain loop over rows,
written from the rules in ``op.py`` with textbook torch ops (softmax, cumsum),
differentiable with autograd through the log-softmax over the support."""
from __future__ import annotations

import torch


def transformed_logprobs_ref(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """(R, V) float64 log-probabilities of the transformed distribution
    (-inf outside the support).  Greedy rows: 0 at the argmax (ties to the
    smaller id), -inf elsewhere."""
    R, V = logits.shape
    rows = []
    for r in range(R):
        t, k, p, m = float(temperature[r]), int(top_k[r]), float(top_p[r]), float(min_p[r])
        l = logits[r].double()
        neg_inf = torch.full_like(l, float("-inf"))
        if t == 0.0:
            best = int(torch.argmax(l.detach()))  # first maximal index
            rows.append(torch.where(torch.arange(V, device=l.device) == best, l * 0.0, neg_inf))  # a point mass: no gradient
            continue
        s = l / t
        order = torch.sort(-s.detach(), stable=True).indices  # value desc, id asc
        keep = V if k <= 0 or k >= V else k
        prob = torch.softmax(s.detach()[order[:keep]], 0)
        n = keep
        if p < 1.0:
            excl = torch.cumsum(prob, 0) - prob
            n = min(n, int((excl < p).sum()))
        if m > 0.0:
            n = min(n, int((prob >= m * prob[0]).sum()))
        support = order[:n]
        lp = neg_inf.clone()
        lp[support] = torch.log_softmax(s[support], 0)
        rows.append(lp)
    return torch.stack(rows)


def sampling_logprobs_ref(logits, tokens, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """(T,) float64 log-probs of the given tokens; differentiable w.r.t. logits."""
    lp = transformed_logprobs_ref(logits, temperature, top_k, top_p, min_p)
    return lp.gather(1, tokens.long()[:, None]).squeeze(1)
