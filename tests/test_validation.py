"""Bad input: a clear error naming the argument, raised before any token moves,
right after the call's first message, which carries a rank's refusal to its
peers: on one host the call's agreement on the board (shared memory, no
collective); the counts all-gather for bad values, which only the plan sees.

Every case runs on a world of 2 where all ranks get the same bad input (and the
value cases also where one rank does); a good round trip on the same world
afterwards proves no rank was left inside an exchange (a half-started exchange
would leave the next one mismatched or hung). Mistakes one rank alone makes,
on every verb, are in test_agreement.py.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import dispatch
from dispatch import checks
import rank_fns
from routing import identity_tokens, make_routing

E = 4
GOOD_IDX = torch.tensor([[0, 3], [1, -1], [2, 0]])
GOOD_W = torch.full((3, 2), 0.5)
GOOD_X = identity_tokens(0, 3, 4, torch.float32)
# The collectives these tests count are the NCCL transport's; the NVLink engine's
# refusals (no collective of NCCL's) are in test_nvlink.py.
CFG = dict(num_experts=E, transport="nccl")

DISPATCH_CASES = {
    "x not a tensor": ([[1.0]], GOOD_IDX, GOOD_W, TypeError, "x"),
    "x 1-D": (torch.ones(3), GOOD_IDX, GOOD_W, ValueError, "x"),
    "x integer": (torch.ones(3, 4, dtype=torch.int32), GOOD_IDX, GOOD_W, TypeError, "x"),
    "x hidden 0": (torch.ones(3, 0), GOOD_IDX, GOOD_W, ValueError, "x"),
    "x on a device the backend cannot move": (rank_fns.OnMeta(torch.ones(3, 4)), GOOD_IDX, GOOD_W, ValueError, "x"),
    "topk_idx float": (GOOD_X, GOOD_IDX.float(), GOOD_W, TypeError, "topk_idx"),
    "topk_idx 1-D": (GOOD_X, GOOD_IDX[:, 0], GOOD_W, ValueError, "topk_idx"),
    "topk_idx wrong T": (GOOD_X, GOOD_IDX[:2], GOOD_W[:2], ValueError, "topk_idx"),
    "topk_idx K = 0": (GOOD_X, GOOD_IDX[:, :0], GOOD_W[:, :0], ValueError, "topk_idx"),
    "topk_idx on another device": (GOOD_X, rank_fns.OnMeta(GOOD_IDX), GOOD_W, ValueError, "topk_idx"),
    "expert id too large": (GOOD_X, torch.tensor([[0, 4], [1, -1], [2, 0]]), GOOD_W, ValueError, "topk_idx"),
    "expert id below -1": (GOOD_X, torch.tensor([[0, 3], [-2, -1], [2, 0]]), GOOD_W, ValueError, "topk_idx"),
    "expert twice in a row": (GOOD_X, torch.tensor([[0, 3], [1, -1], [2, 2]]), GOOD_W, ValueError, "topk_idx"),
    "topk_weights integer": (GOOD_X, GOOD_IDX, torch.ones(3, 2, dtype=torch.int64), TypeError, "topk_weights"),
    "topk_weights shape": (GOOD_X, GOOD_IDX, GOOD_W[:, :1], ValueError, "topk_weights"),
    "topk_weights NaN": (GOOD_X, GOOD_IDX, torch.tensor([[0.5, float("nan")], [1, 0], [1, 0]]), ValueError, "topk_weights"),
    "topk_weights inf": (GOOD_X, GOOD_IDX, torch.tensor([[0.5, 1], [float("inf"), 0], [1, 0]]), ValueError, "topk_weights"),
    "topk_weights on another device": (GOOD_X, GOOD_IDX, rank_fns.OnMeta(GOOD_W), ValueError, "topk_weights"),
}


def _good_round_trip_still_works(world):
    routing = make_routing(2, 2, 2, [3, 2], "random", seed=1)
    xs = [identity_tokens(r, t, 4, torch.float32) for r, t in enumerate(routing.num_tokens)]
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), CFG) for r in range(2)]
    results = world.run(rank_fns.round_trip, args)
    for r in range(2):
        live = (routing.topk_idx[r] >= 0).float()
        assert torch.equal(results[r]["combined"], xs[r] * (routing.topk_weights[r].float() * live).sum(1, keepdim=True))


def _assert_error(results, error, argument, collectives=0):
    """Every rank raised ``error`` naming ``argument`` after exactly ``collectives``
    collectives of the dispatcher (0: before any)."""
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank}: no error raised"
        name, message, calls = result
        assert name == error.__name__, f"rank {rank}: raised {name}: {message}"
        assert argument in message, f"rank {rank}: message does not name {argument!r}: {message}"
        assert len(calls) == collectives, f"rank {rank}: raised after collectives {calls}"


# bad values only a rank's own plan sees: raised after the counts all-gather
VALUE_CASES = ("expert id too large", "expert id below -1", "expert twice in a row", "topk_weights NaN",
               "topk_weights inf")


@pytest.mark.parametrize("case", list(DISPATCH_CASES))
def test_dispatch_rejects(worlds, case):
    x, idx, w, error, argument = DISPATCH_CASES[case]
    world = worlds(2)
    results = world.run(rank_fns.error_of, [("call_dispatch", CFG, x, idx, w)] * 2)
    _assert_error(results, error, argument, collectives=int(case in VALUE_CASES))
    _good_round_trip_still_works(world)


@pytest.mark.parametrize("case", [c for c in DISPATCH_CASES if c not in VALUE_CASES])
def test_a_signature_checked_once_lets_no_other_through(worlds, case):
    """A dispatcher checks the types, shapes, dtypes and devices of a dispatch's
    arguments once per signature: after a good round trip, every bad argument
    is still refused by name, on every rank."""
    x, idx, w, error, argument = DISPATCH_CASES[case]
    world = worlds(2)
    results = world.run(rank_fns.error_of, [("call_dispatch_after_good", CFG, (GOOD_X, GOOD_IDX, GOOD_W), x, idx, w)] * 2)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank}: no error raised"
        name, message, _ = result
        assert name == error.__name__ and argument in message, (rank, name, message)
    _good_round_trip_still_works(world)


NO_ROWS = torch.full((3, 2), -1)  # no slot anywhere: max_rows=1 holds on every rank
SECOND_CALLS = {  # (routing, first dispatch's keywords, second's, error, argument)
    "groups True after groups 1": (GOOD_IDX, {}, {"groups": True}, ValueError, "groups"),
    "groups 0": (GOOD_IDX, {}, {"groups": 0}, ValueError, "groups"),
    "groups over E_local": (GOOD_IDX, {}, {"groups": 3}, ValueError, "groups"),
    "max_rows True after max_rows 1": (NO_ROWS, {"max_rows": 1}, {"max_rows": True}, ValueError, "max_rows"),
    "max_rows -1": (GOOD_IDX, {}, {"max_rows": -1}, ValueError, "max_rows"),
    "groups with max_rows off the engine": (GOOD_IDX, {"groups": 2}, {"groups": 2, "max_rows": 10}, ValueError,
                                            "groups"),
}


@pytest.mark.parametrize("case", list(SECOND_CALLS))
def test_a_signature_checked_once_lets_no_other_keywords_through(worlds, case):
    """The same, for the keywords the signature holds (max_rows, groups, their
    types as well as their values): a dispatch that passed does not let a
    second of other keywords through."""
    idx, first, second, error, argument = SECOND_CALLS[case]
    world = worlds(2)
    results = world.run(rank_fns.error_of, [("call_dispatch_twice", CFG, GOOD_X, idx, GOOD_W, first, second)] * 2)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank}: no error raised"
        name, message, _ = result
        assert name == error.__name__ and argument in message, (rank, name, message)
    _good_round_trip_still_works(world)


@pytest.mark.parametrize("case", VALUE_CASES)
@pytest.mark.parametrize("layer", [dict(variant="alltoall"), dict(variant="allgather"),
                                   dict(variant="hierarchical", local_world_size=1), dict(variant="auto"),
                                   dict(variant="alltoall", groups=2),
                                   dict(variant="allgather", groups=2),
                                   dict(variant="hierarchical", local_world_size=2, groups=2),
                                   dict(variant="alltoall", capacity_factor=0.1)],
                         ids=lambda layer: "-".join(f"{k}={v}" for k, v in layer.items()))
def test_bad_values_on_one_rank_stop_every_rank(worlds, case, layer):
    """Rank 1 alone has bad values: it raises their ValueError and rank 0, which
    has good ones, raises a RuntimeError naming rank 1, both right after the
    counts all-gather (one collective, no token moved); nobody waits for a
    peer. For dispatch in every variant and for MoEExchange, by groups or not;
    with token dropping, whose capacity would drop the second of a repeated id."""
    x, idx, w, error, argument = DISPATCH_CASES[case]
    config = dict(CFG, variant=layer["variant"], local_world_size=layer.get("local_world_size"),
                  capacity_factor=layer.get("capacity_factor"))
    options = {k: v for k, v in layer.items() if k == "groups"}
    call = ("call_layer_as", config, options) if options else ("call_dispatch_as", config)
    world = worlds(2)
    results = world.run(rank_fns.error_of, [(*call, [(GOOD_X, GOOD_IDX, GOOD_W), (x, idx, w)])] * 2)
    assert None not in results, results
    (name, message, calls), (bad_name, bad_message, bad_calls) = results
    assert bad_name == error.__name__ and argument in bad_message, (bad_name, bad_message)
    row = int(checks.bad_rows(idx, w, E).any(0).nonzero()[0])  # the row named, as given (no slot of it dropped)
    assert str((w if "weights" in argument else idx)[row].tolist()) in bad_message, bad_message
    assert name == "PeerRefused" and "rank(s) [1]" in message, (name, message)
    assert calls == bad_calls, (calls, bad_calls)  # both stop at the same collective, no peer left waiting
    assert calls == ["all_gather_rows"], calls  # one plan, by groups or not: the counts all-gather alone
    _good_round_trip_still_works(world)


@pytest.mark.parametrize("case", VALUE_CASES)
@pytest.mark.parametrize("variant", ["auto", "alltoall"])
def test_bad_values_at_a_later_dispatch_stop_every_rank(worlds, case, variant):
    """As above at a dispatcher's second dispatch, which ``variant="auto"`` does
    not choose at (its first dispatch checked the values in its choice's
    exchange; the calls between are checked as any variant's)."""
    x, idx, w, error, argument = DISPATCH_CASES[case]
    config = dict(CFG, variant=variant)
    good = (GOOD_X, GOOD_IDX, GOOD_W)
    results = worlds(2).run(rank_fns.error_of, [("call_dispatch_later_as", config, [good, (x, idx, w)], good)] * 2)
    assert None not in results, results
    (name, message, _), (bad_name, bad_message, _) = results
    assert bad_name == error.__name__ and argument in bad_message, (bad_name, bad_message)
    assert name == "PeerRefused" and "rank(s) [1]" in message, (name, message)


COMBINE_CASES = {
    "expert_out wrong rows": (torch.ones(1, 4), None, ValueError, "expert_out"),
    "expert_out 1-D": (torch.ones(4), None, ValueError, "expert_out"),
    "expert_out integer": (torch.ones(1, 4, dtype=torch.int64), None, TypeError, "expert_out"),
    "weights wrong length": ("same", torch.ones(1000), ValueError, "weights"),
    "weights 2-D": ("same", torch.ones(3, 3), ValueError, "weights"),
}


@pytest.mark.parametrize("case", list(COMBINE_CASES))
def test_combine_rejects(worlds, case):
    expert_out, weights, error, argument = COMBINE_CASES[case]
    world = worlds(2)
    results = world.run(
        rank_fns.error_of, [("call_combine", CFG, GOOD_X, GOOD_IDX, GOOD_W, expert_out, weights)] * 2
    )
    # the dispatch inside call_combine communicates (successfully: one all-gather,
    # two all-to-alls) before combine rejects its input on every rank, at its
    # agreement on the board.
    _assert_error(results, error, argument, collectives=3)
    _good_round_trip_still_works(world)


@pytest.mark.parametrize("case", list(COMBINE_CASES))
def test_a_combine_signature_checked_once_lets_no_other_through(worlds, case):
    """A combine's checks are kept per signature too: after a good round trip
    on the same dispatcher, each bad combine argument is still refused by name."""
    expert_out, weights, error, argument = COMBINE_CASES[case]
    world = worlds(2)
    results = world.run(rank_fns.error_of, [("call_combine_after_good", CFG, GOOD_X, GOOD_IDX, GOOD_W, expert_out,
                                              weights)] * 2)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank}: no error raised"
        name, message, _ = result
        assert name == error.__name__ and argument in message, (rank, name, message)
    _good_round_trip_still_works(world)


