"""Input validation, and what every rank checks of its peers' inputs once the
call's agreement (``dispatch.agreement``) has brought their headers.

A bad argument raises ``TypeError`` (wrong kind or dtype) or ``ValueError``
(wrong shape, device or value), and the message names the argument. Checks of
shapes, dtypes and devices are free; checks of values (expert ids, repeats,
finite weights) need one host synchronisation and can be turned off with
``DispatchConfig(tuning=Tuning(check_inputs=False))`` once the router is trusted.
Only one rank may see its own mistake, so a rank that refuses its arguments
still takes part in the call's agreement (``agreement.refuse``); the checks of
every rank's header (:func:`check_peer_headers`, :func:`check_peer_rows`,
:func:`check_row_budgets`) raise on every rank alike, before any token moves.
"""

from __future__ import annotations

import numbers
from typing import Callable

import torch

from dispatch import agreement, comm, plan
from dispatch.plan import HEADER

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, value: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """``value`` is a tensor of ``ndim`` dimensions with one of ``dtypes``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {str(value.layout).replace('torch.', '')}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(value.dtype).replace('torch.', '')}")
    return value


def check_device(name: str, value: torch.Tensor, like: str, device: torch.device) -> None:
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but must be on {device}, the device of {like}")


def check_backend_device(name: str, value: torch.Tensor, allowed: frozenset[str]) -> None:
    if value.device.type not in allowed:
        raise ValueError(
            f"{name} is on {value.device}, which the process group's backend cannot move "
            f"(it moves {', '.join(sorted(allowed))} tensors)"
        )


def check_max_rows(max_rows: object) -> None:
    """``dispatch``'s ``max_rows``: an int in [0, 2**31)."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral) or not 0 <= max_rows < 2**31:
        raise ValueError(f"max_rows must be None or an int in [0, 2**31) (a bound on the rows this rank "
                         f"receives), got {max_rows!r}")


def check_groups(groups: object, num_local: int) -> None:
    """``dispatch``'s ``groups``: an int in [1, E_local]."""
    if isinstance(groups, bool) or not isinstance(groups, numbers.Integral) or not 1 <= groups <= num_local:
        raise ValueError(f"groups must be an int in [1, {num_local}] (groups of this rank's {num_local} local "
                         f"experts), got {groups!r}")


def check_peer_groups(groups: list[int]) -> None:
    """Every rank's ``groups`` (learnt in the counts exchange) agree; raised on
    every rank alike, before any token moves."""
    if len(set(groups)) > 1:
        told = ", ".join(f"rank {r}: {g}" for r, g in enumerate(groups))
        raise ValueError(f"groups: every rank of the group must dispatch with the same groups; got {told}")


