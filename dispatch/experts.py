"""GroupedExperts: the E_local feed-forward experts of one rank, as grouped GEMMs.

Notation: N rows (canonical order: grouped by local expert), E_local experts,
H hidden size, F the experts' ffn hidden size.

    swiglu:       out = (silu(x W_gate) * (x W_up)) W_down
    gelu / relu:  out = act(x W_up) W_down

Two paths compute the same thing:

* ``grouped_mm``: ``torch._grouped_mm(rows [N, H], weights [E_local, H, F],
  offs=[E_local] int32 cumulative row ends)``, one kernel for all experts (an
  expert with no rows is fine, and so is N = 0). Used by ``backend="auto"`` for
  bf16 on CUDA devices of compute capability 9.0 (Hopper) with H and F multiples
  of 8 (16-byte rows, as the kernel's TMA loads need) and E_local < 1024 (the
  kernel's limit). Elsewhere torch runs a per-expert fallback with a host
  synchronisation (``offs`` read on the host); ``backend="grouped_mm"`` takes it.
* ``loop``: one matmul per expert over its slice of rows. Runs everywhere; on
  CUDA it sizes the slices on the host (one synchronisation per call if
  ``tokens_per_expert`` is on the GPU).

Neither a grouped GEMM nor a library matmul promises that a row's result is
bitwise independent of the other rows of the batch (the tiling may depend on
the group sizes), so chunking the tokens (``MoEExchange(chunks=C)``) gives these
experts' outputs equal to those of C = 1 up to rounding, and bitwise equal only
where the kernels happen to keep the per-row reduction order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("swiglu", "gelu", "relu")
BACKENDS = ("auto", "grouped_mm", "loop")


GROUPED_MM_MAX_GROUPS = 1023  # torch's CUDA grouped GEMM refuses 1024 groups or more


def grouped_mm_available(
    dtype: torch.dtype, device: torch.device, hidden: int, ffn_hidden: int, num_groups: int = 1
) -> bool:
    """Whether ``backend="auto"`` takes the ``torch._grouped_mm`` path for these
    sizes (``num_groups``: E_local)."""
    if not hasattr(torch, "_grouped_mm") or dtype != torch.bfloat16 or device.type != "cuda":
        return False
    if hidden % 8 or ffn_hidden % 8 or num_groups > GROUPED_MM_MAX_GROUPS:
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


class GroupedExperts(nn.Module):
    """E_local experts applied to rows grouped by expert.

    Args:
        num_local_experts: E_local.
        hidden: H, width of the rows in and out.
        ffn_hidden: F, width of each expert's hidden layer.
        activation: ``"swiglu"`` (gate and up projections), ``"gelu"`` or ``"relu"``.
        backend: ``"auto"`` (grouped GEMM where it applies, see the module doc),
            ``"grouped_mm"`` (always; fails where torch has no kernel for the
            dtype/device) or ``"loop"``.
        dtype, device: of the parameters.

    Parameters: ``w_in`` [E_local, H, F] (``2F`` for swiglu: gate then up),
    ``w_out`` [E_local, F, H]; initialised N(0, 1/sqrt(fan_in)).
    """

    def __init__(
        self,
        num_local_experts: int,
        hidden: int,
        ffn_hidden: int,
        activation: str = "swiglu",
        backend: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("num_local_experts", num_local_experts), ("hidden", hidden), ("ffn_hidden", ffn_hidden)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.num_local_experts, self.hidden, self.ffn_hidden = num_local_experts, hidden, ffn_hidden
        self.activation, self.backend = activation, backend
        width = 2 * ffn_hidden if activation == "swiglu" else ffn_hidden
        factory = dict(dtype=dtype, device=device)
        self.w_in = nn.Parameter(torch.randn(num_local_experts, hidden, width, **factory) * hidden**-0.5)
        self.w_out = nn.Parameter(torch.randn(num_local_experts, ffn_hidden, hidden, **factory) * ffn_hidden**-0.5)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Args:
            tokens: [N, H] rows grouped by local expert, dtype of the parameters.
            tokens_per_expert: [E_local] int64 (CPU or the device of tokens), summing to N.
        Returns:
            [N, H] in the dtype of tokens.
        """
        if tokens.dim() != 2 or tokens.shape[1] != self.hidden:
            raise ValueError(f"tokens must be [N, {self.hidden}], got shape {tuple(tokens.shape)}")
        if tokens.dtype != self.w_in.dtype:
            raise TypeError(f"tokens must be {self.w_in.dtype} like the parameters, got {tokens.dtype}")
        if tokens_per_expert.shape != (self.num_local_experts,):
            raise ValueError(
                f"tokens_per_expert must be [{self.num_local_experts}], got shape {tuple(tokens_per_expert.shape)}"
            )
        if self._use_grouped_mm(tokens):
            return self._grouped(tokens, tokens_per_expert)
        return self._loop(tokens, tokens_per_expert)

    def _use_grouped_mm(self, tokens: torch.Tensor) -> bool:
        if self.backend == "auto":
            return grouped_mm_available(
                tokens.dtype, tokens.device, self.hidden, self.ffn_hidden, self.num_local_experts
            )
        return self.backend == "grouped_mm"

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h) if self.activation == "gelu" else F.relu(h)

    def _grouped(self, tokens, tokens_per_expert):
        align = 16 // tokens.element_size()  # the kernel's TMA loads: 16-byte aligned rows, unit column stride
        if tokens.stride(1) != 1 or tokens.stride(0) % align or tokens.data_ptr() % 16:
            tokens = tokens.clone(memory_format=torch.contiguous_format)
        counts = tokens_per_expert.to(tokens.device, non_blocking=True)  # CPU counts: no stream sync for the copy
        offs = torch.cumsum(counts, 0).to(torch.int32)  # row end of each expert
        h = _dense_grad(torch._grouped_mm(tokens, self.w_in, offs=offs))
        return _dense_grad(torch._grouped_mm(self._act(h), self.w_out, offs=offs))

    def _loop(self, tokens, tokens_per_expert):
        sizes = tokens_per_expert.tolist()  # host sync: slice sizes (free for CPU counts)
        outs = []
        for e, rows in enumerate(tokens.split(sizes)):
            outs.append(self._act(rows @ self.w_in[e]) @ self.w_out[e])
        if not outs:
            return tokens.new_zeros(0, self.hidden)
        return torch.cat(outs)


def _dense_grad(out: torch.Tensor) -> torch.Tensor:
    """``out``, whose gradient is made contiguous before the grouped GEMM's backward
    takes it: that backward refuses gradients with no unit stride, such as the
    expanded (stride 0) gradient of a plain ``.sum()`` (with no rows too, where
    ``contiguous()`` would keep the strides)."""
    if out.requires_grad:
        out.register_hook(lambda grad: grad.contiguous() if grad.numel() else grad.new_empty(grad.shape))
    return out
