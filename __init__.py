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


from .common.sampling.params import SamplingParams  # noqa: E402  (public API: alignzoo.SamplingParams)


def list_models() -> list[str]:
    """Names of the models whose aligned pair works in this version."""
    from .models import available_models

    return available_models()


def load_pair(name: str, checkpoint=None, config=None, device=None, dtype=None, **kwargs):
    """Build an aligned pair: ``pair.trainer``, ``pair.server``, ``pair.sync()``.

    name:       a model of ``list_models()``
    checkpoint: a Hugging Face checkpoint directory (config.json + safetensors), or None
    config:     without a checkpoint: a preset name ("tiny", real sizes such as
                "qwen3-8b"), a dict, or the model's config object; the weights
                are then a seeded random init (``seed=`` keyword, default 0)
    device:     default "cuda" when available, else "cpu"
    dtype:      torch.bfloat16 (default) or torch.float32
    kwargs:     engine options (num_pages, max_batch_tokens, max_batch_size,
                cuda_graphs, ...), ``seed``, ``activation_checkpointing``,
                ``server_kernels="vendor"`` (a deliberately misaligned server),
                ``fp8=True`` (unified FP8), ``lora=LoRAConfig | dict``,
                ``lora_mode="merged" | "separate"``, ``lora_adapter=dir`` (a PEFT adapter),
                ``lora_adapters={name: LoRAConfig | dict | PEFT dir}`` (several adapters
                served in one batch, mode "multi"; requests and trainer calls name theirs
                with ``adapters=``)
    """
    import torch

    from .models import model_module

    dtype = torch.bfloat16 if dtype is None else dtype
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    return model_module(name).load(checkpoint=checkpoint, config=config, device=device, dtype=dtype, **kwargs)


__all__ = ["__version__", "list_models", "load_pair", "SamplingParams"]
