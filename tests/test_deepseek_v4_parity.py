"""deepseek_v4_mhc_mxfp4 against transformers' DeepseekV4ForCausalLM, fp32, the same weights (sharpened tiny
preset: 300 / 77 / 5-token sequences, so the C4 indexer picks 24 of up to 75 rows and the window is left).

The indexer's scores Σ_h w·ReLU(q·k) are exactly 0.0 wherever every head's dot is negative, and transformers'
topk breaks such ties its own way (ours: the smaller row).  So the logits are compared with transformers' indexer
returning our selection, and the selections are compared on the rows where no tie sits at the top-k boundary."""
from __future__ import annotations

import pytest
import torch

from alignzoo.common.lm_head import lm_head_logits
from alignzoo.models.deepseek_v4_mhc_mxfp4 import weights as W
from alignzoo.models.deepseek_v4_mhc_mxfp4.config import PRESETS
from alignzoo.models.deepseek_v4_mhc_mxfp4.train import DeepseekV4Trainer, Indexer

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
hf_config = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")

CFG = PRESETS["tiny"]
LENS = (300, 77, 5)


@pytest.fixture(scope="module")
def models():
    from alignzoo.models.deepseek_v4_mhc_mxfp4 import init_weights
    from test_deepseek_v4 import sharpen

    torch.manual_seed(0)
    ours = DeepseekV4Trainer(CFG, dtype=torch.float32)
    init_weights(ours, 3)
    sharpen(ours, 4)
    d = CFG.to_hf()
    for k in ("architectures", "model_type"):
        d.pop(k)
    c = hf_config.DeepseekV4Config(**d)
    c._attn_implementation = "eager"
    hf = modeling.DeepseekV4ForCausalLM(c).float().eval()
    missing, unexpected = hf.load_state_dict(W.to_hf({n: p.detach() for n, p in ours.named_parameters()}, CFG),
                                             strict=False)
    assert not unexpected and all("inv_freq" in m for m in missing)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, CFG.vocab_size, (n,), generator=g) for n in LENS]
    return ours, hf, seqs


def _ours(model, seq, monkeypatch):
    """Our logits of every position, and per CSA layer its selection and the indexer's inputs, for one sequence."""
    sels, inputs = {}, {}
    real = Indexer.select

    def spy(self, h, q_resid, positions, cu, replay=None):
        sel = real(self, h, q_resid, positions, cu, replay)
        sels[self.index], inputs[self.index] = sel, (h, q_resid)
        return sel

    monkeypatch.setattr(Indexer, "select", spy)
    n = seq.shape[0]
    with torch.no_grad():
        h = model.hidden(seq, torch.arange(n), torch.tensor([0, n]), torch.arange(n))
        logits = lm_head_logits(h, model.lm_head_weight)
    monkeypatch.undo()
    return logits, sels, inputs


def test_logits_match_transformers_with_our_selection(models, monkeypatch):
    ours, hf, seqs = models
    for seq in seqs:
        logits, sels, _ = _ours(ours, seq, monkeypatch)
        for L, sel in sels.items():
            ind = hf.model.layers[L].self_attn.compressor.indexer
            monkeypatch.setattr(ind, "forward", lambda *a, _s=sel, **k: _s[None].long())
        with torch.no_grad():
            ref = hf(seq[None]).logits[0]
        monkeypatch.undo()
        err = ((logits.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < 1e-5, (seq.shape[0], err)


def test_selections_match_transformers_where_no_tie_decides(models, monkeypatch):
    """On the same inputs (our layer's hidden state and q residual), our top-k equals transformers' indexer's on
    every row whose k-th and (k+1)-th visible scores differ by more than the two sum orders' rounding."""
    ours, hf, seqs = models
    seq = seqs[0]
    n, k = seq.shape[0], CFG.index_topk
    _, sels, inputs = _ours(ours, seq, monkeypatch)
    checked = 0
    for L, sel in sels.items():
        ind = hf.model.layers[L].self_attn.compressor.indexer
        caught = {}
        real_sc = ind.scorer.forward
        monkeypatch.setattr(ind.scorer, "forward", lambda *a, _f=real_sc, **kw: caught.setdefault("s", _f(*a, **kw)))
        h, q_resid = inputs[L]
        with torch.no_grad():
            theirs_all = ind(h[None], q_resid[None], torch.arange(n)[None], None, L)[0]
        monkeypatch.undo()
        scores = caught["s"][0]  # (n, rows)
        vis = (torch.arange(n) + 1) // CFG.rate(L)
        for t in range(n):
            v = int(vis[t])
            mine = sorted(x for x in sel[t].tolist() if x >= 0)
            theirs = sorted(x for x in theirs_all[t].tolist() if x >= 0)
            top = torch.sort(scores[t, :v], descending=True).values
            if v > k and top[k - 1] - top[k] <= 1e-5 * top[0].abs():
                continue  # a tie (or a near-tie that the two sum orders may flip) at the boundary
            assert mine == theirs, (L, t)
            checked += 1
    assert checked > 0.8 * n * len(sels)
