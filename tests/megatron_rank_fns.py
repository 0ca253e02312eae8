"""Functions run on every rank of a test world for the Megatron-Core adapter tests."""

from __future__ import annotations

import enum
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist

from dispatch.integrations.megatron import MegatronDispatcher, routing_to_topk
from world import current_device


def _cpu(t):
    return None if t is None else t.detach().cpu()


class SharedState(enum.Enum):
    """The states of Megatron's SharedExpertMLP overlapped forward (its ``SharedExpertState``)."""

    IDLE = 0
    PRE_FORWARD_COMM_DONE = 1
    FC1_FORWARD_DONE = 2
    FC2_FORWARD_DONE = 3
    POST_FORWARD_COMM_DONE = 4


class RecordingSharedExperts:
    """Megatron's SharedExpertMLP overlap interface run in place (no streams): the MLP
    tanh(x @ w1) @ w2 (``shared_mlp``), each call logged after the stage it ran in;
    each stage refused out of its turn, as Megatron's state machine refuses it
    (``_overlap_state``)."""

    def __init__(self, hidden: int, seed: int, log: list, device) -> None:
        self.w1, self.w2 = shared_mlp_weights(hidden, seed)
        self.w1, self.w2 = self.w1.to(device), self.w2.to(device)
        self.log = log
        self._overlap_state = SharedState.IDLE

    def _turn(self, required: SharedState, following: SharedState) -> None:
        assert self._overlap_state == required, f"called from {self._overlap_state.name}, not {required.name}"
        self._overlap_state = following

    def wait_current_stream(self):
        self.log.append("wait")

    def pre_forward_comm(self, x):
        self._turn(SharedState.IDLE, SharedState.PRE_FORWARD_COMM_DONE)
        self.log.append("pre")
        self.x = x

    def linear_fc1_forward_and_act(self, overlapped_comm_output=None):
        self._turn(SharedState.PRE_FORWARD_COMM_DONE, SharedState.FC1_FORWARD_DONE)
        self.log.append("fc1")
        self.h = torch.tanh(self.x @ self.w1)

    def linear_fc2_forward(self, overlapped_comm_output=None):
        self._turn(SharedState.FC1_FORWARD_DONE, SharedState.FC2_FORWARD_DONE)
        self.log.append("fc2")
        self.y = self.h @ self.w2

    def post_forward_comm(self):
        self._turn(SharedState.FC2_FORWARD_DONE, SharedState.POST_FORWARD_COMM_DONE)
        self.log.append("post")

    def get_output(self):
        self._turn(SharedState.POST_FORWARD_COMM_DONE, SharedState.IDLE)
        self.log.append("output")
        return self.y


def shared_mlp_weights(hidden: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(hidden, 2 * hidden, generator=gen, dtype=torch.float64) * 0.3,
            torch.randn(2 * hidden, hidden, generator=gen, dtype=torch.float64) * 0.3)


def stage_round_trip(hidden, routing_map, probs, grad_out, num_experts: int, topk: int, options: dict,
                     shared_seed: int | None = None, config_extra: dict | None = None,
                     quantization_multiple: int = 0):
    """The six stages in MoELayer.forward's order, around experts that weight by the probs
    as Megatron's do and scale local expert i by (1 + i); then backward of sum(out * grad_out).
    With ``shared_seed``, shared experts (``RecordingSharedExperts``) run in the dispatcher;
    ``config_extra``: more of Megatron's config; ``quantization_multiple``: the router
    padding's alignment, set on the dispatcher as its constructor would from Megatron's
    rule (which needs megatron-core)."""
    device = current_device()
    world = dist.get_world_size()
    rank = dist.get_rank()
    per_rank = num_experts // world
    d = MegatronDispatcher(
        per_rank,
        list(range(rank * per_rank, (rank + 1) * per_rank)),
        SimpleNamespace(num_moe_experts=num_experts, moe_router_topk=topk, **(config_extra or {})),
        SimpleNamespace(ep=None),
        options=options,
    )
    d.quantization_multiple = quantization_multiple or d.quantization_multiple
    log: list = []
    if shared_seed is not None:
        d.set_shared_experts(RecordingSharedExperts(hidden.shape[-1], shared_seed, log, device))
    x = hidden.to(device).requires_grad_()
    p = probs.to(device).requires_grad_()
    log.append("dispatch_preprocess")
    h, w = d.dispatch_preprocess(x, routing_map.to(device), p)
    return {"log": log, "fixed_rows": d.fixed_rows, **_after_preprocess(d, h, w, x, p, grad_out, log)}


def _after_preprocess(d, h, w, x, p, grad_out, log: list) -> dict:
    """The five stages after ``dispatch_preprocess`` around stage_round_trip's experts,
    then backward of sum(out * grad_out) into ``x`` and ``p``."""
    device = h.device
    log.append("token_dispatch")
    engine_dispatch, calls = d.engine.dispatch, []
    d.engine.dispatch = lambda *args, **kwargs: calls.append(args[1].shape[1]) or engine_dispatch(*args, **kwargs)
    try:
        tokens, permuted_probs = d.token_dispatch(h, w)
    finally:
        del d.engine.dispatch
    log.append("dispatch_postprocess")
    tokens, tokens_per_expert, permuted_probs = d.dispatch_postprocess(tokens, permuted_probs)
    local = torch.repeat_interleave(torch.arange(d.num_local_experts), tokens_per_expert).to(device)
    y = tokens * permuted_probs.unsqueeze(-1).to(tokens.dtype) * (1 + local).to(tokens.dtype).unsqueeze(-1)
    log.append("combine_preprocess")
    y = d.combine_preprocess(y)
    log.append("token_combine")
    y = d.token_combine(y)
    log.append("combine_postprocess")
    out = d.combine_postprocess(y)
    (out * grad_out.to(device)).sum().backward()
    return {"dispatch_slots": calls, **_stage_results(tokens, tokens_per_expert, permuted_probs, out, x, p)}


