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

import numpy as np

from ._eplbx import _Communicator


def _nbytes(t) -> int:
    return t.element_size() * t.numel()


def _check_cpu(t, what: str) -> None:
    if t.device.type != "cpu":
        raise NotImplementedError(
            f"eplbx: {what} is on {t.device}; this eplbx build moves host memory only "
            "(GPU tensors need a CUDA-capable backend, not available yet)")
    if not t.is_contiguous():
        raise ValueError(f"eplbx: {what} is not contiguous; expert rows must be contiguous")


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
                 transport: str = "auto"):
        import torch.distributed as dist

        self._group = cpu_group
        rank = dist.get_rank(group=cpu_group)
        world = dist.get_world_size(group=cpu_group)
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
        for index, b in enumerate(expert_buffer):
            _check_cpu(b, f"expert_buffer tensor {index}")
            tensors.append(b)

        def allgather(blob: bytes) -> list:
            out = [None] * world
            dist.all_gather_object(out, blob, group=cpu_group)
            return out

        self._comm = _Communicator(rank, world, allgather, layers, _merged_regions(tensors), float(timeout_s),
                                   transport)

    @property
    def needs_profile_buffer_reservation(self) -> bool:
        return False

    def set_stream(self, stream) -> None:  # host memory: no streams to order against
        pass

    def set_transfer_context(self, old_indices, layer_idx: int) -> None:
        if hasattr(old_indices, "cpu"):
            old_indices = old_indices.cpu().numpy()
        self._comm.set_transfer_context(np.ascontiguousarray(np.asarray(old_indices, dtype=np.int32).reshape(-1)),
                                        int(layer_idx))

    def add_send(self, tensors, dst_rank: int, expert_id: int) -> None:
        self._comm.add_send(int(dst_rank), int(expert_id))

    def add_recv(self, tensors, src_rank: int, expert_id: int) -> None:
        for index, t in enumerate(tensors):
            _check_cpu(t, f"receive row {index} of expert {expert_id}")
        self._comm.add_recv(int(src_rank), int(expert_id), [t.data_ptr() for t in tensors])

    def execute(self) -> None:
        self._comm.execute()

    @property
    def failed(self) -> bool:
        return self._comm.failed
