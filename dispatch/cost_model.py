"""A cost model of one round trip (dispatch + combine) for each variant.

Time of one exchange stage = the latency of each tier it uses + the slowest
rank's bytes / bandwidth on each tier, the two tiers running side by side
(NVLink and the network are separate links): ``max(intra_time, inter_time)``.
A round trip adds its stages. Bytes come from global routing statistics that
every rank holds alike (``RoutingStats``, all-gathered), so every rank computes
the same costs and picks the same variant.

Notation: W ranks, L ranks per node, M = W // L nodes, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LinkModel:
    """Bandwidth (bytes/s leaving one rank) and latency (s) of each tier.

    The defaults describe one NVLink H100/H200 node (NCCL all-to-all reaches
    about 300 GB/s per rank on 4 x H200, ``bench/results``) and a 400 Gb/s network port per
    GPU; calibrate them with the all-to-all benchmark and pass them in
    (``DispatchConfig.link_model``).
    """

    intra_bandwidth: float = 300e9
    inter_bandwidth: float = 45e9
    intra_latency: float = 25e-6
    inter_latency: float = 40e-6

    def __post_init__(self) -> None:
        for name in ("intra_bandwidth", "inter_bandwidth"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"LinkModel.{name} must be a number > 0, got {value!r}")
        for name in ("intra_latency", "inter_latency"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"LinkModel.{name} must be a number >= 0, got {value!r}")

    def stage(self, intra_bytes: float, inter_bytes: float) -> float:
        """Seconds of one exchange stage in which the slowest rank sends these bytes."""
        time = 0.0
        if intra_bytes > 0:
            time = self.intra_latency + intra_bytes / self.intra_bandwidth
        if inter_bytes > 0:
            time = max(time, self.inter_latency + inter_bytes / self.inter_bandwidth)
        return time


@dataclass(frozen=True)
class RoutingStats:
    """Global statistics of one exchange, identical on every rank.

    Attributes:
        tokens: [W] int64, T of each rank.
        rank_hits: [W, W] int64, ``[s, d]`` = tokens of rank s with an expert on rank d.
        node_hits: [W, M] int64, ``[s, n]`` = tokens of rank s with an expert on node n.
    """

    tokens: torch.Tensor
    rank_hits: torch.Tensor
    node_hits: torch.Tensor


def _tiers(rows_to: torch.Tensor, local_world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, W] rows from rank s to rank d -> per-sender (intra rows [W], inter rows [W]), self excluded."""
    world = rows_to.shape[0]
    node = torch.arange(world) // local_world_size
    same = node.unsqueeze(1) == node.unsqueeze(0)
    off_diagonal = ~torch.eye(world, dtype=torch.bool)
    intra = (rows_to * (same & off_diagonal)).sum(1)
    inter = (rows_to * ~same).sum(1)
    return intra, inter


def _flat_stage(rows_to: torch.Tensor, row_bytes: int, local_world_size: int, link: LinkModel) -> float:
    intra, inter = _tiers(rows_to, local_world_size)
    return link.stage(float(intra.max()) * row_bytes, float(inter.max()) * row_bytes)


def estimate(
    stats: RoutingStats,
    local_world_size: int,
    dispatch_row_bytes: int,
    combine_wire: torch.dtype,
    hidden: int,
    link: LinkModel,
) -> dict[str, float]:
    """Modelled seconds of a round trip for each variant.

    Args:
        stats: global :class:`RoutingStats` (host tensors).
        local_world_size: L.
        dispatch_row_bytes: bytes of one row going to the experts.
        combine_wire: dtype of the partial sums going home.
        hidden: H of the partial sums.
    Returns:
        {"alltoall": s, "allgather": s, "hierarchical": s}.
    """
    world = stats.tokens.numel()
    combine_row_bytes = hidden * combine_wire.itemsize
    hits = stats.rank_hits
    alltoall = _flat_stage(hits, dispatch_row_bytes, local_world_size, link) + _flat_stage(
        hits.t(), combine_row_bytes, local_world_size, link
    )

    # allgather: every rank's block of max(T) rows reaches every peer.
    block = int(stats.tokens.max()) if world else 0
    every = torch.full((world, world), block, dtype=torch.int64)
    gather = _flat_stage(every, dispatch_row_bytes, local_world_size, link)
    if combine_wire == torch.float32:
        back = _flat_stage(every, 4 * hidden, local_world_size, link)  # reduce-scatter
    else:
        back = _flat_stage(hits.t(), combine_row_bytes, local_world_size, link)
    allgather = gather + back

    # hierarchical: stage 1 to rank (node n, same local index), stage 2 inside node n.
    local = local_world_size
    nodes = world // local
    node_of = torch.arange(world) // local
    index_of = torch.arange(world) % local
    stage1 = torch.zeros(world, world, dtype=torch.int64)
    for n in range(nodes):
        stage1[torch.arange(world), n * local + index_of] = stats.node_hits[:, n]
    # holder h = (n, l) forwards the tokens of every source with local index l to (n, l').
    same_index = index_of.unsqueeze(1) == index_of.unsqueeze(0)  # [source, holder]
    stage2 = torch.zeros(world, world, dtype=torch.int64)
    for holder in range(world):
        sources = same_index[:, holder]
        in_node = node_of == node_of[holder]
        stage2[holder, in_node] = hits[sources][:, in_node].sum(0)
    hierarchical = (
        _flat_stage(stage1, dispatch_row_bytes, local, link)
        + _flat_stage(stage2, dispatch_row_bytes, local, link)
        + _flat_stage(stage2.t(), combine_row_bytes, local, link)
        + _flat_stage(stage1.t(), combine_row_bytes, local, link)
    )
    return {"alltoall": alltoall, "allgather": allgather, "hierarchical": hierarchical}
