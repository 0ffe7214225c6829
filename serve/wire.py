"""A weight payload (``alignzoo.sync.Payload``) as one self-contained blob of bytes, for
``/update_weights_from_tensor``: a safetensors file whose tensors are ``indices/<name>`` and
``data/<name>`` (the layout ``DirectoryTransport`` writes) and whose metadata holds the payload's
header (manifest, its hash, stats) under ``alignzoo.sync``.  Decoding checks the framing only; the
receiver checks everything else (versions, shapes, dtypes, checksums, NaN/Inf) before a write."""
from __future__ import annotations

import base64
import binascii
import json
import struct

import torch

from ..sync import CorruptPayload, Payload

_KEY = "alignzoo.sync"


def encode_payload(payload: Payload) -> bytes:
    from safetensors.torch import save

    arrays = {}
    for name, d in payload.tensors.items():
        arrays[f"indices/{name}"] = d.indices.detach().cpu().contiguous()
        arrays[f"data/{name}"] = d.data.detach().cpu().contiguous()
    return save(arrays, metadata={_KEY: json.dumps(payload.header())})


def encode_payload_b64(payload: Payload) -> str:
    return base64.b64encode(encode_payload(payload)).decode("ascii")


def decode_payload(blob: bytes, device: str | torch.device = "cpu") -> Payload:
    """The payload in ``blob``; CorruptPayload when it is not one (bad framing, no header, missing tensors)."""
    if len(blob) < 8:
        raise CorruptPayload(f"the payload is {len(blob)} bytes: not a safetensors file")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise CorruptPayload(f"the payload's safetensors header claims {n} bytes, the blob has {len(blob) - 8}")
    try:
        meta = json.loads(blob[8:8 + n]).get("__metadata__") or {}
        header = json.loads(meta[_KEY])
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise CorruptPayload(f"the payload carries no {_KEY} header in its safetensors metadata "
                             f"({type(e).__name__}: {e})") from None
    from safetensors.torch import load

    try:
        arrays = load(blob)
    except Exception as e:  # safetensors raises its own SafetensorError for torn files
        raise CorruptPayload(f"cannot read the payload's tensors: {type(e).__name__}: {e}") from None
    try:
        names = header["manifest"]["tensors"]
        tensors = {n: (arrays[f"indices/{n}"].to(device), arrays[f"data/{n}"].to(device)) for n in names}
    except (KeyError, TypeError) as e:
        raise CorruptPayload(f"the payload lacks the tensors its manifest names: {e}") from None
    return Payload.from_header(header, tensors)


def decode_payload_b64(text: str, device: str | torch.device = "cpu") -> Payload:
    try:
        blob = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise CorruptPayload(f"the payload is not valid base64: {e}") from None
    return decode_payload(blob, device)
