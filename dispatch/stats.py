"""What one round trip puts on the links: rows and bytes per tier and direction.

Ranks of the EP group are grouped into nodes of ``local_world_size`` consecutive
ranks (rank r is on node ``r // local_world_size``). A row that this rank sends
to a peer of its own node crosses the *intra-node* tier (NVLink on one host); to
a peer of another node, the *inter-node* tier (the network). A row a rank sends
to itself crosses no link and is **not counted** in any tier.

Only token rows are counted (the rows the codec packs on the way to the experts,
the partial sums on the way home); the routing metadata that rides along
(slot lists, some bytes per row) and the counts all-gather are not.

The figures come from the split sizes the plan already copied to the host: they
cost no synchronisation and no communication.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DispatchStats:
    """Rows and bytes this rank sends over each tier in one round trip.

    ``dispatch_*``: rows going to the experts (``Dispatched.tokens``' way), in the
    dispatch wire format (``Codec.row_bytes``). ``combine_*``: partial sums going
    home, in the combine wire dtype, counted for expert outputs of the shape and
    dtype of ``x``. Self-sends are excluded. The backward passes move the same
    rows in the opposite directions (the backward of dispatch sends what combine
    sends, in ``dispatch_grad_wire``).

    Attributes:
        local_world_size: ranks per node used to tell the tiers apart.
        dispatch_intra_rows, dispatch_intra_bytes: sent to peers of this node.
        dispatch_inter_rows, dispatch_inter_bytes: sent to peers of other nodes.
        combine_intra_rows, combine_intra_bytes, combine_inter_rows,
        combine_inter_bytes: the same for the combine.
    """

    local_world_size: int
    dispatch_intra_rows: int
    dispatch_intra_bytes: int
    dispatch_inter_rows: int
    dispatch_inter_bytes: int
    combine_intra_rows: int
    combine_intra_bytes: int
    combine_inter_rows: int
    combine_inter_bytes: int

    @property
    def inter_bytes(self) -> int:
        """Bytes over the inter-node tier, both directions."""
        return self.dispatch_inter_bytes + self.combine_inter_bytes

    @property
    def intra_bytes(self) -> int:
        """Bytes over the intra-node tier, both directions."""
        return self.dispatch_intra_bytes + self.combine_intra_bytes

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def resolve_local_world_size(configured: int | None, world_size: int, hosts: tuple[str, ...] | None = None) -> int:
    """Ranks per node of an EP group of ``world_size`` ranks (nodes are blocks of
    consecutive group ranks).

    ``configured`` (``Tuning.local_world_size``) when given; else
    :func:`ranks_per_host` of the host of each group rank (``hosts``, in group
    order, the same on every rank: ``comm.group_hosts``; not a process's own
    ``LOCAL_WORLD_SIZE``, which ranks on nodes of different sizes would not
    agree on); else (no hosts: a one-rank group) the whole group is one node.

    Raises:
        ValueError: ``configured`` does not divide ``world_size``.
    """
    if configured is not None:
        if world_size % configured != 0:
            raise ValueError(f"local_world_size={configured} does not divide the group size {world_size}")
        return configured
    return world_size if hosts is None else ranks_per_host(hosts)


def ranks_per_host(hosts: tuple[str, ...]) -> int:
    """Ranks per node of a group whose ranks run on ``hosts`` (in group order):
    L where each host's ranks are one block of L consecutive group ranks, the
    same L for every host; else 1 (every rank a node of its own), so that no
    tier takes ranks of two hosts for one node. An EP group strided across
    nodes (tensor parallelism inside them, say) is so counted by its own ranks,
    not by the processes a node runs."""
    runs = [len(list(run)) for _, run in itertools.groupby(hosts)]
    return runs[0] if len(runs) == len(set(hosts)) and len(set(runs)) == 1 else 1


def tier_split(rows_to_peer: list[int] | tuple[int, ...], rank: int, local_world_size: int) -> tuple[int, int]:
    """(intra-node rows, inter-node rows) of per-peer row counts, self excluded.

    Args:
        rows_to_peer: rows sent to each group rank (length W).
        rank: this rank (its own entry is a self-send, not counted).
    """
    node = rank // local_world_size
    intra = inter = 0
    for peer, rows in enumerate(rows_to_peer):
        if peer == rank:
            continue
        if peer // local_world_size == node:
            intra += rows
        else:
            inter += rows
    return intra, inter


def make_stats(
    local_world_size: int,
    dispatch_rows: tuple[int, int],
    dispatch_row_bytes: int,
    combine_rows: tuple[int, int],
    combine_row_bytes: int,
) -> DispatchStats:
    """DispatchStats from (intra, inter) row counts per direction and bytes per row."""
    return DispatchStats(
        local_world_size=local_world_size,
        dispatch_intra_rows=dispatch_rows[0],
        dispatch_intra_bytes=dispatch_rows[0] * dispatch_row_bytes,
        dispatch_inter_rows=dispatch_rows[1],
        dispatch_inter_bytes=dispatch_rows[1] * dispatch_row_bytes,
        combine_intra_rows=combine_rows[0],
        combine_intra_bytes=combine_rows[0] * combine_row_bytes,
        combine_inter_rows=combine_rows[1],
        combine_inter_bytes=combine_rows[1] * combine_row_bytes,
    )
