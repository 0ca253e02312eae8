"""GroupedExperts: every backend against a per-row dense reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dispatch.experts import ExpertsByGroups, GroupedExperts, grouped_mm_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(experts: GroupedExperts, tokens, counts):
    """Row by row: each row through its own expert's two matrices, in fp64."""
    expert_of = torch.repeat_interleave(torch.arange(len(counts)), counts.cpu())
    out = []
    for row, e in zip(tokens.double(), expert_of.tolist()):
        h = row @ experts.w_in[e].double()
        if experts.activation == "swiglu":
            gate, up = h.chunk(2)
            a = F.silu(gate) * up
        else:
            a = F.gelu(h) if experts.activation == "gelu" else F.relu(h)
        out.append(a @ experts.w_out[e].double())
    return torch.stack(out) if out else tokens.new_zeros(0, experts.hidden).double()


def _beside_loop(backend, dtype, counts):
    """Forward and gradients (output, tokens, w_in, w_out) of 3 experts (H 16, F 32)
    with ``backend``, then with the loop on the same weights, rows and output gradient."""
    torch.manual_seed(1)
    tested = GroupedExperts(3, 16, 32, backend=backend, dtype=dtype, device=DEVICE)
    loop = GroupedExperts(3, 16, 32, backend="loop", dtype=dtype, device=DEVICE)
    loop.load_state_dict(tested.state_dict())
    tokens = torch.randn(int(counts.sum()), 16, dtype=dtype, device=DEVICE)
    grad = torch.randn(tokens.shape[0], 16, dtype=dtype, device=DEVICE)
    results = []
    for experts in (tested, loop):
        leaf = tokens.clone().requires_grad_()
        out = experts(leaf, counts)
        (out * grad).sum().backward()
        results.append((out.detach(), leaf.grad, experts.w_in.grad, experts.w_out.grad))
    return results


@pytest.mark.parametrize("backend", ["loop"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu"])
@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 0], [1, 7, 2]])
def test_backend_matches_reference(backend, activation, counts):
    torch.manual_seed(0)
    experts = GroupedExperts(3, 16, 24, activation=activation, backend=backend, dtype=torch.float64)
    counts = torch.tensor(counts)
    tokens = torch.randn(int(counts.sum()), 16, dtype=torch.float64)
    torch.testing.assert_close(experts(tokens, counts), _reference(experts, tokens, counts))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 0], [16, 9, 7]])
def test_grouped_mm_matches_loop(dtype, counts):
    """torch._grouped_mm (CPU in torch 2.13 for fp32/bf16; CUDA bf16 on sm90) against
    the loop, forward and gradients of tokens and parameters."""
    if DEVICE == "cuda" and dtype != torch.bfloat16:
        pytest.skip("CUDA grouped_mm is bf16 only")
    results = _beside_loop("grouped_mm", dtype, torch.tensor(counts, device=DEVICE))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("counts", [[0, 7, 0, 1], [0, 0, 0, 0]])
def test_grouped_mm_empty_experts_and_plain_sum(counts):
    """Experts with no rows get exactly zero weight gradients, N = 0 runs forward
    and backward, and a plain-sum loss (an expanded, stride-0 gradient) is taken."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    torch.manual_seed(3)
    grouped = GroupedExperts(4, 16, 32, backend="grouped_mm", dtype=dtype, device=DEVICE)
    loop = GroupedExperts(4, 16, 32, backend="loop", dtype=dtype, device=DEVICE)
    loop.load_state_dict(grouped.state_dict())
    counts = torch.tensor(counts, device=DEVICE)
    tokens = torch.randn(int(counts.sum()), 16, dtype=dtype, device=DEVICE)
    results = []
    for experts in (grouped, loop):
        leaf = tokens.clone().requires_grad_()
        experts(leaf, counts).sum().backward()
        results.append((leaf.grad, experts.w_in.grad, experts.w_out.grad))
    for e in (counts == 0).nonzero().flatten().tolist():
        assert not results[0][1][e].any() and not results[0][2][e].any(), f"expert {e} has no rows"
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_mm_takes_strided_tokens():
    """Rows whose stride is no multiple of 16 bytes (a column slice) are copied
    for the kernel rather than refused."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    torch.manual_seed(2)
    grouped = GroupedExperts(2, 16, 32, backend="grouped_mm", dtype=dtype, device=DEVICE)
    counts = torch.tensor([3, 4], device=DEVICE)
    wide = torch.randn(7, 17, dtype=dtype, device=DEVICE)
    torch.testing.assert_close(grouped(wide[:, :16], counts), grouped(wide[:, :16].contiguous(), counts))


