"""Host copies of the integer tensors a ring plans with (``cu_seqlens``,
``q_positions``, ``kv_positions``). Planning needs their values on the host;
for a tensor on the GPU that read is a device-to-host copy that waits for the
GPU. The ring's Python entry point passes these host copies to the op instead,
made once per tensor and version (a model calls the ring once per layer with
the same positions: one read per batch, not one per layer), so the op reads
host memory only. Compiled code passes the tensors as they are (the op then
reads them once per call)."""

from __future__ import annotations

import weakref

import torch

__all__ = ["host_copy"]

# id(tensor) -> (weak reference, version, host copy)
_copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def host_copy(t):
    """``t`` itself when it is None, in host memory, meta or fake, or while
    compiling; else its copy in host memory, read once per version of ``t``
    (an in-place change makes a new one), kept while ``t`` lives."""
    from torch._subclasses.fake_tensor import is_fake

    if (not isinstance(t, torch.Tensor) or t.device.type in ("cpu", "meta")
            or torch.compiler.is_compiling() or is_fake(t)):
        return t
    key, version = id(t), t._version
    entry = _copies.get(key)
    if entry is not None and entry[0]() is t and entry[1] == version:
        return entry[2]
    host = t.to("cpu")

    def gone(ref, key=key):
        if key in _copies and _copies[key][0] is ref:
            del _copies[key]
    _copies[key] = (weakref.ref(t, gone), version, host)
    return host
