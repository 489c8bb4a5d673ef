"""A drop-in EPLB communicator for vLLM, on eplbx's transfer engine and protocol.

vLLM drives an EPLB communicator per MoE layer:

    comm.set_transfer_context(old_indices, layer_idx)
    for expert this rank serves:  comm.add_send(weight_rows, dst_rank, expert_id)
    for expert this rank needs:   comm.add_recv(buffer_rows, src_rank, expert_id)
    comm.execute()                # afterwards every buffer row holds its expert
    ... copy from expert_buffer into the weights ...

EplbxCommunicator registers every layer's weight tensors and the buffer once, exchanges
agent and layout metadata with torch.distributed.all_gather_object over `cpu_group`, and
validates the layouts on every rank (a mismatch raises eplbx.MismatchError naming the rank,
layer, tensor and both byte counts). Receivers READ the source's weight row directly (zero
copy on the source) once the source says READY; execute() returns when every rank's reads
for the layer are complete, so nobody overwrites rows a peer still reads. `timeout_s` bounds
every wait: a dead or stopped peer raises eplbx.AbortedError / UnavailableError naming it on
the survivors. See docs/python.md.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ._eplbx import InvalidArgumentError, _Communicator

_INT32_MAX = 2**31 - 1
# Every wait has a deadline (docs/protocol.md): no limit is not offered.
_TIMEOUT_RANGE = (0.1, 86400.0)


def _nbytes(t) -> int:
    return t.element_size() * t.numel()


def _check_cpu(t, what: str) -> None:
    if t.device.type != "cpu":
        raise NotImplementedError(
            f"eplbx: {what} is on {t.device}; this eplbx build moves host memory only "
            "(GPU tensors need a CUDA-capable backend, not available yet)")
    if not t.is_contiguous():
        raise ValueError(f"eplbx: {what} is not contiguous; expert rows must be contiguous")


def _check_int(value, what: str, lo: int, hi: int) -> int:
    """An integral number in [lo, hi], or InvalidArgumentError (never a silent wrap or cut)."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"eplbx: {what} is {value!r}, not an integer")
    if not lo <= int(value) <= hi:
        raise InvalidArgumentError(f"eplbx: {what} is {int(value)}, outside [{lo}, {hi}]")
    return int(value)


def _check_map(indices, what: str) -> np.ndarray:
    """A layer's phy2log as int32: integers in [-1, 2**31 - 1] only (a float, NaN or an id
    past int32 is an error naming the first bad slot, never truncated)."""
    if hasattr(indices, "detach"):
        indices = indices.detach().cpu().numpy()
    a = np.asarray(indices).reshape(-1)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise InvalidArgumentError(
            f"eplbx: {what} has dtype {a.dtype}; expert ids must be integers (int32 or int64)")
    bad = np.nonzero((a < -1) | (a > _INT32_MAX))[0]
    if bad.size:
        raise InvalidArgumentError(
            f"eplbx: {what} slot {int(bad[0])} holds expert id {int(a[bad[0]])}, outside "
            f"[-1, {_INT32_MAX}]")
    return np.ascontiguousarray(a, dtype=np.int32)


def _check_timeout(timeout_s) -> float:
    lo, hi = _TIMEOUT_RANGE
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise InvalidArgumentError(f"eplbx: timeout_s is {timeout_s!r}, not a number of seconds")
    t = float(timeout_s)
    if math.isinf(t):
        raise InvalidArgumentError(
            f"eplbx: timeout_s is {t}; every wait has a deadline (no limit is not offered): "
            f"give seconds in [{lo:g}, {hi:g}]")
    if not lo <= t <= hi:  # also NaN
        raise InvalidArgumentError(f"eplbx: timeout_s is {t}, outside [{lo:g}, {hi:g}] seconds")
    return t


def _merged_regions(tensors) -> list[tuple[int, int]]:
    """Memory ranges covering `tensors`, overlapping ranges merged. Merely adjacent ranges
    stay apart: they may be different shared-memory files, each mappable on its own."""
    spans = sorted((t.data_ptr(), t.data_ptr() + _nbytes(t)) for t in tensors if t.numel() > 0)
    out: list[list[int]] = []
    for start, end in spans:
        if out and start < out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e - s) for s, e in out]


