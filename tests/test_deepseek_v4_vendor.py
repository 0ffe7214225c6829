"""deepseek_v4_mhc_mxfp4's vendor server (``serve_vendor.py``): transformers' arithmetic in torch's kernels on the
aligned server's pools.  It serves a mixed batch, stays close to the trainer in fp32 and is not its bits in bf16;
bisect names the op where it parts.  The contract of the aligned server is in test_deepseek_v4.py."""
from __future__ import annotations

import pytest
import torch
from test_deepseek_v4 import sharpen

from alignzoo import SamplingParams
from alignzoo.models import bisect as B
from alignzoo.models import deepseek_v4_mhc_mxfp4 as V4
from alignzoo.models.checks import scoring_batch
from alignzoo.models.deepseek_v4_mhc_mxfp4.serve_vendor import DeepseekV4VendorServer

KEEP_ALL = 1024  # an index_topk past every sequence here: the indexer keeps every visible compressed row
LENS = [300, 17, 5]  # crosses 75 C4 / 18 C16 groups and leaves the 40-token window; two short ones beside it


def vendor_pair(config="tiny", dtype=torch.bfloat16, seed=1):
    pair = V4.load(config=config, device="cpu", dtype=dtype, seed=seed, server_kernels="vendor", cuda_graphs=False,
                   freeze_gc=False)
    sharpen(pair.trainer, seed + 1)
    pair.sync()
    return pair


def generate(pair, lens, new, seed=3):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, pair.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    sp = SamplingParams(temperature=1.0, max_new_tokens=new, seed=seed, ignore_eos=True)  # no transform: no -inf
    outs = pair.server.generate(prompts, [sp] * len(prompts))
    assert not [o.error for o in outs if o.error]
    return [p + o.tokens for p, o in zip(prompts, outs)], [len(p) for p in prompts], sp, outs


def max_delta(a, b) -> float:
    return max(float((x.cpu() - y.cpu()).abs().max()) for x, y in zip(a, b))


def test_bf16_vendor_serves_a_mixed_batch_but_not_the_trainer_bits():
    """Prompts of 300 / 17 / 5 tokens in one prefill, then 6 new tokens each on torch's kernels: every request
    served with its extras; the trainer's log-probs of what it sampled are finite, near, and not the same bits."""
    pair = vendor_pair()
    assert type(pair.server.model) is DeepseekV4VendorServer
    seqs, plens, sp, outs = generate(pair, LENS, 6)
    for s, o in zip(seqs, outs):  # every fed token's routing
        assert o.extras["routed_experts"].shape == (len(s) - 1, pair.config.num_layers, pair.config.num_experts_per_tok)
    with torch.no_grad():
        want = pair.trainer.logprobs(seqs, plens, sp)
    got = [o.logprobs for o in outs]
    assert all(bool(torch.isfinite(w).all()) for w in want)
    assert max_delta(got, want) < 0.5  # the 0.0-tie selections of torch.topk, bf16 rounding: 0.096 measured
    assert not all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("config", ["tiny", "tiny-mxfp4"])
def test_fp32_vendor_is_close_to_the_trainer(config):
    """Every visible compressed row kept (torch.topk breaks the indexer's exact-0.0 ties otherwise than our
    smaller-row rule: 0.09 apart at the preset's top-24, all 54 parted rows ties), fp32: decode, prefill and
    37-token chunks (splits inside C4 and C16 groups: the ring's windows) within 1e-5 of the trainer
    (1.4e-6 measured), and not its bits."""
    pair = vendor_pair({"index_topk": KEEP_ALL} if config == "tiny" else V4.PRESETS[config].replace(
        index_topk=KEEP_ALL), torch.float32)
    seqs, plens, sp, outs = generate(pair, LENS, 4)
    with torch.no_grad():
        want = pair.trainer.logprobs(seqs, plens, sp)
    paths = {"decode": [o.logprobs for o in outs], "prefill": pair.server.score(seqs, plens, sp),
             "chunks": pair.server.score(seqs, plens, sp, chunk_tokens=37)}
    for name, got in paths.items():
        assert max_delta(got, want) < 1e-5, name
    assert not all(torch.equal(g.cpu(), w) for got in paths.values() for g, w in zip(got, want))


def test_bisect_names_the_first_op_where_the_vendor_parts():
    """bisect's prefill path against the vendor server: it parts in layer 0 (at attn.q, measured: the mHC collapse and the attention
    norm keep the bf16 bits), every op before that has the same bytes, and the indexer and the logits follow."""
    pair = V4.load(config="tiny", device="cpu", dtype=torch.bfloat16, seed=1, cuda_graphs=False, freeze_gc=False)
    sharpen(pair.trainer, 2)
    pair.sync()
    seqs, plens, sp = scoring_batch(pair.config.vocab_size, 300, 3, 0)
    vendor = B._vendor_engine(pair)
    assert type(vendor.runner.model) is DeepseekV4VendorServer
    rep, _ = B._path("vendor prefill", pair.trainer, seqs, plens, sp,
                     lambda: B._record_server(vendor, seqs, plens, sp))
    first = rep.diffs[0]
    before = rep.order[:rep.order.index(first.name)]
    assert first.name.startswith("layer.0.") and before and not {d.name for d in rep.diffs} & set(before)
    assert {"layer.1.indexer.selected", "lm_head.logits"} <= {d.name for d in rep.diffs}
    assert rep.tokens_differing > 0 and not rep.one_sided
    assert f"first difference: {first.name}" in rep.lines()[1]


def test_bisect_runs_both_paths_against_the_vendor():
    pair = V4.load(config="tiny", device="cpu", dtype=torch.bfloat16, seed=1, cuda_graphs=False, freeze_gc=False)
    prefill, decode = B.bisect(pair, against="vendor", length=60, batch=2, decode_tokens=20)
    assert not prefill.equal and not decode.equal
