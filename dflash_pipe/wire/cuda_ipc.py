"""Same-host payloads GPU to GPU: a ring of slots in one device allocation, shared through CUDA IPC.

The producer allocates the ring on its target GPU (``CudaIpcRing.create``: ``cudaMalloc`` through ctypes
on the CUDA runtime torch loaded) and uses it as its staging: the target thread copies each batch's
features device-to-device into a slot and waits for that copy before the BATCH header (naming the slot, as
with ``wire.shm``) goes out. A same-host worker opens the allocation from WELCOME's offer
(``CudaIpcRing.attach``: ``cudaIpcOpenMemHandle``) and its ``unpack`` copies the slot's bytes straight to
its own GPU (the same GPU, or across NVLink/PCIe peer to peer) on its current stream, before its step, so
before its ACK; the producer reuses the slot only after the ACK.

- Nothing is pickled: the 64-byte ``cudaIpcMemHandle_t`` travels as a hex string in WELCOME's msgpack map,
  with the sizes, the GPU's UUID and a random token written into the allocation's first bytes (the worker
  reads it back to prove it opened this run's ring).
- Both sides wrap the raw pointer as a torch tensor through ``__cuda_array_interface__`` and
  ``torch.as_tensor`` (public API; checked to be a view, not a copy).
- The worker opens the handle on the GPU that holds the allocation (found by UUID among its visible GPUs),
  as torch's own CUDA IPC does; its tensors live there, and the copy to the worker's GPU is torch's
  cross-device copy, ordered on both devices' current streams.
- Lifetime: ``close`` (safe twice) calls ``cudaIpcCloseMemHandle`` on a worker and ``cudaFree`` on the
  producer; a finalizer does the same if ``close`` is never reached. Device memory belongs to the process's
  CUDA context, which the driver tears down however the process ends (SIGKILL included): nothing outlives
  the processes. Tensors viewing the ring are invalid after ``close``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import secrets
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_pipe.wire.ring import RingUnavailable, SlotRing, round_up

log = logging.getLogger("dflash_pipe.wire.cuda_ipc")

_MAGIC = b"DFPCUDA1"
_TOKEN_BYTES = 16
_HEADER_BYTES = 4096  # magic + token; slots start 4 KiB in
_SLOT_ALIGN = 4096
HANDLE_BYTES = 64
"""sizeof(cudaIpcMemHandle_t)."""
_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_OFFER_KEYS = frozenset({"pid", "device_uuid", "handle", "slots", "slot_bytes", "token"})


# ---------------------------------------------------------------------------------------------------------
# The CUDA runtime, through ctypes: the few calls torch does not expose publicly.


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


def _runtime_candidates() -> list[str]:
    """libcudart paths: the one this process already mapped (torch's), then those torch's wheel ships."""
    found: list[str] = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = parts[5].strip().removesuffix(" (deleted)") if len(parts) == 6 else ""
            if Path(path).name.startswith("libcudart.so") and path not in found:
                found.append(path)
    site = Path(torch.__file__).resolve().parent.parent
    for pattern in ("nvidia/cuda_runtime/lib/libcudart.so*", "nvidia/*/lib/libcudart.so*"):
        found += [str(p) for p in sorted(site.glob(pattern)) if str(p) not in found]
    found += [str(p) for p in sorted((site / "torch" / "lib").glob("libcudart*.so*")) if str(p) not in found]
    if (name := ctypes.util.find_library("cudart")) is not None:
        found.append(name)
    return found


class CudaRuntime:
    """ctypes bindings of cudaMalloc/cudaFree and the cudaIpc* calls on the CUDA runtime torch loaded."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = lib
        vp, size_t, cint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        signatures = {
            "cudaGetDevice": [ctypes.POINTER(cint)],
            "cudaSetDevice": [cint],
            "cudaMalloc": [ctypes.POINTER(vp), size_t],
            "cudaFree": [vp],
            "cudaIpcGetMemHandle": [ctypes.POINTER(_IpcMemHandle), vp],
            "cudaIpcOpenMemHandle": [ctypes.POINTER(vp), _IpcMemHandle, ctypes.c_uint],
            "cudaIpcCloseMemHandle": [vp],
            "cudaGetLastError": [],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, cint
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [cint], ctypes.c_char_p

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            self._lib.cudaGetLastError()  # clear it: torch would otherwise report it at its next launch
            text = (self._lib.cudaGetErrorString(err) or b"?").decode(errors="replace")
            raise RingUnavailable(f"{what} failed: CUDA error {err} ({text})")

    @contextlib.contextmanager
    def on_device(self, index: int) -> Iterator[None]:
        """This thread's current device is ``index`` inside the block (restored after)."""
        before = ctypes.c_int(-1)
        self._check(self._lib.cudaGetDevice(ctypes.byref(before)), "cudaGetDevice")
        self._check(self._lib.cudaSetDevice(index), f"cudaSetDevice({index})")
        try:
            yield
        finally:
            self._lib.cudaSetDevice(before.value)

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(self._lib.cudaMalloc(ctypes.byref(ptr), nbytes), f"cudaMalloc of {nbytes} bytes")
        return int(ptr.value or 0)

    def free(self, ptr: int) -> None:
        self._check(self._lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def ipc_handle(self, ptr: int) -> bytes:
        handle = _IpcMemHandle()
        self._check(
            self._lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle"
        )
        return bytes(bytearray(handle))  # all 64 bytes (the field itself would stop at the first NUL)

    def ipc_open(self, handle: bytes) -> int:
        if len(handle) != HANDLE_BYTES:
            raise RingUnavailable(f"a CUDA IPC handle has {HANDLE_BYTES} bytes, got {len(handle)}")
        ptr = ctypes.c_void_p()
        raw = _IpcMemHandle.from_buffer_copy(handle)
        self._check(
            self._lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), raw, _LAZY_ENABLE_PEER_ACCESS),
            "cudaIpcOpenMemHandle of the producer's ring",
        )
        return int(ptr.value or 0)

    def ipc_close(self, ptr: int) -> None:
        self._check(self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


_RUNTIME: CudaRuntime | None = None


def cuda_runtime() -> CudaRuntime:
    """The CUDA runtime library torch uses (found once); ``RingUnavailable`` without CUDA or without one."""
    global _RUNTIME
    if _RUNTIME is not None:
        return _RUNTIME
    if not torch.cuda.is_available():
        raise RingUnavailable("CUDA is not available in this process (torch.cuda.is_available() is False)")
    torch.cuda.init()  # torch maps its runtime now, so /proc/self/maps names it
    tried = []
    for path in _runtime_candidates():
        try:
            lib = ctypes.CDLL(path)
            _RUNTIME = CudaRuntime(lib, path)
            return _RUNTIME
        except (OSError, AttributeError) as exc:
            tried.append(f"{path}: {exc}")
    raise RingUnavailable(
        "found no usable CUDA runtime library (libcudart.so) mapped by this process, in torch's nvidia "
        f"wheels or on the loader path; tried: {tried or 'nothing'}. Install torch with its CUDA runtime, "
        "or use --payload-path shm."
    )


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; ``RingUnavailable`` if it cannot see that GPU."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise RingUnavailable(
        f"the producer's ring is on GPU {uuid}, which this process cannot see (CUDA_VISIBLE_DEVICES?)"
    )


# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CudaIpcOffer:
    """What WELCOME tells a same-host CUDA worker so it can open the ring (a plain msgpack map)."""

    pid: int
    device_uuid: str
    handle: str  # hex of the 64-byte cudaIpcMemHandle_t
    slots: int
    slot_bytes: int
    token: str  # hex

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in sorted(_OFFER_KEYS)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CudaIpcOffer:
        if data.keys() != _OFFER_KEYS:
            raise ValueError(f"CUDA IPC offer must have keys {sorted(_OFFER_KEYS)}, got {sorted(data)}")
        ints = {k: data[k] for k in ("pid", "slots", "slot_bytes")}
        if not all(type(v) is int and v >= 0 for v in ints.values()) or data["slots"] < 1:
            raise ValueError(f"CUDA IPC offer fields pid/slots/slot_bytes must be non-negative ints: {ints}")
        for key, nbytes in (("handle", HANDLE_BYTES), ("token", _TOKEN_BYTES)):
            if not _is_hex(data[key], nbytes):
                raise ValueError(f"CUDA IPC offer {key} must be a hex string of {nbytes} bytes")
        if not isinstance(data["device_uuid"], str) or not data["device_uuid"]:
            raise ValueError("CUDA IPC offer device_uuid must be a non-empty string")
        return cls(**data)


def _is_hex(value: Any, nbytes: int) -> bool:
    if not isinstance(value, str) or len(value) != 2 * nbytes:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True


class _DeviceMemory:
    """``nbytes`` of device memory at ``ptr``, as the CUDA array interface torch.as_tensor reads."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


def _as_tensor(ptr: int, nbytes: int, index: int) -> torch.Tensor:
    """uint8 [nbytes] on cuda:index viewing ``ptr`` (never a copy)."""
    try:
        tensor = torch.as_tensor(_DeviceMemory(ptr, nbytes), device=torch.device("cuda", index))
    except (RuntimeError, TypeError, ValueError) as exc:
        raise RingUnavailable(f"torch cannot view the ring's device memory: {exc}") from exc
    if tensor.data_ptr() != ptr or tensor.numel() != nbytes:
        raise RingUnavailable(
            f"torch.as_tensor copied the ring to {tensor.device} instead of viewing it on cuda:{index}"
        )
    return tensor


def _release(runtime: CudaRuntime, ptr: int, index: int, opened: bool) -> None:
    """cudaIpcCloseMemHandle (a worker) or cudaFree (the producer), once every queued copy is done."""
    try:
        with runtime.on_device(index):
            torch.cuda.synchronize(index)
            (runtime.ipc_close if opened else runtime.free)(ptr)
    except Exception as exc:  # at interpreter exit CUDA may already be gone; the driver frees it then
        log.warning("releasing the CUDA IPC ring on cuda:%d failed: %s", index, exc)


class CudaIpcRing(SlotRing):
    """A ring of ``slots`` slots of ``slot_bytes`` in one allocation on one GPU: a ``PayloadStaging`` (of
    device memory) on the producer, a ``codec.SharedRing`` on both sides. Use ``create`` or ``attach``."""

    PATH = "cuda_ipc"

    def __init__(
        self,
        runtime: CudaRuntime,
        ptr: int,
        index: int,
        slots: int,
        slot_bytes: int,
        token: bytes,
        *,
        owner: bool,
        handle: bytes = b"",
    ) -> None:
        self.token = token
        self.index = index
        self._handle = handle
        self._release = weakref.finalize(self, _release, runtime, ptr, index, not owner)
        size = _HEADER_BYTES + slots * slot_bytes
        try:
            self._all = _as_tensor(ptr, size, index)  # uint8 [header + slots * slot_bytes] on cuda:index
        except BaseException:
            self._release()
            raise
        self._init_slots(self._all[_HEADER_BYTES:], slots, slot_bytes, owner=owner)

    @classmethod
    def create(cls, slots: int, slot_bytes: int, device: torch.device | str) -> CudaIpcRing:
        """A new ring of ``slots`` slots of at least ``slot_bytes`` (rounded to 4 KiB) on ``device``."""
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs slots >= 1 and slot_bytes >= 1, got {slots} x {slot_bytes}")
        device = torch.device(device)
        if device.type != "cuda":
            raise RingUnavailable(f"a CUDA IPC ring needs a CUDA device, got {device}")
        runtime = cuda_runtime()
        index = device.index if device.index is not None else torch.cuda.current_device()
        slot_bytes = round_up(slot_bytes, _SLOT_ALIGN)
        with runtime.on_device(index):
            ptr = runtime.malloc(_HEADER_BYTES + slots * slot_bytes)
            try:
                handle = runtime.ipc_handle(ptr)
            except BaseException:
                runtime.free(ptr)
                raise
        token = secrets.token_bytes(_TOKEN_BYTES)
        ring = cls(runtime, ptr, index, slots, slot_bytes, token, owner=True, handle=handle)
        stamp = torch.frombuffer(bytearray(_MAGIC + token), dtype=torch.uint8)
        ring._all[: stamp.numel()].copy_(stamp)  # synchronous: done before any offer goes out
        return ring

    @classmethod
    def attach(cls, offer: CudaIpcOffer) -> CudaIpcRing:
        """Opens the producer's ring; raises ``RingUnavailable`` (take the next path) if it cannot."""
        runtime = cuda_runtime()
        index = local_index(offer.device_uuid)
        if offer.pid == os.getpid():
            raise RingUnavailable("CUDA IPC handles cannot be opened by the process that made them")
        with runtime.on_device(index):
            ptr = runtime.ipc_open(bytes.fromhex(offer.handle))
        token = bytes.fromhex(offer.token)
        ring = cls(runtime, ptr, index, offer.slots, offer.slot_bytes, token, owner=False)
        stamp = bytes(ring._all[: len(_MAGIC) + _TOKEN_BYTES].cpu().numpy())
        if stamp != _MAGIC + token:
            ring.close()
            raise RingUnavailable("the CUDA IPC handle opened another allocation (token mismatch)")
        return ring

    def offer(self) -> CudaIpcOffer:
        if not self.owner:
            raise RuntimeError("only the producer's ring can be offered")
        return CudaIpcOffer(
            pid=os.getpid(),
            device_uuid=device_uuid(self.index),
            handle=self._handle.hex(),
            slots=self.slots,
            slot_bytes=self.slot_bytes,
            token=self.token.hex(),
        )

    def _private(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    @property
    def released(self) -> bool:
        """The device memory is freed (producer) or unmapped (worker)."""
        return not self._release.alive

    def close(self) -> None:
        """Frees (producer) or unmaps (worker) the allocation after the device's queued work; safe twice."""
        if not self._close_slots():
            return
        self._data = self._all = None  # type: ignore[assignment]
        self._release()


def cuda_ipc_supported(device: torch.device | str) -> bool:
    """Whether this process could make or open a CUDA IPC ring for ``device`` (a CUDA device, Linux)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available() and os.name == "posix"
