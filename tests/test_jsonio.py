"""serve/jsonio: the HTTP path's JSON reads back FP32 log-probs with their bits, with orjson and without."""
import pytest
import torch

from alignzoo.serve import jsonio


@pytest.fixture(params=["installed", "stdlib"])
def backend(request, monkeypatch):
    if request.param == "stdlib":
        monkeypatch.setattr(jsonio, "orjson", None)
    elif jsonio.orjson is None:
        pytest.skip("orjson is not installed")
    return request.param


def test_fp32_logprobs_round_trip_bitwise(backend):
    g = torch.Generator().manual_seed(0)
    lp = torch.cat([-torch.rand(4099, generator=g) * 30, torch.tensor([-0.0, -1e-45, -1.17e-38, -3.4e38, -1e-7])])
    lp = lp.float()
    doc = {"output_token_logprobs": [[x, i, None] for i, x in enumerate(lp.tolist())]}
    back = jsonio.loads(jsonio.dumps(doc))
    got = torch.tensor([t[0] for t in back["output_token_logprobs"]], dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), lp.view(torch.int32))  # -0.0 included
    assert back["output_token_logprobs"][7][1:] == [7, None]


def test_reads_what_the_standard_library_reads(backend):
    assert jsonio.loads(b'{"sampling_seed": 1180591620717411303424}') == {"sampling_seed": 2**70}
    assert jsonio.loads('{"t": NaN}')["t"] != jsonio.loads('{"t": NaN}')["t"]
    for bad in (b"{", b'{"a": 1,}', b"\xff"):
        with pytest.raises(ValueError):
            jsonio.loads(bad)


def test_a_nonfinite_logprob_is_an_error_not_a_null():
    from alignzoo.serve.api import Item, item_response
    from alignzoo.common.sampling import SamplingParams

    item = Item(index=0, rid="r", prompt=[1, 2], sampling=SamplingParams(max_new_tokens=2), return_logprob=True,
                adapter=None, routed_start=None)
    assert item_response(item, [3, 4], [-1.0, -2.0], 0)["meta_info"]["output_token_logprobs"] == [[-1.0, 3, None],
                                                                                                  [-2.0, 4, None]]
    with pytest.raises(ValueError, match="not finite"):
        item_response(item, [3, 4], [-1.0, float("nan")], 0)
