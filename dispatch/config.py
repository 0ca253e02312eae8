"""DispatchConfig: the one validated description of a dispatcher.

Every option a dispatcher reads lives here; there are no hidden globals:
:class:`DispatchConfig` holds what a user chooses (variant, transport, wires,
capacity, timeout), :class:`Tuning` how it runs on the machines at hand. Both
are frozen and check themselves on construction, so a config that exists is a
config that makes sense on its own. What can only be checked against a
process group (``num_experts % W``, ``local_world_size``) is checked by
``dispatch.create``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from dispatch.capacity import DROP_POLICIES
from dispatch.cost_model import LinkModel

VARIANTS = ("alltoall", "allgather", "hierarchical", "auto")
# Rows going to the experts (dispatch, and backward of combine) use a codec;
# partial sums going home (combine, and backward of dispatch) a plain dtype.
# Sums never travel in a block-scaled fp8 format (dispatch/codec.py says why).
TO_EXPERTS_WIRES = ("native", "bf16", "fp32", "fp8")
GRAD_TO_EXPERTS_WIRES = (*TO_EXPERTS_WIRES, "e5m2")
SUM_WIRES = ("native", "bf16", "fp32")
TRANSPORTS = ("auto", "nccl", "nvlink", "nvshmem")


@dataclass(frozen=True)
class DispatchConfig:
    """How a dispatcher moves tokens.

    Args:
        num_experts: ``E``, experts in total over the EP group. Expert ``e`` lives
            on rank ``e // (E // W)``; ``E`` must be a multiple of the group size ``W``.
        variant: how bytes move. ``"alltoall"``: one variable-split all-to-all per
            direction, each token sent once per destination rank. ``"allgather"``:
            all-gather the tokens, each rank takes its experts' rows, reduce back.
            ``"hierarchical"``: a token crosses to another node once, then is
            forwarded inside the node. ``"auto"``: the NVLink engine where every
            rank shares a host and it can run, else one of the others by a cost
            model (``Tuning.link_model``; ``dispatch.transports.auto``).
        dispatch_wire: how a token row travels to the experts. ``"native"`` (the
            input's own dtype, lossless), ``"bf16"``, ``"fp32"`` or ``"fp8"`` (e4m3
            with one fp32 scale per 128 channels: about half the bytes of bf16,
            error at most 2^-4 of each block's amax). The experts receive rows
            in the input's dtype whatever the wire.
        combine_wire: how an expert-side partial sum travels home. ``"native"``
            (the expert output's dtype), ``"bf16"`` or ``"fp32"``. Sums are always
            accumulated in fp32 (fp64 for fp64 data) whatever the wire.
        dispatch_grad_wire: backward of dispatch: how the gradients of the
            dispatched rows travel home (pre-summed per (token, rank), like a
            combine) to become the gradient of x. Choices as ``combine_wire``.
        combine_grad_wire: backward of combine: how the gradient of the combined
            output travels to the experts (like a dispatch) to become the
            gradient of the expert outputs. Choices as ``dispatch_wire``, and
            ``"e5m2"`` (block-scaled like ``"fp8"``, one mantissa bit fewer and a
            wider range inside a block, the usual fp8 format for gradients).
        transport: what moves the rows of the ``alltoall`` variant (and of the
            ``hierarchical`` one: ``"nvshmem"`` or ``"nccl"``). ``"nvlink"``:
            the NVLink engine (``dispatch.nvlink``): every rank of the group on
            one host with peer access between the GPUs, NCCL group, CuPy; the
            routing plan and the exchanges run in its own kernels over
            symmetric memory, with one host read per dispatch; results are
            bitwise those of ``"nccl"``. ``"nvshmem"``: PyTorch's NVSHMEM
            all-to-all, whose split sizes stay on the device (any link NVSHMEM
            reaches, across hosts too; ``dispatch.transports.nvshmem``): a
            dispatch with ``max_rows`` reads nothing on the host; results are
            bitwise those of ``"nccl"``; it needs a torch built with NVSHMEM,
            and shares a process with the NVLink engine only where it is made
            first (torch fixes one symmetric-memory backend per process at its
            first allocation; the engine then runs on NVSHMEM's buffers, for a
            group of the whole world); for the hierarchical variant both tiers
            move over it (``dispatch.transports.hierarchical_nvshmem``), bitwise
            its ``"nccl"`` rows. ``"nccl"``: the process
            group's collectives (the only one on CPU/gloo). ``"auto"``
            (default): the engine where every rank shares a host and it can
            run (alltoall, and variant auto); else NVSHMEM where the group
            spans hosts and it can run (alltoall); else the collectives
            (``dispatch.transports.choose``). The other variants use the
            collectives (hierarchical: NVSHMEM where asked).
        capacity_factor: None (default: no token is dropped), or drop tokens
            as Megatron-Core's router does: each rank sends each expert at most
            ``ceil(T * K / E * capacity_factor)`` of its slots, chosen by
            ``drop_policy``; the others become empty slots, before anything moves
            (``dispatch.capacity``; ``Dispatched.dropped`` says which).
        drop_policy: which slots an expert over its capacity keeps: ``"probs"``
            (the largest routing weights, ties to the earlier token) or
            ``"position"`` (the earliest tokens).
        pad_to_capacity: with ``capacity_factor``, give every local expert a
            fixed block of rows from every source rank s, min(C_s, T_s) rows
            (C_s its capacity on rank s): the kept rows, then padding rows (zero
            tokens and weights, sources -1). The outputs then have E_local *
            sum_s min(C_s, T_s) rows whatever the routing (every rank's T
            travels in the call's agreement), and ``tokens_per_expert`` is that block sum for
            every expert; the verbs along the handle take rows so laid out.
        timeout: seconds a rank waits for its peers before it raises a
            RuntimeError naming the ones that did not arrive (died, stalled or
            stopped calling), instead of hanging: at every call's agreement
            (``dispatch.board``; off one host the host channel), at each
            dispatch's counts exchange over NCCL (``comm.Arrivals``), and in
            every kernel's wait for a peer on the NVLink engine (the dispatch
            that waited, or else the next dispatch, raises; a combine does not
            read the device's status: its results are then invalid; the engine
            stays failed: every rank builds its dispatchers again). Over
            NVSHMEM with ``max_rows`` no host waits: a missing peer is caught
            by the process group's own timeout (NCCL's watchdog). After a
            collective's timeout the process group is not usable; after the
            board's, a late rank raises at that call and the group goes on.
        tuning: a :class:`Tuning` (None: its defaults).
    """

    num_experts: int
    variant: str = "alltoall"
    dispatch_wire: str = "native"
    combine_wire: str = "native"
    dispatch_grad_wire: str = "native"
    combine_grad_wire: str = "native"
    transport: str = "auto"
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False
    timeout: float = 60.0
    tuning: "Tuning | None" = None

    @classmethod
    def from_options(cls, **options) -> "DispatchConfig":
        """A config from flat options: the fields of :class:`DispatchConfig` and
        of :class:`Tuning` by name (e.g. from a command line), each checked as
        there; an unknown name raises a TypeError naming it."""
        tuning_names = set(Tuning.__dataclass_fields__)
        tuning = {k: options.pop(k) for k in list(options) if k in tuning_names}
        unknown = sorted(set(options) - set(cls.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unknown dispatcher option(s) {', '.join(unknown)}: DispatchConfig takes "
                            f"{', '.join(cls.__dataclass_fields__)}; Tuning takes {', '.join(sorted(tuning_names))}")
        if tuning and options.pop("tuning", None) is not None:
            raise TypeError(f"{', '.join(tuning)} given beside tuning=: give one or the other")
        return cls(**options, **({"tuning": Tuning(**tuning)} if tuning else {}))

    def __post_init__(self) -> None:
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int):
            raise TypeError(f"num_experts must be an int, got {type(self.num_experts).__name__}")
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        _check_choice("variant", self.variant, VARIANTS)
        _check_choice("dispatch_wire", self.dispatch_wire, TO_EXPERTS_WIRES)
        _check_choice("combine_wire", self.combine_wire, SUM_WIRES)
        _check_choice("dispatch_grad_wire", self.dispatch_grad_wire, SUM_WIRES)
        _check_choice("combine_grad_wire", self.combine_grad_wire, GRAD_TO_EXPERTS_WIRES)
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not 0 < self.timeout < 1e6:
            raise ValueError(f"timeout must be a number of seconds in (0, 1e6), got {self.timeout!r}")
        if self.capacity_factor is not None:  # any real number (numpy's too), kept as a float
            factor = self.capacity_factor
            try:
                factor = float(factor) if isinstance(factor, numbers.Real) and not isinstance(factor, bool) else None
            except OverflowError:  # (an int past float's range)
                factor = None
            if factor is None or not 0 < factor < float("inf"):
                raise ValueError(f"capacity_factor must be None or a finite number > 0, got {self.capacity_factor!r}")
            object.__setattr__(self, "capacity_factor", factor)
        _check_choice("drop_policy", self.drop_policy, DROP_POLICIES)
        if not isinstance(self.pad_to_capacity, bool):
            raise TypeError(f"pad_to_capacity must be a bool, got {type(self.pad_to_capacity).__name__}")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("pad_to_capacity=True needs a capacity_factor (the capacity it pads to)")
        _check_choice("transport", self.transport, TRANSPORTS)
        if self.transport == "nvlink" and self.variant != "alltoall":
            raise ValueError(f"transport='nvlink' needs variant='alltoall', got variant={self.variant!r}")
        if self.transport == "nvshmem" and self.variant not in ("alltoall", "hierarchical"):
            raise ValueError(f"transport='nvshmem' needs variant='alltoall' or 'hierarchical', got "
                             f"variant={self.variant!r}")
        if self.tuning is None:
            object.__setattr__(self, "tuning", Tuning())
        elif not isinstance(self.tuning, Tuning):
            raise TypeError(f"tuning must be a dispatch.Tuning or None, got {type(self.tuning).__name__}")


@dataclass(frozen=True)
class Tuning:
    """How a dispatcher runs on these machines, beside what it computes
    (``DispatchConfig.tuning``). The defaults are measured (``bench/results``);
    none changes which rows reach which expert.

    Args:
        fp8_pow2_scales: the fp8/e5m2 block scales are rounded up to powers of
            two (scaling is then exact; the error bound is unchanged in form,
            with a scale up to 2x larger).
        local_world_size: ranks per node (nodes are blocks of consecutive group
            ranks), for the hierarchical variant, the auto cost model and the
            intra-/inter-node split of ``Dispatched.stats``; checked to divide the
            group size. None: counted from the hosts the group's ranks run on
            (``stats.ranks_per_host``: 1 where a host's ranks are not one
            block of consecutive ranks, the same size for every host).
        link_model: bandwidths and latencies of the tiers for ``variant="auto"``
            (a :class:`dispatch.cost_model.LinkModel`; None: its defaults).
        check_inputs: check the *values* of ``topk_idx`` and ``topk_weights``
            (expert ids in range, no expert twice in a row, finite weights) before
            any token moves. Over NCCL this costs one host synchronisation per
            dispatch; the NVLink engine checks them in its layout kernel, at no
            host synchronisation of its own. Shapes, dtypes and devices are always
            checked (they cost nothing).
        plan_graphs: on CUDA, replay the host-free part of the routing plan as
            CUDA graphs, captured the second time a (T, K, dtypes) is seen (a few
            MB each, the 8 most recent shapes kept); the alltoall variant only.
            This removes some sixty kernel launches per dispatch; over NVSHMEM a
            dispatch with ``max_rows`` replays its whole plan (its puts
            included) as one graph. Turn it off when the dispatch itself runs
            inside a graph capture of the caller's.
        sm_budget: NVLink engine: thread blocks its data kernels may use (None:
            four per SM); fewer leave SMs to expert GEMMs running beside it.
    """

    local_world_size: int | None = None
    link_model: LinkModel | None = None
    check_inputs: bool = True
    plan_graphs: bool = True
    sm_budget: int | None = None
    fp8_pow2_scales: bool = False

    def __post_init__(self) -> None:
        if self.local_world_size is not None:
            if isinstance(self.local_world_size, bool) or not isinstance(self.local_world_size, int):
                raise TypeError(
                    f"local_world_size must be an int or None, got {type(self.local_world_size).__name__}"
                )
            if self.local_world_size < 1:
                raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")
        if self.link_model is not None and not isinstance(self.link_model, LinkModel):
            raise TypeError(
                f"link_model must be a dispatch.cost_model.LinkModel or None, got {type(self.link_model).__name__}"
            )
        if self.sm_budget is not None and (isinstance(self.sm_budget, bool) or not isinstance(self.sm_budget, int)
                                           or self.sm_budget < 1):
            raise ValueError(f"sm_budget must be an int >= 1 or None, got {self.sm_budget!r}")
        for name in ("fp8_pow2_scales", "check_inputs", "plan_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
