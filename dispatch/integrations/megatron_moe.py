"""What the Megatron-Core adapter takes from a ``MoELayer``: its routing
(``routing_map`` and ``probs``) in the top-k form the engine moves, and its
experts computed by groups of local experts (``install(overlap=...)``).

Notation as in ``dispatch.integrations.megatron``.
"""

from __future__ import annotations

import torch

from dispatch.pipeline import hooked, module_parameters


def routing_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's dense routing as the engine's top-k lists, on the device, no host sync.

    Args:
        routing_map: ``[T, E]`` bool, True where token t goes to expert e (at most
            ``topk`` Trues per row; extra Trues beyond the ``topk`` lowest expert ids
            are not represented, see ``MegatronDispatcher`` for the check).
        probs: ``[T, E]`` floating, the routing weight where ``routing_map`` is True.
        topk: ``K``.
    Returns:
        ``(topk_idx [T, K] int64, topk_weights [T, K] dtype of probs)``: the experts of
        each row in ascending order, then ``-1`` slots (weight 0) if the row has fewer
        than ``K``. ``topk_weights`` is differentiable w.r.t. ``probs`` (a gather).
    """
    num_experts = routing_map.shape[1]
    k = min(topk, num_experts)
    # Trues score E - e (largest for the lowest expert id), Falses 0.
    rank_score = torch.arange(num_experts, 0, -1, device=routing_map.device, dtype=torch.int32)
    score = routing_map.to(torch.int32) * rank_score
    top_score, top_expert = score.topk(k, dim=1)
    routed = top_score > 0
    topk_idx = torch.where(routed, top_expert, -1).to(torch.int64)
    topk_weights = torch.where(routed, probs.gather(1, top_expert), 0).to(probs.dtype)
    if k < topk:  # K > E cannot be routed; keep the [T, K] shape with empty slots
        pad = topk - k
        topk_idx = torch.cat([topk_idx, topk_idx.new_full((topk_idx.shape[0], pad), -1)], 1)
        topk_weights = torch.cat([topk_weights, topk_weights.new_zeros(topk_weights.shape[0], pad)], 1)
    return topk_idx, topk_weights


def pad_routing_map(routing_map: torch.Tensor, multiple: int) -> torch.Tensor:
    """Megatron's router padding for quantization: for each expert, the first
    tokens (ascending) not routed to it are routed to it, as many as bring its
    count on this rank to a multiple of ``multiple`` (their probability stays 0);
    on the device, no host sync.

    Args:
        routing_map: ``[T, E]`` bool.
        multiple: the alignment (``get_align_size_for_quantization``), >= 1.
    Returns:
        ``[T, E]`` bool, a new tensor.
    """
    free = ~routing_map
    short = (-routing_map.sum(0)) % multiple  # [E] tokens each expert lacks
    order = torch.cumsum(free.to(torch.int64), 0)  # [T, E]: the free token's place in its expert's column
    return routing_map | (free & (order <= short))


class ExpertsByGroup(torch.nn.Module):
    """Megatron's experts called for one group of local experts at a time
    (``install(overlap=...)``): ``(tokens [N_g, H], tokens_per_expert [E_local]
    int64 on the CPU, zero outside the group, permuted_probs [N_g]) -> [N_g, H]``, as
    ``MoELayer`` calls them. A plain ``SequentialMLP`` (``_runs_alone``) runs the MLPs
    of the experts with rows only, as its own forward runs each on its rows (the
    others' calls on no rows would cost the host as much as a full one, once per
    group); other experts are called whole (a grouped MLP: empty GEMMs for the other
    groups' experts). Not a submodule of the layer (its parameters are the experts'
    own, counted once)."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.experts = experts
        # SequentialMLP: an MLP a local expert, each run on its rows (none for the other
        # groups' experts), its parameters its MLPs' and nothing else
        mlps = getattr(experts, "local_experts", None)
        apart = isinstance(mlps, torch.nn.ModuleList) and len(mlps) > 0 and (
            {id(p) for p in experts.parameters()} == {id(p) for mlp in mlps for p in mlp.parameters()})
        self._mlps = tuple(mlps) if apart else None
        self._alone = apart and runs_alone(experts)

    def group_parameters(self, first: int, end: int) -> list:
        """The parameters that a call with rows of local experts [first, end) only can
        reach (``MoEExchange``): those experts' MLPs' where each expert has its own
        (SequentialMLP), else all (a grouped MLP's weights hold every expert)."""
        if self._mlps is None:
            return module_parameters(self.experts)
        return [p for mlp in self._mlps[first:end] for p in module_parameters(mlp)]

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        if self._alone and not hooked(self.experts):
            # SequentialMLP.forward's loop over the experts with rows (each MLP's bias,
            # if any, is in its output; SequentialMLP returns none); a group without
            # rows gets its empty output from one MLP
            counts = tokens_per_expert.tolist()  # on the CPU where the dispatch read its counts
            rows, weights = tokens.split(counts), probs.split(counts)
            outs = [mlp(r, w)[0] for mlp, r, w, n in zip(self._mlps, rows, weights, counts) if n]
            if not outs:
                return self._mlps[0](tokens, probs)[0]
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        out, bias = self.experts(tokens, tokens_per_expert, probs)
        if bias is not None:
            raise ValueError(f"install(overlap=...): the experts ({type(self.experts).__name__}) returned a bias; "
                             "MoELayer takes none from its dispatchers' experts either")
        return out


def runs_alone(experts: torch.nn.Module) -> bool:
    """Whether ``experts`` is a ``SequentialMLP`` whose forward is, for more than one
    local expert, each MLP on its rows and probs (split by the counts) and the outputs
    concatenated: its own forward, no input scaling by the probs, no padding for
    fp8/fp4 quantization."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    config = getattr(experts, "config", None)
    return (type(experts).forward is SequentialMLP.forward and isinstance(experts, SequentialMLP)
            and len(experts.local_experts) > 1 and config is not None
            and not getattr(config, "moe_apply_probs_on_input", False)
            and not getattr(config, "fp8", None) and not getattr(config, "fp4", None))


def idle(shared) -> None:
    """Megatron's shared experts back in the idle state of their overlapped
    forward, their cached tensors dropped, where a round trip that raised half
    way left them in another: their state machine refuses the next round
    trip's first stage otherwise, and every round trip after it."""
    state = getattr(shared, "_overlap_state", None)
    if state is None or state.name == "IDLE":
        return
    shared._overlap_state = type(state).IDLE
    for name in ("cached_fc1_input", "cached_fc2_input", "cached_fc2_output", "cached_output"):
        if getattr(shared, name, None) is not None:
            setattr(shared, name, None)


def users_stage(moe_layer):
    """The experts stage a user set on ``moe_layer`` itself (an instance attribute
    ``routed_experts_compute``, called as ``MoELayer`` calls it), or None: the
    class's, or one an earlier ``install`` set (a guard, which runs the user's if
    any, or a dispatcher's ``experts_by_groups``)."""
    from dispatch.integrations.megatron_dispatcher import MegatronDispatcher  # (it imports this module)

    own = vars(moe_layer).get("routed_experts_compute")
    if own is None or isinstance(getattr(own, "__self__", None), MegatronDispatcher):
        return None
    return own.guarded if hasattr(own, "guarded") else own
