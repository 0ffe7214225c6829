"""Cache of one merged LoRA weight, rebuilt only when W, A, B or the scale change."""
from __future__ import annotations

import torch

from .op import _check_adapter, lora_merge, lora_merge_fwd


def _stamp(t: torch.Tensor) -> tuple:
    # _version counts in-place writes made through autograd-visible ops
    # (optimizer steps under no_grad, copy_, load_state_dict); data_ptr catches
    # `param.data = ...` (module.to()).
    return t._version, t.data_ptr(), t.device, t.dtype, tuple(t.shape)


class MergedLoRACache:
    """Holds W' = ``lora_merge_fwd(W, A, B, s)`` for one adapted layer.

    ``weight(w, a, b, scale)`` returns W' (N, K): under ``torch.no_grad`` (the
    server) the cached tensor itself; with grad enabled (the trainer) an alias
    that routes dW' to A and B — the same bits either way.  W' is rebuilt when
    a different tensor is passed, or when one of them was written in place
    (``_version``), moved, or the scale changed; ``rebuilds`` counts rebuilds.

    Writes through ``.data`` bypass the version counter; call ``invalidate()``
    after them.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._refs: tuple = ()
        self._merged: torch.Tensor | None = None
        self.rebuilds = 0

    def invalidate(self) -> None:
        self._key, self._refs, self._merged = None, (), None

    def weight(self, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
        """w: (N, K), a: (r, K), b: (N, r) -> W' (N, K) in w.dtype."""
        _check_adapter(w, a, b, scale)
        key = (_stamp(w), _stamp(a), _stamp(b), float(scale))
        fresh = self._merged is not None and key == self._key and all(x is y for x, y in zip(self._refs, (w, a, b)))
        if not fresh:
            self._merged = lora_merge_fwd(w, a, b, float(scale))
            self._key, self._refs = key, (w, a, b)
            self.rebuilds += 1
        if not torch.is_grad_enabled():
            return self._merged
        return lora_merge(w, a, b, scale, merged=self._merged)
