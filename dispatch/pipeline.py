"""MoEExchange: the exchange pipelined against the expert compute, forward and backward.

Notation as in ``dispatch.plan`` (W, E_local, K, T, H, N); C chunks; H' the
experts' output width.

The tokens of each rank are split into C home token ranges; chunk c of every
rank forms one exchange of the group. A token's output depends only on its own
expert rows and on the home-side sum in ascending rank order, and chunk c's rows
are a sub-sequence of the one-shot canonical order, so with experts that compute
each row on its own the output and the gradients of x and topk_weights are
bitwise those of C = 1.

Experts' parameters: for a plain :class:`GroupedExperts` (its own ``forward``
and parameters, no module hooks, no autocast: ``_plain_grouped_experts``) the
backward of each chunk computes only the rows' gradients, and
the weight gradients are formed once, after the last chunk and while its
gradients travel home, from every chunk's rows held expert-major
(``experts.ChunkedExperts``): the same GEMM over the same rows for every C, and
no chunk writes a full set of weight gradients. Other
experts are differentiated chunk by chunk by autograd, their parameter
gradients accumulated in place in the parameters' dtype: bitwise those of
C = 1 when these sums are exact, equal to rounding otherwise, at the cost of one
more pass over the weight gradients per chunk.

Schedule, forward (backward alike, with the exchange of the gradients), with
every chunk dispatched ahead (``ahead=None``, the default)::

    comm stream:     D0 D1 D2 D3 H0 H1 H2 H3      D = dispatch, H = combine
    compute stream:     X0 X1 X2 X3               X = experts (X_c after D_c)

and with ``ahead=2``::

    comm stream:     D0 D1 H0 D2 H1 D3 H2 H3
    compute stream:     X0    X1    X2    X3

With the alltoall variant one routing plan, one counts exchange and one
metadata exchange serve all chunks (its ``_plan_chunks``, replayed as CUDA
graphs like the plan of ``dispatch``), with one host synchronisation before the
pipeline starts; the first A chunks' token all-to-alls start within the plan,
right after the metadata all-to-all, so that their bytes move while the receive
plan is made (C = 1 included); the other variants use the base class's fallback (a plan, a counts
exchange and a host synchronisation per chunk, their exchanges not left in
flight), correct but without overlap. Inside the pipeline the streams are
ordered by CUDA events only: collectives run on a communication stream of their
own (``comm_priority``, default high), the experts on the caller's current
stream. On CPU (gloo) the same schedule runs
with ``async_op`` work handles: the collectives of chunks c - 1 and c + 1 travel
while the experts compute chunk c.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from dispatch import checks, comm
from dispatch.codec import sum_wire_dtype, to_experts_codec
from dispatch.dispatchers.base import TokenDispatcher
from dispatch.experts import ChunkedExperts, GroupedExperts
from dispatch.kernels.gather_sum import accumulate_dtype


def auto_chunks(max_tokens: int, hidden: int, itemsize: int) -> int:
    """The chunk count ``MoEExchange(chunks=None)`` uses: 1, whatever the sizes.

    Measured on 4 and 2 x H200 (``bench/results/nvidia-h200-x*/overlap-*``): over
    NVLink, chunking made the layer slower at every C tried (2, 4, 8) on the
    deepseek-v3 and mixtral shapes, in every setting of CTAs, stream priority,
    SM carveout and wire, since each chunk re-reads the experts' weights and
    the exchange proper is a small part of the layer. Only with the exchange
    slowed to 2 NCCL CTAs did C = 2-4 gain (on 4 GPUs 21-43% of the exchange
    hidden forward and 23-35% forward+backward over the runs, with
    ``local_first`` or without; on 2, 10-36% forward for Mixtral over the
    runs, and nothing for DeepSeek-V3 in the last one). A rule would need the link
    speed, which this function does not know; pass ``chunks`` where
    measurements (``dispatch-bench overlap``) show a gain. The arguments are
    those a size rule needs (the largest rank's T, H, the token itemsize).
    """
    return 1


def chunk_bounds(num_tokens: int, chunks) -> tuple[int, ...]:
    """C + 1 home token bounds. ``chunks`` is C (equal parts: chunk c is tokens
    ``[c T // C, (c + 1) T // C)``) or C relative sizes s_0..s_{C-1} (chunk c is
    tokens ``[T S_c // S, T S_{c+1} // S)``, S_c the sum of the first c sizes, S
    of all)."""
    sizes = (1,) * chunks if isinstance(chunks, int) else tuple(chunks)
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    return tuple(num_tokens * start // starts[-1] for start in starts)


def check_chunks(chunks) -> None:
    """``MoEExchange``'s ``chunks``: None, an int >= 1, or a non-empty tuple or
    list of ints >= 1 (relative chunk sizes)."""
    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if chunks is None or count(chunks):
        return
    if isinstance(chunks, (tuple, list)) and chunks and all(count(size) for size in chunks):
        return
    raise ValueError(f"chunks must be an int >= 1, a non-empty tuple of relative chunk sizes (ints >= 1) "
                     f"or None, got {chunks!r}")


class MoEExchange(nn.Module):
    """dispatch -> experts -> combine, in C chunks overlapping exchange and compute.

    Args:
        dispatcher: a :class:`TokenDispatcher` (``dispatch.create``). Its config's
            wire formats apply to every direction as in ``dispatch``/``combine``.
        experts: any callable ``(tokens [N, H], tokens_per_expert [E_local] int64
            on the device of tokens) -> [N, H']``, rows in canonical order. If it
            is an ``nn.Module`` it becomes a submodule and the gradients of its
            parameters are computed by the pipelined backward.
        chunks: C >= 1 equal chunks; or C relative sizes, a tuple of ints >= 1
            (``(1, 3, 3, 1)``: an eighth of the tokens, three eighths, three
            eighths, an eighth), so that the first dispatch and the last combine,
            which nothing hides, move few rows while the middle chunks keep the
            GEMMs large (on 2 x H200 with a slow exchange, ``bench/results``:
            1:2:1 was within run-to-run noise of C = 2 for Mixtral and slower
            for DeepSeek-V3); or None for :func:`auto_chunks` (which, from the
            measurements so far, does not chunk).
        comm_priority: CUDA priority of the communication stream (lower is
            higher; clamped to the device's range). Default -1: the small
            kernels around the collectives are not stuck behind the GEMMs.
        sm_carveout: on CUDA, SMs the experts' GEMMs leave free while the
            pipeline runs, so that the collectives of the next chunk find SMs
            to run on instead of waiting for a GEMM that holds them all. Only
            kernels that heed torch's switch leave them: ``torch._grouped_mm``
            does (``GroupedExperts``' default on Hopper); cuBLAS matmuls and
            batched matmuls did not on torch 2.11 with CUDA 13 (the same time
            with all but 8 of an H200's SMs carved out; ``dispatch-bench
            chunk-cost`` probes it), so experts built on them take every SM
            whatever this says. Pair it with an EP group whose collectives fit in
            those SMs: ``dispatch.comm.new_group_with_sm_budget(ranks,
            max_ctas=sm_carveout, high_priority=True)``. None (default): no
            carveout. Set through torch's process-wide experimental switch
            for the duration of the call, restored after.
        ahead: A >= 1, how many chunks' rows are on their way to the experts
            before the experts compute the first (forward, and their gradients
            in backward): chunks 0..A-1 are dispatched first, chunk c + A once
            chunk c's combine is issued. With the alltoall variant the first A
            chunks' forward all-to-alls start within the plan, right after the
            metadata all-to-all, so that their bytes move while the host makes
            the receive plan and the chunks' handles. None (default): every
            chunk (A = C), so that no dispatch waits behind a combine that
            waits for the experts; the rows of every chunk are then alive at
            once, as at C = 1. A smaller A keeps fewer rows in flight (the
            rows the experts keep for backward are kept either way; measured on
            4 x H200 with a slow exchange, ``bench/results``: A = 1 was the
            slowest at every C; A = 2 against every chunk depended on the shape).
        local_first: compute the rows this rank routes to its own experts
            (of every chunk) first, from ``topk_idx`` alone, while the plan and
            the dispatch of the other ranks' rows of the first chunks run on
            the communication stream; then the others' rows chunk by chunk as
            above; backward alike (``dispatch.pipeline_local``). The alltoall
            variant, any C. ``sm_carveout`` then applies to the own rows'
            forward and backward too, and to the weight gradients (the work
            that runs beside the plan and the collectives); pair the two.
    """

    def __init__(
        self,
        dispatcher: TokenDispatcher,
        experts,
        chunks: int | None = None,
        comm_priority: int = -1,
        sm_carveout: int | None = None,
        local_first: bool = False,
        ahead: int | None = None,
    ):
        super().__init__()
        if not isinstance(dispatcher, TokenDispatcher):
            raise TypeError(f"dispatcher must be a dispatch.TokenDispatcher, got {type(dispatcher).__name__}")
        if not callable(experts):
            raise TypeError(
                f"experts must be callable (tokens, tokens_per_expert) -> out, got {type(experts).__name__}"
            )
        check_chunks(chunks)
        if isinstance(comm_priority, bool) or not isinstance(comm_priority, int):
            raise TypeError(f"comm_priority must be an int, got {type(comm_priority).__name__}")
        if sm_carveout is not None and (
            isinstance(sm_carveout, bool) or not isinstance(sm_carveout, int) or sm_carveout < 0
        ):
            raise ValueError(f"sm_carveout must be an int >= 0 or None, got {sm_carveout!r}")
        if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1):
            raise ValueError(f"ahead must be an int >= 1 or None, got {ahead!r}")
        if not isinstance(local_first, bool):
            raise TypeError(f"local_first must be a bool, got {type(local_first).__name__}")
        if local_first:
            from dispatch.dispatchers.alltoall import AllToAllDispatcher

            if not isinstance(dispatcher, AllToAllDispatcher):
                raise ValueError(f"local_first=True needs the alltoall variant, got {type(dispatcher).__name__}")
        self.local_first = local_first
        self.sm_carveout = sm_carveout
        self.dispatcher = dispatcher
        self.experts = experts
        self.chunks = chunks if not isinstance(chunks, list) else tuple(chunks)
        self.comm_priority = comm_priority
        self.ahead = ahead
        self._comm_streams: dict = {}

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Args:
            x: [T, H] float16/bfloat16/float32/float64 tokens of this rank (T may be 0).
            topk_idx: [T, K] int32/int64 global expert ids; -1 = empty slot.
            topk_weights: [T, K] floating routing weights.
        Returns:
            [T, H'] in the experts' output dtype (on a rank whose experts got no
            rows, that of the ranks whose did: ``TokenDispatcher._home_rows``):
            for each token, the sum over its slots of ``weight * experts(row)``,
            as ``combine(..., weights=...)``.
            Differentiable w.r.t. x, topk_weights and the experts' parameters.
        """
        d = self.dispatcher
        checks.check_dispatch_inputs(x, topk_idx, topk_weights, d.devices)
        if self.local_first:
            from dispatch.pipeline_local import local_first_forward

            return local_first_forward(self, x, topk_idx, topk_weights)
        bounds = self._bounds(x)
        codec = to_experts_codec(d.config.dispatch_wire, x.dtype, d.config.fp8_pow2_scales)
        streams, started = self._streams(x.device), {}

        def early(splits, send_token):  # the first chunks' rows leave within the plan, while the receive plan is made
            if streams.comm_stream is not None:  # x and the send rows are made on the compute stream
                streams.comm_stream.wait_stream(streams.compute)
            starts = send_starts([send_splits for send_splits, _, _ in splits])
            with on_stream(streams.comm_stream), torch.no_grad():
                for c in range(self.chunks_ahead(len(bounds) - 1)):
                    sent = codec.pack(x[bounds[c] : bounds[c + 1]], send_token[starts[c] : starts[c + 1]])
                    started[c] = comm.all_to_all_rows_start(sent, *splits[c][:2], d.group)

        plans = d._plan_chunks(x, topk_idx, topk_weights, bounds, d.config.check_inputs, early=early)
        params = self._trained_params()
        grad_on = torch.is_grad_enabled()
        anchor = torch.empty(0, device=x.device, requires_grad=grad_on)
        return _PipelineFn.apply(x, topk_weights, anchor, self, (plans, started), bounds, grad_on, *params)

    def chunks_ahead(self, chunks: int) -> int:
        """A, the chunks dispatched before the experts compute the first (see ``ahead``)."""
        return chunks if self.ahead is None else min(self.ahead, chunks)

    def _trained_params(self) -> tuple:
        """The experts' parameters that require grad (none for a plain callable)."""
        if not isinstance(self.experts, nn.Module):
            return ()
        return tuple(p for p in self.experts.parameters() if p.requires_grad)

    def _bounds(self, x: torch.Tensor) -> tuple[int, ...]:
        """The home token bounds of the C chunks of ``x`` (``chunk_bounds``)."""
        # auto_chunks needs no peer's sizes: no collective, no host sync
        chunks = self.chunks if self.chunks is not None else auto_chunks(x.shape[0], x.shape[1], x.element_size())
        return chunk_bounds(x.shape[0], chunks)

    def _streams(self, device: torch.device) -> "_Streams":
        if device.type != "cuda":
            return _Streams(None, None)
        key = torch.cuda.current_device() if device.index is None else device.index
        if key not in self._comm_streams:
            self._comm_streams[key] = torch.cuda.Stream(device=key, priority=self.comm_priority)
        return _Streams(torch.cuda.current_stream(key), self._comm_streams[key], self.sm_carveout)


def on_stream(stream):
    """Run the enclosed work on ``stream`` (CUDA); where it is for None (CPU)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


@contextlib.contextmanager
def sm_carveout(sms: int):
    """GEMMs launched inside leave ``sms`` SMs free, where they heed torch's
    process-wide experimental switch (``torch._grouped_mm`` does; cuBLAS
    matmuls did not on torch 2.11 with CUDA 13); the setting before is restored."""
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


class _Streams:
    """Where a pipeline stage runs. On CUDA: ``comm`` runs a stage on the
    communication stream to its end (the host only enqueues) and the compute
    stream waits for it by an event when its result is taken. On CPU: the stage
    is left in flight (async work) and finished when its result is taken."""

    def __init__(self, compute, comm, sm_carveout: int | None = None) -> None:
        self.compute, self.comm_stream, self.sm_carveout = compute, comm, sm_carveout

    def carveout(self):
        """GEMMs launched inside leave ``sm_carveout`` SMs to the collectives."""
        if self.comm_stream is None or self.sm_carveout is None:
            return contextlib.nullcontext()
        return sm_carveout(self.sm_carveout)

    def comm(self, stage, to_compute: bool, reads: tuple = (), after_compute: bool = True):
        """Run ``stage() -> Pending`` on the communication side; returns an object
        whose ``finish()`` gives the result (``to_compute``: for the compute stream).
        ``after_compute``: the stage starts after the work queued on the compute
        stream so far (False: it reads nothing made there).

        ``reads``: tensors made on the compute stream that the stage reads. On
        CUDA they are marked as used by the communication stream, so the caller
        may drop them at once: the allocator hands their memory out again only
        once the communication stream has passed the point where they were freed.
        On CPU the stage's Pending holds what its work still reads."""
        if self.comm_stream is None:
            return stage()
        if after_compute:
            self.comm_stream.wait_stream(self.compute)  # inputs made on the compute stream so far
        with torch.cuda.stream(self.comm_stream):
            result = stage().finish()
            event = torch.cuda.Event()
            event.record(self.comm_stream)
        for tensor in reads:
            tensor.record_stream(self.comm_stream)
        return _Arrived(result, event, self.compute if to_compute else None)

    def join(self) -> None:
        """The compute stream waits for everything issued on the communication stream."""
        if self.comm_stream is not None:
            self.compute.wait_stream(self.comm_stream)


class _Arrived:
    def __init__(self, result, event, consumer) -> None:
        self.result, self.event, self.consumer = result, event, consumer

    def finish(self):
        if self.consumer is not None:
            self.consumer.wait_event(self.event)
            # made in the communication stream's pool, used on the compute stream:
            # the allocator must not hand the memory out again before that use
            if isinstance(self.result, torch.Tensor):
                self.result.record_stream(self.consumer)
        return self.result


def send_starts(send_splits) -> list[int]:
    """First send row of each chunk among all chunks' (chunk-major), from each
    chunk's send splits; one more entry, the total."""
    starts = [0]
    for splits in send_splits:
        starts.append(starts[-1] + sum(splits))
    return starts


def _run(streams: _Streams, chunks: int, bring, compute, send_back, tail=None, head=None,
         bring_after_compute: bool = True, *, ahead: int) -> None:
    """With ``ahead`` = A, D0 X0 D1 .. D(A-1) H0 DA X1 H1 D(A+1) ...: ``bring(c) -> Pending``
    (rows for the experts), ``compute(c, rows) -> value``, ``send_back(c, value)
    -> Pending`` (stores its result when finished); ``head()`` runs on the
    compute side once the first A chunks' brings are issued, while they travel; ``tail()`` once the last
    chunk's send-back is issued, while it travels. ``bring_after_compute``: the
    brings read what the compute stream made before this call (the input, the
    plan), and the communication stream waits for it once, here (False: they
    read nothing made there); no bring waits for the experts of earlier chunks.
    Every rank issues the collectives in this same order.
    A value is dropped as soon as its send-back is issued (on CUDA the
    communication stream is recorded on its tensors, see ``_Streams.comm``), so
    that no more than a chunk or two of them are alive at once; a brought
    chunk's rows are dropped once computed unless ``compute`` keeps them (for
    backward), so that no more than A + 1 chunks' are in flight."""
    inbound = {}
    if bring_after_compute and streams.comm_stream is not None:  # what the brings read is made by now:
        streams.comm_stream.wait_stream(streams.compute)  # no bring waits for the experts of an earlier chunk

    def issue(c):
        if c < chunks:
            inbound[c] = streams.comm(functools.partial(bring, c), to_compute=True, after_compute=False)

    # on CUDA the host only queues work: chunk 0's experts are queued before the
    # other brings (which go ahead of chunk 0's send-back on the communication
    # stream); on CPU the experts run at once, so the brings are issued first
    defer = head is None and streams.comm_stream is not None
    for c in range(1 if defer else ahead):
        issue(c)
    if head is not None:
        with streams.carveout():
            head()
    outbound = None
    for c in range(chunks):
        with streams.carveout() if chunks > 1 else contextlib.nullcontext():  # beside exchanges in flight
            value = compute(c, inbound.pop(c).finish())
        if c == 0 and defer:
            for k in range(1, ahead):
                issue(k)
        reads = tuple(t for t in (value if isinstance(value, tuple) else (value,)) if isinstance(t, torch.Tensor))
        returning = streams.comm(functools.partial(send_back, c, value), to_compute=False, reads=reads)
        value = reads = None
        issue(c + ahead)
        if outbound is not None:
            outbound.finish()
        outbound = returning
    if tail is not None:
        with streams.carveout():
            tail()
    if outbound is not None:
        outbound.finish()
    streams.join()


class _Stored:
    """A Pending-like step that writes a finished result into a slice of a buffer."""

    def __init__(self, pendings, store) -> None:
        self.pendings, self.store = pendings, store

    def finish(self):
        self.store(*(p.finish() if p is not None else None for p in self.pendings))
        self.pendings = ()


class _PipelineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, anchor, layer, planned, bounds, grad_on, *params):
        d, experts = layer.dispatcher, layer.experts
        plans, started = planned  # started: chunk -> its all-to-all started within the plan
        streams = layer._streams(x.device)
        codec = to_experts_codec(d.config.dispatch_wire, x.dtype, d.config.fp8_pow2_scales)
        handles = [h for h, _ in plans]
        weights = [o.weights.to(topk_weights.dtype, copy=True) for _, o in plans]
        x_grad_any = bool(handles) and handles[0].x_grad_any
        leaves, ys = [None] * len(plans), [None] * len(plans)
        out = []  # [T, H'], allocated once the experts' output width is known
        chunked = None
        if _plain_grouped_experts(experts, x.device.type):  # weight gradients once, over all chunks
            chunked = ChunkedExperts(
                experts, [o.tokens_per_expert for _, o in plans], [o.tokens_per_expert_host for _, o in plans], grad_on
            )

        def bring(c):
            if c in started:
                return d._to_experts_started(started.pop(c), codec, x.dtype, x.shape[1], handles[c].expand_src)
            a, b = bounds[c], bounds[c + 1]
            return d._to_experts_start(x[a:b], handles[c], codec)

        def compute(c, tokens):
            if chunked is not None:
                y = d._home_rows(chunked.forward(c, tokens), handles[c])
                settle_output(out, y, handles[c], bounds, c)
                return y
            leaf = tokens.detach().requires_grad_(grad_on and x_grad_any)
            with torch.set_grad_enabled(grad_on):
                y = experts(leaf, plans[c][1].tokens_per_expert)
            _check_expert_out(y, tokens)
            if grad_on:  # kept for backward; without grad, chunk c's rows die here
                leaves[c], ys[c] = leaf, y
            y = d._home_rows(y.detach(), handles[c])
            settle_output(out, y, handles[c], bounds, c)
            return y.contiguous()

        def send_back(c, y):
            return outputs_home(d, handles[c], y, weights[c], out, slice(bounds[c], bounds[c + 1]))

        _run(streams, len(plans), bring, compute, send_back, ahead=layer.chunks_ahead(len(plans)))
        if not out:  # no chunk (cannot happen: C >= 1), kept for clarity of the types
            raise RuntimeError("the pipeline ran no chunk")
        ctx.layer, ctx.plans, ctx.bounds, ctx.weights = layer, plans, bounds, weights
        ctx.leaves, ctx.ys, ctx.params, ctx.chunked = leaves, ys, params, chunked
        ctx.spent = False
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, topk_weights.dtype
        ctx.anchor_dtype = anchor.dtype
        return out[0]

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.spent:
            raise RuntimeError(
                "MoEExchange's backward ran a second time on one forward (retain_graph=True): each chunk's "
                "expert graph is freed as its gradients are sent; run the forward again"
            )
        ctx.spent = True
        layer, plans, bounds = ctx.layer, ctx.plans, ctx.bounds
        d = layer.dispatcher
        grad_out = grad_out.contiguous()
        streams = layer._streams(grad_out.device)
        handles = [h for h, _ in plans]
        x_any, w_any = handles[0].x_grad_any, handles[0].weights_grad_any
        codec = to_experts_codec(d.config.combine_grad_wire, grad_out.dtype, d.config.fp8_pow2_scales)
        num_tokens, topk = ctx.x_shape[0], handles[0].topk
        grad_x = grad_out.new_zeros(num_tokens, ctx.x_shape[1], dtype=ctx.x_dtype) if x_any else None
        grad_topk = grad_out.new_zeros(num_tokens, topk, dtype=ctx.w_dtype) if w_any else None
        grad_params = [None] * len(ctx.params)

        def bring(c):
            a, b = bounds[c], bounds[c + 1]
            return d._to_experts_start(grad_out[a:b], handles[c], codec)

        chunked = ctx.chunked

        def compute(c, grad_rows):
            y, leaf = ctx.ys[c] if chunked is None else chunked.output(c), ctx.leaves[c]
            grad_y, grad_w = weighted_grads(grad_rows, ctx.weights[c], y, w_any)
            if chunked is not None:
                grad_tokens = chunked.backward(c, grad_y, x_any) if x_any or ctx.params else None
                return grad_tokens, grad_w
            grad_tokens = autograd_rows(leaf, y, grad_y, leaf.requires_grad, ctx.params, grad_params)
            ctx.ys[c] = ctx.leaves[c] = None  # the chunk's graph is spent
            return grad_tokens, grad_w

        def send_back(c, value):
            grad_tokens, grad_w = value
            rows = grad_tokens.contiguous() if x_any else None
            return grads_home(d, handles[c], rows, grad_w, grad_x, grad_topk, slice(bounds[c], bounds[c + 1]))

        def weight_grads():
            grad_params[:] = chunked.param_grads(ctx.params)

        tail = weight_grads if chunked is not None and ctx.params else None
        _run(streams, len(plans), bring, compute, send_back, tail, ahead=layer.chunks_ahead(len(plans)))
        ctx.chunked = None
        needs = ctx.needs_input_grad
        grad_params = [
            torch.zeros_like(p) if g is None and needs[7 + i] else g
            for i, (g, p) in enumerate(zip(grad_params, ctx.params))
        ]
        return (
            grad_x if needs[0] else None,
            grad_topk if needs[1] else None,
            grad_out.new_zeros(0, dtype=ctx.anchor_dtype),
            None,
            None,
            None,
            None,
            *grad_params,
        )


def settle_output(out: list, y: torch.Tensor, handle, bounds: tuple[int, ...], c: int) -> None:
    """Make the pipeline's [T, H'] output ``out[0]`` from chunk c's expert outputs
    ``y`` (in the group's dtype: ``TokenDispatcher._home_rows``) at the first
    chunk where some rank has rows, or at the last. The chunks before it had no
    rows on any rank: nothing comes home, their tokens' outputs are zeros."""
    if out or not (any(handle.has_rows) or c == len(bounds) - 2):
        return
    out.append(y.new_empty(bounds[-1], y.shape[1]))
    out[0][: bounds[c]].zero_()


def outputs_home(d, handle, y, weights, out: list, tokens: slice) -> "_Stored":
    """Start the way home (combine) of one chunk's expert outputs ``y``, weighted
    by ``weights``, into ``out[0][tokens]`` (if ``out`` is not made yet, no rank
    had rows in the chunk: its zeros are written when it is, see ``settle_output``)."""
    wire = sum_wire_dtype(d.config.combine_wire, y.dtype)
    pending = d._to_home_start(y, handle, weights, wire)
    target = out[0][tokens] if out else None
    return _Stored([pending], lambda h: None if target is None else target.copy_(h))


def grads_home(d, handle, rows, values, grad_x, grad_topk, tokens: slice) -> "_Stored":
    """Start the way home of one chunk's gradients: of its rows (``rows``, None
    if x needs none) into ``grad_x[tokens]``, of its rows' weights (``values``,
    None if topk_weights needs none) into ``grad_topk[tokens]``."""
    to_x = to_w = None
    if rows is not None:
        wire = sum_wire_dtype(d.config.dispatch_grad_wire, rows.dtype)
        to_x = d._to_home_start(rows, handle, None, wire)
    if values is not None:
        to_w = d._weights_to_home_start(values, handle)

    def store(gx, gw):
        if gx is not None:
            grad_x[tokens].copy_(gx)
        if gw is not None:
            grad_topk[tokens].copy_(gw)

    return _Stored([to_x, to_w], store)


def weighted_grads(grad_rows: torch.Tensor, w: torch.Tensor, y: torch.Tensor, w_any: bool):
    """From the gradients of weighted expert rows: (gradient of the experts'
    output rows, in y's dtype; gradient of each row's weight, or None)."""
    acc = accumulate_dtype(grad_rows.dtype, w.dtype)
    grad_y = (grad_rows.to(acc) * w.to(acc).unsqueeze(1)).to(y.dtype)
    grad_w = (grad_rows.to(acc) * y.detach().to(acc)).sum(1).to(w.dtype) if w_any else None
    return grad_y, grad_w


def autograd_rows(leaf, y, grad_y, rows_grad: bool, params, grad_params: list):
    """Backward of one call of experts differentiated by autograd: the gradient
    of its rows ``leaf`` (if ``rows_grad``; zeros where autograd has none), and
    its parameters' gradients summed into ``grad_params`` in place, in the
    parameters' dtype (as autograd would sum them over calls)."""
    inputs = ([leaf] if rows_grad else []) + list(params)
    grads = [None] * len(inputs)
    if inputs and y.requires_grad:
        grads = list(torch.autograd.grad(y, inputs, grad_y, allow_unused=True))
    grad_rows = grads.pop(0) if rows_grad else None
    for i, g in enumerate(grads):
        if g is not None:
            grad_params[i] = g if grad_params[i] is None else grad_params[i].add_(g)
    if rows_grad and grad_rows is None:
        grad_rows = leaf.new_zeros(leaf.shape)
    return grad_rows


def _check_expert_out(y: object, tokens: torch.Tensor) -> None:
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"experts must return a tensor, got {type(y).__name__}")
    if y.dim() != 2 or y.shape[0] != tokens.shape[0] or y.device != tokens.device:
        raise ValueError(
            f"experts must return [N, H'] rows on {tokens.device} for N={tokens.shape[0]} tokens; "
            f"got shape {tuple(y.shape)} on {y.device}"
        )


def _plain_grouped_experts(experts, device_type: str) -> bool:
    """Whether ``experts`` is a :class:`GroupedExperts` that ``ChunkedExperts``
    may compute in its place: ``forward`` not overridden, ``w_in`` and
    ``w_out`` its own parameters and its only ones (not parametrized), no
    module hooks (a hook, such as one that gathers sharded parameters, must see
    each call), and no autocast (whose dtypes the manual backward does not
    replay)."""
    if not isinstance(experts, GroupedExperts) or type(experts).forward is not GroupedExperts.forward:
        return False
    own = experts._parameters
    if set(own) != {"w_in", "w_out"} or own["w_in"] is not experts.w_in or own["w_out"] is not experts.w_out:
        return False
    if any(True for _ in experts.children()) or torch.is_autocast_enabled(device_type):
        return False
    hooks = (experts._forward_hooks, experts._forward_pre_hooks, experts._backward_hooks,
             experts._backward_pre_hooks)
    global_hooks = getattr(nn.modules.module, "_has_any_global_hook", lambda: False)()
    return not any(hooks) and not global_hooks
