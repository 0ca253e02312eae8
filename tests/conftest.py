import os
import sys

import pytest
import torch

# Triton kernels run under the interpreter where there is no GPU; this must be
# set before triton.jit sees the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))

from world import World  # noqa: E402


@pytest.fixture(scope="session")
def worlds():
    """``worlds(W)``: a live world of W ranks, shared by the whole session."""
    alive: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in alive:
            alive[size] = World(size)
        return alive[size]

    yield get
    for world in alive.values():
        world.close()
