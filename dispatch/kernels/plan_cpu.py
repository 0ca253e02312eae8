"""The routing plan and the gathered sums on CPU, compiled (``csrc/plan_cpu.cpp``).

On CPU (gloo) the collectives' transports plan in torch operations: some 150
small operations a round trip, each a Python call and the framework's per-op
overhead, for work that is a few loops over [T, K]. The compiled module does
each step of one group in one call, with the same results, bitwise (integer
tables; the sums in the same order, each product and sum rounded once):

* ``route``: ``plan.route_reference``;
* ``route_row``: ``plan_graph.route_phase_reference`` (the value checks folded in);
* ``send_plan``: ``plan_graph.send_phase`` (the send plan, summary and receive table);
* ``recv_plan``: ``plan.build_recv_plan_reference``;
* ``gather_sum``: ``kernels.gather_sum.gather_sum_reference``;
* for the all-gather and hierarchical variants (and ``auto``'s counts exchange):
  ``counts_row`` (``counts.route_and_row``), ``send_order`` (``counts.send_order``)
  and ``expand`` (``counts.expand_reference``); for the hierarchical variant also
  ``tier_plan`` and ``forward_order`` (``transports.hierarchical``).

It is built at first use (``dispatch.build``: a C++ compiler and ninja, under a
minute once per machine). Where it cannot be built, the torch operations run
(the same results, more host time); :func:`why_not` says why.
"""

from __future__ import annotations

import torch

from dispatch import build

enabled = True  # False: the torch operations run (the same results)
_built: tuple = ()  # (the module or None, why not or None), once a process


def module():
    """The compiled module where it is enabled and builds here, else None."""
    return (_built or _build())[0] if enabled else None


def why_not() -> str | None:
    """Why the module does not build here (None where it does)."""
    return (_built or _build())[1]


def cached() -> bool:
    """Whether the module was built on this machine before (else its first use builds it)."""
    return bool(_built) or build.cached(_SOURCE, _PREFIX)


_SOURCE, _PREFIX = "plan_cpu.cpp", "dispatch_plan_cpu"


def _build() -> tuple:
    global _built
    _built = build.load(_SOURCE, _PREFIX, cflags=("-O2", "-ffp-contract=off"))
    return _built


def on_cpu(tensor: torch.Tensor):
    """The module where ``tensor`` is on the CPU and the module is enabled and built, else None."""
    return (_built or _build())[0] if enabled and tensor.is_cpu else None


def on_host(name: str, rows: torch.Tensor, *args) -> list[torch.Tensor]:
    """The module's function ``name`` of ``rows`` on a GPU run on the host (the module
    built): ``rows`` copied to the host (a host sync), the results back as :func:`upload`."""
    return upload(getattr(module(), name)(rows.cpu(), *args), rows.device)


def upload(parts, device: torch.device) -> list[torch.Tensor]:
    """Host tensors of 8-byte elements on ``device`` in one copy from pinned memory."""
    flat = torch.cat([part.reshape(-1).view(torch.int64) for part in parts])
    if device.type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    out, at = [], 0
    for part in parts:
        out.append(flat[at : at + part.numel()].view(part.dtype).view(part.shape))
        at += part.numel()
    return out