def check_group_bounds(headers, groups: list[int], fullest: list[int]) -> None:
    """``check_row_budgets`` of a dispatch by G > 1 groups with max_rows, whose
    outputs pad each group to B = ceil(max_rows / G) rows: refuse, on every
    rank alike, one in which some rank's fullest group has more rows than B,
    or whose G B rows some rank's free device memory does not hold. Raises
    ValueError naming the argument."""
    headers = agreement.header_rows(headers)
    over, short = [], []
    for r, (h, g, n) in enumerate(zip(headers, groups, fullest)):
        bound, memory, per_group = h[_MAX_ROWS], h[_MEMORY_ROWS], -(-h[_MAX_ROWS] // max(g, 1))
        if bound >= 0 and n > per_group:
            over.append(f"rank {r}: {n} rows in a group, over B={per_group} (max_rows={bound}, G={g})")
        if bound >= 0 and 0 <= memory < g * per_group:
            short.append(f"rank {r}: {g * per_group} rows, its free device memory holds {memory}")
    if over:
        raise ValueError(f"max_rows: by groups each group of local experts takes at most B = ceil(max_rows / G) rows "
                         f"({'; '.join(over)}); no token moved")
    if short:
        raise ValueError(f"max_rows: the rows of a dispatch by groups do not fit some rank's free device memory "
                         f"({'; '.join(short)}); no token moved")


def check_dispatch_signature(d, x, topk_idx, topk_weights, max_rows, groups):
    """``TokenDispatcher.dispatch``'s own checks of its arguments on dispatcher
    ``d`` (this rank alone; their types, shapes, dtypes, devices and layouts,
    which the dispatcher keeps as passed for their signature): the wire codec of x."""
    from dispatch.codec import to_experts_codec

    check_dispatch_inputs(x, topk_idx, topk_weights, d.devices)
    check_groups(groups, d.num_local_experts)
    variant, transport = d.transport.key
    name = f"the {variant} variant over {transport}"
    if d.max_topk is not None and topk_idx.shape[1] > d.max_topk:
        raise ValueError(f"topk_idx: {name} takes at most {d.max_topk} slots per token, got K={topk_idx.shape[1]}")
    if groups > 1 and d.config.pad_to_capacity:
        raise ValueError(f"groups={groups} with DispatchConfig.pad_to_capacity: a dispatch by groups of experts "
                         "places its rows group by group; use groups=1")
    if groups > 1 and max_rows is not None and not d.transport.bounded_groups:
        raise ValueError(f"groups={groups} with max_rows: a dispatch by groups with a row bound needs the alltoall "
                         f"variant on the NVLink engine or NVSHMEM (each group padded to its bound on the device); "
                         f"{name} does not move one; use groups=1 or no max_rows")
    if d.config.pad_to_capacity and max_rows is not None:
        raise ValueError("max_rows: a dispatcher with pad_to_capacity fixes its rows itself (E_local * the sum of "
                         "the ranks' capacities); dispatch without max_rows")
    if max_rows is not None:
        check_max_rows(max_rows)
    return to_experts_codec(d.config.dispatch_wire, x.dtype, d.config.tuning.fp8_pow2_scales)


def check_reserve(d, x: object, topk: object) -> None:
    """``TokenDispatcher.reserve``'s own checks of its arguments on dispatcher ``d`` (this rank alone)."""
    check_backend_device("x", check_tensor("x", x, 2, FLOAT_DTYPES), d.devices)
    most = 2**31 - 1 if d.max_topk is None else d.max_topk  # (K may pass E: slots of -1)
    if isinstance(topk, bool) or not isinstance(topk, numbers.Integral) or not 1 <= topk <= most:
        raise ValueError(f"topk must be an int in [1, {most}] (the slots per token to make room for), got {topk!r}")
    if d.transport.device_bound:
        d.transport.check_current(x)


def check_dispatch_inputs(
    x: object,
    topk_idx: object,
    topk_weights: object,
    devices: frozenset[str],
) -> None:
    """Validate the arguments of ``TokenDispatcher.dispatch``.

    Args:
        x: [T, H] float16/bfloat16/float32/float64.
        topk_idx: [T, K] int32/int64, expert ids in ``[-1, E)``, no id twice in a row.
        topk_weights: [T, K] floating, finite.
        devices: device types the group's backend moves.

    The values (ids in range, no repeats, finite weights) are checked by the
    dispatcher's plan with ``value_flags`` / ``values_error``, and raised after
    the counts all-gather (which tells the peers, so that they raise too),
    before any token moves.
    """
    x = check_tensor("x", x, 2, FLOAT_DTYPES)
    topk_idx = check_tensor("topk_idx", topk_idx, 2, INDEX_DTYPES)
    topk_weights = check_tensor("topk_weights", topk_weights, 2, FLOAT_DTYPES)
    check_backend_device("x", x, devices)
    if x.shape[1] < 1:
        raise ValueError(f"x must have a hidden size H >= 1, got shape {tuple(x.shape)}")
    if topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_idx has {topk_idx.shape[0]} rows but x has {x.shape[0]} tokens; "
            "topk_idx must be [T, K] with the T of x"
        )
    if topk_idx.shape[1] < 1:
        raise ValueError(f"topk_idx must have K >= 1 columns, got shape {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weights has shape {tuple(topk_weights.shape)} but topk_idx has "
            f"{tuple(topk_idx.shape)}; they must match"
        )
    check_device("topk_idx", topk_idx, "x", x.device)
    check_device("topk_weights", topk_weights, "x", x.device)


def repeated_ids(topk_idx: torch.Tensor) -> torch.Tensor:
    """[T] bool: the rows that name an expert (an id >= 0) twice; no host synchronisation."""
    ordered = torch.sort(topk_idx, dim=1).values
    return ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1)


