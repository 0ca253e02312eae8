"""Dispatcher variants, one class per file behind the TokenDispatcher interface."""

from dispatch.dispatchers.alltoall import AllToAllDispatcher
from dispatch.dispatchers.base import CombineHandle, Dispatched, TokenDispatcher

VARIANT_CLASSES = {"alltoall": AllToAllDispatcher}

__all__ = ["AllToAllDispatcher", "CombineHandle", "Dispatched", "TokenDispatcher", "VARIANT_CLASSES"]