def test_auto_backend_choice():
    assert not grouped_mm_available(torch.float32, torch.device("cpu"), 16, 16)
    assert not grouped_mm_available(torch.bfloat16, torch.device("cpu"), 16, 16)
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability() == (9, 0)
        assert grouped_mm_available(torch.bfloat16, torch.device("cuda"), 16, 16) == hopper
        assert not grouped_mm_available(torch.bfloat16, torch.device("cuda"), 12, 16)
        assert not grouped_mm_available(torch.bfloat16, torch.device("cuda"), 16, 16, num_groups=1024)


def test_bad_arguments():
    with pytest.raises(ValueError, match="activation"):
        GroupedExperts(2, 8, 8, activation="tanh")
    with pytest.raises(ValueError, match="backend"):
        GroupedExperts(2, 8, 8, backend="cutlass")
    with pytest.raises(ValueError, match="backend"):
        GroupedExperts(2, 8, 8, backend="bmm")
    with pytest.raises(ValueError, match="num_local_experts"):
        GroupedExperts(0, 8, 8)
    experts = GroupedExperts(2, 8, 8)
    with pytest.raises(ValueError, match="tokens"):
        experts(torch.zeros(3, 7), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="tokens_per_expert"):
        experts(torch.zeros(3, 8), torch.tensor([3]))
    with pytest.raises(TypeError, match="tokens"):
        experts(torch.zeros(3, 8, dtype=torch.float64), torch.tensor([1, 2]))
    for backend in ("loop", "grouped_mm"):  # counts on the host past the rows (a grouped GEMM would read past them)
        with pytest.raises(ValueError, match=r"tokens has 3 rows, fewer than tokens_per_expert counts \(4\)"):
            GroupedExperts(2, 8, 8, backend=backend)(torch.zeros(3, 8), torch.tensor([2, 2]))


def _groups_case(splits, activation, dtype, backend, device):
    torch.manual_seed(0)
    experts = GroupedExperts(3, 16, 24, activation=activation, backend=backend, dtype=dtype, device=device)
    counts = [torch.tensor(s, device=device) for s in splits]
    total = sum(counts)
    x = torch.randn(int(total.sum()), 16, dtype=dtype, device=device)
    grad_y = torch.randn_like(x)
    # group g holds, for each expert, the next counts[g][e] rows of that expert
    start, taken, order = torch.cumsum(total, 0) - total, torch.zeros_like(total), []
    for cnt in counts:
        order.append(torch.cat([start[e] + taken[e] + torch.arange(int(cnt[e]), device=device) for e in range(3)]))
        taken += cnt
    return experts, counts, total, x, grad_y, order


def _check_by_groups(splits, activation, dtype, backend, tol):
    """ExpertsByGroups on the groups of ``splits`` against autograd through the whole batch."""
    experts, counts, total, x, grad_y, order = _groups_case(splits, activation, dtype, backend, DEVICE)
    leaf = x.clone().requires_grad_()
    y = experts(leaf, total)
    y.backward(grad_y)
    want = [p.grad.clone() for p in experts.parameters()]
    experts.zero_grad()

    by_groups = ExpertsByGroups(experts, counts, [c.cpu() for c in counts], grad_on=True)
    outs = [by_groups.forward(g, x[rows]) for g, rows in enumerate(order)]
    grads = [by_groups.backward(g, grad_y[rows], rows_grad=True) for g, rows in enumerate(order)]
    assert torch.equal(by_groups.tokens, x)  # expert-major over the groups: the whole batch's order
    got = by_groups.weight_grads()
    every = torch.cat(order)
    close = dict(rtol=tol, atol=tol) if tol else {}
    torch.testing.assert_close(torch.cat(outs), y.detach()[every], **close)
    torch.testing.assert_close(torch.cat(grads), leaf.grad[every], **close)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), **close)
    assert all(p.grad is None for p in experts.parameters())  # the pipeline assigns them


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
@pytest.mark.parametrize(
    "splits", [[[3, 0, 5]], [[1, 0, 2], [2, 0, 3]], [[0, 0, 0], [3, 0, 5]], [[1, 0, 1], [1, 0, 1], [1, 0, 3]]]
)
def test_experts_by_groups_match_autograd(splits, activation):
    """ExpertsByGroups (the pipeline's experts: row gradients per group, weight
    gradients once over all groups) against autograd through the whole batch."""
    _check_by_groups(splits, activation, torch.float64, "loop", tol=None)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not grouped_mm_available(torch.bfloat16, torch.device(DEVICE), 16, 24, 3),
    reason="needs torch._grouped_mm on a Hopper GPU",
)
def test_experts_by_groups_grouped_mm_match_autograd():
    """The grouped-GEMM path of ExpertsByGroups (weight gradients as one 2D x 2D
    grouped GEMM over all groups) against autograd through GroupedExperts, in bf16."""
    _check_by_groups([[40, 0, 17], [9, 0, 64], [0, 0, 5]], "swiglu", torch.bfloat16, "auto", tol=2e-2)