def test_combine_rejects_foreign_handle(worlds):
    results = worlds(2).run(rank_fns.error_of, [("call_foreign_handle", CFG, GOOD_X, GOOD_IDX, GOOD_W)] * 2)
    _assert_error(results, ValueError, "handle", collectives=3)


@pytest.mark.parametrize(
    "config, error, argument",
    [
        (dict(num_experts=3), ValueError, "num_experts"),  # not a multiple of W = 2
        (dict(num_experts=4, local_world_size=3), ValueError, "local_world_size"),
    ],
)
def test_config_must_match_group(worlds, config, error, argument):
    _assert_error(worlds(2).run(rank_fns.error_of, [("call_create", config)] * 2), error, argument)


def test_group_not_a_group_or_without_this_rank(worlds):
    # the collectives: no engine is made (engines made on some ranks only put their
    # symmetric-memory rendezvous out of step with the others': see the README)
    config = dict(num_experts=4, transport="nccl")
    results = worlds(2).run(rank_fns.error_of, [("call_create_in_group", config, None)] * 2)
    _assert_error(results, TypeError, "group", collectives=0)
    results = worlds(2).run(rank_fns.error_of, [("call_create_in_group", config, [0])] * 2)
    assert results[0] is None, results[0]  # a member: a group of one
    kind, message, calls = results[1]
    assert kind == "ValueError" and message.startswith("group:") and "rank 1" in message and not calls, results[1]


