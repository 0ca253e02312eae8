"""Expert tensor parallelism for the Megatron-Core adapter: the rows of an
expert-TP group gathered in Megatron's order, and the experts' partial outputs
summed back over the group (see :mod:`dispatch.integrations.megatron`, "Expert
tensor parallelism").

Notation: P ranks in the expert-TP group, E_local experts per rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable


@dataclass(frozen=True)
class TensorParallelRows:
    """The rows of one expert-TP group: ``counts[p][e]`` rows of local expert e
    dispatched to TP rank p, whose rows come in expert order ([e][source]).

    Attributes:
        counts: host, [P][E_local].
        group, rank: the expert-TP group and this rank in it.
        order: [sum] int64, position in the gathered rows ([p][e] chunks) of each
            row in expert order ([e][p] chunks).
        restore: the inverse permutation.
        per_expert: [E_local] int64 on the CPU, rows of each local expert over the group.
    """

    counts: tuple[tuple[int, ...], ...]
    group: dist.ProcessGroup
    rank: int
    order: torch.Tensor
    restore: torch.Tensor
    per_expert: torch.Tensor

    @staticmethod
    def gather_counts(counts: torch.Tensor, group, size: int, device: torch.device,
                      arrivals=None) -> "TensorParallelRows":
        """Every TP rank's rows per local expert (one small all-gather, a host read,
        waited for within ``arrivals``' timeout where given)."""
        from dispatch import comm, plan

        gathered = comm.all_gather_rows(plan.to_device(counts.to(torch.int64), device), group, size,
                                        arrivals=arrivals).cpu()
        table = tuple(tuple(row) for row in gathered.tolist())  # host sync
        refused = [p for p, row in enumerate(table) if any(n < 0 for n in row)]
        if refused:  # (marked counts: those ranks' dispatch raised in their EP groups, :func:`refuse`)
            raise refused_by(refused)
        return TensorParallelRows.of(table, group, device)

    @staticmethod
    def of(table: tuple[tuple[int, ...], ...], group, device: torch.device) -> "TensorParallelRows":
        """The group's rows from its counts table ([P][E_local], on the host)."""
        size = len(table)
        starts, at = [], 0
        for row in table:
            starts.append([])
            for n in row:
                starts[-1].append(at)
                at += n
        order = [i for e in range(len(table[0])) for p in range(size)
                 for i in range(starts[p][e], starts[p][e] + table[p][e])]
        order_t = torch.tensor(order, dtype=torch.int64)
        restore = torch.empty_like(order_t)
        restore[order_t] = torch.arange(len(order), dtype=torch.int64)
        return TensorParallelRows(table, group, dist.get_rank(group), order_t.to(device), restore.to(device),
                                   torch.tensor(table, dtype=torch.int64).sum(0))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sum(row) for row in self.counts)

    def by_expert(self, gathered: torch.Tensor) -> torch.Tensor:
        """[p][e] chunks -> [e][p] chunks (Megatron's order for its experts)."""
        return gathered.index_select(0, self.order)

    def by_rank(self, rows: torch.Tensor) -> torch.Tensor:
        """[e][p] chunks -> [p][e] chunks."""
        return rows.index_select(0, self.restore)


REFUSED = 2  # the fixed counts' check (MegatronDispatcher._check_fixed_counts) as a rank that refused marks it


def refused_by(ranks: list[int]):
    """The ``PeerRefused`` of expert-TP peers told by ``ranks`` that their EP groups' dispatch raised (:func:`refuse`)."""
    from dispatch.agreement import PeerRefused

    return PeerRefused(ranks, "this round trip in their EP group (their expert-TP peers stop here with them)")


def refuse(fixed: bool, num_local_experts: int, group, size: int, device: torch.device, arrivals) -> None:
    """This rank's dispatch raised (in its EP group, every rank did), while its
    expert-TP peers' EP groups may have gone on to this round trip's counts
    exchange of the expert-TP group (``TensorParallelRows.gather_counts``; with
    fixed rows, eager, the counts' check): it takes part there, marked, so that
    they raise ``PeerRefused`` at once and no exchange of the group pairs with
    one of another round trip."""
    from dispatch import comm

    marked = (torch.tensor([REFUSED], dtype=torch.int32, device=device) if fixed
              else torch.full((num_local_experts,), -1, dtype=torch.int64, device=device))
    comm.all_gather_rows(marked, group, size, arrivals=arrivals)


def gather(rows: torch.Tensor, tp: TensorParallelRows) -> torch.Tensor:
    """Every TP rank's rows, in rank order (an all-to-all of this rank's rows to each)."""
    from dispatch import comm

    sizes = tp.sizes
    mine = sizes[tp.rank]
    return comm.all_to_all_rows(rows.repeat(len(sizes), *([1] * (rows.dim() - 1))), (mine,) * len(sizes), sizes,
                                tp.group)


def sum_over_ranks(rows: torch.Tensor, tp: TensorParallelRows) -> torch.Tensor:
    """Each rank's chunk of ``rows`` ([p] chunks) summed over the group's copies:
    in fp32 (fp64 for fp64), ascending rank, cast once."""
    from dispatch import comm

    sizes = tp.sizes
    mine = sizes[tp.rank]
    parts = comm.all_to_all_rows(rows.contiguous(), sizes, (mine,) * len(sizes), tp.group)
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    total = torch.zeros(mine, *rows.shape[1:], dtype=acc, device=rows.device)
    for p in range(len(sizes)):
        total += parts[p * mine : (p + 1) * mine].to(acc)
    return total.to(rows.dtype)


class GatherRows(torch.autograd.Function):
    """Forward: the rows of every rank of the expert-TP group; backward: the sum of
    this rank's gradient rows over the group."""

    @staticmethod
    def forward(ctx, rows, tp):
        ctx.tp = tp
        return gather(rows, tp)

    @staticmethod
    @once_differentiable  # (its exchanges are not differentiable: a double backward raises)
    def backward(ctx, grad):
        return sum_over_ranks(grad, ctx.tp), None


class SumRows(torch.autograd.Function):
    """Forward: the sum of this rank's rows over the expert-TP group; backward: the
    gradient of every rank's rows (gathered)."""

    @staticmethod
    def forward(ctx, rows, tp):
        ctx.tp = tp
        return sum_over_ranks(rows, tp)

    @staticmethod
    @once_differentiable  # (its exchanges are not differentiable: a double backward raises)
    def backward(ctx, grad):
        return gather(grad.contiguous(), ctx.tp), None
