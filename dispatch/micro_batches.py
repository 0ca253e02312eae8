"""MoEMicroBatches: one MoE layer over M micro-batches at once, on an explicit
schedule, so that each micro-batch's exchange moves under another's experts,
forward and backward.

Notation as in ``dispatch.plan`` (W, E_local, K, T, H, N); M micro-batches.

Forward (on CUDA the exchanges run on the dispatcher's communication stream,
in the order issued; the caller's stream waits for each by event only)::

    dispatch micro-batch 0
    for i: wait dispatch i -> experts(i) -> (i = 0: dispatch 1 .. M-1) -> start the sums home of i
    wait the sums home 0 .. M-1

so dispatch i + 1 moves under the experts of i, and the sums of i under the
experts of i + 1: all but the first dispatch and the last sums can hide. (The
host queues the first experts before it issues the other dispatches; those
still run beside them, on the exchanges' stream, in the order above.)
Backward, the same shape in reverse::

    send the output gradients of 0 .. M-1 to the experts   (all started at once)
    for i: wait them -> the experts' backward of i -> start x's and the
           routing weights' gradients of i home
    wait them 0 .. M-1

Autograd alone would run the micro-batches' backward exchanges in its own
order, each on the caller's stream between the experts' backward, hiding
nothing: the schedule is why this layer exists.

On CUDA the dispatches' plans run on a stream of the layer's own, so that a
plan that waits for the exchanges before it (the NVSHMEM transport's buffers
are used in turn) does not hold up the experts queued behind it. For a plain
:class:`dispatch.experts.GroupedExperts` (as ``MoEExchange`` takes it), each
micro-batch's backward computes only what its exchange home waits for (the
rows' gradients) and keeps what its weight gradients need; those are formed
after the last one's rows' gradients, while they travel home (what is kept
stays until then): each weight's gradient is one grouped GEMM over every
micro-batch's rows (expert e's rows of micro-batch 0, then of 1, ...), not M
gradients summed. Those rows are copied into place at the end of the forward,
beside the last sums: for a moment both copies of the rows and activations
are held. Other experts are differentiated by autograd micro-batch by
micro-batch, their parameters' gradients summed in order in their dtype.

With ``sm_partition`` (CUDA), the call runs on an SM partition's compute stream
(``dispatch.partition``): the experts on its compute SMs, every exchange, plan
and NVSHMEM move beside them on its exchange SMs; the backward likewise. The
caller's stream waits for it on return, as for the layer on shared SMs. A rank
whose partition (its green contexts and compute stream) cannot be made, or
whose arguments fail the layer's own checks, refuses its first dispatch: it
raises there, and its peers raise ``PeerRefused``. (The partition's stand-ins
for the side streams are made as they are first taken, after that.)

Each micro-batch is the round trip of ``combine(experts(dispatch(x)).., weights)``
(the bits of MoEExchange with one group, micro-batch by micro-batch; the plain
experts' weight gradients are those of one GEMM over all the rows, as above).
One rank's experts raising (forward or backward) stop every rank at the next
exchange they wait at (``PeerRefused``), as in ``MoEExchange``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from dispatch import partition
from dispatch.dispatcher import TokenDispatcher
from dispatch.experts import ExpertsByGroups
from dispatch.kernels.row_grads import weighted_row_grads
from dispatch.pipeline import (add_expert_out, at_priority, autograd_rows, carved_out, check_layer,
                               plain_grouped_experts, reach_once, trained_params)


class MoEMicroBatches(nn.Module):
    """The layer ``combine(experts(dispatch(x_i)), weights)`` of each of M
    micro-batches, run together on the schedule of the module doc.

    Args:
        dispatcher: a :class:`dispatch.TokenDispatcher`.
        experts: callable ``(tokens [N, H], tokens_per_expert [E_local]) -> [N, H']``
            (e.g. :class:`dispatch.experts.GroupedExperts`), called once per micro-batch;
            the parameters it trains registered (an ``nn.Module``): an output that
            reaches another tensor requiring grad is refused, as in ``MoEExchange``.
        comm_priority: CUDA priority of the exchanges' stream (lower is higher).
        sm_carveout: SMs the experts' GEMMs leave to the exchange beside them
            (None: none). Without one, the GEMMs are sized for every SM and the
            exchange waits for them: give at least the SMs its kernels take.
        max_rows: each micro-batch's dispatch ``max_rows`` (None: none): on the
            NVLink engine and over NVSHMEM nothing is then read on the host, and a
            call with its backward can be captured in one CUDA graph (shared SMs).
            The first dispatch sizes the room for its micro-batch: where a later
            one is larger, make room first (``TokenDispatcher.reserve``).
        sm_partition: on CUDA, an SM partition (``dispatch.partition``) of this
            many SMs (rounded up as the device requires: a multiple of 8 on
            H100/H200) for the exchange's kernels, the experts on the rest, so
            that no kernel of either lands on the other's SMs; ``sm_carveout``
            then defaults to the partition's SMs. None: the SMs shared. Over a
            slow link (NVSHMEM at 8 blocks, 2 x H200) forward+backward takes
            0.94-0.97x the time on shared SMs. Give the exchange no more blocks
            than its SMs. Not in a CUDA graph.
    """

    def __init__(self, dispatcher: TokenDispatcher, experts, comm_priority: int = -1,
                 sm_carveout: int | None = None, max_rows: int | None = None, sm_partition: int | None = None):
        super().__init__()
        check_layer(dispatcher, experts, comm_priority, sm_carveout, max_rows)
        partition.check(sm_partition)
        self.dispatcher, self.experts = dispatcher, experts
        self.comm_priority, self.sm_carveout, self.max_rows = comm_priority, sm_carveout, max_rows
        self.sm_partition = sm_partition
        self._partition = None  # the SMPartition of the last call's device (sm_partition on CUDA)
        self._reach_checked = False  # whether a call's experts were seen to reach no leaf but their own
        self._plans = self._plans_taken = None  # the plans' stream (on CUDA, made on first use), the one taken last

    def forward(self, xs, topk_idx, topk_weights) -> list[torch.Tensor]:
        """Args:
            xs: M >= 1 tensors [T_i, H] (each as ``MoEExchange``'s x).
            topk_idx, topk_weights: M of each, [T_i, K] (each micro-batch's routing).
        Returns:
            M tensors [T_i, H'], micro-batch i's layer output; differentiable
            w.r.t. every x_i, topk_weights_i and the experts' parameters.
        """
        partition.outside_capture(self.sm_partition)
        try:  # this rank's own checks: where one fails, its peers stop at the first dispatch, as it does
            count = _count(xs, topk_idx, topk_weights)
            self._partition = partition.for_call(self.sm_partition, xs[0].device)
        except (TypeError, ValueError, RuntimeError) as error:
            self.dispatcher.refuse("dispatch", None, error)
        return partition.run_on(self._partition, self._forward, count, xs, topk_idx, topk_weights)

    def _forward(self, count: int, xs, topk_idx, topk_weights) -> list[torch.Tensor]:
        d = self.dispatcher
        grad_on = torch.is_grad_enabled()
        planning = self._planning(xs[0].device, (*xs, *topk_idx, *topk_weights))

        def start(i: int):
            """Dispatch micro-batch i (each checks its arguments within the call's
            agreement: every rank raises)."""
            with at_priority(d, self.comm_priority), planning(), torch.set_grad_enabled(grad_on):
                return d.dispatch(xs[i], topk_idx[i], topk_weights[i], async_op=True, max_rows=self.max_rows)

        first = start(0)
        anchor = torch.empty(0, device=xs[0].device, requires_grad=grad_on)
        return list(_MicroBatchesFn.apply(self, first, start, grad_on, count, *xs, *topk_weights, anchor,
                                          *trained_params(self.experts)))

    def _planning(self, device: torch.device, inputs: tuple):
        """A context in which dispatches plan on the layer's own stream (on CUDA;
        off CUDA, as they are), after the caller's work so far (reading ``inputs``):
        ordered after it once, here, and not after what the caller queues later."""
        if device.type != "cuda":
            return contextlib.nullcontext
        caller = torch.cuda.current_stream(device)
        if self._plans is None or self._plans.device != device:
            self._plans = torch.cuda.Stream(device, priority=self.comm_priority)
        # beside an SM partition's compute stream, the partition's stand-in for the plans stream, in turn with it
        plans = partition.beside(caller, self._plans)
        self._plans_taken = plans = partition.handed_over(self._plans_taken, plans)
        plans.wait_stream(caller)
        for tensor in inputs:  # (a tensor elsewhere is refused by its dispatch's agreed checks)
            if tensor.device == device:
                tensor.record_stream(plans)
        return lambda: torch.cuda.stream(plans)

    def _carved_out(self):
        """The experts' GEMMs leave ``sm_carveout`` SMs free; with an SM partition
        and no carveout given, the partition's exchange SMs."""
        if self.sm_carveout is None and self.sm_partition is not None and self._partition is not None:
            return carved_out(self._partition.exchange_sms)
        return carved_out(self.sm_carveout)


def _count(xs, topk_idx, topk_weights) -> int:
    """M, where xs, topk_idx and topk_weights are sequences of M >= 1 tensors each."""
    for name, value in (("xs", xs), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(value, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in value):
            raise TypeError(f"{name} must be a list or tuple of tensors, one per micro-batch, got "
                            f"{type(value).__name__}")
    if not xs or len(topk_idx) != len(xs) or len(topk_weights) != len(xs):
        raise ValueError(f"xs, topk_idx and topk_weights: one tensor each per micro-batch, at least one; got "
                         f"{len(xs)}, {len(topk_idx)} and {len(topk_weights)}")
    return len(xs)


def _used_here(out) -> None:
    """A dispatch's outputs, planned on another stream, used on the caller's:
    their memory is not handed out again before that use."""
    if out.tokens.is_cuda:
        stream = torch.cuda.current_stream(out.tokens.device)
        for tensor in (out.tokens, out.tokens_per_expert, out.weights, out.src_rank, out.src_token):
            tensor.record_stream(stream)


class _MicroBatchesFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, first, start, grad_on, count, *tensors):
        d, experts = layer.dispatcher, layer.experts
        xs, ws = tensors[:count], tensors[count : 2 * count]
        anchor, params = tensors[2 * count], tensors[2 * count + 1 :]
        handles, weights, leaves, ys, sums = [], [], [], [], []
        # plain experts: backward by hand, the rows' gradients first, the weights' at the end,
        # each weight's one GEMM over every micro-batch's rows
        shared = (ExpertsByGroups(experts, [None] * count, [None] * count, grad_on, group_rows=layer.max_rows,
                                  micro_batches=True)
                  if plain_grouped_experts(experts, xs[0].device.type) else None)
        works = [first]  # the others are started once the first micro-batch's experts are queued
        with at_priority(d, layer.comm_priority):
            for i in range(count):
                out = works[i].wait()
                _used_here(out)
                handles.append(out.handle)
                weights.append(out.weights)
                try:  # the experts, on this rank alone: where they raise, its peers must not wait for it
                    leaf = out.tokens.detach().requires_grad_(grad_on and out.handle.x_grad_any)
                    with torch.set_grad_enabled(grad_on), layer._carved_out():
                        if shared is not None:
                            shared.set_counts(i, out.tokens_per_expert, out.tokens_per_expert_host)
                            leaf, y = shared, shared.forward(i, out.tokens, defer_keep=True)
                        else:
                            y = experts(leaf, out.tokens_per_expert)
                            if grad_on:
                                reach_once(layer, y, (leaf, *params))
                except Exception as error:
                    works += [start(j) for j in range(len(works), count)]  # as its peers do
                    for later in works[i + 1:]:  # every rank started them: done before this rank stops
                        later.wait()
                    d.refuse("combine_groups", out.handle, error)  # raises error; its peers PeerRefused
                works += [start(j) for j in range(len(works), count)]
                sums.append(d.combine_groups(out.handle, dtype=None, wire=d.config.combine_wire))
                add_expert_out(sums[-1], y, out.weights, out.tokens, f"micro-batch {i}")
                leaves.append(leaf if grad_on else None)
                ys.append(y if grad_on else None)
            if shared is not None:  # what backward keeps, placed behind the last sums' start
                shared.place_kept()
            results = tuple(s.wait() for s in sums)
        ctx.layer, ctx.handles, ctx.weights, ctx.params = layer, handles, weights, params
        ctx.leaves, ctx.ys, ctx.shared = leaves, ys, shared if grad_on else None
        ctx.count, ctx.spent, ctx.partition = count, False, layer._partition if layer.sm_partition else None
        ctx.x_dtypes, ctx.w_dtypes, ctx.anchor_dtype = [x.dtype for x in xs], [w.dtype for w in ws], anchor.dtype
        return results

    @staticmethod
    @once_differentiable  # (its exchanges are not differentiable: a double backward raises)
    def backward(ctx, *grad_outs):
        # (autograd runs it on the forward's stream, the compute stream: on it alike)
        return partition.run_on(ctx.partition, _MicroBatchesFn._backward, ctx, grad_outs)

    @staticmethod
    def _backward(ctx, grad_outs):
        if ctx.spent:
            raise RuntimeError("MoEMicroBatches' backward ran a second time on one forward (retain_graph=True): "
                               "each micro-batch's expert graph is freed as its gradients are sent; run it again")
        ctx.spent = True
        layer, handles, count = ctx.layer, ctx.handles, ctx.count
        d, config = layer.dispatcher, layer.dispatcher.config
        grad_params, to_w = [None] * len(ctx.params), [None] * count
        with at_priority(d, layer.comm_priority):
            brings = []
            for i, handle in enumerate(handles):  # every micro-batch's output gradient to its experts, at once
                # (autograd gives an output the loss did not use zeros: its gradients are materialized)
                brings.append(d.dispatch_rows(grad_outs[i].contiguous(), handle, wire=config.combine_grad_wire,
                                              async_op=True))
            to_x = [d.combine_groups(h, dtype=ctx.x_dtypes[i], wire=config.dispatch_grad_wire) if h.x_grad_any
                    else None for i, h in enumerate(handles)]
            for i, handle in enumerate(handles):
                grad_rows = brings[i].wait()
                w_any = handle.weights_grad_any
                try:  # the experts' backward, on this rank alone: where it raises, its peers must not wait for it
                    y, leaf = ctx.ys[i], ctx.leaves[i]
                    grad_y, grad_weight = weighted_row_grads(grad_rows, ctx.weights[i], y, w_any)
                    with layer._carved_out():
                        if isinstance(leaf, ExpertsByGroups):  # the weights' gradients after the last's rows'
                            wanted = handle.x_grad_any or ctx.params
                            grad_tokens = leaf.backward(i, grad_y, handle.x_grad_any) if wanted else None
                        else:
                            grad_tokens = autograd_rows(leaf, y, grad_y, handle.x_grad_any, ctx.params, grad_params)
                            ctx.leaves[i] = None
                    ctx.ys[i] = None  # the micro-batch's graph is spent
                except Exception as error:
                    for later in brings[i + 1:]:  # every rank started them: done before this rank stops
                        later.wait()
                    for j in range(i, count):  # the next call its peers wait at refused (each raises error)
                        if to_x[j] is not None:
                            to_x[j].refuse(error)
                        if handles[j].weights_grad_any:
                            d.refuse("combine_slots", handles[j], error)
                    raise  # (nothing follows that its peers wait at: it raises alone)
                if to_x[i] is not None:
                    to_x[i].add(grad_tokens)
                if w_any:
                    to_w[i] = d.combine_slots(grad_weight, handle, async_op=True)
                grad_rows = grad_y = grad_weight = grad_tokens = y = leaf = None
            if ctx.params and ctx.shared is not None:  # plain experts' weight gradients, while the last rows go home
                with layer._carved_out():
                    grad_params[:] = ctx.shared.param_grads(ctx.params)
            ctx.leaves = ctx.shared = None
            grad_xs = [None if t is None else t.wait().to(ctx.x_dtypes[i]) for i, t in enumerate(to_x)]
            grad_ws = [None if t is None else t.wait().to(ctx.w_dtypes[i]) for i, t in enumerate(to_w)]
        needs = ctx.needs_input_grad[5:]
        grad_xs = [g if needs[i] else None for i, g in enumerate(grad_xs)]
        grad_ws = [g if needs[count + i] else None for i, g in enumerate(grad_ws)]
        grad_params = [torch.zeros_like(p) if g is None and needs[2 * count + 1 + i] else g  # (MoEExchange's rule)
                       for i, (g, p) in enumerate(zip(grad_params, ctx.params))]
        anchor = torch.zeros(0, dtype=ctx.anchor_dtype, device=handles[0].device)
        return (None, None, None, None, None, *grad_xs, *grad_ws, anchor, *grad_params)