def _strided_round_trip(x, topk_idx, topk_weights, variant="alltoall"):
    """A round trip of x, topk_idx and topk_weights as strided and overlapping
    (stride-0) views, and of their contiguous copies."""
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(num_experts=4, variant=variant))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    views = (x[:, ::2], x[:1].expand(x.shape[0], -1)), topk_idx.t().contiguous().t(), topk_weights[:, :1].expand(
        -1, topk_idx.shape[1])
    out = []
    for x_view in views[0]:
        for args in ((x_view, views[1], views[2]), (x_view.contiguous(), views[1].contiguous(),
                                                    views[2].contiguous())):
            got = d.dispatch(*args)
            out.append((got.tokens, got.weights, d.combine(got.tokens * 2, got.handle, weights=got.weights)))
    return out


@pytest.mark.parametrize("variant", ["alltoall", "allgather", "hierarchical", "auto"])
@pytest.mark.parametrize("tokens", [6, 1])
def test_strided_and_overlapping_inputs_move_like_their_copies(worlds, variant, tokens):
    """Not refused: non-contiguous and overlapping (expanded) inputs are read as
    their contiguous copies, every variant (one token: a strided row flattens to
    a strided view)."""
    x = torch.randn(6, 8)[:tokens]
    idx = torch.tensor([[0, 3], [1, -1], [2, 1], [3, 0], [0, 2], [1, 3]])[:tokens]
    w = torch.rand(6, 2)[:tokens]
    for got in worlds(2).run(_strided_round_trip, [(x, idx, w, variant)] * 2):
        for view, copy in (got[0:2], got[2:4]):
            assert all(torch.equal(a, b) for a, b in zip(view, copy))


