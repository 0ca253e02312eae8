"""A thin layer over torch.distributed: the collectives the dispatchers use.

Rows travel as raw bytes (a ``[rows, row_bytes]`` uint8 view), so one code path
serves every dtype and wire format on every backend: gloo has no bf16 or fp8
all-to-all, NCCL moves bytes at the same speed as any other type.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor (a FutureWarning) for its new name, all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_BACKEND_DEVICES = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu", "ucc": "cuda", "xccl": "xpu"}


def device_types(group: dist.ProcessGroup | None) -> frozenset[str]:
    """Device types whose tensors the group's backend can move.

    A backend string such as ``"cpu:gloo,cuda:nccl"`` maps devices explicitly;
    a plain name maps to its usual device.
    """
    backend = str(dist.get_backend(group))
    if ":" in backend:
        return frozenset(part.split(":")[0] for part in backend.split(","))
    return frozenset({_BACKEND_DEVICES.get(backend, "cpu")})


def all_gather_rows(
    row: torch.Tensor, group: dist.ProcessGroup | None, world_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """All-gather of one fixed-size row per rank.

    Args:
        row: [L] this rank's row.
        out: optional [W, L] buffer to gather into.
    Returns:
        [W, L]; ``out[s]`` is rank s's ``row``.
    """
    if out is None:
        out = torch.empty(world_size, row.numel(), dtype=row.dtype, device=row.device)
    if world_size == 1:
        out.copy_(row.unsqueeze(0))
    else:
        _all_gather_single(out.view(-1), row.contiguous(), group=group)
    return out


def all_to_all_rows(
    rows: torch.Tensor,
    send_splits: tuple[int, ...],
    recv_splits: tuple[int, ...],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Variable-split all-to-all of rows of any dtype.

    Args:
        rows: [S, ...] rows in destination-rank order; ``send_splits[r]`` go to rank r.
        send_splits, recv_splits: host row counts per peer (recv_splits[s] rows
            arrive from rank s).
    Returns:
        [sum(recv_splits), ...] rows in source-rank order, same dtype as ``rows``.
    """
    if len(send_splits) == 1:
        return rows
    rows = rows.contiguous()
    tail = rows.shape[1:]
    as_bytes = rows.view(rows.shape[0], math.prod(tail)).view(torch.uint8)
    num_recv = sum(recv_splits)
    out = torch.empty(num_recv, as_bytes.shape[1], dtype=torch.uint8, device=rows.device)
    dist.all_to_all_single(
        out, as_bytes, list(recv_splits), list(send_splits), group=group
    )
    return out.view(rows.dtype).view(num_recv, *tail)


def all_to_all_rows_start(
    rows: torch.Tensor,
    send_splits: tuple[int, ...],
    recv_splits: tuple[int, ...],
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, "dist.Work | None"]:
    """:func:`all_to_all_rows` issued with ``async_op=True``.

    Returns:
        (out, work): ``out`` is the [sum(recv_splits), ...] result buffer, valid
        once ``work.wait()`` returned (on NCCL: once the current stream reaches
        the point where ``wait`` was called). ``work`` is None when nothing
        travels (a group of one), and ``out`` is then ``rows`` itself.
    """
    if len(send_splits) == 1:
        return rows, None
    rows = rows.contiguous()
    tail = rows.shape[1:]
    as_bytes = rows.view(rows.shape[0], math.prod(tail)).view(torch.uint8)
    num_recv = sum(recv_splits)
    out = torch.empty(num_recv, as_bytes.shape[1], dtype=torch.uint8, device=rows.device)
    work = dist.all_to_all_single(
        out, as_bytes, list(recv_splits), list(send_splits), group=group, async_op=True
    )
    return out.view(rows.dtype).view(num_recv, *tail), work