def shared_experts_raise(raising: int, first: tuple, second: tuple, num_experts: int, topk: int,
                         config_extra: dict | None = None):
    """Shared experts run beside the exchange (``RecordingSharedExperts``) whose
    fc1 raises on rank ``raising`` only, right after its dispatch: what each rank
    raised in that round trip (its type and message); then a whole round trip on
    the same dispatcher, every rank in step (``first``, ``second``: (hidden,
    routing_map, probs, grad_out) of each; ``config_extra``: more of Megatron's
    config, e.g. fixed rows, with the NCCL/gloo transport marked host-free as in
    ``fixed_rows_round_trip``)."""
    from dispatch.transports import AllToAllTransport

    if config_extra:
        AllToAllTransport.host_free = True
    try:
        return _shared_experts_raise(raising, first, second, num_experts, topk, config_extra or {})
    finally:
        if config_extra:
            del AllToAllTransport.host_free


def _shared_experts_raise(raising: int, first: tuple, second: tuple, num_experts: int, topk: int,
                          config_extra: dict):
    device = current_device()
    rank = dist.get_rank()
    per_rank = num_experts // dist.get_world_size()
    d = MegatronDispatcher(per_rank, list(range(rank * per_rank, (rank + 1) * per_rank)),
                           SimpleNamespace(num_moe_experts=num_experts, moe_router_topk=topk, **config_extra),
                           SimpleNamespace(ep=None), options=dict(timeout=30.0))
    log: list = []
    shared = RecordingSharedExperts(first[0].shape[-1], 11, log, device)
    d.set_shared_experts(shared)
    if rank == raising:
        def broken(overlapped_comm_output=None):
            raise RuntimeError(f"rank {rank}'s shared experts broke")

        shared.linear_fc1_forward_and_act = broken
    hidden, routing_map, probs, _ = first
    try:
        h, w = d.dispatch_preprocess(hidden.to(device), routing_map.to(device), probs.to(device))
        tokens, permuted_probs = d.token_dispatch(h, w)
        tokens, _, permuted_probs = d.dispatch_postprocess(tokens, permuted_probs)
        d.combine_postprocess(d.token_combine(d.combine_preprocess(tokens * permuted_probs.unsqueeze(-1))))
        raised = None
    except Exception as error:
        raised = (type(error).__name__, str(error))
    vars(shared).pop("linear_fc1_forward_and_act", None)
    hidden, routing_map, probs, grad_out = second
    x, p = hidden.to(device).requires_grad_(), probs.to(device).requires_grad_()
    h, w = d.dispatch_preprocess(x, routing_map.to(device), p)
    return raised, _after_preprocess(d, h, w, x, p, grad_out, log)["out"]


def with_slot_limit(limit: int, round_trip: str, *args):
    """``round_trip(*args)`` (a function of this module, by name) with either transport
    moving at most ``limit`` slots per token (the NVLink engine moves 32, NCCL any)."""
    from dispatch.transports import AllToAllTransport, NVLinkTransport

    classes = (AllToAllTransport, NVLinkTransport)
    saved = [cls.__dict__.get("max_topk") for cls in classes]
    for cls in classes:
        cls.max_topk = limit
    try:
        return globals()[round_trip](*args)
    finally:
        for cls, value in zip(classes, saved):
            if value is None:
                del cls.max_topk
            else:
                cls.max_topk = value


def replayed_preprocess(first: tuple, second: tuple, num_experts: int, topk: int):
    """``dispatch_preprocess`` inside a CUDA graph (``moe_preprocess``), as Megatron
    replays it: a round trip on ``first`` = (hidden, routing_map, probs, grad_out) as
    captured, then one on ``second`` where dispatch_preprocess does not run: the
    graph's outputs hold the second rows and weights, and Megatron sets the tensors
    named in ``cudagraph_attrs`` on the dispatcher from them. Returns the second round
    trip's results, and the error of a token_dispatch run after the first round trip
    with nothing set again (a stale routing must not be reused)."""
    device = current_device()
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = num_experts // world
    config = SimpleNamespace(num_moe_experts=num_experts, moe_router_topk=topk, cuda_graph_impl="local",
                             cuda_graph_modules=["moe_router", "moe_preprocess"])
    d = MegatronDispatcher(per_rank, list(range(rank * per_rank, (rank + 1) * per_rank)), config,
                           SimpleNamespace(ep=None))
    hidden, routing_map, probs, grad_out = first
    x, p = hidden.to(device).requires_grad_(), probs.to(device).requires_grad_()
    h, w = d.dispatch_preprocess(x, routing_map.to(device), p)
    captured = {name: getattr(d, name) for name in d.cudagraph_attrs}
    _after_preprocess(d, h, w, x, p, grad_out, [])
    try:
        d.token_dispatch(h, w)
        stale = None
    except RuntimeError as exc:
        stale = str(exc)
    # Megatron captures the graph of the layer's postprocess after the eager round trip:
    # combine_postprocess alone, on rows of the round trip's shape
    alone = d.combine_postprocess(torch.zeros(h.shape, dtype=h.dtype, device=device))
    assert alone.shape == hidden.shape, (alone.shape, hidden.shape)
    hidden, routing_map, probs, grad_out = second
    x, p = hidden.to(device).requires_grad_(), probs.to(device).requires_grad_()
    topk_idx, w = routing_to_topk(routing_map.to(device), p, topk)  # what the replay leaves in the graph's outputs
    outputs = {"topk_idx": topk_idx}
    assert sorted(captured) == sorted(outputs) and all(torch.is_tensor(t) for t in captured.values())
    for name in d.cudagraph_attrs:
        setattr(d, name, outputs[name])
    return _after_preprocess(d, x.reshape(-1, x.shape[-1]), w, x, p, grad_out, []), stale