@pytest.mark.parametrize(
    "kwargs, error, argument",
    [
        (dict(num_experts=0), ValueError, "num_experts"),
        (dict(num_experts=2.0), TypeError, "num_experts"),
        (dict(num_experts=4, variant="nope"), ValueError, "variant"),
        (dict(num_experts=4, dispatch_wire="fp4"), ValueError, "dispatch_wire"),
        (dict(num_experts=4, combine_wire="int8"), ValueError, "combine_wire"),
        (dict(num_experts=4, dispatch_grad_wire="fp4"), ValueError, "dispatch_grad_wire"),
        (dict(num_experts=4, combine_grad_wire="int8"), ValueError, "combine_grad_wire"),
        (dict(num_experts=4, local_world_size=0), ValueError, "local_world_size"),
        (dict(num_experts=4, check_inputs="yes"), TypeError, "check_inputs"),
        (dict(num_experts=4, plan_graphs=1), TypeError, "plan_graphs"),
        (dict(num_experts=4, transport="peer_copy"), ValueError, "transport"),
        (dict(num_experts=4, variant="allgather", transport="nvlink"), ValueError, "transport"),
        (dict(num_experts=4, sm_budget=0), ValueError, "sm_budget"),
        (dict(num_experts=4, timeout=0), ValueError, "timeout"),
        (dict(num_experts=4, chunks=2), TypeError, "chunks"),  # an unknown option, named
        (dict(num_experts=4, sm_budget=8, tuning=dispatch.Tuning()), TypeError, "sm_budget"),  # both ways at once
        (dict(num_experts=4, tuning={"sm_budget": 8}), TypeError, "tuning"),
    ],
)
def test_config_validates_itself(kwargs, error, argument):
    with pytest.raises(error, match=argument):
        dispatch.DispatchConfig.from_options(**kwargs)