def test_experts_by_groups_keep_only_what_a_weight_gradient_needs():
    """With w_out frozen, neither the activations nor the output gradients are
    kept, and only w_in gets a gradient; with no rows at all, zero gradients."""
    experts, counts, total, x, grad_y, order = _groups_case([[1, 0, 2], [2, 0, 3]], "swiglu", torch.float64,
                                                             "loop", DEVICE)
    experts.w_out.requires_grad_(False)
    by_groups = ExpertsByGroups(experts, counts, [c.cpu() for c in counts], grad_on=True)
    for g, rows in enumerate(order):
        by_groups.forward(g, x[rows])
    for g, rows in enumerate(order):
        by_groups.backward(g, grad_y[rows], rows_grad=False)
    assert by_groups.acts is None and by_groups.grad_outs is None and by_groups.tokens is not None
    grad_in, grad_out = by_groups.weight_grads()
    assert grad_out is None and grad_in.shape == experts.w_in.shape

    empty = [torch.zeros(3, dtype=torch.int64, device=DEVICE)] * 2
    by_groups = ExpertsByGroups(experts, empty, [c.cpu() for c in empty], grad_on=True)
    for g in range(2):
        by_groups.forward(g, x[:0])
        by_groups.backward(g, grad_y[:0], rows_grad=True)
    grad_in, _ = by_groups.weight_grads()
    assert grad_in.shape == experts.w_in.shape and not grad_in.any()


def test_experts_by_groups_counts_given_later():
    """A group's counts given after construction: what the first group kept waits
    for them, and the weight gradients are those of counts given up front; a
    group's counts are given once."""
    torch.manual_seed(0)
    experts = GroupedExperts(3, 4, 6, activation="relu", dtype=torch.float64)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_((p * 8).round() / 8)
    counts = [torch.tensor([2, 0, 3]), torch.tensor([1, 4, 0])]
    rows = [(torch.randn(int(c.sum()), 4, dtype=torch.float64) * 8).round() / 8 for c in counts]
    grads = [(torch.randn(int(c.sum()), 4, dtype=torch.float64) * 8).round() / 8 for c in counts]
    results = []
    for late, defer in ((False, False), (True, False), (True, True)):
        by_groups = ExpertsByGroups(experts, [counts[0], None if late else counts[1]],
                                 [counts[0], None if late else counts[1]], grad_on=True)
        by_groups.forward(0, rows[0])
        if late:
            assert by_groups.waiting and by_groups.tokens is None
            by_groups.set_counts(1, counts[1], counts[1])
            with pytest.raises(ValueError, match="already"):
                by_groups.set_counts(1, counts[1], counts[1])
        by_groups.forward(1, rows[1], defer_keep=defer)
        if defer:  # group 1's rows wait until placed
            assert len(by_groups.waiting) == 4 and by_groups.tokens is None
            by_groups.place_kept()
            assert not by_groups.waiting and by_groups.tokens.shape == (5 + 5, 4)
        for g in (0, 1):
            by_groups.backward(g, grads[g], rows_grad=False)
        results.append(by_groups.weight_grads())
    for other in results[1:]:
        for want, got in zip(results[0], other):
            assert torch.equal(want, got)


