"""A small device shim: the one place where CUDA streams and events appear.

On CPU every operation here is complete when it returns, so the model runner has a single
code path: it asks for an asynchronous host copy and later waits on it. Host values go the
other way through `upload`, which never makes the host wait for the device.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch


class HostCopy:
    """Device -> host copy of a few tensors, started on a side stream on CUDA."""

    def __init__(self, tensors: list[torch.Tensor], stream=None) -> None:
        if stream is None:
            self._host = [t.cpu() for t in tensors]
            self._event = None
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for src, dst in zip(tensors, self._host):
                dst.copy_(src, non_blocking=True)
                src.record_stream(stream)
            self._event = torch.cuda.Event(blocking=True)
            self._event.record(stream)

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host


def device_seconds(start: torch.cuda.Event | None, end: torch.cuda.Event | None) -> float:
    """Device time between two marks, in seconds; 0.0 without marks or before the end has run
    (never waits)."""
    if start is None or end is None or not end.query():
        return 0.0
    return start.elapsed_time(end) / 1e3


def upload(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values (a list, an ndarray or a CPU tensor) as a tensor on `device`, without a host
    synchronisation: on CUDA they are staged in pinned memory and copied with `non_blocking`
    (a copy from pageable memory, as `torch.tensor(values, device=cuda)` makes, waits for the
    device to drain its queue). On CUDA the staging buffer is private to this copy (the caller
    may change `values` at once; the pinned pool keeps it until the copy has run); on CPU an
    ndarray or tensor is shared, not copied."""
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        tensor = values if dtype is None else values.to(dtype)
    elif isinstance(values, np.ndarray):
        tensor = torch.from_numpy(values) if dtype is None else torch.from_numpy(values).to(dtype)
    else:
        tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def host_reads_are_free(device: torch.device) -> bool:
    """Whether the host may read a device value (`.item()`, a mask's count) at no cost: on CPU
    it exists when its op returns; on CUDA the host would wait for the device, so code there
    picks shapes that do not depend on device values."""
    return device.type != "cuda"


class DeviceShim:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self.is_cuda else None

    def host_copy(self, tensors: list[torch.Tensor]) -> HostCopy:
        return HostCopy(tensors, self._copy_stream)

    def mark(self) -> torch.cuda.Event | None:
        """A point in the device's stream (CUDA; None elsewhere): two of them time the device
        work between them, read with `device_seconds` once the later one has run."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def to_device(self, array) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if not self.is_cuda:
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)


@functools.cache
def fix_blas_thread_count() -> bool:
    """Turn off MKL's dynamic threading (torch's CPU BLAS on x86); True where it was on MKL.

    With it on (MKL's default) a product may run on fewer threads than torch's count while
    the machine is busy, and a sum split another way rounds differently: the same greedy
    request gave other fp32 logprobs in 50 of 60 runs beside a CPU hog (each value a few ulps
    off, enough to flip a near tie). Off, a result depends on the inputs and on the thread
    count the worker sets, not on the load. `MKL_DYNAMIC=FALSE` does the same where MKL reads
    it before its first call; this works after torch has run."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        set_dynamic = ctypes.CDLL(str(lib)).MKL_Set_Dynamic  # C; `mkl_set_dynamic` is Fortran
    except (OSError, AttributeError):  # not Linux, or a torch built without MKL
        return False
    set_dynamic.argtypes, set_dynamic.restype = [ctypes.c_int], None
    set_dynamic(0)
    return True