def fixed_rows_round_trip(hidden, routing_map, probs, grad_out, num_experts: int, topk: int, factor: float,
                          tp: int = 1):
    """The six stages as with every stage inside CUDA graphs (``cuda_graph_modules=["moe"]``,
    padded to capacity): K' = E and ``max_rows`` fixed from the capacity, the counts fixed
    on the host; with ``tp`` > 1, by ``stage_round_trip_expert_tp``. The NCCL/gloo
    transport stands in for the engine here (its ``max_rows`` gives the engine's shapes,
    with a host read): it is marked host-free for the call."""
    from dispatch.transports import AllToAllTransport

    config = {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe"],
              "moe_expert_capacity_factor": factor, "moe_pad_expert_input_to_capacity": True}
    AllToAllTransport.host_free = True
    try:
        if tp > 1:
            return stage_round_trip_expert_tp(hidden, routing_map, probs, grad_out, num_experts, topk, tp, config)
        return stage_round_trip(hidden, routing_map, probs, grad_out, num_experts, topk, {}, config_extra=config)
    except ValueError as exc:
        return str(exc)
    finally:
        del AllToAllTransport.host_free


def stage_round_trip_expert_tp(hidden, routing_map, probs, grad_out, num_experts: int, topk: int, tp: int,
                               config_extra: dict | None = None):
    """The six stages with expert tensor parallelism: rank r is expert-TP rank r % tp
    of EP rank r // tp (Megatron's order of the tp-ep group); each TP rank's share of
    local expert i scales by (1 + i) * share[p] (the shares sum to 1), so that the
    sum over the expert-TP group is stage_round_trip's expert. ``config_extra``: more
    of Megatron's config."""
    device = current_device()
    world, rank = dist.get_world_size(), dist.get_rank()
    ep = world // tp
    tp_groups = [dist.new_group([e * tp + p for p in range(tp)]) for e in range(ep)]
    ep_groups = [dist.new_group([e * tp + p for e in range(ep)]) for p in range(tp)]
    tp_rank, ep_rank = rank % tp, rank // tp
    per_rank = num_experts // ep
    share = [(2 * p + 1) / tp**2 for p in range(tp)]  # 1/4, 3/4 for tp = 2
    d = MegatronDispatcher(
        per_rank,
        list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank)),
        SimpleNamespace(num_moe_experts=num_experts, moe_router_topk=topk, expert_tensor_parallel_size=tp,
                        **(config_extra or {})),
        SimpleNamespace(ep=ep_groups[tp_rank], expt_tp=tp_groups[ep_rank]),
    )
    x = hidden.to(device).requires_grad_()
    p = probs.to(device).requires_grad_()
    h, w = d.dispatch_preprocess(x, routing_map.to(device), p)
    tokens, permuted_probs = d.token_dispatch(h, w)
    tokens, tokens_per_expert, permuted_probs = d.dispatch_postprocess(tokens, permuted_probs)
    local = torch.repeat_interleave(torch.arange(per_rank), tokens_per_expert).to(device)
    scale = ((1 + local).to(tokens.dtype) * share[tp_rank]).unsqueeze(-1)
    y = tokens * permuted_probs.unsqueeze(-1).to(tokens.dtype) * scale
    y = d.combine_preprocess(y)
    y = d.token_combine(y)
    out = d.combine_postprocess(y)
    (out * grad_out.to(device)).sum().backward()
    return {"fixed_rows": d.fixed_rows, **_stage_results(tokens, tokens_per_expert, permuted_probs, out, x, p)}


def _stage_results(tokens, tokens_per_expert, permuted_probs, out, x, p) -> dict:
    """What a stage round trip hands back to the test (on the CPU)."""
    return {
        "tokens": _cpu(tokens),
        "tokens_per_expert": tokens_per_expert,
        "permuted_probs": _cpu(permuted_probs),
        "out": _cpu(out),
        "x_grad": _cpu(x.grad),
        "probs_grad": _cpu(p.grad),
    }


def stage_error(call: str, num_experts: int, topk: int, config_extra: dict, options: dict):
    """Construct a dispatcher (and run one misuse named by ``call``); return the error or None."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    per_rank = num_experts // world
    config = SimpleNamespace(num_moe_experts=num_experts, moe_router_topk=topk, **config_extra)
    try:
        d = MegatronDispatcher(
            per_rank, list(range(rank * per_rank, (rank + 1) * per_rank)), config, SimpleNamespace(ep=None),
            options=options,
        )
        x = torch.zeros(3, 2, 4, device=current_device())
        routing_map = torch.zeros(6, num_experts, dtype=torch.bool, device=current_device())
        routing_map[:, :topk] = True
        probs = routing_map.float()
        if call in ("too_many", "too_many_on_rank_0"):  # refused at the dispatch, whose value check sees it
            if call == "too_many" or rank == 0:
                routing_map[2, :] = True
            d.token_dispatch(*d.dispatch_preprocess(x, routing_map, probs))
        elif call == "map_dtype":
            d.dispatch_preprocess(x, routing_map.float(), probs)
        elif call == "map_shape":
            d.dispatch_preprocess(x, routing_map[:5], probs[:5])
        elif call == "probs_dtype":
            d.dispatch_preprocess(x, routing_map, routing_map.long())
        elif call == "order":
            d.token_dispatch(x.view(6, 4), probs[:, :topk])
        elif call == "postprocess_alone":
            d.combine_postprocess(x.view(6, 4))
        elif call == "combine_twice":
            h, w = d.dispatch_preprocess(x, routing_map, probs)
            rows, pp = d.token_dispatch(h, w)
            rows, _, pp = d.dispatch_postprocess(rows, pp)
            d.token_combine(d.combine_preprocess(rows))
            d.token_combine(rows)
    except Exception as exc:  # the test inspects what was raised
        return type(exc).__name__, str(exc)
    return None


# ----------------------------------------------------------------------------- a real MoELayer on CPU


class CpuTopKRouter(torch.nn.Module):
    """A top-k softmax router in plain torch, for MoELayers on CPU (Megatron's TopKRouter
    moves its weight to CUDA). Returns Megatron's ``(probs [T, E] fp32, routing_map [T, E] bool)``."""

    def __init__(self, config, pg_collection=None, is_mtp_layer=False) -> None:
        super().__init__()
        self.config = config
        self.topk = config.moe_router_topk
        self.weight = torch.nn.Parameter(torch.zeros(config.num_moe_experts, config.hidden_size))

    def set_layer_number(self, layer_number: int) -> None:
        del layer_number

    def forward(self, hidden_states, padding_mask=None):
        del padding_mask
        logits = hidden_states.reshape(-1, hidden_states.shape[-1]).float() @ self.weight.float().t()
        top, experts = logits.topk(self.topk, dim=1)
        probs = torch.zeros_like(logits).scatter(1, experts, torch.softmax(top, dim=1))
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)
        config = self.config
        if config.moe_expert_capacity_factor is not None:  # as Megatron's TopKRouter drops tokens
            from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, self.topk, config.moe_expert_capacity_factor, config.moe_token_drop_policy,
                config.moe_pad_expert_input_to_capacity)
        return probs, routing_map


