"""Transports: ``send(payload)`` on the trainer side, ``recv() -> Payload`` on the server side.

They move bytes and keep the order; all validation (versions, sizes,
checksums) is the ``Receiver``'s.
"""
from __future__ import annotations

import json
import os
import queue
import re
import time
import uuid
from pathlib import Path

import torch

from .checksum import tensor_bytes
from .payload import CorruptPayload, Payload, VersionSkew, parse_dtype


class InProcessTransport:
    """Trainer and server in one process (threads): a FIFO queue of payload
    objects.  The payload's tensors are the publisher's copies, so handing the
    object over is safe."""

    def __init__(self, maxsize: int = 0):
        self._queue: queue.Queue[Payload] = queue.Queue(maxsize)

    def send(self, payload: Payload) -> None:
        self._queue.put(payload)

    def recv(self, timeout: float | None = None) -> Payload:
        """The next payload; TimeoutError if none comes within ``timeout`` s."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no payload within {timeout} s") from None


_COMPLETE = re.compile(r"^v(\d{8})\.json$")


class DirectoryTransport:
    """Payloads as files in a shared directory: ``v{version:08d}.safetensors``
    (tensors ``indices/<name>`` and ``data/<name>``) and ``v{version:08d}.json``
    (manifest, its hash, stats).

    The writer writes each file under a hidden temporary name, fsyncs it and
    renames it into place with ``os.replace`` (atomic), the JSON last: a
    version exists for a reader once its JSON does, and by then its tensors
    are complete.  The reader takes versions in order from ``next_version``
    and refuses a gap (a later version present while the next is missing).
    """

    def __init__(self, directory: str | os.PathLike, *, next_version: int = 1, device: str | torch.device = "cpu"):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.next_version = next_version
        self.device = device

    def paths(self, version: int) -> tuple[Path, Path]:
        stem = self.directory / f"v{version:08d}"
        return stem.with_suffix(".safetensors"), stem.with_suffix(".json")

    def versions(self) -> list[int]:
        """The complete versions in the directory, ascending."""
        return sorted(int(m.group(1)) for f in os.listdir(self.directory) if (m := _COMPLETE.match(f)))

    # ------------------------------------------------------------ writer
    def send(self, payload: Payload) -> None:
        from safetensors.torch import save_file

        st_path, json_path = self.paths(payload.version)
        if json_path.exists():
            raise FileExistsError(f"{json_path} exists: version {payload.version} was already sent")
        arrays = {}
        for name, d in payload.tensors.items():
            arrays[f"indices/{name}"] = d.indices.detach().cpu().contiguous()
            arrays[f"data/{name}"] = d.data.detach().cpu().contiguous()
        tmp = self._tmp(st_path)
        save_file(arrays, tmp)
        self._commit(tmp, st_path)
        tmp = self._tmp(json_path)
        tmp.write_text(json.dumps(payload.header()))
        self._commit(tmp, json_path)

    def _tmp(self, path: Path) -> Path:
        return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")

    def _commit(self, tmp: Path, path: Path) -> None:
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash
        finally:
            os.close(fd)

    # ------------------------------------------------------------ reader
    def poll(self) -> Payload | None:
        """The payload of ``next_version`` if it is complete, else None.
        Raises VersionSkew if it is missing but a later version exists."""
        v = self.next_version
        st_path, json_path = self.paths(v)
        if not json_path.exists():
            later = [k for k in self.versions() if k > v]
            if later:
                raise VersionSkew(f"{self.directory}: the reader expects v{v} next but the next complete version "
                                  f"is v{later[0]}: v{v} was lost; resync with a full payload and set next_version")
            return None
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            header = json.loads(json_path.read_text())
            arrays = load_file(st_path, device=str(self.device))
        except (OSError, ValueError, SafetensorError) as e:
            raise CorruptPayload(f"cannot read v{v} from {self.directory}: {type(e).__name__}: {e}") from None
        try:
            tensors = {n: (arrays[f"indices/{n}"], arrays[f"data/{n}"]) for n in header["manifest"]["tensors"]}
        except (KeyError, TypeError) as e:
            raise CorruptPayload(f"{st_path} lacks the tensors its manifest names: {e}") from None
        payload = Payload.from_header(header, tensors)
        if payload.version != v:
            raise CorruptPayload(f"{json_path} holds version {payload.version}")
        self.next_version = v + 1
        return payload

    def recv(self, timeout: float | None = None, poll_interval: float = 0.01) -> Payload:
        """Wait for ``next_version``; TimeoutError after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            payload = self.poll()
            if payload is not None:
                return payload
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"v{self.next_version} did not appear in {self.directory} within {timeout} s")
            time.sleep(poll_interval)


class DistTransport:
    """Point-to-point over ``torch.distributed`` (gloo on CPU, NCCL on GPU)
    between the trainer (``send``, to rank ``peer``) and the server (``recv``,
    from rank ``peer``): an int64 header length, the JSON header, then for each
    tensor in name order its block indices and data as raw bytes (empty ones
    are skipped; the header gives every size).  Timeouts are the process
    group's.  ``device``: where tensors travel and land (default: the current
    CUDA device for NCCL, else the CPU)."""

    def __init__(self, peer: int, *, group=None, device: str | torch.device | None = None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("DistTransport needs torch.distributed initialized (dist.init_process_group)")
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.peer, self.group, self.device = peer, group, torch.device(device)
        self._dist = dist

    def send(self, payload: Payload) -> None:
        header = json.dumps(payload.header()).encode()
        self._send(torch.tensor([len(header)], dtype=torch.int64))
        self._send(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        for name in sorted(payload.tensors):
            d = payload.tensors[name]
            for t in (d.indices, d.data):
                if t.numel():
                    self._send(tensor_bytes(t))

    def recv(self) -> Payload:
        n = self._recv(1, torch.int64)
        header = json.loads(self._recv(int(n.item()), torch.uint8).cpu().numpy().tobytes())
        try:
            entries = sorted(header["manifest"]["tensors"].items())
            arrays = {name: (self._recv(int(t["num_indices"]), torch.int64),
                             self._recv(int(t["num_data"]), parse_dtype(t["dtype"]))) for name, t in entries}
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptPayload(f"malformed payload header from rank {self.peer}: {e}") from None
        return Payload.from_header(header, arrays)

    def _send(self, t: torch.Tensor) -> None:
        self._dist.send(t.to(self.device), dst=self.peer, group=self.group)

    def _recv(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype, device=self.device)
        if numel:
            self._dist.recv(out.view(torch.uint8), src=self.peer, group=self.group)
        return out
