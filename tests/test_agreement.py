"""One rank's own mistake reaches every rank at once, and no call completes by
pairing with another call.

A rank that refuses its own arguments (a dtype, a shape, a device, rows of
another dispatch than its handle's, another dispatcher's handle) still takes
part in the call's first message, marked refused: it raises its own error, every
peer a ``PeerRefused`` (a RuntimeError) naming it, at once, and the dispatcher
is usable on every rank afterwards. Ranks at different calls (one skipped a
call) all raise, naming the ranks and both calls. A rank whose experts raise
(``MoEExchange``), or whose own loop hands its error to ``refuse``, takes part
in its peers' next call refused, alike. Over the NCCL transport's variants on
gloo worlds of 2 to 4 ranks, the calls agreed on the board (ranks on one host;
its agreement in Python and compiled) and over the host channel (a gloo
collective, as ranks on several hosts agree), and the NVLink engine's share on
2 GPUs; a peer that dies or never arrives is also in test_peer_failure.py
(fresh processes).
"""

from __future__ import annotations

import functools

import pytest

import agreement_fns
import world
from shared_gpu import engine_ranks

ALONG = ("combine", "combine_rows", "dispatch_rows", "combine_slots", "combine_groups")
MISTAKES = {
    "dispatch": ("dtype", "shape", "device", "layout", "layout after a dense call"),
    **{verb: ("dtype", "shape", "device", "rows versus handle", "handle") for verb in ALONG},
}
MISTAKES["combine"] += ("layout", "layout after a dense call")  # a sparse tensor
ERRORS = {"dtype": "TypeError", "shape": "ValueError", "device": "ValueError", "rows versus handle": "ValueError",
          "handle": "ValueError", "layout": "TypeError", "layout after a dense call": "TypeError"}
SOON = 5.0  # seconds: peers raise at the call's first message, not at the timeout (60 s by default)


BOARDS = ("board", "compiled board", "host channel")


def _fn(name: str, board: str):
    """The rank function ``name`` of agreement_fns on the board in Python, the
    compiled board, or the host channel (``agreement_fns.on_board``)."""
    if board == "compiled board":
        _needs_compiled()
    return functools.partial(agreement_fns.on_board, board, name)


def _needs_compiled() -> None:
    from dispatch import host

    if host.built() is None:
        pytest.skip("the compiled host path does not build here (no C++ compiler, ninja or cuda.h)")


def _check(results, mistake: str, bad_rank: int) -> None:
    """The rank that made the mistake raised its own error; every other rank a
    PeerRefused naming it, soon; the dispatcher worked afterwards on every rank."""
    for rank, (name, message, elapsed, usable) in enumerate(results):
        if rank == bad_rank:
            assert name == ERRORS[mistake], (rank, name, message)
        else:
            assert name == "PeerRefused" and f"rank(s) [{bad_rank}]" in message, (rank, name, message)
        assert elapsed < SOON, (rank, elapsed)
        assert usable, f"rank {rank}: the round trip after the refusal went wrong"


@pytest.mark.parametrize("verb, mistake", [(v, m) for v, ms in MISTAKES.items() for m in ms])
@pytest.mark.parametrize("bad_rank", [0, 2])
def test_one_ranks_mistake_stops_every_rank_at_once(worlds, verb, mistake, bad_rank):
    config = dict(num_experts=agreement_fns.E, transport="nccl")
    results = worlds(3).run(agreement_fns.one_rank_mistake, [(config, verb, mistake, bad_rank)] * 3)
    _check(results, mistake, bad_rank)


@pytest.mark.parametrize("verb, mistake", [(v, ms[0]) for v, ms in MISTAKES.items()])
def test_one_ranks_mistake_stops_every_rank_at_once_on_the_compiled_board(worlds, verb, mistake):
    """The compiled agreement (``board_agree``: as a process with CUDA, or a host
    other than x86-64, agrees), on the same words."""
    config = dict(num_experts=agreement_fns.E, transport="nccl")
    results = worlds(3).run(_fn("one_rank_mistake", "compiled board"), [(config, verb, mistake, 1)] * 3)
    _check(results, mistake, 1)


VARIANTS = {
    "allgather": dict(variant="allgather"),
    "hierarchical": dict(variant="hierarchical", local_world_size=2),
    "auto": dict(variant="auto"),
    "alltoall-pad": dict(variant="alltoall", capacity_factor=1.0, pad_to_capacity=True),
}