_SINGLE_GROUPS: dict[int, dist.ProcessGroup] = {}


def _single_rank_group() -> dist.ProcessGroup:
    """This rank alone, as a process group (created collectively once per world)."""
    world = dist.get_world_size()
    if world not in _SINGLE_GROUPS:
        groups = [dist.new_group([r]) for r in range(world)]
        _SINGLE_GROUPS[world] = groups[dist.get_rank()]
    return _SINGLE_GROUPS[world]


def _build_layer(config, pg_collection):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    experts = spec.keywords["submodules"].experts
    return MoELayer(config=config, submodules=MoESubmodules(experts=experts, router=CpuTopKRouter), pg_collection=pg_collection)


def _fill(layer, first_expert: int, seed: int) -> None:
    """Weights from the seed and the global expert id: the same expert is the same everywhere."""
    gen = torch.Generator().manual_seed(seed)
    layer.router.weight.data.copy_(torch.randn(layer.router.weight.shape, generator=gen))
    for i, expert in enumerate(layer.experts.local_experts):
        gen = torch.Generator().manual_seed(seed * 1000 + first_expert + i + 1)
        for _, p in sorted(expert.named_parameters()):
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _forward_backward(layers, seed: int, shape: tuple, hidden: int, device) -> dict:
    """One input and output gradient from ``seed``; each (name, MoELayer)'s output, input
    gradient and router gradient (on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, hidden, generator=gen).to(device)
    grad = torch.randn(*shape, hidden, generator=gen).to(device)
    results = {}
    for name, module in layers:
        inp = x.clone().requires_grad_()
        out, bias = module(inp)
        assert bias is None
        (out * grad).sum().backward()
        results[name] = {"out": _cpu(out), "x_grad": _cpu(inp.grad), "router_grad": _cpu(module.router.weight.grad)}
    return results


def megatron_layer_vs_local(seed: int, num_experts: int, topk: int, hidden: int, shape: tuple, options: dict,
                            layer_config: dict | None = None):
    """A real MoELayer over the whole world with our dispatcher installed, against the same
    layer on this rank alone (all experts local, Megatron's own allgather dispatcher, which
    needs no communication on one rank). Returns outputs and gradients of both; expert
    gradients of the local layer summed over the world (every rank's tokens)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection

        from dispatch.bench.megatron_baseline import _ensure_parallel_state
        from dispatch.integrations.megatron import install

        from bench_scripts import load

        moe_config = load("megatron_layer").moe_config
        world, rank = dist.get_world_size(), dist.get_rank()
        _ensure_parallel_state(world)
        common = dict(hidden=hidden, ffn=2 * hidden, experts=num_experts, topk=topk, dtype="fp32",
                      use_cpu_initialization=True, moe_token_dispatcher_type="allgather", **(layer_config or {}))
        layer = _build_layer(moe_config(**common), ProcessGroupCollection.use_mpu_process_groups())
        one = _single_rank_group()
        alone = ProcessGroupCollection(tp=one, ep=one, expt_tp=one, tp_ep=one, expt_dp=one)
        local = _build_layer(moe_config(**common, expert_model_parallel_size=1), alone)
    per_rank = num_experts // world
    _fill(layer, rank * per_rank, seed)
    _fill(local, 0, seed)
    device = current_device()
    layer, local = layer.to(device), local.to(device)
    dispatcher = install(layer, **options)
    assert layer.token_dispatcher is dispatcher and parallel_state.model_parallel_is_initialized()
    seen = {}
    postprocess = dispatcher.dispatch_postprocess

    def recording(tokens, probs):  # what our dispatcher hands the experts
        seen["topk"] = dispatcher._in_flight.dispatched[0].handle.topk
        out = postprocess(tokens, probs)
        seen["tokens_per_expert"] = out[1].clone()
        return out

    dispatcher.dispatch_postprocess = recording

    results = _forward_backward((("ours", layer), ("local", local)), seed * 7 + rank, shape, hidden, device)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    local_grads = [[p.grad.clone() for _, p in sorted(e.named_parameters())] for e in local.experts.local_experts]
    for grads in local_grads:
        for g in grads:
            dist.all_reduce(g)
    results["ours"]["expert_grads"] = [[_cpu(p.grad) for _, p in sorted(e.named_parameters())] for e in layer.experts.local_experts]
    results["local"]["expert_grads"] = [[_cpu(g) for g in grads] for grads in local_grads[mine]]
    results["ours"].update(seen)
    return results


def _small_layer(seed: int):
    """(a small fp32 MoELayer over the world, 2 experts a rank, filled from ``seed``; its device)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.process_groups_config import ProcessGroupCollection

        from dispatch.bench.megatron_baseline import _ensure_parallel_state

        from bench_scripts import load

        world, rank = dist.get_world_size(), dist.get_rank()
        _ensure_parallel_state(world)
        config = load("megatron_layer").moe_config(hidden=16, ffn=32, experts=2 * world, topk=2, dtype="fp32",
                                                   use_cpu_initialization=True, moe_token_dispatcher_type="allgather")
        layer = _build_layer(config, ProcessGroupCollection.use_mpu_process_groups())
    _fill(layer, rank * 2, seed)
    device = current_device()
    return layer.to(device), device


def megatron_experts_raise(raising: int, overlap: int, seed: int = 3):
    """A real MoELayer over the world with our dispatcher installed (``overlap``:
    groups of experts, or False), whose experts raise on rank ``raising`` only: every rank's
    forward raises (returned: its exception's type and message); then a forward and
    backward of the layer on every rank, its output's sum returned, the ranks still
    in step."""
    from dispatch.integrations.megatron import install

    rank = dist.get_rank()
    layer, device = _small_layer(seed)
    install(layer, overlap=overlap, timeout=60.0)

    def broken(*args, **kwargs):
        raise RuntimeError(f"rank {rank}'s experts broke")

    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(seed + rank)).to(device).requires_grad_()
    mlps = layer.experts.local_experts  # (each expert's MLP: what the layer's experts run, whole or by groups)
    if rank == raising:
        for mlp in mlps:
            mlp.forward = broken
    try:
        layer(x)
        raised = None
    except Exception as error:
        raised = (type(error).__name__, str(error))
    for mlp in mlps:
        vars(mlp).pop("forward", None)
    out, _ = layer(x)
    out.sum().backward()
    return raised, float(out.sum())


def megatron_users_stage(raising: int, seed: int = 5):
    """A real MoELayer whose experts stage the user set on the layer itself (a
    ``routed_experts_compute`` instance attribute that counts its calls, and
    raises on rank ``raising`` when told), with our dispatcher installed, then
    installed again: (its calls after one forward under each install, whether
    the second install's guard runs the user's stage itself (not the first
    install's guard), what the raising forward raised, what ``install(overlap=2)``
    raised)."""
    from dispatch.integrations.megatron import install

    rank = dist.get_rank()
    layer, device = _small_layer(seed)
    calls, breaks = [0], [False]

    def users_stage(hidden_states, probs):
        calls[0] += 1
        if breaks[0] and rank == raising:
            raise RuntimeError(f"rank {rank}'s own stage broke")
        return type(layer).routed_experts_compute(layer, hidden_states, probs)

    layer.routed_experts_compute = users_stage
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(seed + rank)).to(device)
    seen = []
    for _ in range(2):
        install(layer, timeout=60.0)
        layer(x)
        seen.append(calls[0])
    unwrapped = getattr(layer.routed_experts_compute, "guarded", None) is users_stage
    breaks[0] = True
    try:
        layer(x)
        raised = None
    except Exception as error:
        raised = (type(error).__name__, str(error))
    try:
        install(layer, overlap=2)
        refused = None
    except ValueError as error:
        refused = str(error)
    return seen, unwrapped, raised, refused


def megatron_overlap_then_plain(seed: int = 7):
    """A real MoELayer with ``install(overlap=2)``, then a plain ``install``: (whether
    the layer's stage is then a guard of the class's own stage, not of the overlap's
    ``experts_by_groups``; whether the two installs' outputs are bitwise equal)."""
    from dispatch.integrations.megatron import install

    layer, device = _small_layer(seed)
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(seed + dist.get_rank())).to(device)
    install(layer, overlap=2, timeout=60.0)
    by_groups, _ = layer(x)
    install(layer, timeout=60.0)
    stage = layer.routed_experts_compute
    plain, _ = layer(x)
    return hasattr(stage, "guarded") and stage.guarded is None, torch.equal(by_groups, plain)


def run_doc_snippet(snippet: str):
    """Execute the README/docs snippet on this rank (parallel state reset first); return the
    loss and how many dispatchers it installed."""
    from megatron.core import parallel_state

    from dispatch.integrations.megatron import MegatronDispatcher as Ours

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(snippet, "README.md", "exec"), scope)
    layers = [m for m in scope["model"].modules() if hasattr(m, "token_dispatcher")]
    assert layers and all(isinstance(m.token_dispatcher, Ours) for m in layers)
    parallel_state.destroy_model_parallel()
    return float(scope["loss"]), len(scope["dispatchers"])


def run_doc_snippet_on_cpu(snippet: str, grads: bool = False):
    """The docs snippet on a CPU gloo rank, as written except for what only CUDA runs, patched
    for the call and restored after (the world outlives it): ``device="cuda"`` reads "cpu",
    the config adds ``use_cpu_initialization=True``, ``Module.cuda`` returns the module, Megatron's CUDA seeding is ``torch.manual_seed``, its
    ``TopKRouter`` is ``CpuTopKRouter``, the ``alltoall`` dispatcher the layers are built with
    (ours replaces it before the first forward) is the ``allgather`` one, dropout runs outside
    the CUDA RNG tracker and the global memory buffer allocates on the CPU. Returns the loss,
    the dispatchers installed, the parameter dtypes the forward saw and the names of the
    parameters left without a gradient; with ``grads``, also {name: gradient} and how many
    MoE layers run their experts by groups (``install(overlap=...)``)."""
    import contextlib
    from unittest import mock

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_layer

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    assert snippet.count('device="cuda"') >= 1 and snippet.count("TransformerConfig(\n") == 1
    snippet = snippet.replace('device="cuda"', 'device="cpu"')
    snippet = snippet.replace("TransformerConfig(\n", "TransformerConfig(\n    use_cpu_initialization=True,\n")
    tracker = mcore_random.get_cuda_rng_tracker()

    def cpu_buffer(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(shape, dtype=dtype)

    scope: dict = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        stack.enter_context(mock.patch.object(torch.nn.Module, "cuda", lambda self, *a, **k: self))
        stack.enter_context(mock.patch.object(mcore_random, "model_parallel_cuda_manual_seed", lambda seed, **k: torch.manual_seed(seed)))
        defaults = tuple(CpuTopKRouter if d is moe_layer.TopKRouter else d for d in moe_layer.MoESubmodules.__init__.__defaults__)
        stack.enter_context(mock.patch.object(moe_layer.MoESubmodules.__init__, "__defaults__", defaults))
        stack.enter_context(mock.patch.object(moe_layer, "MoEAlltoAllTokenDispatcher", moe_layer.MoEAllGatherTokenDispatcher))
        stack.enter_context(mock.patch.object(tracker, "fork", lambda *a, **k: contextlib.nullcontext()))
        stack.enter_context(mock.patch("megatron.core.utils.GlobalMemoryBuffer.get_tensor", cpu_buffer))
        exec(compile(snippet, "README.md", "exec"), scope)
    try:
        model = scope["model"]
        assert all(isinstance(m.token_dispatcher, MegatronDispatcher) for m in model.modules() if hasattr(m, "token_dispatcher"))
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        if grads:
            named = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            by_groups = sum(vars(m).get("routed_experts_compute") == m.token_dispatcher.experts_by_groups
                            for m in model.modules() if hasattr(m, "token_dispatcher"))
            return float(scope["loss"]), len(scope["dispatchers"]), dtypes, missing, named, by_groups
        return float(scope["loss"]), len(scope["dispatchers"]), dtypes, missing
    finally:
        parallel_state.destroy_model_parallel()


def doc_snippet_overlap_vs_plain(snippet: str, overlapped: str):
    """The docs snippet on CPU (``run_doc_snippet_on_cpu``) as written, then as
    ``overlapped`` (the same with ``install_all(..., overlap=G)``), from the same seeds:
    both runs' (loss, dispatchers, dtypes, parameters without a gradient, gradients,
    layers by groups)."""
    return [run_doc_snippet_on_cpu(text, grads=True) for text in (snippet, overlapped)]


def megatron_layer_expert_tp(seed: int, num_experts: int, topk: int, hidden: int, shape: tuple, tp: int):
    """A real MoELayer with expert tensor parallelism ``tp`` (EP = world / tp; Megatron's
    parallel state made for it, and destroyed after) and our dispatcher installed,
    against the same layer on this rank alone without tensor parallelism. Each rank's
    expert weights are its shard of the full experts' (fc1 by rows, fc2 by columns;
    no gated linear unit). Returns outputs and gradients of both; the experts'
    gradients of the local layer summed over the world and cut to this rank's shard."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection

        from dispatch.integrations.megatron import install

        from bench_scripts import load

        moe_config = load("megatron_layer").moe_config
        world, rank = dist.get_world_size(), dist.get_rank()
        ep = world // tp
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=tp,
                                                 create_gloo_process_groups=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            common = dict(hidden=hidden, ffn=2 * hidden, experts=num_experts, topk=topk, dtype="fp32",
                          use_cpu_initialization=True, moe_token_dispatcher_type="allgather", gated_linear_unit=False,
                          activation_func=torch.nn.functional.gelu)
            layer = _build_layer(moe_config(**common, expert_model_parallel_size=ep, expert_tensor_parallel_size=tp),
                                 ProcessGroupCollection.use_mpu_process_groups())
            one = _single_rank_group()
            alone = ProcessGroupCollection(tp=one, ep=one, expt_tp=one, tp_ep=one, expt_dp=one)
            local = _build_layer(moe_config(**common, expert_model_parallel_size=1), alone)
        tp_rank, ep_rank = parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_model_parallel_rank()
        per_rank = num_experts // ep
        _fill(local, 0, seed)
        layer.router.weight.data.copy_(local.router.weight.data)
        mine = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)

        def shard(name, full):
            rows = full.shape[0] // tp if "fc1" in name else full.shape[1] // tp
            return full[tp_rank * rows : (tp_rank + 1) * rows] if "fc1" in name else full[:, tp_rank * rows : (tp_rank + 1) * rows]

        for expert, full in zip(layer.experts.local_experts, local.experts.local_experts[mine]):
            fulls = dict(full.named_parameters())
            for name, p in expert.named_parameters():
                p.data.copy_(shard(name, fulls[name].data))
        device = current_device()
        layer, local = layer.to(device), local.to(device)
        dispatcher = install(layer)
        assert dispatcher.tp_size == tp
        results = _forward_backward((("ours", layer), ("local", local)), seed * 7 + rank, shape, hidden, device)
        local_grads = [dict(e.named_parameters()) for e in local.experts.local_experts]
        for grads in local_grads:  # every rank reduces every expert, in one order
            for p in grads.values():
                dist.all_reduce(p.grad)
        local_grads = local_grads[mine]
        results["ours"]["expert_grads"] = [[_cpu(p.grad) for _, p in sorted(e.named_parameters())]
                                           for e in layer.experts.local_experts]
        results["local"]["expert_grads"] = [[_cpu(shard(n, grads[n].grad)) for n in sorted(grads)]
                                            for grads in local_grads]
        return results
    finally:
        parallel_state.destroy_model_parallel()


class _Node:
    """One node of Megatron's EP-communication overlap schedule (combined 1F1B),
    as that schedule runs it: the forward on detached copies of its inputs (a
    graph of its own), its inputs' storage freed after the forward where
    ``frees``, and its backward run by hand from the next node's input gradients."""

    def __init__(self, fn, frees: bool) -> None:
        self.fn, self.frees = fn, frees
        self.side: list = []  # (tensor, its detached copy) handed to later nodes aside

    def aside(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.detach().requires_grad_(tensor.requires_grad)
        self.side.append((tensor, copy))
        return copy

    def forward(self, *inputs):
        self.inputs = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        out = self.fn(self, *self.inputs)
        self.outputs = out if isinstance(out, tuple) else (out,)
        if self.frees:
            for t in inputs:
                t.untyped_storage().resize_(0)
        return out

    def backward(self, *grads):
        tensors = [*self.outputs, *(t for t, _ in self.side)]
        given = [*grads, *(c.grad if c.grad is not None else torch.zeros_like(c) for _, c in self.side)]
        pairs = [(t, g) for t, g in zip(tensors, given) if t.requires_grad]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return tuple(t.grad for t in self.inputs)


def split_node_round_trip(hidden, logits_seed: int, num_experts: int, topk: int):
    """A MoE layer (a linear router, experts weighting by the probs) through the
    adapter with overlap_moe_expert_parallel_comm: once in one graph, once as
    Megatron's four nodes (attention + router + dispatch_preprocess; token_dispatch;
    dispatch_postprocess + experts + combine_preprocess; token_combine +
    combine_postprocess) with their inputs freed after forward as Megatron frees
    them. Returns (gradients of x, router, experts: one graph; the same: nodes;
    the dispatch backwards each run made, and the gradient norms they got)."""
    import dispatch.autograd as base

    device = current_device()
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = num_experts // world
    d = MegatronDispatcher(
        per_rank, list(range(rank * per_rank, (rank + 1) * per_rank)),
        SimpleNamespace(num_moe_experts=num_experts, moe_router_topk=topk, overlap_moe_expert_parallel_comm=True,
                        moe_token_dispatcher_type="alltoall"),
        SimpleNamespace(ep=None),
    )
    gen = torch.Generator().manual_seed(logits_seed)
    width = hidden.shape[-1]
    router = torch.randn(width, num_experts, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    weight = torch.randn(width, width, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    x = hidden.to(device).requires_grad_()
    seen = []
    original = base.DispatchFn.backward

    def counted(ctx, grad_tokens, grad_weights, grad_link):
        seen.append(float(grad_tokens.abs().sum()))
        return original(ctx, grad_tokens, grad_weights, grad_link)

    def route(h):
        probs = torch.softmax(h.reshape(-1, h.shape[-1]) @ router, -1)  # [T, E], T the leading dims' tokens
        chosen = probs.topk(topk, -1).indices
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, chosen, True)
        return torch.where(routing_map, probs, 0), routing_map

    def experts(tokens, permuted_probs):
        return torch.tanh(tokens @ weight) * permuted_probs.unsqueeze(1)

    results = []
    base.DispatchFn.backward = staticmethod(counted)
    try:
        # one graph
        h = torch.tanh(x)
        probs, routing_map = route(h)
        rows, p = d.dispatch_preprocess(h, routing_map, probs)
        tokens, pp = d.token_dispatch(rows, p)
        tokens, _, pp = d.dispatch_postprocess(tokens, pp)
        out = d.combine_postprocess(d.token_combine(d.combine_preprocess(experts(tokens, pp))))
        out.pow(2).sum().backward()
        results.append([_cpu(t.grad) for t in (x, router, weight)])
        one_graph = list(seen)
        for t in (x, router, weight):
            t.grad = None
        seen.clear()
        # Megatron's nodes
        probs_aside = {}

        def pre(node, x_in):
            h = torch.tanh(x_in)
            probs, routing_map = route(h)
            return d.dispatch_preprocess(h, routing_map, probs)

        def moe_dispatch(node, rows, p):
            tokens, pp = d.token_dispatch(rows, p)
            probs_aside["pp"] = node.aside(pp)
            return tokens

        def mlp(node, tokens):
            tokens, _, pp = d.dispatch_postprocess(tokens, probs_aside["pp"])
            return d.combine_preprocess(experts(tokens, pp))

        def moe_combine(node, y):
            return d.combine_postprocess(d.token_combine(y))

        nodes = [_Node(pre, False), _Node(moe_dispatch, True), _Node(mlp, True), _Node(moe_combine, True)]
        a = nodes[0].forward(x)
        a = nodes[1].forward(*a)
        a = nodes[2].forward(a)
        out = nodes[3].forward(a)
        grads = (2 * out.detach(),)
        for node in reversed(nodes):  # Megatron's order: combine, mlp, dispatch, then the rest
            grads = node.backward(*grads)
        x.backward(grads[0])
        results.append([_cpu(t.grad) for t in (x, router, weight)])
    finally:
        base.DispatchFn.backward = original
    return results[0], results[1], one_graph, list(seen)


def megatron_overlap_vs_plain(seed: int, num_experts: int, topk: int, hidden: int, shape: tuple, overlaps: tuple,
                              dtype: str = "fp32", experts_hook: bool = False):
    """A real MoELayer over the world with our dispatcher installed without overlap, then
    with ``install(overlap=G)`` for each G of ``overlaps`` (the experts by groups), the
    same weights and input each time; {G or "plain": out, x_grad, router_grad,
    expert_grads, stage, mlp_calls, mlp_calls_on_rows, mlp_rows} on the CPU ("stage":
    whether the layer's routed_experts_compute is ours; each local expert's MLP's calls
    in the forward, those on some rows, and the rows they took). ``experts_hook``: a
    forward pre-hook on the layer's experts module (SequentialMLP) counts its calls
    too ("experts_calls")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.process_groups_config import ProcessGroupCollection

        from dispatch.bench.megatron_baseline import _ensure_parallel_state
        from dispatch.integrations.megatron import install

        from bench_scripts import load

        moe_config = load("megatron_layer").moe_config
        world, rank = dist.get_world_size(), dist.get_rank()
        _ensure_parallel_state(world)
        layer = _build_layer(moe_config(hidden=hidden, ffn=2 * hidden, experts=num_experts, topk=topk, dtype=dtype,
                                        use_cpu_initialization=True, moe_token_dispatcher_type="allgather"),
                             ProcessGroupCollection.use_mpu_process_groups())
    _fill(layer, rank * (num_experts // world), seed)
    device = current_device()
    layer = layer.to(device)
    results = {}
    seen = [[0, 0, 0] for _ in layer.experts.local_experts]  # each local expert's MLP: calls, on rows, rows

    def counting(e):
        def hook(module, args):
            rows = args[0].shape[0]
            seen[e][0] += 1
            seen[e][1] += rows > 0
            seen[e][2] += rows
        return hook

    hooks = [mlp.register_forward_pre_hook(counting(e)) for e, mlp in enumerate(layer.experts.local_experts)]
    module_calls = [0]
    if experts_hook:
        hooks.append(layer.experts.register_forward_pre_hook(lambda module, args: module_calls.__setitem__(
            0, module_calls[0] + 1)))
    for overlap in ("plain", *overlaps):
        dispatcher = install(layer, overlap=False if overlap == "plain" else overlap)
        layer.zero_grad(set_to_none=True)
        for counts in seen:
            counts[:] = [0, 0, 0]
        module_calls[0] = 0
        got = _forward_backward((("layer", layer),), seed * 7 + rank, shape, hidden, device)["layer"]
        got["mlp_calls"], got["mlp_calls_on_rows"], got["mlp_rows"] = (list(c) for c in zip(*seen))
        got["experts_calls"] = module_calls[0]
        got["expert_grads"] = [[_cpu(p.grad) for _, p in sorted(e.named_parameters())]
                               for e in layer.experts.local_experts]
        got["stage"] = vars(layer).get("routed_experts_compute") == dispatcher.experts_by_groups
        if overlap != "plain":  # a group's backward reaches its SequentialMLP experts' weights only
            mlps = layer.experts.local_experts
            got["first_group_reaches"] = [id(p) for p in dispatcher.exchange.experts.group_parameters(0, 1)] == [
                id(p) for p in mlps[0].parameters()]
        results[overlap] = got
    for hook in hooks:
        hook.remove()
    return results


def megatron_overlap_refusal(num_experts: int, overlap, config_extra: dict):
    """``install(overlap=...)`` on a layer whose config has ``config_extra``: the error's
    type and message, or None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.process_groups_config import ProcessGroupCollection

        from dispatch.bench.megatron_baseline import _ensure_parallel_state
        from dispatch.integrations.megatron import install

        from bench_scripts import load

        moe_config = load("megatron_layer").moe_config
        _ensure_parallel_state(dist.get_world_size())
        layer = _build_layer(moe_config(hidden=8, ffn=16, experts=num_experts, topk=2, dtype="fp32",
                                        use_cpu_initialization=True, moe_token_dispatcher_type="allgather"),
                             ProcessGroupCollection.use_mpu_process_groups())
    for name, value in config_extra.items():
        setattr(layer.config, name, value)
    try:
        install(layer, overlap=overlap)
    except (ValueError, TypeError) as exc:
        return type(exc).__name__, str(exc)
    return None


def padded_with_a_rank_absent(absent: int, timeout: float):
    """Every rank makes a dispatcher that pads to capacity (its slots per token
    agreed by the EP group before the dispatch); rank ``absent`` then never comes
    to the layer. Returns, on the others, (seconds until the round trip raised,
    the error's type and message); None on the absent rank."""
    import time

    rank, world = dist.get_rank(), dist.get_world_size()
    config = SimpleNamespace(num_moe_experts=2 * world, moe_router_topk=2, moe_expert_capacity_factor=1.0,
                             moe_pad_expert_input_to_capacity=True)
    d = MegatronDispatcher(2, [2 * rank, 2 * rank + 1], config, SimpleNamespace(ep=None),
                           options=dict(timeout=timeout))
    if rank == absent:
        return None
    routing_map = torch.zeros(6, 2 * world, dtype=torch.bool, device=current_device())
    routing_map[:, :2] = True
    start = time.monotonic()
    try:
        d.token_dispatch(*d.dispatch_preprocess(torch.randn(3, 2, 4, device=current_device()), routing_map,
                                                routing_map.float()))
    except Exception as error:  # noqa: BLE001 - reported to the test
        return time.monotonic() - start, type(error).__name__, str(error)
    return time.monotonic() - start, None, None


def expert_tp_with_one_ep_group_failing(timeout: float, fixed: bool):
    """4 ranks, expert TP 2 (EP groups {0, 2} and {1, 3}; expert-TP groups {0, 1} and
    {2, 3}); rank 0's routing has a non-finite weight, so the dispatch of EP group
    {0, 2} fails there, while EP group {1, 3}'s succeeds and goes on to the
    expert-TP counts exchange with ranks 0 and 2. Then every rank makes a round
    trip of good routing at once. ``fixed``: with fixed rows (as every stage
    inside CUDA graphs, eager here: the counts' check is the exchange; the
    NCCL/gloo transport marked host-free as in ``fixed_rows_round_trip``).
    Returns per round trip (seconds until it raised or ended, the error's type
    and message or None, the layer's output)."""
    from dispatch.transports import AllToAllTransport

    if fixed:
        AllToAllTransport.host_free = True
    try:
        return _expert_tp_with_one_ep_group_failing(timeout, fixed)
    finally:
        if fixed:
            del AllToAllTransport.host_free


def _expert_tp_with_one_ep_group_failing(timeout: float, fixed: bool):
    import time

    rank, world, tp = dist.get_rank(), dist.get_world_size(), 2
    ep = world // tp
    tp_groups = [dist.new_group([e * tp + p for p in range(tp)]) for e in range(ep)]
    ep_groups = [dist.new_group([e * tp + p for e in range(ep)]) for p in range(tp)]
    tp_rank, ep_rank = rank % tp, rank // tp
    num_experts = 4
    extra = {}
    if fixed:  # (each expert gets exactly its capacity, 3 of a rank's 6 tokens: the map padded to capacity)
        extra = {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe"],
                 "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    d = MegatronDispatcher(2, [2 * ep_rank, 2 * ep_rank + 1],
                           SimpleNamespace(num_moe_experts=num_experts, moe_router_topk=2, **extra),
                           SimpleNamespace(ep=ep_groups[tp_rank], expt_tp=tp_groups[ep_rank]),
                           options=dict(timeout=timeout))
    routing_map = torch.zeros(6, num_experts, dtype=torch.bool, device=current_device())
    routing_map[:3, :2] = routing_map[3:, 2:] = True
    results = []
    for step in range(2):  # (tokens of each EP rank and step apart: a step paired with another is seen)
        hidden = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(10 * ep_rank + step)).to(current_device())
        probs = routing_map.float()
        if rank == 0 and step == 0:
            probs[2, 0] = float("nan")
        start = time.monotonic()
        try:
            tokens, weights = d.token_dispatch(*d.dispatch_preprocess(hidden, routing_map, probs))
            tokens, _, weights = d.dispatch_postprocess(tokens, weights)
            out = d.combine_postprocess(d.token_combine(d.combine_preprocess(tokens * weights.unsqueeze(-1))))
            results.append((time.monotonic() - start, None, None, out.detach().cpu()))
        except Exception as error:  # noqa: BLE001 - reported to the test
            results.append((time.monotonic() - start, type(error).__name__, str(error), None))
    return results
