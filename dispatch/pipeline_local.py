"""MoEExchange(local_first=True): a rank's own rows are computed while the plan
and the exchange of the other ranks' rows run.

Notation as in ``dispatch.plan``; C chunks of home tokens as in
``dispatch.pipeline``. The rows of the canonical order whose source is this rank
("own rows": its tokens routed to its own experts) need nothing from any peer:
they are known from ``topk_idx`` alone. With ``local_first`` the layer

1. finds the own rows of every chunk with the plan's route (``plan.own_keys``,
   in the plan's first CUDA graph), their counts read in the plan's first host
   synchronisation (that of the value checks, when they are on), and packs
   every send row of every chunk at once, on the communication stream, before
   the GEMMs hold the SMs;
2. computes all own rows, taken from the self blocks of the packed rows, on
   the compute stream, while the rest of the plan and the dispatch of the first
   chunks (``ahead``) run on the communication stream;
3. runs the pipeline of ``dispatch.pipeline`` on the other ranks' rows: the
   experts compute chunk c's others' rows once they have arrived, and chunk c's
   combine (its own rows' outputs joined in) travels while chunk c + 1 computes.

Backward alike: every row's gradient is packed once; the own rows' are
computed from the self blocks while the first chunks' others' travel; each
chunk's gradients go home as its others' are done, and the weight gradients'
GEMMs run beside the last chunk's.

The exchanges are the plain ones, own rows included (they cross each
all-to-all's self block, a local copy): the rows the experts see, the combine's
pre-sums and the home sums are those of ``dispatch`` / ``combine``, value for
value. So where the experts compute each row on its own, outputs and the
gradients of x and topk_weights are bitwise those of C = 1. Parameter
gradients: for a plain ``GroupedExperts`` one grouped GEMM per weight over every
part's rows (each expert's own rows first, ``experts.ChunkedExperts``); for
other experts the sum of the parts' calls (own rows, then the others' chunk by
chunk); equal to those of one call up to rounding (the rows' order within an
expert differs from the canonical one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dispatch import plan
from dispatch.codec import to_experts_codec
from dispatch.dispatchers.base import Pending
from dispatch.experts import ChunkedExperts
from dispatch.pipeline import (_Arrived, _check_expert_out, _plain_grouped_experts, _run, autograd_rows,
                               grads_home, on_stream, outputs_home, send_starts, settle_output,
                               weighted_grads)


@dataclass(frozen=True)
class OwnRows:
    """The rows of the canonical order whose source is this rank, all chunks'.

    Attributes:
        send_token: [S] the home token of each send row (all chunks', chunk-major);
            packing with it makes every send row at once.
        expand: [N_own] the send row (among all S) behind each own row, in the
            canonical order of one exchange (local expert, then token).
        in_chunk: per chunk, [N_own_c] the own rows (indices into ``expand``'s
            order) of the chunk, in the chunk's canonical order; ``[None]`` for
            one chunk (all of them).
        chunk_counts: [C, E_local] int64 own rows of each chunk per local expert, on the device.
        chunk_counts_host: the same on the host.
    """

    send_token: torch.Tensor
    expand: torch.Tensor
    in_chunk: list
    chunk_counts: torch.Tensor
    chunk_counts_host: torch.Tensor

    @property
    def counts(self) -> torch.Tensor:
        """[E_local] int64 own rows per local expert (all chunks), on the device."""
        return self.chunk_counts.sum(0)

    @property
    def counts_host(self) -> torch.Tensor:
        """The same on the host."""
        return self.chunk_counts_host.sum(0)

    def of_chunk(self, rows: torch.Tensor, c: int) -> torch.Tensor:
        """Chunk c's own rows of ``rows`` ([N_own, ...] in the own rows' order)."""
        return rows if self.in_chunk[c] is None else rows[self.in_chunk[c]]


def own_rows(keys: plan.OwnKeys, counts_host: torch.Tensor, rank: int, bounds: tuple[int, ...]) -> OwnRows:
    """The own rows, from this rank's ``plan.OwnKeys`` and its counts of each
    chunk on the host ([C, W, 1 + E_local]), for home token chunks ``bounds``;
    no host synchronisation. The keys are a replayed plan's buffers: what is
    made here from them is new tensors."""
    chunks = len(bounds) - 1
    num_send = int(counts_host[:, :, 0].sum())
    per_chunk = counts_host[:, rank, 1:].clone()  # [C, E_local]
    num_tokens = keys.send_row.shape[0]
    row_token = keys.row_key[: int(per_chunk.sum())] % max(num_tokens, 1)
    device = keys.send_row.device
    send_token = keys.send_token[:num_send]
    in_chunk = [None]
    if chunks > 1:  # tokens inside their chunk -> home tokens; own rows split by chunk, order kept
        rows_per_chunk = plan.to_device(counts_host[:, :, 0].sum(1), device)
        starts = plan.to_device(torch.tensor(bounds[:-1], dtype=torch.int64), device)
        send_token = send_token + torch.repeat_interleave(starts, rows_per_chunk, output_size=num_send)
        chunk = torch.searchsorted(starts[1:], row_token, right=True)
        in_chunk = list(torch.sort(chunk, stable=True).indices.split(per_chunk.sum(1).tolist()))
    send_token = send_token if chunks > 1 else send_token.clone()  # (a view of the keys for one chunk)
    return OwnRows(send_token, keys.send_row[row_token], in_chunk, plan.to_device(per_chunk, device), per_chunk)


def used_on(obj, stream) -> None:
    """Mark every tensor field of a plan dataclass as used by ``stream`` (the
    plan is made on the communication stream and read on the compute stream)."""
    if stream is None:
        return
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                tensor.record_stream(stream)


class Parts:
    """The experts over parts of the canonical order: the own rows of every
    chunk (part 0) first, then the others' rows of chunk c (part 1 + c). A
    plain :class:`GroupedExperts` runs as ``experts.ChunkedExperts`` (its
    weight gradients formed once, over every part's rows); other experts
    through autograd, part by part, their parameter gradients summed in the
    parameters' dtype."""

    def __init__(self, experts, params, own: OwnRows, grad_on: bool, plain: bool, parts: int) -> None:
        self.experts, self.params, self.grad_on = experts, params, grad_on
        counts, counts_host = own.counts, own.counts_host
        self.counts = [(counts, counts_host)] + [None] * (parts - 1)
        self.chunked = None
        if plain:
            self.chunked = ChunkedExperts(experts, [counts] + [None] * (parts - 1),
                                          [counts_host] + [None] * (parts - 1), grad_on)
        self.kept = [None] * parts  # autograd path: (leaf, output with its graph) per part
        self.grad_params = [None] * len(params)

    def set_counts(self, p: int, counts: torch.Tensor, counts_host: torch.Tensor) -> None:
        """Part p's rows per expert (device, host), known once the plan is made."""
        self.counts[p] = (counts, counts_host)
        if self.chunked is not None:
            self.chunked.set_counts(p, counts, counts_host)

    def forward(self, p: int, rows: torch.Tensor, defer_keep: bool = False) -> torch.Tensor:
        """Part p's rows -> the experts' output (detached); ``defer_keep``: what
        backward keeps is placed by :meth:`place_kept`, not behind the GEMMs."""
        if self.chunked is not None:
            return self.chunked.forward(p, rows, defer_keep)
        leaf = rows.detach().requires_grad_(self.grad_on)
        with torch.set_grad_enabled(self.grad_on):
            y = self.experts(leaf, self.counts[p][0])
        _check_expert_out(y, rows)
        if self.grad_on:
            self.kept[p] = (leaf, y)
        return y.detach()

    def place_kept(self) -> None:
        """Place what the parts' forwards left to keep (once every part's counts are set)."""
        if self.chunked is not None:
            self.chunked.place_kept()

    def backward(self, p: int, grad_y: torch.Tensor, rows_grad: bool) -> torch.Tensor | None:
        """Gradient of part p's output -> gradient of its rows (if ``rows_grad``)."""
        if self.chunked is not None:
            if not (rows_grad or self.params):
                return None
            return self.chunked.backward(p, grad_y, rows_grad)
        leaf, y = self.kept[p]
        self.kept[p] = None  # the part's graph is spent
        return autograd_rows(leaf, y, grad_y, rows_grad, self.params, self.grad_params)

    def weight_grads(self) -> list:
        """Per parameter its gradient (None where it has none), once every part's backward ran."""
        if self.chunked is not None and self.params:
            return self.chunked.param_grads(self.params)  # _plain_grouped_experts: its only parameters
        return self.grad_params


@dataclass(frozen=True)
class Partition:
    """The canonical order's rows in two parts: the others' rows, then the own.

    Attributes:
        others, mine: positions of each part's rows in the canonical order, ascending.
        order: [N] the canonical row behind each row of the parts' concatenation
            (``others`` then ``mine``).
        at: [N] the inverse: where each canonical row sits in that concatenation.
    """

    others: torch.Tensor
    mine: torch.Tensor
    order: torch.Tensor
    at: torch.Tensor

    def handle(self, handle):
        """``handle`` for rows in the parts' concatenation: its pre-sum index
        points there (same rows, same order of summation), so that the parts'
        outputs need no scatter into the canonical order."""
        index = handle.presum_index
        return dataclasses.replace(handle, presum_index=torch.where(index >= 0, self.at[index.clamp(min=0)], -1))


def partition(src_rank: torch.Tensor, rank: int, num_own: int) -> Partition:
    """The own rows (source ``rank``, ``num_own`` of them) and the others'."""
    order = torch.sort((src_rank == rank).to(torch.int8), stable=True).indices
    at = torch.empty_like(order)
    at[order] = torch.arange(order.shape[0], device=order.device)
    split = order.shape[0] - num_own
    return Partition(order[:split], order[split:], order, at)


def arrive(streams, pending: Pending) -> torch.Tensor:
    """Finish an exchange issued on the communication stream there (CUDA), and
    make the compute stream wait for its result; on CPU, finish it."""
    if streams.comm_stream is None:
        return pending.finish()
    with torch.cuda.stream(streams.comm_stream):
        result = pending.finish()
        event = torch.cuda.Event()
        event.record(streams.comm_stream)
    return _Arrived(result, event, streams.compute).finish()


def _joined(others: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The parts' rows in the order of ``Partition.order``. A part without rows
    takes no part: experts may answer an empty call in another dtype (a rank
    raising here, after the dispatch, would leave its peers waiting)."""
    filled = [rows for rows in (others, own) if rows.shape[0]]
    return torch.cat(filled) if len(filled) > 1 else (filled or [others])[0]


def local_first_forward(layer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``MoEExchange(local_first=True)``'s forward: the plan of C chunks of home
    tokens, beside it the own rows of all chunks, then the pipeline of the
    others' rows (the inputs are checked)."""
    d = layer.dispatcher
    streams = layer._streams(x.device)
    grad_on = torch.is_grad_enabled()
    codec = to_experts_codec(d.config.dispatch_wire, x.dtype, d.config.fp8_pow2_scales)
    params = layer._trained_params()
    plain = _plain_grouped_experts(layer.experts, x.device.type)
    bounds = layer._bounds(x)
    if streams.comm_stream is not None:  # the plan reads the inputs, made on the compute stream
        streams.comm_stream.wait_stream(streams.compute)
    made = {}

    def beside(keys, counts_host):  # the values are checked; the plan's collectives and host work come next
        own = own_rows(keys, counts_host, d.rank, bounds)
        with torch.no_grad():  # every row of every chunk packed at once, before the GEMMs take the SMs
            sent = arrive(streams, Pending.done(codec.pack(x, own.send_token)))
        parts = Parts(layer.experts, params, own, grad_on, plain, len(bounds))
        # in the carveout: the plan's kernels and collectives need SMs beside these GEMMs
        with on_stream(streams.compute), streams.carveout():
            own_y = parts.forward(0, codec.unpack(sent, x.dtype, x.shape[1], own.expand))
        made.update(own=own, sent=sent, parts=parts, own_y=own_y)

    def early(splits, send_token):  # the first chunks' rows leave within the plan, while the receive plan is made
        starts = send_starts([send_splits for send_splits, _, _ in splits])
        for c in range(layer.chunks_ahead(len(splits))):
            made.setdefault("early", {})[c] = d.transport.start(made["sent"][starts[c] : starts[c + 1]], *splits[c])

    with on_stream(streams.comm_stream):  # the plan, beside the own rows' work
        plans = d._plan_exchanges(x, topk_idx, topk_weights, bounds, d.config.check_inputs, beside=beside,
                                  early=early)
        own = made["own"]
        splits = [partition(o.src_rank, d.rank, int(own.chunk_counts_host[c].sum())) for c, (_, o) in enumerate(plans)]
        joined = [split.handle(h) for split, (h, _) in zip(splits, plans)]
    if streams.comm_stream is not None:  # the plan's results are read on the compute stream from here on
        streams.compute.wait_stream(streams.comm_stream)  # (behind the own rows' GEMMs: no delay to them)
    for made_there in (own, *splits, *joined, *(t for pair in plans for t in pair)):
        used_on(made_there, streams.compute)
    for c, (_, o) in enumerate(plans):  # the others' rows of chunk c per expert
        made["parts"].set_counts(1 + c, o.tokens_per_expert - own.chunk_counts[c],
                                 o.tokens_per_expert_host - own.chunk_counts_host[c])
    anchor = torch.empty(0, device=x.device, requires_grad=grad_on)
    # not to autograd; the packed rows in a list the pipeline empties, so that they are freed once sent
    inbound = (made["parts"], made["own_y"], splits, joined, [made.pop("sent")], made.get("early", {}))
    return LocalFirstFn.apply(x, topk_weights, anchor, layer, plans, bounds, own, inbound, grad_on, *params)


class Held:
    """A tensor read in parts by a known number of readers, dropped once the
    last has taken its part, so that the work after it can have the memory (on
    CUDA the allocator hands it out only once the streams that used it are past)."""

    def __init__(self, tensor: torch.Tensor, readers: int) -> None:
        self.tensor, self.readers = (tensor if readers > 0 else None), readers

    def take(self, part: slice = slice(None)) -> torch.Tensor:
        rows = self.tensor[part]
        self.readers -= 1
        if not self.readers:
            self.tensor = None
        return rows


class LocalFirstFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, anchor, layer, plans, bounds, own, inbound, grad_on, *params):
        d = layer.dispatcher
        parts, own_y, splits, joined, sent, started = inbound
        sent = Held(sent.pop(), readers=len(plans) - len(started))  # read by the brings not started early
        streams = layer._streams(x.device)
        codec = to_experts_codec(d.config.dispatch_wire, x.dtype, d.config.fp8_pow2_scales)
        handles, outputs = [h for h, _ in plans], [o for _, o in plans]
        starts = send_starts([h.send_splits for h in handles])
        weights = [o.weights.to(topk_weights.dtype, copy=True) for o in outputs]
        ys, out = [None] * len(plans), []

        def bring(c):  # the others' rows of chunk c, from the rows packed beside the plan
            if c in started:  # its all-to-all started within the plan
                moving = started.pop(c)
            else:
                moving = d._rows_start(sent.take(slice(starts[c], starts[c + 1])), handles[c], back=False)
            return d._to_experts_started(moving, codec, x.dtype, x.shape[1], handles[c].expand_src[splits[c].others])

        def compute(c, rows):
            # what the earlier parts keep for backward is placed only now, once their
            # combine is on its way: placed behind their GEMMs it delayed it
            parts.place_kept()
            ys[c] = parts.forward(1 + c, rows, defer_keep=True)
            y_all = d._home_rows(_joined(ys[c], own.of_chunk(own_y, c)), joined[c])
            settle_output(out, y_all, joined[c], bounds, c)
            return y_all

        def send_back(c, y_all):
            return outputs_home(d, joined[c], y_all, weights[c][splits[c].order], out, slice(bounds[c], bounds[c + 1]))

        _run(streams, len(plans), bring, compute, send_back, tail=parts.place_kept, bring_after_compute=False,
             ahead=layer.chunks_ahead(len(plans)))
        own_weights = weights[0].new_empty(own.expand.shape[0])  # the own rows' weights, in their order
        for c, w in enumerate(weights):
            own_weights[slice(None) if own.in_chunk[c] is None else own.in_chunk[c]] = w[splits[c].mine]
        ctx.layer, ctx.plans, ctx.bounds, ctx.own, ctx.parts = layer, plans, bounds, own, parts
        ctx.splits, ctx.joined, ctx.outs = splits, joined, [own_y, *ys]
        ctx.weights, ctx.own_weights, ctx.params, ctx.spent = weights, own_weights, params, False
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.anchor_dtype = x.shape, x.dtype, topk_weights.dtype, anchor.dtype
        return out[0]

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.spent:
            raise RuntimeError("MoEExchange's backward ran a second time on one forward (retain_graph=True): "
                               "the experts' graphs are freed as their gradients are sent; run the forward again")
        ctx.spent = True
        layer, plans, bounds, own = ctx.layer, ctx.plans, ctx.bounds, ctx.own
        d = layer.dispatcher
        grad_out = grad_out.contiguous()
        streams = layer._streams(grad_out.device)
        handles = [h for h, _ in plans]
        starts = send_starts([h.send_splits for h in handles])
        x_any, w_any = handles[0].x_grad_any, handles[0].weights_grad_any
        codec = to_experts_codec(d.config.combine_grad_wire, grad_out.dtype, d.config.fp8_pow2_scales)
        splits, joined, parts = ctx.splits, ctx.joined, ctx.parts
        num_tokens, hidden = ctx.x_shape[0], grad_out.shape[1]
        grad_x = grad_out.new_zeros(num_tokens, ctx.x_shape[1], dtype=ctx.x_dtype) if x_any else None
        grad_topk = grad_out.new_zeros(num_tokens, handles[0].topk, dtype=ctx.w_dtype) if w_any else None
        # every row's gradient packed once, on the communication stream: its self
        # blocks feed the own rows, the rest travels to the others
        # read by the head and by every chunk's bring, then dropped: the weight gradients need the memory
        sent = Held(streams.comm(lambda: Pending.done(codec.pack(grad_out, own.send_token)), to_compute=True).finish(),
                    readers=len(plans) + 1)
        own_grads = []

        def bring(c):
            moving = d._rows_start(sent.take(slice(starts[c], starts[c + 1])), handles[c], back=False)
            return d._to_experts_started(moving, codec, grad_out.dtype, hidden, handles[c].expand_src[splits[c].others])

        def head():  # the own rows' backward, while the first chunks' gradients travel
            rows = codec.unpack(sent.take(), grad_out.dtype, hidden, own.expand)
            grad_y, grad_w = weighted_grads(rows, ctx.own_weights, ctx.outs[0], w_any)
            ctx.outs[0] = rows = None
            own_grads.extend((parts.backward(0, grad_y, x_any), grad_w))

        def compute(c, grad_rows):
            grad_y, grad_w = weighted_grads(grad_rows, ctx.weights[c][splits[c].others], ctx.outs[1 + c], w_any)
            grad_in = parts.backward(1 + c, grad_y, x_any)
            ctx.outs[1 + c] = None
            own_in, own_w = (None if g is None else own.of_chunk(g, c) for g in own_grads)
            if c == len(plans) - 1:
                own_grads.clear()  # every chunk has taken its own rows' part
            return (_joined(grad_in, own_in) if x_any else None, _joined(grad_w, own_w) if w_any else None)

        def send_back(c, value):
            rows, values = value
            return grads_home(d, joined[c], rows, values, grad_x, grad_topk, slice(bounds[c], bounds[c + 1]))

        grad_params = []
        _run(streams, len(plans), bring, compute, send_back, head=head,
             tail=lambda: grad_params.extend(parts.weight_grads()), bring_after_compute=False,
             ahead=layer.chunks_ahead(len(plans)))
        ctx.parts = ctx.outs = None  # the experts' graphs are spent
        needs = ctx.needs_input_grad
        grad_params = [
            torch.zeros_like(p) if g is None and needs[9 + i] else g
            for i, (g, p) in enumerate(zip(grad_params, ctx.params))
        ]
        return (grad_x if needs[0] else None, grad_topk if needs[1] else None,
                grad_out.new_zeros(0, dtype=ctx.anchor_dtype), None, None, None, None, None, None, *grad_params)