def test_flat_options_split_into_the_config_and_its_tuning():
    cfg = dispatch.DispatchConfig.from_options(num_experts=4, variant="allgather", sm_budget=8, check_inputs=False)
    assert cfg == dispatch.DispatchConfig(num_experts=4, variant="allgather",
                                          tuning=dispatch.Tuning(sm_budget=8, check_inputs=False))
    assert dispatch.DispatchConfig.from_options(num_experts=4, tuning=None, sm_budget=8).tuning.sm_budget == 8
    assert dispatch.DispatchConfig(num_experts=4).tuning == dispatch.Tuning()
    assert len(dataclasses.fields(dispatch.DispatchConfig)) <= 12  # what a user chooses; the rest is Tuning


def test_create_needs_a_config():
    with pytest.raises(TypeError, match="config"):
        dispatch.create({"num_experts": 4})


PEER_CASES = {
    "K differs": ((GOOD_X, GOOD_IDX, GOOD_W), (GOOD_X, GOOD_IDX[:, :1], GOOD_W[:, :1]), "topk_idx"),
    "H differs": ((GOOD_X, GOOD_IDX, GOOD_W), (torch.ones(3, 6), GOOD_IDX, GOOD_W), "x"),
    "x dtype differs": ((GOOD_X, GOOD_IDX, GOOD_W), (GOOD_X.double(), GOOD_IDX, GOOD_W), "x"),
    "weights dtype differs": ((GOOD_X, GOOD_IDX, GOOD_W), (GOOD_X, GOOD_IDX, GOOD_W.double()), "topk_weights"),
}


@pytest.mark.parametrize("case", list(PEER_CASES))
def test_ranks_that_disagree_are_refused_alike(worlds, case):
    """What no rank can see alone is checked in the counts all-gather: every rank
    raises the same error before any token moves, and the world stays usable."""
    first, second, argument = PEER_CASES[case]
    world = worlds(2)
    results = world.run(rank_fns.error_of, [("call_dispatch_as", CFG, [first, second])] * 2)
    _assert_error(results, ValueError, argument, collectives=1)
    _good_round_trip_still_works(world)


