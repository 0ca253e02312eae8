"""MoEExchange: the exchange pipelined against the expert compute, forward and backward.

Notation as in ``dispatch.plan`` (W, E_local, K, T, H, N); G groups; H' the
experts' output width.

The pipeline's groups are **groups of local experts** (``plan.expert_groups``:
G contiguous ranges of each rank's experts, so that a group's rows are one
range of the canonical order). One dispatch by groups (``dispatch(groups=G)``)
makes one plan and moves the rows group after group; the experts compute
group g as soon as its rows are in, while group g + 1's move; each group's
outputs are added into the running pre-sums of their (token, source rank)
rows, and a pre-sum goes home as soon as its last group is in
(``combine_groups``). So every expert's weights are read once per pass, each
GEMM keeps its full M, a token crosses to a rank once (with the first group
there that needs it), and the result is bitwise that of one piece (G = 1): the
same rows in the same order, summed in the same order from the same zero.

The pipeline uses the dispatcher's public verbs only. Forward::

    start dispatch by groups           (one plan; pieces 0 .. G-1 leave)
    for g: wait piece g -> experts(g) -> add group g's outputs (pre-sums it completes leave)
    wait the home sums

With one group there is nothing to overlap: the forward is the plain verbs,
``dispatch`` -> experts -> ``combine`` (whose usual calls on the NVLink engine
are compiled whole, ``dispatch.usual``), the same bits.

Backward is the mirror image: the output gradient is dispatched along the
handle by groups (``dispatch_rows``), then per group the experts' backward and
the addition of its rows' gradients into the running sums going home
(``combine_groups`` for x); the routing weights' gradients go home in one
exchange after the last group (``combine_slots``). On CUDA the exchanges run on
the dispatcher's communication stream (``comm_priority``), ordered against the
caller's stream by events only (group g's compute waits for group g's piece
alone); on CPU they are asynchronous collectives. The alltoall variant on the
NCCL transport (or gloo) moves each group as its own all-to-all; the NVLink
engine pulls each group's rows in turn (a row an earlier group brought is
copied locally) and pushes the pre-sums each group completes; the other
variants move all groups at once, so there G > 1 computes by group but hides
nothing.

One rank's experts raising (forward or backward) must not leave its peers
waiting for it until the timeout: that rank takes part in the next call they
wait at, refused (``GroupSums.refuse``, ``TokenDispatcher.refuse``), so that
every peer raises ``PeerRefused`` there and it raises its experts' error. In a
backward where only the experts' parameters want gradients no call follows
theirs: the peers finish, and that rank raises alone.

Experts' parameters: for a plain :class:`GroupedExperts` (its own ``forward``
and parameters, no module hooks, no autocast: ``plain_grouped_experts``) the
backward of each group computes only the rows' gradients, and the weight
gradients are formed once, after the last group and while its gradients travel
home, from every group's rows held expert-major (``experts.ExpertsByGroups``):
the same GEMM over the same rows for every G. With ``max_rows`` (each group's
rows padded on the device), the rows are placed expert-major on the device, so
nothing is read on the host. Other experts are differentiated
group by group by autograd, their parameter gradients accumulated in place in
the parameters' dtype (each expert's gradient comes from one group, so the
sums add zeros to it: bitwise those of G = 1 where the experts' backward gives
an expert without rows a zero gradient). A parameter no group's graph reached
gets a zero gradient, as experts that run every expert give it through the
plain verbs (Megatron's ``SequentialMLP``, ``GroupedExperts``); where experts
skip one without rows, the plain verbs leave its ``.grad`` None instead.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from dispatch.dispatcher import TokenDispatcher
from dispatch.experts import ExpertsByGroups, GroupedExperts
from dispatch.kernels.row_grads import weighted_row_grads


@contextlib.contextmanager
def carved_out(sms: int | None):
    """GEMMs launched inside leave ``sms`` SMs free for kernels beside them (torch's
    experimental SM carveout, process-wide, restored after). None, or no CUDA:
    nothing changes."""
    if sms is None or not torch.cuda.is_available():
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


def check_layer(dispatcher, experts, comm_priority, sm_carveout, max_rows) -> None:
    """The arguments every layer over a dispatcher takes (``MoEExchange``,
    ``MoEMicroBatches``), refused by name at its construction."""
    if not isinstance(dispatcher, TokenDispatcher):
        raise TypeError(f"dispatcher must be a dispatch.TokenDispatcher, got {type(dispatcher).__name__}")
    if not callable(experts):
        raise TypeError(f"experts must be callable (tokens, tokens_per_expert) -> out, got {type(experts).__name__}")
    if isinstance(comm_priority, bool) or not isinstance(comm_priority, int):
        raise TypeError(f"comm_priority must be an int, got {type(comm_priority).__name__}")
    if sm_carveout is not None and (isinstance(sm_carveout, bool) or not isinstance(sm_carveout, int)
                                    or sm_carveout < 0):
        raise ValueError(f"sm_carveout must be None or an int >= 0, got {sm_carveout!r}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int)
                                 or not 0 <= max_rows < 2**31):
        raise ValueError(f"max_rows must be None or an int in [0, 2**31), got {max_rows!r}")


@contextlib.contextmanager
def at_priority(dispatcher: TokenDispatcher, priority: int):
    """The dispatcher's exchanges run at CUDA ``priority`` inside."""
    before, dispatcher.comm_priority = dispatcher.comm_priority, priority
    try:
        yield
    finally:
        dispatcher.comm_priority = before


