"""The counts rows, defined once (``plan.CountsRow``; the engine's ``Row`` in
csrc/engine.cuh, held by test_engine_launches.py), and every parser of them:
what a rank builds, every rank reads back where it was put."""

from __future__ import annotations

import torch

from dispatch import checks, counts, plan, plan_graph


def _row_parts(world, local, tail, seed=0):
    gen = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 100, (world, 1 + local), generator=gen)
    h = torch.randint(-5, 100, (len(plan.HEADER),), generator=gen)
    t = torch.randint(0, 100, (tail,), generator=gen)
    return c, h, t


def test_a_row_splits_back_into_its_parts():
    world, local, tail = 3, 2, 4
    layout = plan.CountsRow(world, local, tail)
    parts = [_row_parts(world, local, tail, seed=r) for r in range(world)]
    rows = torch.stack([layout.row(*p) for p in parts])
    assert rows.shape == (world, layout.width) and layout.width == world * (1 + local) + len(plan.HEADER) + tail
    all_counts, headers, tails = layout.split(rows)
    for r, (c, h, t) in enumerate(parts):
        assert torch.equal(all_counts[r], c) and torch.equal(headers[r], h) and torch.equal(tails[r], t)


def test_bad_values_raise_the_failed_entry_alone():
    """``checks.fold_flags``: a bad value marks the header failed (at least 1,
    a higher mark kept), nothing else changes; no bad value, nothing changes."""
    failed = plan.HEADER.index("failed")
    header = torch.arange(len(plan.HEADER), dtype=torch.int64) + 10
    for mark in (0, 2):
        header[failed] = mark
        for bad, want in ((False, mark), (True, max(mark, 1))):
            flags = torch.tensor([False, bad, False])
            folded = checks.fold_flags(header, flags)
            assert folded[failed] == want
            keep = torch.arange(len(plan.HEADER)) != failed
            assert torch.equal(folded[keep], header[keep]) and header[failed] == mark  # the input untouched


def test_each_exchange_names_its_row():
    """The alltoall transport's row ends in its group tail, the others' in T, the
    node hits and G: the widths the host channel pairs with."""
    assert plan_graph.counts_row(4, 3).tail == 4 * 2 * 3 + 1
    assert counts.counts_row(4, 3, 2).tail == 1 + 2 + 1


def test_the_plan_summary_reads_back_by_part():
    world, local, rank = 3, 2, 1
    gen = torch.Generator().manual_seed(0)
    route_counts = torch.randint(0, 9, (world, 1 + local), generator=gen)
    all_counts = torch.randint(0, 9, (world, world, 1 + local), generator=gen)
    all_counts[:, 2, 0] = 0  # rank 2 receives no rows
    headers = torch.randint(0, 9, (world, len(plan.HEADER)), generator=gen)
    tails = torch.randint(0, 9, (world, plan_graph.counts_row(world, local).tail), generator=gen)
    own = int(tails[rank, -1]) % local + 1  # this rank's G, in [1, E_local], the last entry of its tail
    tails[rank, -1] = own
    summary = plan_graph.plan_summary(route_counts, all_counts, headers, rank, tails, own)
    got = plan_graph.Summary.read(summary, world, local)
    assert torch.equal(got.send, route_counts[:, 0]) and torch.equal(got.recv, all_counts[:, rank, 0])
    assert torch.equal(got.per_expert, all_counts[:, rank, 1:].sum(0))
    assert torch.equal(plan_graph.Summary.per_expert_of(summary, world, local), got.per_expert)
    assert torch.equal(got.headers, headers) and torch.equal(got.matrix, all_counts[:, :, 0])
    assert torch.equal(got.received, all_counts[:, :, 1:].sum((0, 2)))
    by_group = tails[:, :-1].view(world, world, 2 * local)
    assert torch.equal(got.by_group[0].flatten(), by_group[rank].flatten())
    assert torch.equal(got.by_group[1].flatten(), by_group[:, rank].flatten())
    assert torch.equal(got.groups, tails[:, -1])
    groups = plan.expert_groups(local, own)  # every rank's fullest group by this rank's G
    per_expert = all_counts[:, :, 1:].sum(0)
    fullest = [max(int(per_expert[d, lo:hi].sum()) for lo, hi in zip(groups[:-1], groups[1:])) for d in range(world)]
    assert got.fullest.tolist() == fullest
    # the host path's one read: the same parts as Python ints
    host = plan_graph.HostSummary.read(summary, world, local)
    assert host.send == tuple(got.send.tolist()) and host.recv == tuple(got.recv.tolist())
    assert host.per_expert == got.per_expert.tolist() and torch.equal(host.per_expert_host(), got.per_expert)
    assert host.headers == got.headers.tolist() and host.matrix == got.matrix.tolist()
    assert host.received == got.received.tolist() and host.groups == got.groups.tolist()
    assert host.fullest == got.fullest.tolist()
    assert torch.equal(host.by_group_tensor(world, local), got.by_group)
    assert host.has_rows == tuple(bool(n) for n in got.matrix.sum(0).tolist()) and host.has_rows[2] is False


def test_the_receive_table_of_one_group_on_the_device_is_the_hosts():
    """``plan.one_group_table`` (made with the plan, no host copy) is
    ``plan.recv_table`` of one group."""
    for recv in ([0], [3], [2, 0, 5, 1], [0, 0, 0]):
        want = torch.tensor(plan.recv_table([recv]), dtype=torch.int64)
        assert torch.equal(plan.one_group_table(torch.tensor(recv, dtype=torch.int64)), want)