def test_both_headers_put_each_column_where_HEADER_names_it():
    """plan.header (a dispatch) and plan.call_header (any other call's agreement)
    write the call, its refusal and the budgets in HEADER's columns by name."""
    from dispatch.plan import HEADER, Ticket, call_header, header

    ticket = Ticket(verb=2, call=7, along=5, refused=True, max_rows=40, memory_rows=90)
    x, w = torch.ones(3, 6, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.float64)
    full, bare = dict(zip(HEADER, header(x, w, 2, ticket))), dict(zip(HEADER, call_header(ticket, dtype_code=3)))
    for row in (full, bare):
        assert (row["verb"], row["call"], row["along"], row["failed"]) == (2, 7, 5, 1)
    assert (full["topk"], full["hidden"], full["x_dtype"], full["weights_dtype"]) == (2, 6, 1, 3)
    assert (full["max_rows"], full["memory_rows"]) == (40, 90)
    assert (bare["x_dtype"], bare["weights_dtype"], bare["max_rows"], bare["memory_rows"]) == (3, -1, -1, -1)
    assert len(full) == len(bare) == len(HEADER)


def test_peer_header_checks_read_lists_as_tensors():
    """checks.check_peer_headers / check_row_budgets take every rank's header as a host
    tensor (the NCCL plan) or as lists (the NVLink engine's host read) alike: the same
    answer, the same refusals."""
    from dispatch import checks
    from dispatch.plan import HEADER

    def header(**values):
        row = [0] * len(HEADER)
        row[HEADER.index("topk")], row[HEADER.index("hidden")] = 2, 8
        row[HEADER.index("max_rows")] = row[HEADER.index("memory_rows")] = -1
        for name, value in values.items():
            row[HEADER.index(name)] = value
        return row

    agree = [header(x_grad=1), header(weights_grad=0)]
    for form in (agree, torch.tensor(agree)):
        assert checks.check_peer_headers(form) == (True, False)
        checks.check_row_budgets(form, [5, 7], 16)
    cases = [([header(), header(failed=1)], RuntimeError, "rank(s) [1]", None),
             ([header(), header(hidden=4)], ValueError, "H (columns of x) (rank 0: 8, rank 1: 4)", None),
             ([header(x_dtype=3), header(x_dtype=2)], ValueError, "dtype of x (rank 0: float64, rank 1: float32)",
              None),
             ([header(weights_dtype=1), header()], ValueError, "rank 0: bfloat16, rank 1: float16", None),
             ([header(max_rows=4), header()], ValueError, "over its max_rows=4", [5, 7]),
             ([header(), header(memory_rows=6)], ValueError, "holds 6", [5, 7])]
    for rows, error, words, received in cases:
        for form in (rows, torch.tensor(rows)):
            with pytest.raises(error, match=re.escape(words)):
                if received is None:
                    checks.check_peer_headers(form)
                else:
                    checks.check_row_budgets(form, received, 16)


def test_rows_off_the_dispatchs_device_refused_by_name():
    """The verbs along a handle hold their rows to the dispatch's device
    (``CombineHandle.device``): an engine's kernel would read another GPU's
    memory through its address. The checks name the argument and both devices;
    on the dispatch's device, or with no device given, they pass."""
    from dispatch import checks

    rows, values, cpu = torch.zeros(3, 4), torch.zeros(3), frozenset({"cpu"})
    elsewhere = torch.device("meta")
    with pytest.raises(ValueError, match=r"expert_out is on cpu but must be on meta, the device of the dispatch's x"):
        checks.check_combine_inputs(rows, None, 3, cpu, device=elsewhere)
    with pytest.raises(ValueError, match=r"rows is on cpu but must be on meta"):
        checks.check_rows("rows", rows, 3, "the dispatch had", cpu, elsewhere)
    with pytest.raises(ValueError, match=r"values is on cpu but must be on meta"):
        checks.check_values("values", values, 3, cpu, elsewhere)
    checks.check_combine_inputs(rows, values, 3, cpu, device=torch.device("cpu"))
    checks.check_rows("rows", rows, 3, "the dispatch had", cpu)
    checks.check_values("values", values, 3, cpu, torch.device("cpu"))