def _padded_groups(backend, dtype, device, counts, groups, bound):
    """ExpertsByGroups by ``groups`` groups of experts, each given ``bound`` rows (its
    own, then rows no expert takes, filled with 1e4 here) and its counts on the
    device only, against autograd through the whole batch: (outputs, row
    gradients, weight gradients) of both, the outputs and row gradients of the
    groups' own rows in canonical order; and whether every padding row of the
    outputs is zero."""
    torch.manual_seed(0)
    experts = GroupedExperts(len(counts), 16, 24, backend=backend, dtype=dtype, device=device)
    total = torch.tensor(counts, device=device)
    x = torch.randn(int(total.sum()), 16, dtype=dtype, device=device)
    grad_y = torch.randn_like(x)
    leaf = x.clone().requires_grad_()
    y = experts(leaf, total)
    y.backward(grad_y)
    want = (y.detach(), leaf.grad, *(p.grad.clone() for p in experts.parameters()))
    experts.zero_grad()

    edges = [g * len(counts) // groups for g in range(groups + 1)]
    by_groups = ExpertsByGroups(experts, [None] * groups, [None] * groups, grad_on=True, group_rows=bound)
    outs, grads, padding_zero, start = [], [], True, 0
    for g in range(groups):
        per_expert = torch.zeros_like(total)
        per_expert[edges[g]:edges[g + 1]] = total[edges[g]:edges[g + 1]]
        n = int(per_expert.sum())
        rows = torch.full((bound, 16), 1e4, dtype=dtype, device=device)
        rows[:n] = x[start:start + n]
        by_groups.set_counts(g, per_expert, None, (edges[g], edges[g + 1]))
        out = by_groups.forward(g, rows)
        padding_zero &= not out[n:].any()
        grad_rows = torch.zeros(bound, 16, dtype=dtype, device=device)  # padding rows carry weight 0
        grad_rows[:n] = grad_y[start:start + n]
        outs.append(out[:n])
        grads.append(by_groups.backward(g, grad_rows, rows_grad=True)[:n])
        start += n
    got = (torch.cat(outs), torch.cat(grads), *by_groups.weight_grads())
    return want, got, padding_zero


@pytest.mark.parametrize("counts, groups, bound", [
    ([3, 0, 5, 2], 2, 8), ([3, 0, 5, 2], 4, 5), ([0, 0, 4, 1], 2, 6), ([2, 2, 2, 2], 2, 4),
])
def test_experts_by_groups_by_padded_groups(counts, groups, bound):
    """Groups of experts given B rows each with their counts on the device only (a
    dispatch by groups with max_rows): outputs, row gradients and weight
    gradients bitwise those of autograd through the whole batch (fp64 loop),
    the padding's outputs zero, and the kept rows placed expert-major on the
    device (the dump row past them takes the padding)."""
    want, got, padding_zero = _padded_groups("loop", torch.float64, DEVICE, counts, groups, bound)
    assert padding_zero
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_experts_by_groups_by_padded_groups_in_order():
    """A group's counts before the previous group's are refused (its places start
    after the earlier groups' rows), and group_rows takes no counts up front."""
    experts = GroupedExperts(4, 4, 6, activation="relu", dtype=torch.float64)
    by_groups = ExpertsByGroups(experts, [None, None], [None, None], grad_on=True, group_rows=4)
    with pytest.raises(ValueError, match="group order"):
        by_groups.set_counts(1, torch.tensor([0, 0, 1, 1]), None, (2, 4))
    by_groups.set_counts(0, torch.tensor([1, 0, 0, 0]), None, (0, 2))  # the refusal kept nothing
    by_groups.set_counts(1, torch.tensor([0, 0, 1, 1]), None, (2, 4))
    with pytest.raises(ValueError, match="group order"):
        ExpertsByGroups(experts, [torch.tensor([1, 0, 0, 0]), None], [None, None], grad_on=True, group_rows=4)


def _padded_micro_batches(backend, dtype, device, splits, bound):
    """ExpertsByGroups over micro-batches (``splits``: each one's rows per expert),
    each given ``bound`` rows (its own, expert-major, then rows no expert takes,
    filled with 1e4) with its counts on the device only, against autograd
    through the whole batch (expert e's rows of micro-batch 0, then of 1, ...):
    (outputs, row gradients, weight gradients) of both, and whether every
    padding row of the outputs is zero. In fp64 the data are dyadic and the
    activation relu, so that GEMMs of other sizes give the same bits."""
    exact = dtype == torch.float64
    experts, counts, total, x, grad_y, order = _groups_case(splits, "relu" if exact else "swiglu", dtype, backend,
                                                            device)
    if exact:
        with torch.no_grad():
            for t in (x, grad_y, *experts.parameters()):
                t.copy_((t * 8).round() / 8)
    leaf = x.clone().requires_grad_()
    y = experts(leaf, total)
    y.backward(grad_y)
    every = torch.cat(order)
    want = (y.detach()[every], leaf.grad[every], *(p.grad.clone() for p in experts.parameters()))
    experts.zero_grad()

    by_groups = ExpertsByGroups(experts, [None] * len(splits), [None] * len(splits), grad_on=True,
                                group_rows=bound, micro_batches=True)
    outs, padding_zero = [], True
    for g, rows in enumerate(order):
        padded = torch.full((bound, x.shape[1]), 1e4, dtype=dtype, device=device)
        padded[:len(rows)] = x[rows]
        by_groups.set_counts(g, counts[g], None)
        out = by_groups.forward(g, padded)
        padding_zero &= not out[len(rows):].any()
        outs.append(out[:len(rows)])
    grads = []
    for g, rows in enumerate(order):
        grad_rows = torch.zeros(bound, x.shape[1], dtype=dtype, device=device)  # padding rows carry weight 0
        grad_rows[:len(rows)] = grad_y[rows]
        grads.append(by_groups.backward(g, grad_rows, rows_grad=True)[:len(rows)])
    got = (torch.cat(outs), torch.cat(grads), *by_groups.weight_grads())
    return want, got, padding_zero


@pytest.mark.parametrize("splits, bound", [
    ([[1, 0, 2], [2, 0, 3]], 6), ([[0, 0, 0], [3, 0, 5]], 8), ([[1, 0, 1], [1, 0, 1], [1, 0, 3]], 5),
    ([[2, 1, 0]], 4),
])
def test_experts_by_groups_of_padded_micro_batches(splits, bound):
    """Micro-batches given B rows each, every one with rows of any expert and its
    counts on the device only (MoEMicroBatches with max_rows): outputs, row
    gradients and weight gradients bitwise those of autograd through the whole
    batch (fp64 loop), the kept rows placed expert-major over the micro-batches
    on the device once all counts are in, the padding's outputs zero."""
    want, got, padding_zero = _padded_micro_batches("loop", torch.float64, DEVICE, splits, bound)
    assert padding_zero
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not grouped_mm_available(torch.bfloat16, torch.device(DEVICE), 16, 24, 3),
    reason="needs torch._grouped_mm on a Hopper GPU",
)
def test_experts_by_groups_of_padded_micro_batches_grouped_mm():
    """The grouped-GEMM path of padded micro-batches: against autograd through
    the whole batch to bf16 rounding (the micro-batches' GEMMs are of other sizes)."""
    want, got, padding_zero = _padded_micro_batches("auto", torch.bfloat16, DEVICE,
                                                    [[40, 0, 17], [9, 3, 64], [0, 0, 5]], 96)
    assert padding_zero
    for w, g in zip(want, got):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not grouped_mm_available(torch.bfloat16, torch.device(DEVICE), 16, 24, 4),
    reason="needs torch._grouped_mm on a Hopper GPU",
)
def test_experts_by_groups_by_padded_groups_grouped_mm():
    """The grouped-GEMM path of padded groups (nothing read on the host): outputs,
    row gradients and weight gradients against autograd through the whole batch
    to bf16 rounding (the groups' GEMMs are of other sizes), the padding's
    outputs zero."""
    want, got, padding_zero = _padded_groups("auto", torch.bfloat16, DEVICE, [40, 0, 17, 64], 2, 96)
    assert padding_zero
    for w, g in zip(want, got):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 0]])
