"""The transports, one class per file behind one protocol (``transports.base``),
and the registry that makes every choice among them.

``REGISTRY`` maps (variant, transport) to the class that moves the rows:

==================  ==========  =========================================
variant             transport   class
==================  ==========  =========================================
``alltoall``        ``nccl``    :class:`AllToAllTransport` (gloo on CPU)
``alltoall``        ``nvlink``  :class:`NVLinkTransport` (the engine)
``allgather``       ``nccl``    :class:`AllGatherTransport`
``hierarchical``    ``nccl``    :class:`HierarchicalTransport`
``auto``            ``nccl``    :class:`AutoTransport` (cost model per call)
==================  ==========  =========================================

:func:`build` resolves ``DispatchConfig.transport="auto"`` (and
``variant="auto"``): the NVLink engine where it can run (every rank on one
host, NCCL, CuPy; ``nvlink.unusable``), the collectives otherwise.
"""

from __future__ import annotations

from dispatch.transports.allgather import AllGatherTransport
from dispatch.transports.alltoall import AllToAllTransport
from dispatch.transports.auto import AutoTransport
from dispatch.transports.base import Request, Transport
from dispatch.transports.hierarchical import HierarchicalTransport
from dispatch.transports.nvlink import NVLinkTransport, unusable

REGISTRY: dict[tuple[str, str], type[Transport]] = {
    (cls.variant, cls.transport): cls
    for cls in (AllToAllTransport, NVLinkTransport, AllGatherTransport, HierarchicalTransport, AutoTransport)
}


def build(config, group) -> Transport:
    """The transport ``config`` asks for over ``group``: ``REGISTRY[(variant,
    transport)]``, where ``transport="auto"`` (and ``variant="auto"``) takes the
    NVLink engine if it can run, else the collectives. Where it asks whether
    the engine can run on an NCCL group, a collective (every rank gets the same
    answer). Raises ValueError for ``transport="nvlink"`` where the engine
    cannot run, naming why."""
    variant, transport = config.variant, config.transport
    if transport != "nccl" and variant in ("alltoall", "auto"):
        problem = unusable(group, config.num_experts)
        if problem is None:
            return REGISTRY["alltoall", "nvlink"](config, group)
        if transport == "nvlink":
            raise ValueError(f"transport='nvlink': {problem}")
    return REGISTRY[variant, "nccl"](config, group)


__all__ = [
    "REGISTRY",
    "AllGatherTransport",
    "AllToAllTransport",
    "AutoTransport",
    "HierarchicalTransport",
    "NVLinkTransport",
    "Request",
    "Transport",
    "build",
]
