"""MoEExchange(local_first=True): a rank's own rows are computed while the plan
and the exchange of the other ranks' rows run.

Notation as in ``dispatch.plan``. The rows of the canonical order whose source is
this rank ("own rows": its tokens routed to its own experts) need nothing from
any peer: they are known from ``topk_idx`` alone. With ``local_first`` the layer

1. finds the own rows with the plan's route (``plan.own_keys``, in the plan's
   first CUDA graph), their counts read in the plan's first host
   synchronisation (that of the value checks, when they are on), and packs
   every send row at once, on the communication stream, before the GEMMs hold
   the SMs;
2. computes the own rows, taken from the self block of the packed rows, on
   the compute stream, while the rest of the plan and the dispatch run on the
   communication stream;
3. computes the other ranks' rows once they have arrived, and
4. combines all rows as ``combine`` does.

Backward alike: every row's gradient is packed once; the own rows' are
computed from the self block while the others' travel, then all rows'
gradients go home together, beside the weight gradients' GEMMs.

The exchange is the plain one, own rows included (they cross the all-to-all's
self block, a local copy): the rows the experts see, the combine's pre-sums and
the home sums are those of ``dispatch`` / ``combine``, value for value. So where
the experts compute each row on its own, outputs and the gradients of x and
topk_weights are bitwise those of C = 1. Parameter gradients: for a plain
``GroupedExperts`` one grouped GEMM per weight over both parts' rows (each
expert's own rows first, ``experts.ChunkedExperts``); for other experts the sum
of two calls' (own rows, then the others'); equal to those of one call up to
rounding (the rows' order within an expert differs from the canonical one).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from dispatch import plan
from dispatch.codec import sum_wire_dtype, to_experts_codec
from dispatch.dispatchers.base import Pending
from dispatch.experts import ChunkedExperts
from dispatch.pipeline import _Arrived, _check_expert_out, autograd_rows, weighted_grads


@dataclass(frozen=True)
class OwnRows:
    """The rows of the canonical order whose source is this rank.

    Attributes:
        expand: [N_own] the send row (among all S) behind each own row, in
            canonical order (local expert, then token).
        counts: [E_local] int64 own rows per local expert, on the device.
        counts_host: the same on the host.
    """

    expand: torch.Tensor
    counts: torch.Tensor
    counts_host: torch.Tensor


def own_rows(keys: plan.OwnKeys, counts_host: torch.Tensor, rank: int) -> tuple[torch.Tensor, OwnRows]:
    """(the send rows' tokens [S], the own rows), from this rank's ``plan.OwnKeys``
    and its counts on the host ([W, 1 + E_local]); no host synchronisation.
    The tokens are a view of the keys (a replayed plan's buffers): used at once."""
    num_send = int(counts_host[:, 0].sum())
    per_expert = counts_host[rank, 1:].clone()
    row_token = keys.row_key[: int(per_expert.sum())] % max(keys.send_row.shape[0], 1)
    device = keys.send_row.device
    return keys.send_token[:num_send], OwnRows(keys.send_row[row_token], plan.to_device(per_expert, device), per_expert)


def used_on(obj, stream) -> None:
    """Mark every tensor field of a plan dataclass as used by ``stream`` (the
    plan is made on the communication stream and read on the compute stream)."""
    if stream is None:
        return
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if isinstance(value, torch.Tensor) and value.is_cuda:
            value.record_stream(stream)


def on_stream(stream):
    """Run the enclosed work on ``stream`` (CUDA); where it is for None (CPU)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


class Parts:
    """The experts over two parts of the canonical order, own rows (part 0)
    first, then the others' (part 1). A plain :class:`GroupedExperts` runs as
    ``experts.ChunkedExperts`` (its weight gradients formed once, over both
    parts' rows); other experts through autograd, part by part, their parameter
    gradients summed in the parameters' dtype."""

    def __init__(self, experts, params, own: OwnRows, grad_on: bool, plain: bool) -> None:
        self.experts, self.params, self.grad_on = experts, params, grad_on
        self.chunked = ChunkedExperts(experts, [own.counts, None], [own.counts_host, None], grad_on) if plain else None
        self.kept = [None, None]  # autograd path: (leaf, output with its graph) per part
        self.grad_params = [None] * len(params)

    def forward(self, p: int, rows: torch.Tensor, counts, counts_host, defer_keep: bool = False) -> torch.Tensor:
        """Part p's rows -> the experts' output (detached); ``defer_keep``: what
        backward keeps is placed by :meth:`place_kept`."""
        if self.chunked is not None:
            if p == 1:
                self.chunked.set_counts(1, counts, counts_host)
            return self.chunked.forward(p, rows, defer_keep)
        leaf = rows.detach().requires_grad_(self.grad_on)
        with torch.set_grad_enabled(self.grad_on):
            y = self.experts(leaf, counts)
        _check_expert_out(y, rows)
        if self.grad_on:
            self.kept[p] = (leaf, y)
        return y.detach()

    def place_kept(self) -> None:
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
        """Per parameter its gradient (None where it has none), once both parts' backward ran."""
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


def bring(d, sent, handle, codec, dtype, hidden, positions):
    """The rows for the experts at ``positions`` of the canonical order, left in
    flight (``sent``: every send row, packed by ``codec`` from [T, hidden] rows
    of ``dtype``)."""
    received, work = d._rows_start(sent, handle, back=False)
    return Pending(work, lambda: codec.unpack(received, dtype, hidden, handle.expand_src[positions]))


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


class LocalFirstFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, anchor, layer, plan_out, own, inbound, grad_on, *params):
        d = layer.dispatcher
        handle, outputs = plan_out
        parts, own_y, (split, joined), pending = inbound  # not tensors to autograd: it is not to follow them
        streams = layer._streams(x.device)
        rows = arrive(streams, pending)
        y = parts.forward(1, rows, outputs.tokens_per_expert - own.counts,  # nothing else runs now: no carveout
                          outputs.tokens_per_expert_host - own.counts_host, defer_keep=True)
        y_all = _joined(y, own_y)
        weights = outputs.weights.to(topk_weights.dtype, copy=True)
        wire = sum_wire_dtype(d.config.combine_wire, y_all.dtype)
        back = streams.comm(lambda: d._to_home_start(y_all, joined, weights[split.order], wire), to_compute=True,
                            reads=(y_all,))
        parts.place_kept()  # what backward keeps, placed while the outputs travel home
        out = back.finish()
        streams.join()
        ctx.layer, ctx.plan_out, ctx.own, ctx.parts = layer, plan_out, own, parts
        ctx.split, ctx.joined, ctx.outs = split, joined, (own_y, y)
        ctx.weights, ctx.params, ctx.spent = weights, params, False
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.anchor_dtype = x.shape, x.dtype, topk_weights.dtype, anchor.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.spent:
            raise RuntimeError("MoEExchange's backward ran a second time on one forward (retain_graph=True): "
                               "the experts' graphs are freed as their gradients are sent; run the forward again")
        ctx.spent = True
        layer, (handle, _), own = ctx.layer, ctx.plan_out, ctx.own
        d = layer.dispatcher
        grad_out = grad_out.contiguous()
        streams = layer._streams(grad_out.device)
        x_any, w_any = handle.x_grad_any, handle.weights_grad_any
        codec = to_experts_codec(d.config.combine_grad_wire, grad_out.dtype, d.config.fp8_pow2_scales)
        split, joined, parts = ctx.split, ctx.joined, ctx.parts
        # every row's gradient packed once, on the communication stream: its self
        # block feeds the own rows, the rest travels to the others
        sent = streams.comm(lambda: Pending.done(codec.pack(grad_out, handle.send_token)), to_compute=True).finish()
        hidden = grad_out.shape[1]
        arrived = streams.comm(lambda: bring(d, sent, handle, codec, grad_out.dtype, hidden, split.others),
                               to_compute=True)

        def backward_part(p, positions, grad_rows):
            grad_y, grad_w = weighted_grads(grad_rows, ctx.weights[positions], ctx.outs[p], w_any)
            return parts.backward(p, grad_y, x_any), grad_w

        with streams.carveout():  # beside the others' gradients in flight
            own_in, own_w = backward_part(0, split.mine, codec.unpack(sent, grad_out.dtype, hidden, own.expand))
        sent = None
        other_in, other_w = backward_part(1, split.others, arrived.finish())
        ctx.parts = ctx.outs = None  # the experts' graphs are spent
        to_x = to_w = None
        if x_any:
            rows = _joined(other_in, own_in)
            wire = sum_wire_dtype(d.config.dispatch_grad_wire, rows.dtype)
            to_x = streams.comm(lambda: d._to_home_start(rows, joined, None, wire), to_compute=True, reads=(rows,))
        if w_any:
            values = _joined(other_w, own_w)
            to_w = streams.comm(lambda: d._weights_to_home_start(values, joined), to_compute=True, reads=(values,))
        with streams.carveout():
            grad_params = parts.weight_grads()  # while the gradients travel home
        grad_x = to_x.finish().to(ctx.x_dtype) if to_x is not None else None
        grad_topk = to_w.finish().to(ctx.w_dtype) if to_w is not None else None
        streams.join()
        needs = ctx.needs_input_grad
        grad_params = [
            torch.zeros_like(p) if g is None and needs[8 + i] else g
            for i, (g, p) in enumerate(zip(grad_params, ctx.params))
        ]
        return (grad_x if needs[0] else None, grad_topk if needs[1] else None,
                grad_out.new_zeros(0, dtype=ctx.anchor_dtype), None, None, None, None, None, *grad_params)