def test_rows_past_the_experts_are_zero(backend, counts):
    """Rows past N = sum(tokens_per_expert) (a dispatch with max_rows): outputs zero,
    the first N rows and the weight gradients as without them."""
    if backend == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    dtype = torch.bfloat16 if backend == "grouped_mm" and DEVICE == "cuda" else torch.float32
    torch.manual_seed(2)
    experts = GroupedExperts(3, 16, 32, backend=backend, dtype=dtype, device=DEVICE)
    counts = torch.tensor(counts, device=DEVICE)
    n = int(counts.sum())
    tokens = torch.randn(n + 5, 16, dtype=dtype, device=DEVICE)
    tokens[n:] = float("nan")  # whatever sits past N must not leak
    grad = torch.randn(n + 5, 16, dtype=dtype, device=DEVICE)
    got, want = [], []
    for rows, into in ((tokens, got), (tokens[:n], want)):
        experts.zero_grad()
        out = experts(rows.clone().requires_grad_(), counts)
        (out * grad[: out.shape[0]]).sum().backward()
        into += [out.detach(), experts.w_in.grad.clone(), experts.w_out.grad.clone()]
    assert got[0].shape == (n + 5, 16) and bool((got[0][n:] == 0).all())
    assert torch.equal(got[0][:n], want[0])
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("first", [0, 3, 17, 40])
def test_zero_rows_kernel_matches_reference(first):
    from dispatch.kernels.zero_rows import zero_rows_reference, zero_rows_triton

    rows = torch.randn(17, 300, device=DEVICE)
    index = torch.tensor([first], device=DEVICE)
    assert torch.equal(zero_rows_triton(rows.clone(), index), zero_rows_reference(rows.clone(), index))
