"""safetensors written by hand: streamed tensor by tensor (one tensor at a time on the host, from a
GPU), written atomically, and ending in a "checksum" tensor, the sha256 of every byte before it.
A saved cache (formats/cache_file.py) is such a file."""
import hashlib
import itertools
import json
import os
import struct

import torch

from cli import atomic_path

_ST_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
              "torch.int64": "I64", "torch.uint8": "U8"}
TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "U8": torch.uint8}


def tensor_bytes(t):
    """A tensor's bytes (little-endian, as safetensors stores them) as a buffer (no copy on CPU)."""
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def write_safetensors(path, tensors, metadata):
    """A safetensors file written by hand, so that it streams tensor by tensor (one tensor at a time
    on the host, from a GPU) and ends in a "checksum" tensor: the sha256 of every byte before it
    (checksum_ok). Tensors lie by element size, largest first, so each starts aligned to its
    element; the header is padded to 8 bytes. Atomic (cli.atomic_path): a failed write leaves no
    file."""
    names = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header, offset = {}, 0
    for name in names:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = dict(dtype=_ST_DTYPES[str(t.dtype)], shape=list(t.shape),
                            data_offsets=[offset, offset + n])
        offset += n
    header["checksum"] = dict(dtype="U8", shape=[32], data_offsets=[offset, offset + 32])
    header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            digest = hashlib.sha256()
            head = [struct.pack("<Q", len(head)), head]
            for chunk in itertools.chain(head, (tensor_bytes(tensors[n]) for n in names)):
                f.write(chunk)
                digest.update(chunk)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible


def checksum_ok(path):
    """Whether the last 32 bytes of a write_safetensors file are the sha256 of all bytes before."""
    with open(path, "rb") as f:
        h, left = hashlib.sha256(), os.fstat(f.fileno()).st_size - 32
        while left > 0:
            chunk = f.read(min(left, 16 << 20))
            h.update(chunk)
            left -= len(chunk)
        return h.digest() == f.read(32)


def read_tensors(f, header, start, device="cpu", digest=None):
    """The tensors of a write_safetensors file, read from the open file `f` (positioned at byte
    `start`, where the data begins) in the order they lie, one at a time on the host, each moved to
    `device`: {name: tensor}. The header must have been checked to tile the data (every tensor's
    bytes its shape's, back to back, the "checksum" last). digest: a hashlib object that has seen
    every byte before `start`; it sees every byte read, so that the bytes checked are the ones
    used. Raises EOFError when the file ends early (it changed while read)."""
    out = {}
    f.seek(start)
    for name, spec in sorted(((n, s) for n, s in header.items() if n not in ("__metadata__",
                                                                               "checksum")),
                             key=lambda item: item[1]["data_offsets"][0]):
        begin, end = spec["data_offsets"]
        buf = bytearray(end - begin)
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = f.readinto(view[got:])
            if not n:
                raise EOFError(name)
            got += n
        if digest is not None:
            digest.update(buf)
        dtype = TORCH_DTYPES[spec["dtype"]]
        t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(spec["shape"]).to(device)
    return out
