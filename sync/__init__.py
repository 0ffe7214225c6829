"""Trainer -> server weight synchronisation (versioned, changed blocks only).

After every optimizer step the server must hold exactly the weights the
trainer's next forward reads.  The trainer's ``Publisher`` diffs its forward
weights byte for byte against the last shipped version and builds a
``Payload`` of the changed blocks (``layout.py``: 128x128 blocks for float8
codes, one entry per block for their scales, row blocks of each matrix of a
stack otherwise, so one changed expert ships only its own blocks) with
checksums; a transport moves it; the server's ``Receiver`` checks all of it,
the end state included (the blocks staged over its weights must hash to the
publisher's), and only then copies the blocks into its tensors in place
(``apply_between_steps``: between two engine steps).

    pub = Publisher(lambda: {n: p.detach() for n, p in trainer.named_parameters()})
    rx = Receiver(server.model.weights)
    apply_between_steps(server, rx, pub.publish())      # v1: everything
    ...optimizer step...
    apply_between_steps(server, rx, pub.publish())      # v2: changed blocks
    assert weights_digest(server.model.weights) == weights_digest(dict(trainer.named_parameters()))
"""
from .checksum import tensor_checksum, weights_checksum, weights_digest
from .layout import Layout, layout_of
from .payload import (CorruptPayload, EndStateMismatch, LayoutMismatch, NonFiniteWeights, Payload, SyncError, SyncStats,
                      TensorDelta, VersionSkew)
from .publisher import Publisher
from .receiver import Receiver, apply_between_steps
from .transport import DirectoryTransport, DistTransport, InProcessTransport

__all__ = ["CorruptPayload", "DirectoryTransport", "DistTransport", "EndStateMismatch", "InProcessTransport", "Layout",
           "LayoutMismatch", "NonFiniteWeights", "Payload", "Publisher", "Receiver", "SyncError", "SyncStats",
           "TensorDelta", "VersionSkew", "apply_between_steps", "layout_of", "tensor_checksum", "weights_checksum",
           "weights_digest"]