class EplbxCommunicator:
    """vLLM's EplbCommunicator interface on eplbx (host tensors)."""

    def __init__(self, cpu_group, all_expert_weights, expert_buffer, timeout_s: float = 300.0,
                 transport: str = "auto", paths: str = "", defer_setup: bool = False, **_ignored):
        """Registers the weights and the buffer. The exchange with the peers (a collective over
        `cpu_group`: agent metadata and layouts, checked on every rank) happens here, or with
        `defer_setup=True` at the first set_transfer_context, as vLLM's NIXL communicator
        defers its remote setup (elastic EP builds communicators before every peer is up).
        Keyword arguments a newer vLLM may add are accepted and ignored."""
        import torch.distributed as dist

        self._group = cpu_group
        timeout_s = _check_timeout(timeout_s)
        rank = dist.get_rank(group=cpu_group)
        world = dist.get_world_size(group=cpu_group)
        self._rank, self._world = rank, world
        self._rows = []  # per layer, per tensor: (dtype, row shape, bytes per row)
        self._layer = None
        layers = []
        tensors = []
        for layer, layer_tensors in enumerate(all_expert_weights):
            spec = []
            for index, w in enumerate(layer_tensors):
                _check_cpu(w, f"weight tensor {index} of layer {layer}")
                rows = int(w.shape[0])
                per_expert = _nbytes(w) // rows if rows else 0
                spec.append((f"tensor{index}", str(w.dtype).replace("torch.", ""), [int(d) for d in w.shape[1:]],
                             w.data_ptr(), per_expert, rows))
                tensors.append(w)
            layers.append(spec)
            self._rows.append([(w.dtype, tuple(w.shape[1:]), _nbytes(w) // int(w.shape[0]) if w.shape[0] else 0)
                               for w in layer_tensors])
        for index, b in enumerate(expert_buffer):
            _check_cpu(b, f"expert_buffer tensor {index}")
            tensors.append(b)

        def allgather(blob: bytes) -> list:
            out = [None] * world
            dist.all_gather_object(out, blob, group=cpu_group)
            return out

        self._comm = None
        self._setup_args = (rank, world, allgather, layers, _merged_regions(tensors), float(timeout_s),
                            transport, paths)
        if not defer_setup:
            self._setup()

    def _setup(self) -> None:
        """The exchange with every peer (collective), once."""
        if self._comm is None:
            self._comm = _Communicator(*self._setup_args)
            self._setup_args = None

    @property
    def needs_profile_buffer_reservation(self) -> bool:
        return False

    def set_stream(self, stream) -> None:  # host memory: no streams to order against
        pass

    def set_transfer_context(self, old_indices, layer_idx: int, new_indices=None, **_ignored) -> None:
        """`old_indices`: the layer's phy2log in force; `new_indices` (optional): the one
        after. Every rank must pass the same maps: execute() compares them across ranks
        before any READ. Keyword arguments a newer vLLM may add are accepted and ignored."""
        layer = _check_int(layer_idx, "layer_idx", 0, len(self._rows) - 1)
        old = _check_map(old_indices, f"old_indices of layer {layer}")
        new = None if new_indices is None else _check_map(new_indices, f"new_indices of layer {layer}")
        self._setup()  # deferred setup: every rank reaches its first layer together
        self._comm.set_transfer_context(old, layer, new)
        self._layer = layer

    def _refuse(self, error: Exception) -> None:
        """Bad input found here once a layer's context is set: peers are told at once (their
        execute() fails naming this rank) instead of waiting for the deadline."""
        if self._layer is not None:
            self._comm.abort(str(error))
            self._layer = None
        raise error

    def _context(self):
        if self._comm is None:
            raise InvalidArgumentError("eplbx: call set_transfer_context(old_indices, layer_idx) first")
        return self._comm

    def add_send(self, tensors, dst_rank: int, expert_id: int, **_ignored) -> None:
        self._context()
        try:
            dst = _check_int(dst_rank, "dst_rank", 0, self._world - 1)
            expert = _check_int(expert_id, "expert_id", 0, _INT32_MAX)
        except InvalidArgumentError as e:
            self._refuse(e)
        self._comm.add_send(dst, expert)

    def add_recv(self, tensors, src_rank: int, expert_id: int, **_ignored) -> None:
        self._context()
        try:
            src = _check_int(src_rank, "src_rank", 0, self._world - 1)
            expert = _check_int(expert_id, "expert_id", 0, _INT32_MAX)
        except InvalidArgumentError as e:
            self._refuse(e)
        rows = []
        for index, t in enumerate(tensors):
            _check_cpu(t, f"receive row {index} of expert {expert}")
            if self._layer is not None and index < len(self._rows[self._layer]):
                dtype, shape, nbytes = self._rows[self._layer][index]
                if t.dtype != dtype or tuple(t.shape) != shape or _nbytes(t) != nbytes:
                    self._refuse(InvalidArgumentError(
                        f"eplbx: rank {self._rank}: receive row {index} of expert {expert} in layer "
                        f"{self._layer} is {str(t.dtype).replace('torch.', '')} {list(t.shape)} "
                        f"({_nbytes(t)} bytes); the weights' rows of that tensor are "
                        f"{str(dtype).replace('torch.', '')} {list(shape)} ({nbytes} bytes)"))
            rows.append((t.data_ptr(), _nbytes(t)))
        self._comm.add_recv(src, expert, rows)

    def execute(self, **_ignored) -> None:
        comm = self._context()
        self._layer = None  # the layer's context ends here, whatever execute() raises
        comm.execute()

    @property
    def failed(self) -> bool:
        return self._comm is not None and self._comm.failed
