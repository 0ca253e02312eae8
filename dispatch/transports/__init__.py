"""The transports, one class per file behind one protocol (``transports.base``),
and the registry that makes every choice among them.

``REGISTRY`` maps (variant, transport) to the class that moves the rows:

==================  ==========  =========================================
variant             transport   class
==================  ==========  =========================================
``alltoall``        ``nccl``    :class:`AllToAllTransport` (gloo on CPU)
``alltoall``        ``nvlink``  :class:`NVLinkTransport` (the engine)
``alltoall``        ``nvshmem`` :class:`NVSHMEMTransport` (splits on the device)
``allgather``       ``nccl``    :class:`AllGatherTransport`
``hierarchical``    ``nccl``    :class:`HierarchicalTransport`
``hierarchical``    ``nvshmem`` :class:`HierarchicalNVSHMEMTransport`
``auto``            ``nccl``    :class:`AutoTransport` (cost model per call)
==================  ==========  =========================================

:func:`build` resolves ``DispatchConfig.transport="auto"`` (and
``variant="auto"``) by :func:`choose`: the NVLink engine where it can run
(every rank on one host, NCCL, CuPy; ``nvlink.unusable``); else, for the
alltoall variant on a group that spans hosts, NVSHMEM where it can run
(``symmetric.unusable``); the collectives otherwise. The hierarchical variant
moves over NVSHMEM where asked (``transport="nvshmem"``).
"""

from __future__ import annotations

import torch.distributed as dist

from dispatch import comm
from dispatch.transports.allgather import AllGatherTransport
from dispatch.transports.alltoall import AllToAllTransport
from dispatch.transports.auto import AutoTransport
from dispatch.transports.base import Request, Transport
from dispatch.transports.hierarchical import HierarchicalTransport
from dispatch.transports.hierarchical_nvshmem import HierarchicalNVSHMEMTransport
from dispatch.transports.nvlink import NVLinkTransport, unusable
from dispatch.transports.nvshmem import NVSHMEMTransport
from dispatch.transports import symmetric

REGISTRY: dict[tuple[str, str], type[Transport]] = {
    (cls.variant, cls.transport): cls
    for cls in (AllToAllTransport, NVLinkTransport, NVSHMEMTransport, AllGatherTransport, HierarchicalTransport,
                HierarchicalNVSHMEMTransport, AutoTransport)
}


def build(config, group) -> Transport:
    """The transport ``config`` asks for over ``group``: ``REGISTRY[(variant,
    transport)]``, the transport resolved by :func:`choose`. Where it asks
    whether the engine or NVSHMEM can run on an NCCL group, a collective
    (every rank gets the same answer). Raises ValueError for
    ``transport="nvlink"`` or ``"nvshmem"`` where it cannot run, naming why."""
    key = choose(config.variant, config.transport, lambda: unusable(group, config.num_experts),
                 lambda: _spans_hosts(group), lambda: _nvshmem_problem(group))
    return REGISTRY[registry_key(config.variant, key)](config, group)


def registry_key(variant: str, transport: str) -> tuple[str, str]:
    """The ``REGISTRY`` key of ``variant`` over the ``transport`` :func:`choose`
    gave: off NCCL, ``variant="auto"`` is the alltoall variant there."""
    return (variant if transport == "nccl" or variant != "auto" else "alltoall"), transport


def choose(variant: str, transport: str, engine_problem, spans_hosts, nvshmem_problem) -> str:
    """The transport that moves ``variant``'s rows when the config asks for
    ``transport``: ``"nccl"``, ``"nvlink"`` or ``"nvshmem"``.

    The rule for ``"auto"``: for the alltoall and auto variants, the NVLink
    engine where it can run (every rank on one host); else, for the alltoall
    variant, NVSHMEM where the group spans hosts and it can run (its counts
    stay on the device where NCCL's splits are read on the host); else NCCL.
    The other variants (and ``variant="auto"``'s cost model) move over NCCL off
    the engine: the hierarchical one over NVSHMEM only where asked
    (``transport="nvshmem"``; without ``max_rows`` its two plans read the host
    twice where NCCL's one reads it once). The
    answers are asked lazily, in that order, each at most once: each of
    ``engine_problem()``, ``nvshmem_problem()`` (why it cannot run, or None) and
    ``spans_hosts()`` may be a collective; ``nvshmem_problem()`` fixes this
    process's symmetric memory on NVSHMEM where it answers None.

    Raises ValueError for ``"nvlink"`` / ``"nvshmem"`` where it cannot run."""
    if transport == "nccl" or variant not in ("alltoall", "auto", "hierarchical"):
        return "nccl"
    if transport == "nvshmem":
        problem = nvshmem_problem()
        if problem is not None:
            raise ValueError(f"transport='nvshmem': {problem}")
        return "nvshmem"
    if variant == "hierarchical":
        return "nccl"
    problem = engine_problem()
    if problem is None:
        return "nvlink"
    if transport == "nvlink":
        raise ValueError(f"transport='nvlink': {problem}")
    if variant == "alltoall" and spans_hosts() and nvshmem_problem() is None:
        return "nvshmem"
    return "nccl"


def _spans_hosts(group) -> bool:
    """Whether the ranks of an NCCL group run on more than one host (a
    collective at the group's first ask, ``comm.group_hosts``); False for any
    other group (no NVSHMEM there)."""
    hosts = comm.group_hosts(group) if "nccl" in str(dist.get_backend(group)) else None
    return hosts is not None and len(set(hosts)) > 1


def _nvshmem_problem(group) -> str | None:
    """Why NVSHMEM cannot serve ``group``, agreed by its ranks (None: it can,
    and every rank's symmetric memory is on its backend now). Each rank asks
    for the backend only once every rank may run NVSHMEM, so that no rank takes
    it for a group its peers refuse; whether each got it is agreed again (a
    rank whose engine fixed its backend first cannot take it: those that took
    it keep it, as torch cannot put it back, and the engine refuses a group
    whose ranks' backends differ). The ranks' ``TORCH_SYMMMEM_NBLOCKS`` must
    be alike too (``symmetric.blocks_differ``)."""
    problem = _agreed(group, symmetric.unusable(group))
    if problem is None:
        problem = symmetric.blocks_differ(group)  # the same answer on every rank
    return problem if problem is not None else _agreed(group, symmetric.take_backend())


def _agreed(group, problem: str | None) -> str | None:
    """This rank's answer to "can it run?" agreed by every rank of an NCCL
    group (a collective: the first rank's problem, named; None if none has
    one); on any other group the answer as it is (the same on every rank)."""
    if dist.get_backend(group) != "nccl" or dist.get_world_size(group) == 1:
        return problem
    told: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(told, problem, group=group)  # host sync: every rank's answer
    for rank, said in enumerate(told):
        if said is not None:
            return said if rank == dist.get_rank(group) else f"rank {rank}: {said}"
    return None


__all__ = [
    "REGISTRY",
    "AllGatherTransport",
    "AllToAllTransport",
    "AutoTransport",
    "HierarchicalNVSHMEMTransport",
    "HierarchicalTransport",
    "NVLinkTransport",
    "NVSHMEMTransport",
    "Request",
    "Transport",
    "build",
    "choose",
    "registry_key",
]
