"""What the device's torch offers the vendor baseline: the flash varlen op's schema, paged block_table
support at page 64, GQA in varlen flash, and flex_attention."""
import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print(torch.ops.aten._flash_attention_forward.default._schema)
dev, dt = "cuda", torch.bfloat16
q = torch.randn(130, 8, 128, device=dev, dtype=dt)
k = torch.randn(130, 2, 128, device=dev, dtype=dt)
cu = torch.tensor([0, 100, 130], dtype=torch.int32, device=dev)
try:
    o = torch.ops.aten._flash_attention_forward(q, k, k, cu, cu, 100, 100, 0.0, True, False)[0]
    print("varlen flash GQA ok", tuple(o.shape))
except Exception as e:  # noqa: BLE001
    print("varlen flash GQA failed:", str(e)[:300])
try:
    from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    print("flex_attention importable")
except Exception as e:  # noqa: BLE001
    print("flex import failed", e)