SOME = [("dispatch", "dtype"), ("dispatch", "device"), ("combine", "shape"), ("combine_rows", "handle"),
        ("dispatch_rows", "rows versus handle"), ("combine_slots", "dtype"), ("combine_groups", "shape")]


def test_a_layers_mistake_stops_every_rank_at_once(worlds):
    """``MoEExchange`` leaves its arguments' checks to its dispatch, within the
    call's agreement: one rank's bad x stops every rank at once."""
    config = dict(num_experts=agreement_fns.E, transport="nccl")
    _check(worlds(3).run(agreement_fns.moe_layer_mistake, [(config, 1)] * 3), "dtype", 1)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("mistake, error", [("shape", "ValueError"), ("dtype", "TypeError"),
                                            ("not a tensor", "TypeError")])
def test_a_layers_expert_mistake_stops_every_rank_at_once(worlds, mistake, error, groups):
    """``MoEExchange`` checks its experts' rows within the agreement of the add
    that sums them home (``GroupSums.add``): one rank's experts answering rows of
    another shape, a dtype that is not floating or no tensor stop every rank at
    once, that rank with an error naming the experts, its peers with
    ``PeerRefused`` (they wait for none in an exchange)."""
    config = dict(num_experts=agreement_fns.E, transport="nccl")
    results = worlds(2).run(agreement_fns.moe_experts_mistake, [(config, mistake, groups, 1)] * 2)
    for rank, (name, message, elapsed, usable) in enumerate(results):
        if rank == 1:
            assert name == error and "the experts' rows of group" in message, (rank, name, message)
        else:
            assert name == "PeerRefused" and "rank(s) [1]" in message, (rank, name, message)
        assert elapsed < SOON, (rank, elapsed)
        assert usable, f"rank {rank}: the round trip after the refusal went wrong"


@pytest.mark.parametrize("verb", [*ALONG, "GroupSums.add", "dispatch"])
def test_an_error_handed_to_refuse_stops_every_rank_at_once(worlds, verb):
    """A rank whose own loop fails before its next call hands the error to
    ``d.refuse(verb, handle, error)`` (``sums.refuse(error)`` for an add;
    ``d.refuse("dispatch", None, error)`` before a dispatch): it
    raises that error, its peers ``PeerRefused`` naming it at that call, at
    once; the dispatcher works afterwards."""
    config = dict(num_experts=agreement_fns.E, transport="nccl", timeout=30.0)
    for rank, (name, message, elapsed, usable) in enumerate(worlds(2).run(agreement_fns.refused_by_hand,
                                                                           [(config, verb, 0)] * 2)):
        if rank == 0:
            assert name == "RuntimeError" and "own loop failed" in message, (rank, name, message)
        else:
            named = "refused dispatch #2 " if verb == "dispatch" else verb  # (after the first dispatch, #1)
            assert name == "PeerRefused" and "rank(s) [0]" in message and named in message, (rank, name, message)
        assert elapsed < SOON and usable, (rank, elapsed, usable)


def test_a_dispatch_waited_for_in_another_grad_mode_keeps_the_agreed_one(worlds):
    """``DispatchWork.wait()`` under ``no_grad`` on one rank of a dispatch started
    with grad on: its node is made in the mode the call was agreed in, so every
    rank's backward pairs (x's gradient on each), at once."""
    config = dict(num_experts=agreement_fns.E, transport="nccl", timeout=30.0)
    for rank, (has_grad, elapsed, usable) in enumerate(worlds(2).run(agreement_fns.wait_in_another_grad_mode,
                                                                     [(config, 0)] * 2)):
        assert has_grad and elapsed < SOON and usable, (rank, has_grad, elapsed, usable)


def test_refuse_names_a_dispatch_or_a_call_along_a_handle():
    """``refuse`` takes a dispatch (with no handle) or a verb that moves rows
    along a handle, checked on this rank before any agreement."""
    import types

    from dispatch.dispatcher import TokenDispatcher

    me = types.SimpleNamespace(_check_handle=lambda handle: None)
    for verb, handle in (("bogus", None), ("dispatch", object()), ("combine_all", object())):
        with pytest.raises(ValueError, match=r"verb must be dispatch \(handle None\) or name a call along a handle"):
            TokenDispatcher.refuse(me, verb, handle, RuntimeError("x"))


