"""A real Megatron-Core MoELayer with our dispatcher installed, on CPU gloo worlds.

Megatron's ``TopKRouter`` and ``alltoall`` dispatcher need CUDA, so on CPU the layer
uses a plain-torch top-k router, and the reference is the same layer on each rank
alone (all experts local, Megatron's ``allgather`` dispatcher, which does not
communicate on one rank). The GPU comparison with Megatron's ``alltoall`` dispatcher
is ``python3 bench/megatron_layer.py``. Skipped without megatron-core.
"""

from __future__ import annotations

import math

import pytest
import torch

from dispatch.bench.megatron_baseline import megatron_available

pytestmark = pytest.mark.skipif(not megatron_available(), reason="megatron-core is not importable")


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("topk", [2, 3])
def test_layer_matches_all_experts_local(worlds, world_size, topk):
    import megatron_rank_fns

    num_experts = 2 * world_size
    args = (11 + topk, num_experts, min(topk, num_experts), 16, (5, 3), {})
    results = worlds(world_size).run(megatron_rank_fns.megatron_layer_vs_local, [args] * world_size)
    for rank, result in enumerate(results):
        ours, local = result["ours"], result["local"]
        assert ours["out"].shape == (5, 3, 16)
        for key in ("out", "x_grad", "router_grad"):
            torch.testing.assert_close(ours[key], local[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {key}: {m}")
        assert len(ours["expert_grads"]) == len(local["expert_grads"]) == 2
        for mine, want in zip(ours["expert_grads"], local["expert_grads"]):
            for a, b in zip(mine, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert ours["router_grad"].abs().sum() > 0  # the probs carry gradient back to the router


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("policy, pad, factor", [("probs", False, 0.5), ("position", False, 0.5), ("probs", True, 0.5),
                                                 ("probs", True, 1.5), ("position", True, 1.5)])
def test_token_dropping_matches_all_experts_local(worlds, world_size, policy, pad, factor):
    """moe_expert_capacity_factor: Megatron's router drops (each rank its own tokens, the
    same on one rank alone); the dispatcher moves what it kept. With
    moe_pad_expert_input_to_capacity, every expert takes exactly its capacity of each
    rank's tokens (padding with probability 0): with room to pad (factor 1.5), a token
    names more than K experts."""
    import megatron_rank_fns

    num_experts = 2 * world_size
    layer_config = dict(moe_expert_capacity_factor=factor, moe_token_drop_policy=policy,
                        moe_pad_expert_input_to_capacity=pad)
    args = (7, num_experts, 2, 16, (6, 4), {}, layer_config)
    results = worlds(world_size).run(megatron_rank_fns.megatron_layer_vs_local, [args] * world_size)
    capacity = math.ceil(24 * 2 / num_experts * factor)  # Megatron's, from each rank's 24 tokens
    for rank, result in enumerate(results):
        ours, local = result["ours"], result["local"]
        if pad:  # every expert: its capacity from every rank; some token names more than K = 2 experts
            assert torch.equal(ours["tokens_per_expert"], torch.full((2,), capacity * world_size)), ours
            assert ours["topk"] > 2 or factor < 1, ours["topk"]
        else:
            assert ours["topk"] == 2 and int(ours["tokens_per_expert"].max()) <= capacity * world_size
        for key in ("out", "x_grad", "router_grad"):
            torch.testing.assert_close(ours[key], local[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {key}: {m}")
        for mine, want in zip(ours["expert_grads"], local["expert_grads"]):
            for a, b in zip(mine, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_tensor_parallel_layer_matches_all_experts_local(worlds, world_size):
    """expert_tensor_parallel_size=2 (EP = world / 2): each rank's experts are shards of
    the full ones; our dispatcher gathers the expert-TP group's rows and sums the
    partial outputs back, so outputs and gradients are those of the full experts."""
    import megatron_rank_fns

    args = (5, 4, 2, 16, (6, 2), 2)
    results = worlds(world_size).run(megatron_rank_fns.megatron_layer_expert_tp, [args] * world_size)
    for rank, result in enumerate(results):
        ours, local = result["ours"], result["local"]
        for key in ("out", "x_grad", "router_grad"):
            torch.testing.assert_close(ours[key], local[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {key}: {m}")
        assert len(ours["expert_grads"]) == len(local["expert_grads"]) == 4 // (world_size // 2)
        for mine, want in zip(ours["expert_grads"], local["expert_grads"]):
            for a, b in zip(mine, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_install_refuses_what_is_not_a_moe_layer():
    from dispatch.integrations.megatron import install

    with pytest.raises(TypeError, match="MoELayer"):
        install(torch.nn.Linear(2, 2))


def _doc_snippet() -> str:
    import pathlib

    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = text.split("## Use with Megatron-Core", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_doc_snippet_is_complete_python():
    snippet = _doc_snippet()
    compile(snippet, "README.md", "exec")
    assert "install_all(model" in snippet and "loss.backward()" in snippet


@pytest.mark.skipif(torch.cuda.is_available(), reason="with GPUs, test_doc_snippet_runs runs the snippet as written")
def test_doc_snippet_runs_on_cpu(worlds):
    """The snippet's bf16 GPTModel on gloo with only its CUDA calls patched (see
    ``run_doc_snippet_on_cpu``): a bf16 model must run inside ``Float16Module``, or the fp32
    position embeddings reach the first attention linear, whose weight is bf16."""
    import megatron_rank_fns

    world_size = 2
    results = worlds(world_size).run(megatron_rank_fns.run_doc_snippet_on_cpu, [(_doc_snippet(),)] * world_size)
    for loss, installed, dtypes, missing in results:
        assert installed == 2 and loss == loss and 0 < loss < 20
        assert dtypes == ["torch.bfloat16"]
        assert missing == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the snippet is patched for gloo (see run_doc_snippet_on_cpu)")
def test_doc_snippet_with_overlap_is_bitwise_the_plain_adapter(worlds):
    """The snippet's GPTModel (two MoE layers, 2 local experts a rank, bf16 wire) with
    ``install_all(..., overlap=2)``: the loss and every parameter's gradient bitwise those
    of ``install_all`` without overlap, and every parameter gets one."""
    import megatron_rank_fns

    snippet = _doc_snippet()
    plain = 'install_all(model, dispatch_wire="bf16")'
    assert snippet.count(plain) == 1
    overlapped = snippet.replace(plain, 'install_all(model, dispatch_wire="bf16", overlap=2)')
    world_size = 2
    results = worlds(world_size).run(megatron_rank_fns.doc_snippet_overlap_vs_plain,
                                     [(snippet, overlapped)] * world_size)
    for rank, (want, got) in enumerate(results):
        assert want[1] == got[1] == 2 and want[3] == got[3] == [], rank
        assert (want[5], got[5]) == (0, 2), rank  # both MoE layers by groups with overlap, none without
        assert got[0] == want[0] and 0 < want[0] < 20, (rank, got[0], want[0])
        assert got[4].keys() == want[4].keys() and any("experts" in name for name in want[4]), rank
        for name, grad in want[4].items():
            assert torch.equal(got[4][name], grad), f"rank {rank}: {name}"
    # the experts had rows somewhere (the snippet's fresh router may send every token to one rank's)
    assert any(grad.abs().sum() > 0 for want, _ in results for name, grad in want[4].items() if "experts" in name)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the snippet trains on CUDA (Megatron's router needs it)")
def test_doc_snippet_runs(worlds):
    import megatron_rank_fns

    world_size = 2
    results = worlds(world_size).run(megatron_rank_fns.run_doc_snippet, [(_doc_snippet(),)] * world_size)
    for loss, installed in results:
        assert installed == 2 and loss == loss and 0 < loss < 20


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("local, shape", [(4, (6, 2)), (8, (2, 2))])
def test_overlap_by_groups_is_bitwise_the_plain_adapter(worlds, world_size, local, shape):
    """install(overlap=G): the layer's experts by G groups of local experts as their rows
    land; output, input, router and expert gradients bitwise those without overlap, for
    every G (True: 2), and install without overlap puts the layer's own stage back. The
    SequentialMLP's MLPs run once a forward on the rows they have without overlap, and
    with it only those that have rows, and one MLP on no rows for a group without any
    (the second case has experts without rows)."""
    import megatron_rank_fns

    overlaps = (1, True, 3, local)
    args = (5, local * world_size, 3, 16, shape, overlaps)
    results = worlds(world_size).run(megatron_rank_fns.megatron_overlap_vs_plain, [args] * world_size)
    for rank, result in enumerate(results):
        want = result["plain"]
        assert not want["stage"]
        assert want["mlp_calls"] == [1] * local, rank  # SequentialMLP runs every expert
        for overlap in overlaps:
            got = result[overlap]
            assert got["stage"], (rank, overlap)
            assert got["first_group_reaches"], (rank, overlap)
            assert got["mlp_rows"] == want["mlp_rows"], (rank, overlap)
            # each MLP with rows once, and one call without rows at most for each group without
            assert got["mlp_calls_on_rows"] == [int(rows > 0) for rows in want["mlp_rows"]], (rank, overlap)
            groups = local if overlap == local else 2 if overlap is True else overlap
            assert sum(got["mlp_calls"]) - sum(got["mlp_calls_on_rows"]) <= groups, (rank, overlap)
            for key in ("out", "x_grad", "router_grad"):
                assert torch.equal(got[key], want[key]), f"rank {rank} overlap={overlap} {key}"
            for mine, theirs in zip(got["expert_grads"], want["expert_grads"]):
                for a, b in zip(mine, theirs):
                    assert torch.equal(a, b), f"rank {rank} overlap={overlap} expert grads"
        assert want["router_grad"].abs().sum() > 0
    if local == 8:
        assert any(0 in result["plain"]["mlp_rows"] for result in results)


def test_overlap_calls_hooked_experts_whole(worlds):
    """install(overlap=2) on a SequentialMLP with a hook of its own (one that, say,
    gathers sharded weights) calls the whole module for each group, so that the hook
    sees every call; still bitwise the plain adapter."""
    import megatron_rank_fns

    local, world_size = 4, 2
    args = (7, local * world_size, 3, 16, (6, 2), (2,), "fp32", True)
    for rank, result in enumerate(worlds(world_size).run(megatron_rank_fns.megatron_overlap_vs_plain,
                                                         [args] * world_size)):
        want, got = result["plain"], result[2]
        assert (want["experts_calls"], got["experts_calls"]) == (1, 2), rank
        assert got["mlp_calls"] == [2] * local, rank  # the whole module: every MLP, each group
        for key in ("out", "x_grad", "router_grad"):
            assert torch.equal(got[key], want[key]), f"rank {rank} {key}"
        for mine, theirs in zip(got["expert_grads"], want["expert_grads"]):
            for a, b in zip(mine, theirs):
                assert torch.equal(a, b), f"rank {rank} expert grads"


@pytest.mark.parametrize("overlap, extra, words", [
    (0, {}, "an int in [1, 4]"),
    (5, {}, "an int in [1, 4]"),
    (2.0, {}, "overlap must be"),
    (True, {"moe_pad_expert_input_to_capacity": True}, "padding to capacity"),
    (2, {"overlap_moe_expert_parallel_comm": True}, "overlap_moe_expert_parallel_comm"),
    (2, {"delay_wgrad_compute": True}, "delay_wgrad_compute"),
    (2, {"moe_layer_recompute": True}, "moe_layer_recompute"),
])
def test_overlap_refusals_name_the_setting(worlds, overlap, extra, words):
    import megatron_rank_fns

    for result in worlds(2).run(megatron_rank_fns.megatron_overlap_refusal, [(8, overlap, extra)] * 2):
        assert result is not None and result[0] == "ValueError" and words in result[1], result


def test_an_experts_stage_set_on_the_layer_is_kept_and_guarded(worlds):
    """A ``routed_experts_compute`` the user set on the layer itself: install runs
    it (once a forward, installed twice; the second install's guard around the
    user's stage, not around the first's guard), guards it (raising on one rank:
    its peers PeerRefused at once), and install(overlap=...) refuses it by name
    rather than replace it."""
    import megatron_rank_fns

    results = worlds(2).run(megatron_rank_fns.megatron_users_stage, [(1,)] * 2)
    for rank, (seen, unwrapped, raised, refused) in enumerate(results):
        assert seen == [1, 2], (rank, seen)
        assert unwrapped, rank
        if rank == 1:
            assert raised == ("RuntimeError", "rank 1's own stage broke"), raised
        else:
            assert raised[0] == "PeerRefused" and "rank(s) [1]" in raised[1], raised
        assert refused is not None and "routed_experts_compute set on the layer itself" in refused, refused


def test_a_plain_install_after_an_overlapped_one_guards_the_layers_own_stage(worlds):
    """install(overlap=2), then install(): the layer runs its own experts stage,
    guarded, not the first dispatcher's experts by groups; its output bitwise the
    overlapped one's."""
    import megatron_rank_fns

    for rank, (guards_own, same) in enumerate(worlds(2).run(megatron_rank_fns.megatron_overlap_then_plain, [()] * 2)):
        assert guards_own and same, rank


@pytest.mark.parametrize("overlap", [False, 2])
def test_one_ranks_experts_raising_stops_every_rank_at_once(worlds, overlap):
    """The layer's experts raise on one rank only (between its dispatch and its
    combine): that rank raises its error, its peers PeerRefused naming it, in
    their combine, at once (not after DispatchConfig.timeout); the next forward
    and backward run on every rank, in step."""
    import megatron_rank_fns

    world_size, raising = 2, 1
    results = worlds(world_size).run(megatron_rank_fns.megatron_experts_raise, [(raising, overlap)] * world_size)
    for rank, (raised, total) in enumerate(results):
        assert raised is not None, rank
        name, message = raised
        if rank == raising:
            assert (name, message) == ("RuntimeError", f"rank {rank}'s experts broke"), raised
        else:
            assert name == "PeerRefused" and f"rank(s) [{raising}]" in message, raised
        assert total == total  # (not NaN: the next round trip ran)
