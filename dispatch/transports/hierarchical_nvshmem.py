"""The ``hierarchical`` variant over NVSHMEM (``transport="nvshmem"``): across
nodes once, then inside the node, with every split size on the device, so that
a dispatch with ``max_rows`` and the round trip after it read nothing on the
host, over any link NVSHMEM reaches (InfiniBand or RoCE between hosts).

Notation as in ``dispatch.transports.hierarchical``: L ranks per node, M = W // L
nodes; this rank is (node a, index l).

Two plans of the NVSHMEM all-to-all (``transports.nvshmem``), over one exchange
of the whole world (NVSHMEM's symmetric memory is the world's):

1. ``inter`` (across nodes): each token to the rank (n, l) of every node n that
   holds one of its experts (to itself for its own node), planned as a dispatch
   to W experts, one per rank, with the token's slots (n L + l for each such n,
   K wide: the ranks agree on K and the dtypes in its plan); its routing (expert
   ids and weights) rides along as a row. With one expert per rank, its
   expanded rows are its received rows, in their order: the rows the node sums
   go home by;
2. ``intra`` (inside the node): the rows that rank holds, taken as its tokens,
   routed to the experts of its own node only (the others' ids dropped),
   planned as a dispatch to the real experts.

Stage 2 hands each expert its rows by (holder's index, node, token); the
canonical order is by (source rank = node L + index, token). The permutation
between them is made once, in the plan, and folded into stage 2's places (the
receive side writes each row straight to its canonical place), so no row is
moved twice for it.

The wire rows are packed once at home and unpacked once at the experts (stage
2 forwards the packed bytes). Combine, in reverse, as the NCCL hierarchical
variant sums: the experts' pre-sums home to their holder, summed there in
ascending rank in the accumulation dtype (fp32, fp64 for fp64 weights); the
node sums cast to the combine wire and home across nodes, the home node's own
partial kept unrounded, summed in ascending node order and cast once. Every
verb is bitwise the NCCL hierarchical variant's.

With ``max_rows`` the buffers hold M T rows in stage 1 and W T in stage 2 (T
the group's largest tokens, ``reserve``; stage 2's tokens are the M T held rows,
from L ranks): stage 1 pads its held rows to M T, stage 2's outputs to
``max_rows``; ``memory_rows`` budgets stage 2's outputs. The failure checks are
the stages' (``transports.nvshmem``): a bad value is marked in stage 1's
routing (an id past the ranks), on the device; a rank over ``max_rows`` fails
stage 2, on every rank alike.

Inside the node the rows move by the same kernels (``nvshmem_puts``), which
reach the node's peers over NVLink where NVSHMEM maps their memory; the NVLink
engine's own kernels do not serve that tier.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dispatch import checks
from dispatch.codec import Codec, to_experts_codec
from dispatch.handle import CombineHandle, PlanOutputs
from dispatch.stats import make_stats
from dispatch.streams import Done, Pending
from dispatch.transports.base import Request, Transport, by_groups, grads_of, handle_fields, shape_fields
from dispatch.transports.nvshmem import NVSHMEMHandle, NVSHMEMTransport, presums
from dispatch.transports.symmetric import exchange_for
from dispatch.kernels.gather_sum import accumulate_dtype, gather_owned, gather_sum
from dispatch.timing import mark


class _Stage(NVSHMEMTransport):
    """One stage's all-to-all plan over the shared exchange (see the module doc).

    Attributes:
        fan: the ranks one rank's rows go to or come from in this stage (M
            across nodes, L inside one): the buffers hold ``fan`` times its
            tokens.
        extra: bytes of the rows this stage moves besides its own kinds (the
            routing rows, per-slot values of the whole round trip; set by
            ``HierarchicalNVSHMEMTransport.reserve``).
        original: ``inter`` only, during its plan: (topk_idx, topk_weights, E)
            of the dispatch behind its routing, named where a value is bad.
    """

    def __init__(self, config, group, exchange, fan: int) -> None:
        super().__init__(config, group, exchange)
        self.fan = fan
        self.extra: list[int] = []
        self.original = None

    @property
    def tokens(self) -> int:
        """T its buffers hold with max_rows (0 before any reserve)."""
        return 0 if self._capacity is None else self._capacity[0]

    def _row_sizes(self, x: torch.Tensor, topk: int) -> list[int]:
        return super()._row_sizes(x, topk) + self.extra

    def _raise_own_values(self, request: Request, header: list[int]) -> None:
        if self.original is None:
            return super()._raise_own_values(request, header)
        topk_idx, topk_weights, num_experts = self.original  # (the values stage 1's routing was made of)
        checks.raise_own_values(header, request.ticket, topk_idx, topk_weights, num_experts)


@dataclass(frozen=True, kw_only=True)
class StagedHandle(CombineHandle):
    """Plan of one two-stage exchange over NVSHMEM.

    Attributes:
        inter: stage 1's handle (held rows: its N, padded to M T with max_rows).
        intra: stage 2's, its places folded to the canonical order, moving in
            one piece.
    """

    inter: NVSHMEMHandle
    intra: NVSHMEMHandle


class HierarchicalNVSHMEMTransport(Transport):
    """Two-tier transport over NVSHMEM (``variant="hierarchical"``,
    ``transport="nvshmem"``; see the module doc). Like the alltoall variant over
    NVSHMEM, every dispatch is agreed over the host first, and a rank whose own
    dispatch does not fit the buffers takes part with nothing.

    Args:
        exchange: what moves the rows (the world's ``SymmetricExchange`` by
            default), as ``NVSHMEMTransport`` takes it.
    """

    variant = "hierarchical"
    transport = "nvshmem"
    host_free = True
    agrees_dispatch = True
    reserves = True

    def __init__(self, config, group=None, exchange=None) -> None:
        super().__init__(config, group)
        local = self.local_world_size
        self.num_nodes = self.world_size // local
        self.node, self.local_rank = divmod(self.rank, local)
        if exchange is None:
            device = torch.device("cuda", torch.cuda.current_device())
            exchange = exchange_for(group, self.world_size, device)
        stage = dataclasses.replace(config, variant="alltoall", transport="nvshmem")
        self.inter = _Stage(dataclasses.replace(stage, num_experts=self.world_size), group, exchange, self.num_nodes)
        self.intra = _Stage(stage, group, exchange, local)

    # -- the plan ---------------------------------------------------------------

    def plan(self, request: Request) -> tuple[StagedHandle, PlanOutputs]:
        words = self.agreed_words(request)
        x, topk_idx, weights = request.x, request.topk_idx, request.topk_weights.detach()
        topk = topk_idx.shape[1]
        bounded = request.max_rows is not None
        if bounded and not self.inter.tokens:
            self.reserve(x, topk)  # every rank alike (agreed): the buffers sized once
        # stage 1: each token once to every node that holds one of its experts
        held_rows = -1 if not bounded else self.num_nodes * self.inter.tokens
        # (as wide as the dispatch's slots, its weights' dtype: the ranks agree on K and dtypes in stage 1's header,
        # before the routing rows move)
        first = Request(owner=request.owner, x=x, topk_idx=self._inter_routing(topk_idx, weights, request.check_values),
                        topk_weights=torch.zeros_like(weights),
                        ticket=dataclasses.replace(request.ticket, max_rows=held_rows, memory_rows=-1),
                        check_values=request.check_values, agreed=request.agreed)
        self.inter.original = (topk_idx, weights, self.config.num_experts)
        try:
            inter, held = self.inter.plan_agreed(first, words)
        finally:
            self.inter.original = None
        native = to_experts_codec("native", torch.float64)
        routing = torch.cat([topk_idx.double(), weights.double()], 1)  # exact in fp64: ids and any weight dtype
        routing = self.inter.to_experts(routing, inter, native, True).finish()  # [N1, 2K] (sized by reserve)
        # stage 2: the held rows to this node's experts
        ids = routing[:, :topk].long()
        real = torch.arange(ids.shape[0], device=ids.device) < held.tokens_per_expert.sum()  # not padding
        node = ids.div(self.num_local_experts, rounding_mode="floor").div(self.local_world_size, rounding_mode="floor")
        second = Request(owner=request.owner, x=_like(x, ids.shape[0]),
                         topk_idx=torch.where(real.unsqueeze(1) & (ids >= 0) & (node == self.node), ids, -1),
                         topk_weights=routing[:, topk:].to(weights.dtype), ticket=request.ticket, check_values=False,
                         groups=request.groups, agreed=request.agreed, exact_memory_rows=request.exact_memory_rows)
        intra, got = self.intra.plan_agreed(second, words)
        intra = dataclasses.replace(intra, group_rows=None, group_experts=None)  # (G agreed in its plan) at once
        sources = torch.stack([held.src_rank, held.src_token], 1).double()  # [N1, 2] each held row's home
        sources = self.intra.to_experts(sources, intra, native, True).finish().long()  # [N, 2], stage 2's order
        sources = torch.where(got.src_rank.unsqueeze(1) >= 0, sources, -1)  # padding: no source
        order = self._canonical(got.tokens_per_expert, sources, intra.num_rows)
        place = torch.empty_like(order)
        place[order] = torch.arange(order.numel(), device=order.device)
        presum = intra.presum_index
        intra = dataclasses.replace(intra, presum_index=torch.where(presum >= 0, place[presum.clamp(min=0)], -1),
                                     expand_src=intra.expand_src[order])
        fields = dict(max_rows=intra.max_rows)
        if request.groups > 1:
            fields = shape_fields(request, self.num_local_experts, got.tokens_per_expert_host.tolist(),
                                  intra.num_rows)
        handle = StagedHandle(**handle_fields(request, self, intra.num_rows, grads_of(words), intra.has_rows),
                              inter=inter, intra=intra, **fields)
        outputs = PlanOutputs(weights=got.weights[order], tokens_per_expert=got.tokens_per_expert,
                              tokens_per_expert_host=got.tokens_per_expert_host, src_rank=sources[order, 0],
                              src_token=sources[order, 1])
        mark(self.phase_timer, "plan")
        return handle, outputs

    def _inter_routing(self, topk_idx: torch.Tensor, weights: torch.Tensor, check_values: bool) -> torch.Tensor:
        """[T, K] stage 1's slots: the rank with this rank's index of each node
        where the token has an expert (at most K nodes), ascending, then -1;
        where the dispatch's values are bad (``checks.value_flags``), its first
        slot marked past the ranks, for stage 1's checks to fail the dispatch
        on every rank."""
        nodes, local = self.num_nodes, self.local_world_size
        num_tokens, topk = topk_idx.shape
        device = topk_idx.device
        valid = (topk_idx >= 0) & (topk_idx < self.config.num_experts)
        node = topk_idx.clamp(min=0).div(self.num_local_experts * local, rounding_mode="floor")
        hit = torch.zeros(num_tokens, nodes + 1, dtype=torch.bool, device=device)
        hit.scatter_(1, torch.where(valid, node, nodes), True)
        hit_nodes = torch.where(hit[:, :nodes], torch.arange(nodes, device=device), nodes).sort(1).values[:, :topk]
        slots = torch.full((num_tokens, topk), -1, dtype=torch.int64, device=device)
        slots[:, : hit_nodes.shape[1]] = torch.where(hit_nodes < nodes, hit_nodes * local + self.local_rank, -1)
        if check_values and num_tokens:
            bad = checks.value_flags(topk_idx, weights, self.config.num_experts).any()
            slots[:1, :1] = torch.where(bad, self.world_size, slots[:1, :1])
        return slots

    def _canonical(self, per_expert: torch.Tensor, sources: torch.Tensor, num_rows: int) -> torch.Tensor:
        """[N] the stage-2 row of each canonical row: by local expert, then
        (source rank, source token); padding rows (past the real ones) last."""
        device = per_expert.device
        expert = torch.searchsorted(per_expert.cumsum(0), torch.arange(num_rows, device=device), right=True)
        key = (expert * self.world_size + sources[:, 0].clamp(min=0)) * (1 << 31) + sources[:, 1].clamp(min=0)
        return torch.argsort(key, stable=True)

    # -- the movements ------------------------------------------------------------

    def to_experts(self, rows: torch.Tensor, handle: StagedHandle, codec: Codec, own: bool = False):
        packed = codec.pack(rows)  # [T, wire row], forwarded as bytes by both stages
        native = to_experts_codec("native", packed.dtype)
        held = self.inter.to_experts(packed, handle.inter, native, own).finish()
        arrived = self.intra.to_experts(held, handle.intra, native, own).finish()  # canonical order
        mark(self.phase_timer, "exchange_out")
        return by_groups(Done(codec.unpack(arrived, rows.dtype, rows.shape[1])), handle)

    def to_home(self, rows, handle: StagedHandle, weights, wire) -> Pending:
        acc = accumulate_dtype(rows.dtype, wire, *([] if weights is None else [weights.dtype]))
        intra, inter = handle.intra, handle.inter
        at = torch.arange(handle.num_tokens, device=handle.device)  # this rank's rows to itself in stage 1: one a
        own = at < inter.sends[self.rank]  # token at most, at these places among its sends and its held rows
        sent_at, held_at = (torch.cumsum(t, 0)[self.rank] - t[self.rank] for t in (inter.sends, inter.receives))

        def node_sums(back):  # [S2, H] the pre-sums at their holder, summed there in ascending rank
            sums = gather_sum(back, intra.home_index, None, wire, acc)  # [N1, H] as they cross: cast once
            held = intra.home_index.shape[0]
            if wire == acc or not held:
                return sums, None
            # this node's partials cross no link: its own rows' sums again, unrounded
            mine = intra.home_index[torch.where(own, held_at + at, 0).clamp(max=held - 1)]
            return sums, gather_sum(back, torch.where(own.unsqueeze(1), mine, -1), None, acc)  # [T, H]

        sums, mine = self.intra.back_home(presums(rows, intra.presum_index, weights, wire), intra, node_sums)

        def home(back):  # [S1, H] in stage 1's send order
            if mine is not None:  # the own rows' unrounded sums in their places (the others' to a spare row)
                count = back.shape[0]
                full = torch.empty(count + 1, back.shape[1], dtype=acc, device=back.device)
                full[:count].copy_(back)
                full.index_copy_(0, torch.where(own, sent_at + at, count), mine)
                back = full
            return gather_sum(back, inter.home_index, None, rows.dtype, acc)

        out = self.inter.back_home(sums, inter, home)
        mark(self.phase_timer, "final_sum")
        return Done(out)  # [T, H]

    def slots_home(self, values: torch.Tensor, handle: StagedHandle) -> Pending:
        # each slot lives on one rank, the others hold zeros for it: gathered, not summed (signed zeros kept)
        held = self.intra.slots_home(values, handle.intra).finish()  # [N1, K]
        inter = handle.inter
        return Done(self.inter.back_home(held, inter, lambda back: gather_owned(back, inter.home_index)))

    def stats(self, handle: StagedHandle, dispatch_row_bytes, combine_wire, hidden):
        inter, intra, rank = handle.inter, handle.intra, self.rank
        if inter.send_splits is None:
            return None  # with max_rows: nothing read on the host
        return make_stats(
            self.local_world_size,
            (sum(intra.send_splits) - intra.send_splits[rank], sum(inter.send_splits) - inter.send_splits[rank]),
            dispatch_row_bytes,
            (sum(intra.recv_splits) - intra.recv_splits[rank], sum(inter.recv_splits) - inter.recv_splits[rank]),
            hidden * combine_wire.itemsize,
        )

    # -- sizes and failures -------------------------------------------------------

    def reserve(self, x: torch.Tensor, topk: int) -> None:
        """Both stages' buffers for dispatches of up to T tokens of K slots and
        rows like x, the group's largest (a collective of each stage)."""
        extra = [16 * topk, 8 * topk]  # the routing rows (fp64 ids and weights), per-slot values home
        self.inter.extra = self.intra.extra = extra
        self.inter.reserve(x, topk)
        held = self.num_nodes * self.inter.tokens
        self.intra.reserve(_like(x, held), topk)

    def seen_failed(self, bounded: bool) -> bool:
        return self.inter.seen_failed(bounded) or self.intra.seen_failed(bounded)

    def check(self) -> None:
        errors = []
        for stage in (self.inter, self.intra):  # each stage's record read (and cleared), the first raised
            try:
                stage.check()
            except Exception as error:  # noqa: BLE001 - re-raised below
                errors.append(error)
        if errors:
            raise errors[0]


def _like(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A stand-in for ``rows`` rows like x's (its width and dtype, no data): a
    stage's plan reads only those of its x."""
    return x.new_empty(1, x.shape[1]).expand(rows, -1)
