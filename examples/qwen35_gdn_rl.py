"""RL on qwen35_gdn (Gated DeltaNet + MoE) with K3 == 0 on every token of
every step: the qwen3 example's task, objectives and flags
(``examples/qwen3_rl.py``) on the zoo's second model.  The server decodes
the GDN layers from each sequence's state slot, row by row with the
trainer's chunk arithmetic; the check before each update compares every
sampled token's FP32 log-probability bit for bit.

    python examples/qwen35_gdn_rl.py --steps 30
    python examples/qwen35_gdn_rl.py --lora 8 --lora-mode separate   # attention, GDN projections and experts
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen3_rl  # noqa: E402

qwen3_rl.MODEL = "qwen35_gdn"
qwen3_rl.DESCRIPTION = __doc__

if __name__ == "__main__":
    sys.exit(qwen3_rl.main())