def trained_params(experts) -> tuple:
    """The experts' parameters that require grad (none for a plain callable)."""
    if not isinstance(experts, nn.Module):
        return ()
    return tuple(p for p in module_parameters(experts) if p.requires_grad)


class MoEExchange(nn.Module):
    """dispatch -> experts -> combine, by G groups of local experts overlapping
    exchange and compute.

    Args:
        dispatcher: a :class:`TokenDispatcher` (``dispatch.create``). Its config's
            wire formats apply to every direction as in ``dispatch``/``combine``.
        experts: any callable ``(tokens [N, H], tokens_per_expert [E_local] int64 on
            the device of tokens) -> [N, H']``, rows in canonical order; called once
            per group with that group's rows and counts (zero for the experts of
            other groups). If it is an ``nn.Module`` it becomes a submodule and the
            gradients of its parameters are computed by the pipelined backward;
            experts whose output reaches another tensor that requires grad (a plain
            callable closing over parameters) are refused by name at the first call
            with grad (it would get no gradient). Experts that hold each expert's
            weights apart may name them: ``group_parameters(first, end)``, the
            parameters that a call with rows of local experts [first, end) only can
            reach; each group's backward then differentiates those only (once per
            pass), not every expert's again (zeros for the experts the group gives
            no rows, as those that run every expert on its rows, empty or not,
            give).
        groups: G, the groups of local experts, in [1, E_local] (1: no
            pipelining, one dispatch and one combine in one piece each). The
            default, 1: over NCCL every G > 1 measured slower; over NVSHMEM
            slowed to 8 blocks, G = 2-4 with SMs carved out gained 1-4%
            (bench/results/README.md).
        comm_priority: CUDA priority of the dispatcher's communication stream
            during this layer's exchanges (lower is higher; clamped to the
            device's range). Default -1: the small kernels around the
            collectives are not stuck behind the GEMMs. With G = 1 the
            forward's dispatch and combine run on the caller's stream (as the
            plain verbs do: nothing beside them to overlap), the backward's
            exchanges on the communication stream.
        sm_carveout: with G > 1 on CUDA, SMs the experts' GEMMs leave free
            while the groups' exchanges run beside them (torch's experimental
            SM carveout, process-wide, set around each group's experts and
            restored after; ``torch._grouped_mm`` heeds it, cuBLAS does not).
            A persistent GEMM holding every SM delays the collective kernels
            queued behind it until it ends. None: no carveout.
        out_dtype: with G > 1, the dtype of the layer's output and of the
            pre-sums (they start home before every rank has computed a row,
            so it is fixed up front; experts' rows in another dtype are cast
            to it). Default: the autocast dtype where autocast is on for x's
            device, else x's dtype. With G = 1 the outputs' dtype is agreed
            as ``combine`` does.
        max_rows: M: the dispatch takes ``max_rows=M`` (see
            ``TokenDispatcher.dispatch``), so that on the NVLink engine and over NVSHMEM nothing
            is read on the host and the layer's forward and backward can be
            captured in a CUDA graph. The experts then get M rows: the N received
            first, then rows that no token takes, with weight 0, and counts on
            the device only (:class:`GroupedExperts` takes them as they are;
            other experts must give those rows any finite values). With G > 1
            (the alltoall variant on the NVLink engine, NVSHMEM) each group gets
            B = ceil(M / G) rows so: a rank with more rows in a group fails. None: the dispatch reads its
            counts on the host. What a graph saves is measured by
            ``dispatch-bench overlap --graph`` (bench/results/README.md).
        weighted_experts: the experts weigh their rows themselves, as
            Megatron-Core's do: they are called ``experts(tokens,
            tokens_per_expert, weights)`` with the rows' routing weights ([N]
            in the dispatch's weight dtype, differentiable: their gradients come
            from the experts' backward) and ``tokens_per_expert`` on the host
            where the dispatch read its counts (else on the device); the rows
            are summed home unweighted. Default False: ``experts(tokens,
            tokens_per_expert)``, the sums weighted as ``combine(...,
            weights=...)``.
    """

    def __init__(self, dispatcher: TokenDispatcher, experts, groups: int = 1, comm_priority: int = -1,
                 sm_carveout: int | None = None, out_dtype: torch.dtype | None = None,
                 max_rows: int | None = None, weighted_experts: bool = False):
        super().__init__()
        check_layer(dispatcher, experts, comm_priority, sm_carveout, max_rows)
        local = dispatcher.num_local_experts
        if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= local:
            raise ValueError(f"groups must be an int in [1, {local}] (groups of the {local} local experts), "
                             f"got {groups!r}")
        if max_rows is not None and groups > 1 and not dispatcher.transport.bounded_groups:
            raise ValueError(f"max_rows={max_rows!r} with groups={groups}: a dispatch by groups with a row bound "
                             "needs the alltoall variant on the NVLink engine or NVSHMEM "
                             f"({dispatcher.transport.key} does not move one); use groups=1")
        if groups > 1 and dispatcher.config.pad_to_capacity:
            raise ValueError(f"groups={groups} with DispatchConfig.pad_to_capacity: padded blocks are placed when "
                             "the whole dispatch is in; use groups=1")
        if out_dtype is not None and (not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point):
            raise TypeError(f"out_dtype must be None or a floating torch.dtype, got {out_dtype!r}")
        if not isinstance(weighted_experts, bool):
            raise TypeError(f"weighted_experts must be a bool, got {type(weighted_experts).__name__}")
        self.out_dtype, self.sm_carveout, self.max_rows = out_dtype, sm_carveout, max_rows
        self.weighted_experts = weighted_experts
        self.dispatcher = dispatcher
        self.experts = experts
        self.groups = groups
        self._reach_checked = False  # whether a call's experts were seen to reach no leaf but their own
        self.comm_priority = comm_priority

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Args:
            x: [T, H] float16/bfloat16/float32/float64 tokens of this rank (T may be 0).
            topk_idx: [T, K] int32/int64 global expert ids; -1 = empty slot.
            topk_weights: [T, K] floating routing weights.
        Returns:
            [T, H'] in the experts' output dtype (on a rank whose experts got no
            rows, that of the ranks whose did): for each token, the sum over its
            slots of ``weight * experts(row)``, as ``combine(..., weights=...)``.
            Differentiable w.r.t. x, topk_weights and the experts' parameters.
            With G > 1, in ``out_dtype`` (see the class).
        """
        d = self.dispatcher  # (its dispatch checks the arguments, within the call's agreement: every rank raises)
        with self._priority():
            if self.groups == 1:  # nothing to overlap: the plain verb, the usual compiled call where it applies
                work = d.dispatch(x, topk_idx, topk_weights, max_rows=self.max_rows)
            else:
                work = d.dispatch(x, topk_idx, topk_weights, groups=self.groups, async_op=True,
                                  max_rows=self.max_rows)
        grad_on = torch.is_grad_enabled()
        anchor = torch.empty(0, device=x.device, requires_grad=grad_on)
        return _PipelineFn.apply(x, topk_weights, anchor, self, work, grad_on, *trained_params(self.experts))

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The dtype the pre-sums travel in (None for one group: agreed as combine)."""
        if self.groups == 1:
            return None
        if self.out_dtype is not None:
            return self.out_dtype
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def _carveout(self):
        """The experts' GEMMs inside leave ``sm_carveout`` SMs free (G > 1 on CUDA)."""
        return carved_out(None if self.groups == 1 else self.sm_carveout)

    def _priority(self):
        """The dispatcher's exchanges run at this layer's ``comm_priority`` inside."""
        return at_priority(self.dispatcher, self.comm_priority)


def _group(work, g: int, groups: int):
    """(rows, rows per expert on the device, on the host, weights, handle, the
    group's local experts or None for all) of group g; one group takes the whole
    result (where a pad_to_capacity dispatch places its rows)."""
    if groups == 1:  # (dispatched whole, at once)
        out = work
        return out.tokens, out.tokens_per_expert, out.tokens_per_expert_host, out.weights, out.handle, None
    part = work.wait_group(g)
    return (part.tokens, part.tokens_per_expert, part.tokens_per_expert_host, part.weights, work.handle,
            part.experts)


class _Whole:
    """The sums of one group: ``combine`` along the handle (its usual compiled
    call where it applies), as ``GroupSums`` takes one add, the same bits."""

    def __init__(self, dispatcher: TokenDispatcher, handle) -> None:
        self._dispatcher, self._handle, self._result = dispatcher, handle, None

    def add(self, rows, weights=None) -> None:
        self._result = self._dispatcher.combine(rows, self._handle, weights)

    def wait(self) -> torch.Tensor:
        return self._result


class _PipelineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, anchor, layer, work, grad_on, *params):
        d, experts, groups = layer.dispatcher, layer.experts, layer.groups
        handle = work.handle
        x_grad_any = handle.x_grad_any
        by_groups = None
        # weight gradients once, over all groups; with max_rows, from each group's
        # B = ceil(M / G) rows placed on the device (one group: autograd's GEMMs)
        if (not layer.weighted_experts and plain_grouped_experts(experts, x.device.type)
                and (layer.max_rows is None or groups > 1)):
            bound = None if layer.max_rows is None else -(-layer.max_rows // groups)
            by_groups = ExpertsByGroups(experts, [None] * groups, [None] * groups, grad_on, group_rows=bound)
        weights, leaves, ys = [None] * groups, [None] * groups, [None] * groups
        reach = [None] * groups  # each group's parameters, by index into params (None: all)
        with layer._priority():
            sums = None
            for g in range(groups):
                tokens, per_expert, per_expert_host, weights[g], handle, group_experts = _group(work, g, groups)
                try:  # the experts, on this rank alone: where they raise, its peers must not wait for it
                    reach[g] = _reached(experts, params, group_experts)
                    if by_groups is not None:
                        by_groups.set_counts(g, per_expert, per_expert_host, group_experts)
                        with layer._carveout():
                            y = by_groups.forward(g, tokens)
                    elif layer.weighted_experts:  # the experts weigh the rows: their weights are leaves too
                        leaf = tokens.detach().requires_grad_(grad_on and x_grad_any)
                        w_leaf = weights[g].detach().requires_grad_(grad_on and handle.weights_grad_any)
                        counts = per_expert if per_expert_host is None else per_expert_host
                        with torch.set_grad_enabled(grad_on), layer._carveout():
                            y = experts(leaf, counts, w_leaf)
                        if grad_on:
                            reach_once(layer, y, (leaf, w_leaf, *params))
                            leaves[g], ys[g] = (leaf, w_leaf), y
                    else:
                        leaf = tokens.detach().requires_grad_(grad_on and x_grad_any)
                        with torch.set_grad_enabled(grad_on), layer._carveout():
                            y = experts(leaf, per_expert)
                        if grad_on:  # kept for backward; without grad, group g's rows die here
                            reach_once(layer, y, (leaf, *params))
                            leaves[g], ys[g] = leaf, y
                except Exception as error:  # its peers raise at the call they wait at (PeerRefused)
                    if sums is None:  # (each refuse raises error)
                        d.refuse("combine" if groups == 1 else "combine_groups", handle, error)
                    sums.refuse(error)
                if sums is None:
                    sums = (_Whole(d, handle) if groups == 1 else
                            d.combine_groups(handle, dtype=layer._out_dtype(x), wire=d.config.combine_wire))
                add_expert_out(sums, y, None if layer.weighted_experts else weights[g], tokens, f"group {g}")
                tokens = y = None
            result = sums.wait()
        ctx.layer, ctx.handle, ctx.weights = layer, handle, weights
        ctx.leaves, ctx.ys, ctx.params, ctx.by_groups, ctx.reach = leaves, ys, params, by_groups, reach
        ctx.spent = False
        ctx.x_dtype, ctx.w_dtype = x.dtype, topk_weights.dtype
        ctx.anchor_dtype = anchor.dtype
        return result

    @staticmethod
    @once_differentiable  # (its exchanges are not differentiable: a double backward raises)
    def backward(ctx, grad_out):
        if ctx.spent:
            raise RuntimeError(
                "MoEExchange's backward ran a second time on one forward (retain_graph=True): each group's "
                "expert graph is freed as its gradients are sent; run the forward again"
            )
        ctx.spent = True
        layer, handle, by_groups = ctx.layer, ctx.handle, ctx.by_groups
        d, config, groups = layer.dispatcher, layer.dispatcher.config, layer.groups
        grad_out = grad_out.contiguous()
        x_any, w_any = handle.x_grad_any, handle.weights_grad_any
        grad_params = [None] * len(ctx.params)
        grad_w = []
        with layer._priority():
            brings = d.dispatch_rows(grad_out, handle, wire=config.combine_grad_wire, async_op=True)
            # the rows' gradients are in x's dtype on every rank: nothing to agree
            to_x = d.combine_groups(handle, dtype=ctx.x_dtype, wire=config.dispatch_grad_wire) if x_any else None
            for g in range(groups):
                grad_rows = brings.wait() if groups == 1 else brings.wait_group(g)
                try:  # the experts' backward, on this rank alone: where it raises, its peers must not wait for it
                    y = ctx.ys[g] if by_groups is None else by_groups.output(g)
                    if layer.weighted_experts:  # the weights' gradients from the experts' backward
                        (leaf, w_leaf), grad_y = ctx.leaves[g], grad_rows.to(y.dtype)
                    else:
                        leaf, w_leaf = ctx.leaves[g], None
                        grad_y, grad_weight = weighted_row_grads(grad_rows, ctx.weights[g], y, w_any)
                    with layer._carveout():
                        if by_groups is not None:
                            grad_tokens = by_groups.backward(g, grad_y, x_any) if x_any or ctx.params else None
                        else:
                            reach = ctx.reach[g]
                            params = ctx.params if reach is None else [ctx.params[i] for i in reach]
                            grads = grad_params if reach is None else [grad_params[i] for i in reach]
                            if w_leaf is None:
                                grad_tokens = autograd_rows(leaf, y, grad_y, x_any, params, grads)
                            else:
                                grad_tokens, grad_weight = autograd_rows(leaf, y, grad_y, x_any, params, grads,
                                                                         w_leaf, w_any)
                            for i, grad in zip(reach or (), grads):
                                grad_params[i] = grad
                        ctx.ys[g] = ctx.leaves[g] = None  # the group's graph is spent
                except Exception as error:
                    _refuse_backward(d, handle, brings, to_x, w_any, g, error)
                if x_any:
                    to_x.add(grad_tokens)
                if w_any:
                    grad_w.append(grad_weight)
                y = grad_rows = grad_y = grad_weight = grad_tokens = None
            if w_any:  # the routing weights' gradients, in one exchange
                values = grad_w[0] if groups == 1 else torch.cat(grad_w)
                to_w = d.combine_slots(values, handle, async_op=True)
            if by_groups is not None and ctx.params:  # while the last group's gradients travel home
                with layer._carveout():
                    grad_params[:] = by_groups.param_grads(ctx.params)
            grad_x = to_x.wait().to(ctx.x_dtype) if x_any else None
            grad_topk = to_w.wait().to(ctx.w_dtype) if w_any else None
        ctx.by_groups = None
        needs = ctx.needs_input_grad
        grad_params = [  # a parameter no group reached: zeros, as experts that run every expert give (module doc)
            torch.zeros_like(p) if g is None and needs[6 + i] else g
            for i, (g, p) in enumerate(zip(grad_params, ctx.params))
        ]
        return (
            grad_x if needs[0] else None,
            grad_topk if needs[1] else None,
            grad_out.new_zeros(0, dtype=ctx.anchor_dtype),
            None,
            None,
            None,
            *grad_params,
        )


def _refuse_backward(d, handle, brings, to_x, w_any: bool, g: int, error: Exception) -> None:
    """Raise ``error``, which this rank's experts' backward raised in group g,
    once its peers raise too at the next call they make (``PeerRefused``): the
    add of group g's gradients of x; without those, after the later groups'
    rows (which the peers move on) the routing weights' gradients' exchange.
    With neither, nothing follows that its peers wait at: it raises alone."""
    if to_x is not None:
        to_x.refuse(error)
    for later in range(g + 1, handle.groups):
        brings.wait_group(later)
    if w_any:
        d.refuse("combine_slots", handle, error)
    raise error


def _reached(experts, params: tuple, group_experts: tuple[int, int] | None) -> list[int] | None:
    """The indices into ``params`` of the parameters that a call of ``experts`` with
    rows of local experts ``group_experts`` = (first, end) only can reach, where the
    experts name them (``group_parameters``); None: every one (one group, or
    experts that do not say)."""
    named = getattr(experts, "group_parameters", None)
    if group_experts is None or named is None:
        return None
    reached = {id(p) for p in named(*group_experts)}
    return [i for i, p in enumerate(params) if id(p) in reached]


def autograd_rows(leaf, y, grad_y, rows_grad: bool, params, grad_params: list, weights=None,
                  weights_grad: bool = False):
    """Backward of one call of experts differentiated by autograd: the gradient
    of its rows ``leaf`` (if ``rows_grad``; zeros where autograd has none), and
    its parameters' gradients summed into ``grad_params``, in the parameters'
    dtype (as autograd would sum them over calls), each sum a new tensor:
    autograd may hand one tensor to two parameters, or a broadcast view. With the rows'
    routing ``weights`` (a leaf the experts weighed the rows by), returns
    (rows' gradient, weights' gradient if ``weights_grad``, else None)."""
    rows_grad = rows_grad and leaf.requires_grad
    weights_grad = weights is not None and weights_grad and weights.requires_grad
    inputs = ([leaf] if rows_grad else []) + ([weights] if weights_grad else []) + list(params)
    grads = [None] * len(inputs)
    if inputs and y.requires_grad:
        grads = list(torch.autograd.grad(y, inputs, grad_y, allow_unused=True))
    grad_rows = grads.pop(0) if rows_grad else None
    grad_weights = grads.pop(0) if weights_grad else None
    for i, g in enumerate(grads):
        if g is not None:
            grad_params[i] = g if grad_params[i] is None else grad_params[i] + g
    if rows_grad and grad_rows is None:
        grad_rows = leaf.new_zeros(leaf.shape)
    if weights is None:
        return grad_rows
    if weights_grad and grad_weights is None:
        grad_weights = weights.new_zeros(weights.shape)
    return grad_rows, grad_weights


def add_expert_out(sums, y: object, weights, tokens: torch.Tensor, what: str) -> None:
    """Add the experts' rows ``y`` of ``what`` (a group, a micro-batch; ``tokens``
    their input) to ``sums``: its add checks them within the call's agreement,
    so that a rank whose experts answered other rows raises there, naming them,
    and its peers raise ``PeerRefused`` at once (none waits for it in an exchange)."""
    try:
        sums.add(y.detach() if isinstance(y, torch.Tensor) else y, weights)
    except (TypeError, ValueError) as error:
        raise type(error)(f"the experts' rows of {what} (each rank's experts return [N, H'] floating rows on "
                          f"its device; here N={tokens.shape[0]} on {tokens.device}): {error}") from error


def check_reach(y, allowed: tuple) -> None:
    """Refuse experts whose output ``y`` reaches a tensor that requires grad other
    than ``allowed`` (their rows, the weights they weigh them by, the parameters
    they register as an ``nn.Module``): a layer's backward differentiates those
    only, so such a tensor (a parameter a plain callable closes over, say) would
    get no gradient, silently. A walk of y's graph: a layer makes it once."""
    if not isinstance(y, torch.Tensor) or y.grad_fn is None:
        return
    known, seen, stack = {id(t) for t in allowed}, set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) not in known:
            raise ValueError(f"experts: their output depends on a tensor that requires grad ({tuple(leaf.shape)} "
                             f"{leaf.dtype}) other than their rows and the parameters they register as an "
                             "nn.Module; the layer's backward would give it no gradient: pass experts as an "
                             "nn.Module that registers it")
        stack.extend(following for following, _ in node.next_functions)


