"""DeepSeek-V4 (``deepseek_v4_mhc_mxfp4``, transformers' ``deepseek_v4``): four mHC residual streams, shared-KV
MQA over a sliding window plus compressed history (C4 rows picked by an indexer, C128 rows read whole), hash- and
learned-routed MXFP4 experts.  Being built: the config (``config.py``) is here; the trainer, the server and the
weights follow on the shared ops ``common/mhc`` and ``common/compress``.  Not yet in the registry.
"""