def bad_rows(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[3, T] bool: per row, (an id out of range, an id twice, a non-finite weight)."""
    out_of_range = (topk_idx < -1) | (topk_idx >= num_experts)
    non_finite = ~torch.isfinite(topk_weights)
    return torch.stack([out_of_range.any(1), repeated_ids(topk_idx), non_finite.any(1)])


def value_flags(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[3] bool on the device: (an id out of range, an id twice in a row, a non-finite weight).

    No host synchronisation; ``values_error`` turns the flags into an error.
    """
    return bad_rows(topk_idx, topk_weights, num_experts).any(1)


def raise_own_values(header: list[int], ticket: plan.Ticket, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     num_experts: int) -> None:
    """Where this rank's own header as the counts exchange read it back
    (``header``, its ``plan.HEADER`` entries first) is marked failed by its bad
    values (``fold_flags``), raise the ValueError naming them (one more host
    read, on the failure only); its peers raise in :func:`check_peer_headers`."""
    if header[_FAILED] and not ticket.refused:
        weights = topk_weights.detach()
        flags = value_flags(topk_idx, weights, num_experts).cpu()  # host sync: the message
        raise (values_error(flags, topk_idx, weights, num_experts)
               or ValueError("topk_idx/topk_weights: the plan found a bad value"))


def values_error(
    flags: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> ValueError | None:
    """The ValueError that host ``flags`` (from ``value_flags``) call for, or None.

    The dispatchers do not raise it at once: only this rank sees its values, so
    it marks itself failed in the row of the counts all-gather
    (``fold_flags``, on the device) and raises after it (``raise_own_values``),
    where its peers raise too (``check_peer_headers``) instead of waiting for it
    in that all-gather."""
    if not flags.any():
        return None
    kind = int(flags.nonzero()[0])
    # host sync: the first bad row and its values, for the message (error path only)
    first = int(bad_rows(topk_idx, topk_weights, num_experts)[kind].nonzero()[0])
    if kind == 0:
        return ValueError(
            f"topk_idx holds an expert id outside [-1, {num_experts}) (num_experts={num_experts}): "
            f"row {first} is {topk_idx[first].tolist()}"
        )
    if kind == 1:
        return ValueError(f"topk_idx names one expert twice in row {first}: {topk_idx[first].tolist()}")
    return ValueError(f"topk_weights holds a non-finite value in row {first}: {topk_weights[first].tolist()}")


# header column -> (argument, what must agree), for the columns all ranks share
_MUST_AGREE = {
    "topk": ("topk_idx", "K (columns of topk_idx)"),
    "hidden": ("x", "the hidden size H (columns of x)"),
    "x_dtype": ("x", "the dtype of x"),
    "weights_dtype": ("topk_weights", "the dtype of topk_weights"),
}


def check_row_budgets(headers: torch.Tensor, rows_of: list[int], row_bytes: int,
                      exact: Callable[[], list[int]] | None = None) -> None:
    """Refuse, on every rank alike, a dispatch in which some rank would receive
    more rows than its ``max_rows``, or need more than its free device memory
    holds (the ``memory_rows`` of ``plan.header``: its outputs have N rows, or
    max_rows where it gave one).

    Args:
        headers: [W, len(HEADER)] every rank's header (host int64 tensor, or lists).
        rows_of: N of every rank.
        row_bytes: bytes the dispatch allocates per received row (for the message).
        exact: where the headers' memory budgets are lower bounds
            (``free_memory.device_free_bytes``), a collective giving every rank's exact
            one (``free_memory.free_bytes``), made only where some rank falls short of
            its lower bound (every rank alike: they see the same headers and N).
    Raises:
        ValueError after the counts exchange and before any token moves.
    """
    headers = agreement.header_rows(headers)
    for h, n in zip(headers, rows_of):  # the usual case, at a glance: every rank within its budgets
        m, f = h[_MAX_ROWS], h[_MEMORY_ROWS]
        if 0 <= m < n or 0 <= f < (n if n > m else m):
            break
    else:
        return
    max_rows = [h[HEADER.index("max_rows")] for h in headers]
    memory = [h[HEADER.index("memory_rows")] for h in headers]
    over = [f"rank {r}: {n} rows, over its max_rows={m}" for r, (n, m) in enumerate(zip(rows_of, max_rows))
            if 0 <= m < n]
    if over:
        raise ValueError(f"max_rows: the routing sends more rows to some rank than its max_rows ({'; '.join(over)}); "
                         "no token moved")
    short = [f"rank {r}: {max(n, m)} rows, its free device memory holds {f}"
             for r, (n, m, f) in enumerate(zip(rows_of, max_rows, memory)) if 0 <= f < max(n, m)]
    if short and exact is not None:  # lower bounds fell short: the exact budgets decide
        memory = exact()
        short = [f"rank {r}: {max(n, m)} rows, its free device memory holds {f}"
                 for r, (n, m, f) in enumerate(zip(rows_of, max_rows, memory)) if 0 <= f < max(n, m)]
    if short:
        raise ValueError(
            f"x: the routing sends some rank more rows than its free device memory holds for the dispatch's "
            f"outputs ({row_bytes} bytes a row): {'; '.join(short)}; no token moved (free memory on that rank, "
            "or spread the routing)")


def check_peer_headers(headers: torch.Tensor) -> tuple[bool, bool]:
    """Check that every rank dispatched the same kind of input; return which
    gradients some rank needs (x, topk_weights).

    Args:
        headers: [W, len(HEADER)] every rank's ``plan.header`` (host int64
            tensor, or lists).
    Raises:
        ValueError on every rank alike (all ranks see the same headers), after
        the counts all-gather and before any token moves; RuntimeError where
        a rank marked itself failed (``fold_flags``).
    """
    headers = agreement.header_rows(headers)  # a few host values: plain Python, no tensor op per check
    first = headers[0][:AGREED]
    usual, x_grad, weights_grad = True, False, False
    for h in headers:  # a loop, not generators: every dispatch's host path
        usual = usual and not h[_FAILED] and h[:AGREED] == first
        x_grad, weights_grad = x_grad or bool(h[_X_GRAD]), weights_grad or bool(h[_WEIGHTS_GRAD])
    if usual:
        return x_grad, weights_grad
    agreement.check_peer_calls(headers)
    for column, (argument, what) in _MUST_AGREE.items():
        values = [h[HEADER.index(column)] for h in headers]
        if any(v != values[0] for v in values):
            named = column.endswith("dtype")  # a dtype's code (plan.DTYPE_CODES: FLOAT_DTYPES' order)
            told = ", ".join(f"rank {r}: {_DTYPE_NAMES.get(v, v) if named else v}" for r, v in enumerate(values))
            raise ValueError(
                f"{argument}: ranks disagree on {what} ({told}); "
                "every rank of the group must dispatch the same K, H and dtypes"
            )
    return (any(h[HEADER.index("x_grad")] for h in headers),
            any(h[HEADER.index("weights_grad")] for h in headers))


# where the checks read a header (``plan.HEADER``); the columns every rank must agree on come first
# (AGREED of them: the compiled counts exchange, csrc/host.cpp, compares them too)
AGREED = HEADER.index("weights_dtype") + 1
_FAILED, _X_GRAD, _WEIGHTS_GRAD = HEADER.index("failed"), HEADER.index("x_grad"), HEADER.index("weights_grad")
_HIDDEN, _X_DTYPE, _WEIGHTS = HEADER.index("hidden"), HEADER.index("x_dtype"), HEADER.index("weights_dtype")
_MAX_ROWS, _MEMORY_ROWS = HEADER.index("max_rows"), HEADER.index("memory_rows")
assert set(HEADER[:AGREED]) == {"verb", "call", "along", "topk", "hidden", "x_dtype", "weights_dtype"}


def fold_flags(header_row: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """``header_row`` (a ``plan.header`` on the device) with its ``failed``
    entry raised where ``flags`` (``value_flags``) found a bad value, on the
    device: every rank sees the failure where it reads the all-gathered rows
    back (the split sizes' host read, or a later one where nothing is read on
    the host), with no host read of its own."""
    folded = header_row.clone()
    folded[_FAILED] = torch.maximum(header_row[_FAILED], flags.any().to(header_row.dtype))
    return folded


def peers_fail(headers: torch.Tensor, rows_of: torch.Tensor, groups: torch.Tensor,
               fullest: torch.Tensor) -> torch.Tensor:
    """The device twin of ``check_peer_headers``, ``check_peer_groups``,
    ``check_row_budgets`` and ``check_group_bounds`` for a dispatch that reads
    nothing on the host: a 0-dim bool, True where they would raise (every rank
    computes it from the same all-gathered rows, so all agree without a word).
    By G > 1 groups a rank's bound is on each group: B = ceil(max_rows / G)
    rows (its outputs G B).

    Args:
        headers: [W, len(HEADER)] every rank's header; rows_of: [W] every
            rank's N; groups: [W] every rank's G; fullest: [W] every rank's
            rows in its fullest group (int64, on the device).
    """
    agreed = headers[:, :AGREED]
    bound, memory = headers[:, _MAX_ROWS], headers[:, _MEMORY_ROWS]
    split = groups.clamp(min=1)
    per_group = (bound + split - 1) // split  # B (the bound itself for one group)
    by_groups = groups > 1
    over = (bound >= 0) & torch.where(by_groups, fullest > per_group, rows_of > bound)
    outputs = torch.where(by_groups & (bound >= 0), split * per_group, bound)
    short = (memory >= 0) & (memory < torch.maximum(rows_of, outputs))
    return ((agreed != agreed[:1]).any() | (headers[:, _FAILED] != 0).any() | over.any() | short.any()
            | (groups != groups[:1]).any())


def check_peer_choice(rows: list[list[int]], name: str, choices: tuple[str, ...]) -> None:
    """Every rank chose one of ``choices`` alike for the argument ``name`` of a
    call (its index, the last entry of each rank's row of the call's
    agreement): a ``wire`` decides the bytes each row takes on the way, so
    that ranks that differ would read each other's rows as other bytes. Raises
    ValueError naming ``name`` and every rank's, on every rank alike."""
    codes = [row[-1] for row in rows]
    if any(code != codes[0] for code in codes):
        told = ", ".join(f"rank {r}: {choices[code]!r}" for r, code in enumerate(codes))
        raise ValueError(f"{name}: the ranks of the group chose different ones ({told}); every rank passes the "
                         f"same {name}")


def check_peer_rows(headers: list[list[int]], name: str) -> None:
    """The rows a call moves (its agreement's ``hidden`` and ``x_dtype`` columns,
    :meth:`agreement.Calls.agree`) have one width H' on every rank (0: a verb of no
    width) and one dtype on every rank that gave one (:func:`dtype_code`): the
    wire carries neither, so rows that differ would be summed, or read, as
    other bytes. Raises ValueError naming ``name`` and every rank's, on every
    rank alike (they all read the same headers), before any row moves. Its
    weights too (``weights_dtype``: their dtype's ``FLOAT_CODES``, -1 for none and
    on every rank of a verb without): of one dtype on every rank, or none on every rank, since
    fp64 weights sum in fp64, which a variant may move another way (the
    all-gather's); a ValueError naming ``weights`` where they differ."""
    first = headers[0]
    for h in headers:  # the usual case, at a glance: one width, one dtype (a loop: every verb's host path)
        if h[_HIDDEN] != first[_HIDDEN] or h[_X_DTYPE] != first[_X_DTYPE] or h[_WEIGHTS] != first[_WEIGHTS]:
            break
    else:
        return
    widths = [h[_HIDDEN] for h in headers]
    codes = [h[_X_DTYPE] for h in headers]
    if len(set(widths)) > 1:
        told = ", ".join(f"rank {r}: {w}" for r, w in enumerate(widths))
        raise ValueError(f"{name}: the ranks' rows have different widths H' ({told}); every rank's {name} must "
                         "have the same number of columns")
    if len({c for c in codes if c >= 0}) > 1:
        told = ", ".join(f"rank {r}: {_DTYPE_NAMES.get(c, 'not floating')}"
                         for r, c in enumerate(codes) if c >= 0)
        raise ValueError(f"{name}: the ranks' rows have different dtypes ({told}); give {name} one floating dtype "
                         "on every rank")
    if any(h[_WEIGHTS] != first[_WEIGHTS] for h in headers):
        told = ", ".join(f"rank {r}: {_DTYPE_NAMES.get(h[_WEIGHTS], 'None' if h[_WEIGHTS] < 0 else 'not floating')}"
                         for r, h in enumerate(headers))
        raise ValueError(f"weights: the ranks' weights differ ({told}); every rank passes weights of one dtype, or "
                         "every rank None")


NO_DTYPE = len(FLOAT_DTYPES) + 1  # the code of a dtype not given (``combine_groups(dtype=None)``)
_DTYPE_NAMES = {**{code: str(d).replace("torch.", "") for code, d in enumerate(FLOAT_DTYPES)}, NO_DTYPE: "None"}
FLOAT_CODES = {dtype: code for code, dtype in enumerate(FLOAT_DTYPES)}  # a floating dtype's code (FLOAT_DTYPES)


def dtype_code(rows: torch.Tensor, always: bool = False) -> int:
    """The code of rows' dtype that ranks agree on (:func:`home_rows`,
    :func:`check_peer_rows`): its index in ``FLOAT_DTYPES``, one past them for
    any other; -1 for no rows, unless ``always`` (a rank that takes its peers'
    rows in its own dtype, rows or not)."""
    if not (rows.shape[0] or always):
        return -1
    return FLOAT_DTYPES.index(rows.dtype) if rows.dtype in FLOAT_DTYPES else len(FLOAT_DTYPES)


def home_rows(rows: torch.Tensor, has_rows: tuple[bool, ...], group, world_size: int,
              headers: list[list[int]] | None = None) -> torch.Tensor:
    """``rows``, expert outputs about to go home, in the dtype in which the
    group's partial sums travel.

    A rank whose experts got no rows answered an empty call, and experts may
    answer one in another dtype than their outputs (autocast, an early
    return). That rank still receives its tokens' partial sums, in the dtype
    of the ranks that computed them. So where ``has_rows`` (``CombineHandle``)
    shows ranks without rows beside ranks with rows, every rank learns the
    dtype of the others' rows and a rank without rows takes it; ranks with
    rows in different dtypes are then refused, on every rank alike (the verbs
    refuse them in any case, at their agreement: :func:`check_peer_rows`).
    ``headers``: the call's agreement (``agreement.Calls.agree`` with :func:`dtype_code`),
    which carries every rank's code; without it (``GroupSums`` of one group)
    the codes are all-gathered here over ``group``, where needed (a host read).
    """
    if all(has_rows) or not any(has_rows):
        return rows
    if headers is not None:
        codes = [h[HEADER.index("x_dtype")] for h in headers]
    else:
        row = plan.to_device(torch.tensor([dtype_code(rows)], dtype=torch.int64), rows.device)
        codes = comm.all_gather_rows(row, group, world_size).flatten().tolist()  # host sync: dtype
    known = sorted({c for c in codes if c >= 0})
    if len(known) != 1 or known[0] == len(FLOAT_DTYPES):
        names = ", ".join(f"rank {r}: {FLOAT_DTYPES[c] if c < len(FLOAT_DTYPES) else 'not floating'}"
                          for r, c in enumerate(codes) if c >= 0)
        raise ValueError(f"expert outputs must have one floating dtype on every rank that has rows; got {names}")
    return rows if rows.shape[0] else rows.to(FLOAT_DTYPES[known[0]])


def check_combine_inputs(
    expert_out: object,
    weights: object,
    num_rows: int,
    devices: frozenset[str],
    name: str = "expert_out",
    device: torch.device | None = None,
) -> None:
    """Validate the arguments of ``TokenDispatcher.combine`` (and ``combine_rows``,
    whose rows are called ``name``).

    Args:
        expert_out: [N, H'] floating, N = the rows the matching dispatch produced.
        weights: None or [N] floating.
        device: where they must lie (the dispatch's, ``CombineHandle.device``), or None.
    """
    expert_out = check_rows(name, expert_out, num_rows, "the dispatch behind handle produced", devices, device)
    if weights is not None:
        weights = check_tensor("weights", weights, 1, FLOAT_DTYPES)
        if weights.shape[0] != num_rows:
            raise ValueError(f"weights has {weights.shape[0]} entries but {name} has {num_rows} rows")
        check_device("weights", weights, name, expert_out.device)


def check_rows(name: str, rows: object, num_rows: int, what: str, devices: frozenset[str],
               device: torch.device | None = None) -> torch.Tensor:
    """``rows`` is [num_rows, H'] floating (H' >= 1) on a device the backend moves
    (on ``device``, the dispatch's, where given: a kernel of the engine would read
    another GPU's memory through its address); ``what`` says where ``num_rows``
    comes from (for the message)."""
    rows = check_tensor(name, rows, 2, FLOAT_DTYPES)
    check_backend_device(name, rows, devices)
    if device is not None:
        check_device(name, rows, "the dispatch's x", device)
    if rows.shape[1] < 1:
        raise ValueError(f"{name} must have a hidden size >= 1, got shape {tuple(rows.shape)}")
    if rows.shape[0] != num_rows:
        raise ValueError(
            f"{name} has {rows.shape[0]} rows but {what} {num_rows}; "
            f"{name} must be [{num_rows}, H] in the order of the handle"
        )
    return rows


def check_values(name: str, values: object, num_rows: int, devices: frozenset[str],
                 device: torch.device | None = None) -> torch.Tensor:
    """``values`` is [num_rows] floating, one per dispatched row (on ``device``
    where given, as :func:`check_rows`)."""
    values = check_tensor(name, values, 1, FLOAT_DTYPES)
    check_backend_device(name, values, devices)
    if device is not None:
        check_device(name, values, "the dispatch's x", device)
    if values.shape[0] != num_rows:
        raise ValueError(f"{name} has {values.shape[0]} entries but the dispatch behind handle produced "
                         f"{num_rows} rows; one value per dispatched row")
    return values