def reach_once(layer, y, allowed: tuple) -> None:
    """:func:`check_reach` of the experts' outputs with grad until one had a graph
    to walk (``layer._reach_checked``): an output without (the experts' answer
    to no rows, say) tells nothing, so the next is checked."""
    if not layer._reach_checked:
        check_reach(y, allowed)
        layer._reach_checked = isinstance(y, torch.Tensor) and y.grad_fn is not None


def plain_grouped_experts(experts, device_type: str) -> bool:
    """Whether ``experts`` is a :class:`GroupedExperts` that ``ExpertsByGroups``
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
    return not hooked(experts)


def module_parameters(module: nn.Module) -> list:
    """``list(module.parameters())``, in its order (a module's own, then its
    submodules' depth first, each parameter and module once), walked without the
    generators ``parameters()`` stacks: the layer asks for them every pass. Where
    a module's class walks its parameters or submodules its own way, that walk."""
    out, seen, visited = [], set(), set()

    def walk(m: nn.Module) -> bool:  # False: a class with a walk of its own
        if id(m) in visited:
            return True
        visited.add(id(m))
        if _own_walk(type(m)):
            return False
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return all(walk(child) for child in m._modules.values() if child is not None)

    return out if walk(module) else list(module.parameters())


@functools.lru_cache(maxsize=None)
def _own_walk(cls: type) -> bool:
    """Whether ``cls`` overrides how ``nn.Module.parameters()`` walks a module."""
    return any(getattr(cls, name) is not getattr(nn.Module, name)
               for name in ("parameters", "named_parameters", "named_modules", "_named_members"))


def hooked(module: nn.Module) -> bool:
    """Whether a call of ``module`` runs hooks (its own or global ones), which a
    computation in its place would skip."""
    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    return any(own) or getattr(nn.modules.module, "_has_any_global_hook", lambda: False)()