@pytest.mark.parametrize("groups, bad_group", [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize("where, grads", [("forward", "both"), ("backward", "both"), ("backward", "x"),
                                          ("backward", "weights"), ("backward", "none")])
def test_a_layers_experts_raising_on_one_rank_stop_every_rank_at_once(worlds, groups, bad_group, where, grads):
    """``MoEExchange``: one rank's experts raising an error of their own (forward,
    or backward with the gradients of x, of the routing weights or both) make
    that rank take part in the next call its peers wait at, refused
    (``GroupSums.refuse``, ``TokenDispatcher.refuse``): it raises its error, its
    peers ``PeerRefused`` naming it, at once (not at the timeout), and the
    dispatcher works afterwards on every rank. Where only the experts'
    parameters want gradients, no exchange follows the experts' backward: the
    peers finish theirs, and the rank raises alone."""
    config = dict(num_experts=agreement_fns.E, transport="nccl", timeout=30.0)
    results = worlds(2).run(agreement_fns.moe_experts_raise, [(config, groups, 1, bad_group, where, grads)] * 2)
    for rank, (name, message, elapsed, usable) in enumerate(results):
        if rank == 1:
            assert name == "RuntimeError" and "the experts" in message and "failed on this rank" in message, \
                (rank, name, message)
        elif grads == "none":
            assert name is None, (rank, name, message)
        else:
            assert name == "PeerRefused" and "rank(s) [1]" in message, (rank, name, message)
        assert elapsed < SOON, (rank, elapsed)
        assert usable, f"rank {rank}: the round trip after the refusal went wrong"


@pytest.mark.parametrize("board", BOARDS)
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("variant", ["alltoall", "allgather"])
def test_adds_of_two_combines_in_another_order_stop_every_rank(worlds, variant, groups, board):
    """Two ``combine_groups`` along one handle whose adds one rank makes in the
    other order (B before A): each add names its combine in its agreement, so
    the adds do not pair crosswise (the sums were silently wrong); every rank
    raises CallsDiffer naming both combines, and the dispatcher stays usable."""
    config = dict(num_experts=agreement_fns.E, transport="nccl", variant=variant)
    fn = _fn("crosswise_adds", board)
    results = worlds(2).run(fn, [(config, groups, 1)] * 2)
    for rank, (name, message, right, usable) in enumerate(results):
        assert name == "CallsDiffer", (rank, name, message, right)
        assert "rank(s) [0] at GroupSums.add #1 of combine_groups #1" in message, message
        assert "rank(s) [1] at GroupSums.add #1 of combine_groups #2" in message, message
        assert usable, f"rank {rank}: the round trip after the crossed adds went wrong"


def _cases(variants):
    """(variant, verb, mistake) of SOME on each variant (a pad_to_capacity dispatch moves as one group)."""
    return [(v, verb, m) for v in variants for verb, m in SOME if not (v == "alltoall-pad" and verb == "combine_groups")]


@pytest.mark.parametrize("variant, verb, mistake", _cases(VARIANTS))
@pytest.mark.parametrize("world", [2, 4])
def test_every_variant_agrees_on_refusals(worlds, variant, verb, mistake, world):
    config = dict(num_experts=agreement_fns.E, transport="nccl", **VARIANTS[variant])
    bad_rank = world - 1
    results = worlds(world).run(agreement_fns.one_rank_mistake, [(config, verb, mistake, bad_rank)] * world)
    _check(results, mistake, bad_rank)


@pytest.mark.skipif(not engine_ranks(2), reason="needs 2 CUDA devices (or one shared) and CuPy")
@pytest.mark.parametrize("verb, mistake", SOME)
def test_the_engine_agrees_on_refusals(worlds, verb, mistake):
    """The NVLink engine's share: the same refusals on a world of 2 GPUs."""
    config = dict(num_experts=agreement_fns.E, transport="nvlink")
    results = worlds(2).run(agreement_fns.one_rank_mistake, [(config, verb, mistake, 1)] * 2)
    _check(results, mistake, 1)


@pytest.mark.parametrize("variant, verb, mistake", _cases(["alltoall", "allgather", "alltoall-pad"]))
def test_refusals_agree_over_the_host_channel_without_a_board(worlds, variant, verb, mistake):
    config = dict(num_experts=agreement_fns.E, transport="nccl", **VARIANTS.get(variant, dict(variant=variant)))
    results = worlds(3).run(_fn("one_rank_mistake", "host channel"), [(config, verb, mistake, 1)] * 3)
    _check(results, mistake, 1)


@pytest.mark.parametrize("board", BOARDS)
@pytest.mark.parametrize("variant", ["alltoall", "allgather"])
def test_a_skipped_call_stops_every_rank_naming_both_calls(worlds, variant, board):
    """Rank 1 skips the combine_rows along dispatch #1 and makes the one along
    dispatch #2: every rank raises, naming the ranks and both calls."""
    config = dict(num_experts=agreement_fns.E, transport="nccl", variant=variant)
    fn = _fn("skipped_call", board)
    results = worlds(3).run(fn, [(config, 1)] * 3)
    for rank, (name, message) in enumerate(results):
        assert name == "CallsDiffer", (rank, name, message)
        assert "rank(s) [0, 2] at combine_rows #1 along dispatch #1" in message, message
        assert "rank(s) [1] at combine_rows #1 along dispatch #2" in message, message


ROWS = [("combine", "dtype"), ("combine", "width"), ("combine_rows", "dtype"), ("combine_rows", "width"),
        ("dispatch_rows", "dtype"), ("dispatch_rows", "width"), ("combine_slots", "dtype"),
        ("combine_groups", "dtype"), ("combine_groups", "none"), ("GroupSums.add", "width"), ("dispatch_rows", "wire"),
        ("combine_rows", "wire"), ("combine_groups", "wire")]
ROWS_NAMED = {"combine": "expert_out", "combine_slots": "values", "combine_groups": "dtype"}


@pytest.mark.parametrize("variant", ["alltoall", "allgather"])
@pytest.mark.parametrize("verb, what", [(v, w) for v in ("combine", "combine_rows") for w in ("weights", "no weights")])
def test_ranks_whose_weights_differ_all_raise_before_any_row_moves(worlds, variant, verb, what):
    """Weights of another dtype on one rank (fp64 sums there, which the
    all-gather variant moves another way: a hang), or none there: every rank
    raises at the call's agreement naming weights; the dispatcher stays usable."""
    config = dict(num_experts=agreement_fns.E, transport="nccl", variant=variant)
    results = worlds(3).run(agreement_fns.rows_differ, [(config, verb, what, 1)] * 3)
    for rank, (name, message, elapsed, usable) in enumerate(results):
        assert name == "ValueError" and "weights: the ranks' weights differ" in message, (rank, name, message)
        assert elapsed < SOON, (rank, elapsed)
        assert usable, f"rank {rank}: the round trip after the refusal went wrong"


@pytest.mark.parametrize("verb, what", ROWS)
def test_ranks_whose_rows_differ_all_raise_before_any_row_moves(worlds, verb, what):
    """Rows that each rank's own checks pass but that differ between the ranks
    (a dtype, a width H', the wire they travel in; the wire carries none of
    them: summed as they are, they were garbage or a crash in the collective)
    are refused by every rank at the call's agreement, naming the argument;
    the dispatcher stays usable."""
    config = dict(num_experts=agreement_fns.E, transport="nccl")
    results = worlds(3).run(agreement_fns.rows_differ, [(config, verb, what, 1)] * 3)
    differ = f"{ROWS_NAMED.get(verb, 'rows')}: the ranks' rows have different {'widths' if what == 'width' else 'dtypes'}"
    if what == "wire":
        differ = "wire: the ranks of the group chose different ones"
    for rank, (name, message, elapsed, usable) in enumerate(results):
        assert name == "ValueError" and differ in message, (rank, name, message)
        assert elapsed < SOON, (rank, elapsed)
        assert usable, f"rank {rank}: the round trip after the refusal went wrong"


@pytest.mark.parametrize("board", BOARDS)
def test_a_call_on_another_dispatcher_leaves_the_ranks_in_step(worlds, board):
    """Rank 1 combines on a second dispatcher of the group (with the first's
    handle) while its peers combine on the first: every rank raises, naming
    both dispatchers (which the call's header carries, over the host channel
    too), and none counts the call, so the next round trip on the first
    dispatcher pairs every rank's calls again."""
    config = dict(num_experts=agreement_fns.E, transport="nccl")
    fn = _fn("other_dispatchers_call", board)
    results = worlds(3).run(fn, [(config, 1)] * 3)
    for rank, (name, message, elapsed, usable) in enumerate(results):
        assert name == "CallsDiffer" and "different dispatchers" in message, (rank, name, message)
        assert usable, f"rank {rank}: the round trip after the different calls went wrong"


@pytest.mark.skipif(world.default_backend(2) != "gloo", reason="the CPU (gloo) side")
@pytest.mark.parametrize("kind", ["dispatch", "create"])
def test_calls_of_other_shapes_over_the_host_channel_pair_and_differ(worlds, kind):
    """Off the board over gloo, a dispatch on a dispatcher of other shapes, or
    a create, beside a peer's call: the calls' agreements are of one width and
    a dispatch agrees before its counts exchange, so the messages pair (gloo
    aborted the process where a counts exchange met an agreement of another
    width) and every rank raises CallsDiffer; the ranks stay in step."""
    config = dict(num_experts=agreement_fns.E, transport="nccl")
    results = worlds(2).run(agreement_fns.calls_of_other_shapes, [(config, 1, kind)] * 2)
    for rank, (name, message, elapsed, usable) in enumerate(results):
        assert name == "CallsDiffer", (rank, name, message)
        assert usable, f"rank {rank}: the round trip after the different calls went wrong"


@pytest.mark.parametrize("board", [*BOARDS, "auto, host channel"])
def test_an_extra_call_beside_a_dispatch_leaves_the_ranks_in_step(worlds, board):
    """Rank 1 makes a combine_rows while its peers dispatch (off the board the
    dispatch's counts exchange meets it; on auto its own agreement, whose rows
    its alltoall's counts exchange would not match): every rank raises
    CallsDiffer, none counts its call, and the next round trip pairs every
    rank's calls again."""
    config = dict(num_experts=agreement_fns.E, transport="nccl")
    fn = agreement_fns.extra_call_on_auto_without_board if board.startswith("auto") else _fn("extra_call", board)
    results = worlds(3).run(fn, [(config, 1)] * 3)
    for rank, (name, message, elapsed, usable) in enumerate(results):
        assert name == "CallsDiffer", (rank, name, message)
        assert usable, f"rank {rank}: the round trip after the extra call went wrong"


@pytest.mark.parametrize("verb", ["dispatch", "combine"])
def test_ranks_whose_grad_modes_differ_all_raise_at_the_call(worlds, verb):
    """A rank that dispatches (or combines) with grad mode off while its peers
    have it on would leave them waiting in the backward; every rank raises at
    that very call instead, naming it, and none counts it."""
    config = dict(num_experts=agreement_fns.E, transport="nccl")
    results = worlds(3).run(agreement_fns.grad_modes_differ, [(config, verb, 1)] * 3)
    for rank, (name, message, elapsed, usable) in enumerate(results):
        assert name == "CallsDiffer" and f"rank(s) [1] at {verb} #" in message and "grad mode off" in message, \
            (rank, name, message)
        assert usable, f"rank {rank}: the round trip after the different grad modes went wrong"


@pytest.mark.parametrize("kind", ["dispatchers", "create"])
def test_fixed_host_rows_pair_calls_apart_and_tell_them(worlds, kind):
    """Beside NCCL the host channel carries only agreements, in rows of one
    shape for every dispatcher and for create's agreement on the config: ranks
    at calls of two dispatchers (of other shapes), or one creating a
    dispatcher while another calls, pair and all raise CallsDiffer naming both
    (rows of each dispatcher's own shape would abort gloo)."""
    results = worlds(2).run(agreement_fns.fixed_rows_apart, [(kind,)] * 2)
    want = "different dispatchers" if kind == "dispatchers" else "dispatch.create #"
    for rank, (name, message) in enumerate(results):
        assert name == "CallsDiffer" and want in message, (rank, name, message)


@pytest.mark.parametrize("field, value", [("num_experts", 24), ("num_experts", 13), ("variant", "hierarchical"),
                                          ("combine_wire", "bf16"), ("pad_to_capacity", True), ("timeout", 30.0)])
def test_ranks_that_create_with_different_configs_all_raise_naming_the_field(worlds, field, value):
    """A rank whose config differs (here one that would make other collectives
    at creation, or none, or move other bytes) makes every rank raise at
    ``create``, naming the field and each rank's value, before anything else
    is exchanged; a dispatcher made next with one config works."""
    config = dict(num_experts=agreement_fns.E, transport="nccl", capacity_factor=4.0)
    results = worlds(3).run(agreement_fns.configs_differ, [(config, 2, field, value)] * 3)
    for rank, (name, message, elapsed, usable) in enumerate(results):
        assert name == "ValueError" and f"{field} (rank 0: " in message and "rank 2: " in message, (rank, message)
        assert elapsed < SOON, (rank, elapsed)
        assert usable, f"rank {rank}: the dispatcher made after the refusal went wrong"


def test_configs_equal_but_written_apart_agree(worlds):
    """A capacity factor of 4 on one rank and 4.0 on the others is one config."""
    config = dict(num_experts=agreement_fns.E, transport="nccl", capacity_factor=4.0)
    results = worlds(3).run(agreement_fns.configs_differ, [(config, 2, "capacity_factor", 4)] * 3)
    for rank, (name, message, elapsed, usable) in enumerate(results):
        assert name is None and usable, (rank, name, message)


def test_the_mutation_without_the_call_check_pairs_the_skipped_call_silently(worlds):
    """The mutation test of the check above: with the calls' comparison taken
    out, the same skipped call completes on every rank, the skipping rank's
    rows summed with its peers' rows of another dispatch; so the check is what
    stops it."""
    config = dict(num_experts=agreement_fns.E, transport="nccl")
    results = worlds(3).run(agreement_fns.skipped_call, [(config, 1, False)] * 3)
    assert all(name is None for name, _ in results), results
    assert not all(right for _, right in results), results  # dispatch 2's rows reached dispatch 1's sums


def test_a_signal_ends_a_wait_on_the_compiled_board(worlds):
    """A signal handler that raises (Ctrl-C's KeyboardInterrupt, here an alarm's
    TimeoutError) ends a rank's wait at an agreement on the compiled board, as
    Python's sleep lets it, not the timeout (30 s); the rank withdraws, so its
    late peer raises when it comes, and the board stays in step."""
    config = dict(num_experts=agreement_fns.E, transport="nccl", timeout=30.0)
    results = worlds(2).run(_fn("interrupted_wait", "compiled board"), [(config,)] * 2)
    (name0, message0, elapsed0, usable0), (name1, message1, _, usable1) = results
    assert name0 == "TimeoutError" and "alarm" in message0 and elapsed0 < SOON, results
    assert name1 == "RuntimeError" and "rank(s) [0]" in message1 and "gave up waiting" in message1, results
    assert usable0 and usable1, results


@pytest.mark.parametrize("board", BOARDS[:2])
def test_a_rank_late_for_a_call_is_named_within_the_timeout(worlds, board):
    """Rank 2 makes a combine_rows its peers make only after their timeout: they
    raise a RuntimeError naming it within DispatchConfig.timeout, it raises when
    it comes (they gave the call up), and the same group then serves a good
    round trip (the board is in step; over the host channel a timeout leaves a
    collective behind: test_peer_failure.py)."""
    timeout = 2.0
    config = dict(num_experts=agreement_fns.E, transport="nccl", timeout=timeout)
    results = worlds(3).run(_fn("never_calls", board), [(config, 2)] * 3)
    for rank, (name, message, elapsed, usable) in enumerate(results):
        assert name == "RuntimeError", (rank, name, message)
        if rank < 2:
            assert "rank(s) [2]" in message and "did not reach" in message, message
            assert timeout / 2 < elapsed < timeout + SOON, elapsed  # the first to time out stops the others
        else:
            assert "gave up waiting" in message, message
        assert usable, f"rank {rank}: the round trip after the timeout went wrong"


def test_ranks_at_other_numbers_of_one_verb_differ():
    """Two ranks at the same verb of one dispatcher, along the same dispatch, but
    at different calls of it (a rank made one more): CallsDiffer naming both
    calls, on every rank alike."""
    from dispatch import agreement, plan

    def header(call):
        row = [0] * len(plan.HEADER)
        row[plan.HEADER.index("verb")] = agreement.VERB_CODES["combine"]
        row[plan.HEADER.index("call")], row[plan.HEADER.index("along")] = call, 3
        return row

    agreement.check_peer_calls([header(5), header(5)])  # the same call: nothing raised
    with pytest.raises(agreement.CallsDiffer, match=r"combine #5 .*combine #6"):
        agreement.check_peer_calls([header(5), header(6)])
