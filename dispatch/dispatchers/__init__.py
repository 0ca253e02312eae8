"""Dispatcher variants, one class per file behind the TokenDispatcher interface."""

from dispatch.dispatchers.allgather import AllGatherDispatcher
from dispatch.dispatchers.alltoall import AllToAllDispatcher
from dispatch.dispatchers.auto import AutoDispatcher
from dispatch.dispatchers.base import CombineHandle, Dispatched, DispatchWork, ExchangeWork, TokenDispatcher
from dispatch.dispatchers.hierarchical import HierarchicalDispatcher

VARIANT_CLASSES = {
    "alltoall": AllToAllDispatcher,
    "allgather": AllGatherDispatcher,
    "hierarchical": HierarchicalDispatcher,
    "auto": AutoDispatcher,
}

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "AutoDispatcher",
    "CombineHandle",
    "DispatchWork",
    "Dispatched",
    "ExchangeWork",
    "HierarchicalDispatcher",
    "TokenDispatcher",
    "VARIANT_CLASSES",
]
