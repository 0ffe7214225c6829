"""GLM-5 (``glm5_sparse_fp8``, transformers' ``glm_moe_dsa``): MLA attention whose
positions a DSA indexer selects ("full" layers run it, "shared" layers reuse the
last full layer's top-k), a sigmoid router with a correction bias over FP8 block
experts, shared experts, dense MLP layers first.

What exists so far is the foundation (issue 47):

- ``config.py``: ``Glm5Config`` (the fields of ``GlmMoeDsaConfig``, its per-layer
  lists, RoPE, the FP8 ``quantization_config``), presets ``tiny``, ``glm-5`` and
  ``glm-5-h200``, ``from_hf`` / ``to_hf`` of config.json;
- ``weights.py``: our tensor names <-> Hugging Face names (``name_map``,
  ``expected``, ``from_hf``, ``to_hf``, ``check_checkpoint_config``), experts
  stacked on load and unstacked on save, and FP8 block checkpoints read as their
  codes and scales (``from_hf_fp8`` / ``to_hf_fp8``) or as FP32 masters.

No trainer, server or kernels yet, so the model is not registered:
``alignzoo.list_models()`` does not name it and this package defines no ``SPEC``.
"""
