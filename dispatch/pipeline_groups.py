"""MoEExchange(split="experts"): the exchange pipelined against the experts by
groups of local experts (``dispatch.expert_groups``), forward and backward.

Chunk g's dispatch carries the rows that group g is the first to need; group g
computes on its run of the canonical order (its weights only); chunk g's combine
carries the rows whose last slot is in group g, pre-summed over all their slots.
Rows, pre-sums and home sums are those of the plain exchange, so outputs and
the gradients of x, topk_weights and the experts' weights are those of C = 1,
however many groups, where the experts' GEMMs keep an expert's reduction order
whatever the other experts of the call (``experts.ExpertGroups``). Schedule and streams as in ``dispatch.pipeline``.
"""

from __future__ import annotations

import torch

from dispatch import comm
from dispatch.codec import sum_wire_dtype, to_experts_codec
from dispatch.dispatchers.base import Pending
from dispatch.experts import ExpertGroups
from dispatch.kernels.gather_sum import accumulate_dtype, gather_sum
from dispatch.pipeline import _run


class _Held:
    """A buffer of received rows filled chunk after chunk (allocated with the first chunk's rows)."""

    def __init__(self, rows: int) -> None:
        self.rows, self.buffer = rows, None

    def region(self, start: int, like: torch.Tensor, count: int) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = like.new_empty(self.rows, *like.shape[1:])
        return self.buffer[start : start + count]

    def read_on(self, streams) -> torch.Tensor | None:
        """The buffer, to be read on the compute stream once the pipeline joined: made in
        the communication stream's pool, it must not be handed out again before that read."""
        if self.buffer is not None and streams.compute is not None:
            self.buffer.record_stream(streams.compute)
        return self.buffer


def _bring(d, rows, handle, gp, c, codec, held, dtype):
    """Chunk c's rows to the experts, into ``held``; finishing decodes group c's expanded rows."""
    chunk = gp.chunks[c]
    to, frm = chunk.dispatch_splits
    sent = codec.pack(rows, handle.send_token[chunk.send_rows])
    region = held.region(chunk.held_start, sent, sum(frm))
    _, work = comm.all_to_all_rows_start(sent, to, frm, d.group, out=region)
    a, b = chunk.expanded
    return Pending(work, lambda: codec.unpack(held.buffer, dtype, rows.shape[1], gp.expand_src[a:b]))


def _send_back(d, values, gp, c, weights, wire, back):
    """Chunk c's pre-summed rows home, into ``back`` (finished: nothing left to do)."""
    chunk = gp.chunks[c]
    to, frm = chunk.combine_splits
    partial = gather_sum(values, chunk.presum_index, weights, wire)
    region = back.region(chunk.back_start, partial, sum(frm))
    _, work = comm.all_to_all_rows_start(partial, to, frm, d.group, out=region)
    return Pending(work, lambda: region)


class GroupsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, anchor, layer, plan, gp, bounds, grad_on, *params):
        d, (handle, outputs) = layer.dispatcher, plan
        streams = layer._streams(x.device)
        groups = ExpertGroups(layer.experts, bounds, outputs.tokens_per_expert, outputs.tokens_per_expert_host, grad_on)
        codec = to_experts_codec(d.config.dispatch_wire, x.dtype, d.config.fp8_pow2_scales)
        weights = outputs.weights.to(topk_weights.dtype, copy=True)
        held, back = _Held(gp.num_held), _Held(gp.num_back)
        ys = []  # [N, H'] expert outputs, group runs filled in order

        def compute(c, rows):
            y = groups.forward(c, rows)
            if not ys:
                ys.append(y.new_empty(handle.num_rows, y.shape[1]))
            a, b = gp.chunks[c].expanded
            ys[0][a:b] = y
            return ys[0]

        def send_back(c, y_all):
            return _send_back(d, y_all, gp, c, weights, sum_wire_dtype(d.config.combine_wire, y_all.dtype), back)

        _run(streams, len(gp.chunks), lambda c: _bring(d, x, handle, gp, c, codec, held, x.dtype), compute,
             send_back)
        y_all = ys[0]
        partials = back.read_on(streams)
        out = gather_sum(partials if partials is not None else y_all.new_empty(0, y_all.shape[1]),
                         gp.home_index, None, y_all.dtype, weights.dtype)
        ctx.layer, ctx.plan, ctx.gp, ctx.groups, ctx.weights, ctx.y_all = layer, plan, gp, groups, weights, y_all
        ctx.params, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = params, x.shape, x.dtype, topk_weights.dtype
        ctx.anchor_dtype, ctx.spent = anchor.dtype, False
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.spent:
            raise RuntimeError("MoEExchange's backward ran a second time on one forward (retain_graph=True): "
                               "each group's expert graph is freed as its gradients are sent; run the forward again")
        ctx.spent = True
        layer, (handle, _), gp, groups = ctx.layer, ctx.plan, ctx.gp, ctx.groups
        d = layer.dispatcher
        grad_out = grad_out.contiguous()
        streams = layer._streams(grad_out.device)
        x_any, w_any = handle.x_grad_any, handle.weights_grad_any
        codec = to_experts_codec(d.config.combine_grad_wire, grad_out.dtype, d.config.fp8_pow2_scales)
        held, back_x, back_w = _Held(gp.num_held), _Held(gp.num_back), _Held(gp.num_back)
        weights, y_all = ctx.weights, ctx.y_all
        grad_rows_all = []  # [N, H] gradients of the expert inputs; [N] of each row's weight

        def compute(c, grad_rows):
            a, b = gp.chunks[c].expanded
            w = weights[a:b]
            acc = accumulate_dtype(grad_rows.dtype, w.dtype)
            grad_y = (grad_rows.to(acc) * w.to(acc).unsqueeze(1)).to(y_all.dtype)
            if not grad_rows_all:
                grad_rows_all.append(grad_out.new_zeros(handle.num_rows, ctx.x_shape[1], dtype=ctx.x_dtype)
                                     if x_any else None)
                # one entry more, left 0: what the padding of a row's slot list reads
                grad_rows_all.append(weights.new_zeros(handle.num_rows + 1) if w_any else None)
            gx, gw = grad_rows_all
            if gw is not None:
                gw[a:b] = (grad_rows.to(acc) * y_all[a:b].to(acc)).sum(1).to(gw.dtype)
            if x_any or ctx.params:
                grad_x = groups.backward(c, grad_y, x_any)
                if gx is not None:
                    gx[a:b] = grad_x
            return c

        def send_back(c, _):
            gx, gw = grad_rows_all
            to_x = to_w = None
            if gx is not None:
                to_x = _send_back(d, gx, gp, c, None, sum_wire_dtype(d.config.dispatch_grad_wire, gx.dtype), back_x)
            if gw is not None:
                chunk = gp.chunks[c]
                index = chunk.presum_index
                grid = gw[torch.where(index >= 0, index, handle.num_rows)]  # [R_c, J]
                to, frm = chunk.combine_splits
                region = back_w.region(chunk.back_start, grid, sum(frm))
                _, work = comm.all_to_all_rows_start(grid, to, frm, d.group, out=region)
                to_w = Pending(work, lambda: region)
            return _Both(to_x, to_w)

        _run(streams, len(gp.chunks), lambda c: _bring(d, grad_out, handle, gp, c, codec, held, grad_out.dtype),
             compute, send_back)
        grad_x = grad_topk = None
        if x_any:
            source = back_x.read_on(streams)
            source = source if source is not None else grad_out.new_empty(0, ctx.x_shape[1])
            grad_x = gather_sum(source, gp.home_index, None, ctx.x_dtype)  # as the plain dispatch's backward
        if w_any:
            grad_topk = _slots(back_w.read_on(streams), gp, handle, weights).to(ctx.w_dtype)
        grad_params = [None] * len(ctx.params)
        if ctx.params:
            by_param = dict(zip((id(layer.experts.w_in), id(layer.experts.w_out)), groups.weight_grads()))
            grad_params = [by_param[id(p)] for p in ctx.params]
        needs = ctx.needs_input_grad
        ctx.groups = ctx.y_all = None
        return (grad_x if needs[0] else None, grad_topk if needs[1] else None,
                grad_out.new_zeros(0, dtype=ctx.anchor_dtype), None, None, None, None, None, *grad_params)


class _Both:
    def __init__(self, *pendings) -> None:
        self.pendings = pendings

    def finish(self):
        for p in self.pendings:
            if p is not None:
                p.finish()


def _slots(back: torch.Tensor | None, gp, handle, weights: torch.Tensor) -> torch.Tensor:
    """[S, J] per-row values home (last-group order) -> [T, K] per-slot values (0 for empty slots)."""
    width = handle.presum_index.shape[1]
    flat = weights.new_zeros(1) if back is None else torch.cat([back.flatten(), weights.new_zeros(1)])
    at = torch.where(gp.slot_row >= 0, gp.slot_row * width + handle.slot_col, flat.numel() - 1)
    return flat[at]
