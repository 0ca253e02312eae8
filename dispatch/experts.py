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
the group sizes), so computing the experts by groups (``MoEExchange(groups=G)``)
gives these experts' outputs equal to those of G = 1 up to rounding, and bitwise
equal only where the kernels happen to keep the per-row reduction order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dispatch import plan
from dispatch.kernels.scatter_rows import scatter_rows
from dispatch.kernels.zero_rows import zero_rows

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
        backend: ``"auto"`` (grouped GEMM where it applies, else the loop; see
            the module doc), ``"grouped_mm"`` (always; fails where torch has no
            kernel for the dtype/device) or ``"loop"``.
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
            tokens: [M, H] rows grouped by local expert, dtype of the parameters:
                the first N = sum(tokens_per_expert), then any rows past them (a
                dispatch with ``max_rows`` gives M >= N), which no expert takes.
            tokens_per_expert: [E_local] int64 (CPU or the device of tokens).
        Returns:
            [M, H] in the dtype of tokens, zero past row N (found on the device
            by the grouped GEMMs' path: no host read). The grouped path passes
            the gradient of those rows back unchanged (its GEMMs' backward reads
            no row past N).
        """
        if tokens.dim() != 2 or tokens.shape[1] != self.hidden:
            raise ValueError(f"tokens must be [N, {self.hidden}], got shape {tuple(tokens.shape)}")
        if tokens.dtype != self.w_in.dtype:
            raise TypeError(f"tokens must be {self.w_in.dtype} like the parameters, got {tokens.dtype}")
        if tokens_per_expert.shape != (self.num_local_experts,):
            raise ValueError(
                f"tokens_per_expert must be [{self.num_local_experts}], got shape {tuple(tokens_per_expert.shape)}"
            )
        path = self._path(tokens)
        if path == "grouped_mm":
            return self._grouped(tokens, tokens_per_expert)
        return self._loop(tokens, tokens_per_expert)

    def _path(self, tokens: torch.Tensor) -> str:
        """The backend that runs for ``tokens``: ``auto`` resolved."""
        if self.backend != "auto":
            return self.backend
        available = grouped_mm_available(
            tokens.dtype, tokens.device, self.hidden, self.ffn_hidden, self.num_local_experts
        )
        return "grouped_mm" if available else "loop"

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h) if self.activation == "gelu" else F.relu(h)

    def _matmul(self, rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, counts_host):
        """rows [M, K] grouped by expert times weight [E_local, K, M'] of each expert -> [M, M']
        (``counts`` on the device for the grouped GEMM, ``counts_host`` for the loop; None:
        the loop reads ``counts``). Rows past the counts' sum: the grouped GEMM leaves
        them unspecified, the loop zero."""
        path = self._path(rows)
        if path == "grouped_mm":
            return torch._grouped_mm(_aligned(rows), weight, offs=_ends(counts))
        sizes = (counts if counts_host is None else counts_host).tolist()  # host sync where on the device
        taken = sum(sizes)
        parts = [r @ weight[e] for e, r in enumerate(rows[:taken].split(sizes))]
        parts.append(rows.new_zeros(rows.shape[0] - taken, weight.shape[2]))
        return torch.cat(parts)

    def _weight_grad(self, rows: torch.Tensor, grads: torch.Tensor, counts, counts_host) -> torch.Tensor:
        """[E_local, K, M]: for each expert, its rows [n_e, K] transposed times their
        gradients [n_e, M] (zero for an expert with no rows); rows past the counts'
        sum are not read."""
        if rows.shape[0] == 0:  # no rows at all: a grouped GEMM of contraction length 0 is not asked for
            return rows.new_zeros(counts.shape[0], rows.shape[1], grads.shape[1])
        path = self._path(rows)
        if path == "grouped_mm":
            return torch._grouped_mm(_aligned(rows).t(), _aligned(grads), offs=_ends(counts))
        sizes = (counts if counts_host is None else counts_host).tolist()  # host sync where on the device
        taken = sum(sizes)
        parts = [r.t() @ g for r, g in zip(rows[:taken].split(sizes), grads[:taken].split(sizes))]
        return torch.stack(parts) if parts else rows.new_zeros(0, rows.shape[1], grads.shape[1])

    def _grouped(self, tokens, tokens_per_expert):
        on_host = tokens_per_expert.device.type == "cpu"
        taken = _taken(tokens, sum(tokens_per_expert.tolist())) if on_host else None  # (checked where it is free)
        tokens = _aligned(tokens)
        counts = plan.to_device(tokens_per_expert, tokens.device)  # CPU counts: no stream sync for the copy
        offs = _ends(counts)
        h = _dense_grad(torch._grouped_mm(tokens, self.w_in, offs=offs))
        out = _dense_grad(torch._grouped_mm(self._act(h), self.w_out, offs=offs))
        if on_host:  # N known on the host: zero a tail only if there is one
            if taken == out.shape[0]:
                return out
            return _ZeroPast.apply(out, plan.to_device(torch.tensor([taken]), out.device))
        return _ZeroPast.apply(out, offs[-1:]) if out.shape[0] and offs.numel() else out

    def _loop(self, tokens, tokens_per_expert):
        sizes = tokens_per_expert.tolist()  # host sync: slice sizes (free for CPU counts)
        taken = _taken(tokens, sum(sizes))
        outs = []
        for e, rows in enumerate(tokens[:taken].split(sizes)):
            outs.append(self._act(rows @ self.w_in[e]) @ self.w_out[e])
        if tokens.shape[0] > taken:  # rows past the experts' (a dispatch with max_rows)
            outs.append(tokens.new_zeros(tokens.shape[0] - taken, self.hidden))
        if not outs:
            return tokens.new_zeros(0, self.hidden)
        return torch.cat(outs)


class _ZeroPast(torch.autograd.Function):
    """Rows from ``first`` (one device integer) on zeroed in place, with no host
    read; the gradient passes back unchanged (see ``GroupedExperts.forward``)."""

    @staticmethod
    def forward(ctx, rows, first):
        zero_rows(rows, first)
        ctx.mark_dirty(rows)
        return rows

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _taken(tokens: torch.Tensor, taken: int) -> int:
    """``taken``, the rows the experts' counts sum to, where ``tokens`` holds them."""
    if tokens.shape[0] < taken:
        raise ValueError(f"tokens has {tokens.shape[0]} rows, fewer than tokens_per_expert counts ({taken})")
    return taken


def _aligned(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as the grouped GEMM's TMA loads need them: unit column stride,
    16-byte aligned rows and start."""
    align = 16 // rows.element_size()
    if rows.stride(1) != 1 or rows.stride(0) % align or rows.data_ptr() % 16:
        return rows.clone(memory_format=torch.contiguous_format)
    return rows


def _ends(counts: torch.Tensor) -> torch.Tensor:
    """int32 row end of each expert, for ``torch._grouped_mm``'s ``offs``."""
    return torch.cumsum(counts, 0).to(torch.int32)


def _dense_grad(out: torch.Tensor) -> torch.Tensor:
    """``out``, whose gradient is made contiguous before the grouped GEMM's backward
    takes it: that backward refuses gradients with no unit stride, such as the
    expanded (stride 0) gradient of a plain ``.sum()`` (with no rows too, where
    ``contiguous()`` would keep the strides)."""
    if out.requires_grad:
        out.register_hook(lambda grad: grad.contiguous() if grad.numel() else grad.new_empty(grad.shape))
    return out


class ExpertsByGroups:
    """:class:`GroupedExperts` over the G groups of one ``MoEExchange`` step (its
    groups of local experts), with the weight gradients computed once, over the
    rows of all groups.

    Backward per group computes only what the exchange waits for (the rows'
    gradients and, kept for later, the gradient at the first GEMM's output);
    after the last group, one grouped GEMM per weight forms its gradient from
    every group's rows. Rows are kept expert-major over the groups (expert e's
    rows of group 0, then of group 1, ...), which is the canonical order of the
    whole step: each expert's weight gradient is one GEMM over the same rows in
    the same order for every G, and no group writes a full set of weight
    gradients. (The activations and gradients in those rows come from
    group-sized GEMMs, so the parameter gradients equal those of G = 1 where
    the GEMMs give a row the same bits whatever the batch, and to rounding
    otherwise.) What a weight gradient needs is kept only for a weight that
    requires grad: for ``w_in`` the rows and the first GEMM's output
    gradients, for ``w_out`` the activations and the output gradients, all
    groups' at once until the end of backward.

    Args:
        experts: the :class:`GroupedExperts`.
        counts: per group, [E_local] int64 rows per expert on the device; None
            for a group whose counts come later (:meth:`set_counts`, before its
            forward; what earlier groups keep waits for them).
        counts_host: the same on the host.
        grad_on: keep what backward needs.
        group_rows: B, for groups given as B rows each, the group's own first and
            then rows that no expert takes (a dispatch by groups with ``max_rows``,
            or micro-batches dispatched with it), with counts on the device only
            (``counts_host`` None): nothing is read on the host. The rows kept
            for the weight gradients are placed expert-major on the device, the
            same rows in the same order as one group's.
        micro_batches: the groups are micro-batches, each with rows of any local
            expert, not groups of experts: the rows kept are placed expert-major
            over all of them (expert e's rows of micro-batch 0, then of 1, ...)
            once every group's counts are known, so that each weight's gradient
            is one GEMM over every micro-batch's rows (no sum of M gradients).
    """

    def __init__(self, experts: GroupedExperts, counts, counts_host, grad_on: bool,
                 group_rows: int | None = None, micro_batches: bool = False) -> None:
        self.experts, self.grad_on = experts, grad_on
        self.counts, self.counts_host = list(counts), list(counts_host)
        self.need_in = grad_on and experts.w_in.requires_grad
        self.need_out = grad_on and experts.w_out.requires_grad
        groups = len(counts)
        self.group_rows, self.micro_batches = group_rows, micro_batches
        if group_rows is None:
            self.rows = [None if g is None else int(g.sum()) for g in counts_host]
            self.places = None  # per group, the expert-major row of each of its rows (made on first use)
        else:  # B rows a group: groups of experts placed as their counts come (in group order), micro-batches
            # once every group's counts are in
            if any(g is not None for g in counts):
                raise ValueError("group_rows: give each group's counts by set_counts, in group order")
            self.rows = [group_rows] * groups
            self.places = None if micro_batches else [None] * groups  # (micro-batches: once all counts are in)
            self.taken = [None] * groups  # per group, [1] its rows (on the device)
            self._before = None  # [1] the rows of the groups placed so far (on the device)
        self.waiting = []  # (kept name, group, rows) until every group's counts are known
        self.tokens = self.acts = self.grad_outs = self.grad_hidden = None
        self.hidden, self.outs = [None] * groups, [None] * groups
        self.experts_of: list[tuple[int, int] | None] = [None] * groups

    def set_counts(self, g: int, counts: torch.Tensor, counts_host: torch.Tensor,
                   experts: tuple[int, int] | None = None) -> None:
        """Group g's counts, given as None at construction. What earlier groups
        keep is placed with group g's first kept rows, behind its GEMMs (with
        ``forward(defer_keep=True)``, by :meth:`place_kept`); over micro-batches
        (``micro_batches``) once every group's counts are in. ``experts``:
        (first, end), the only local experts with rows in group g (a group of
        experts): its GEMMs then take those experts' weights and counts alone,
        so that a grouped GEMM is sized for the experts it computes."""
        if self.counts[g] is not None:
            raise ValueError(f"group {g}'s counts were given already")
        if self.group_rows is not None and g and self.taken[g - 1] is None:
            raise ValueError(f"group {g}'s counts came before group {g - 1}'s: give them in group order")
        self.counts[g], self.counts_host[g], self.experts_of[g] = counts, counts_host, experts
        if self.group_rows is None:
            self.rows[g] = int(counts_host.sum())
        elif self.micro_batches:
            self.taken[g] = counts.sum().reshape(1)
        else:
            self._place_group(g)

    def _place_group(self, g: int) -> None:
        """Group g's places (``group_rows``): its row j < n_c goes to j plus the rows of
        the earlier groups, the rest to the dump row past them all (on the device)."""
        counts, bound = self.counts[g], self.group_rows
        taken = counts.sum().reshape(1)
        before = self._before if g else torch.zeros_like(taken)
        local = torch.arange(bound, device=counts.device)
        self.places[g] = torch.where(local < taken, before + local, len(self.rows) * bound)
        self.taken[g], self._before = taken, before + taken

    def _sliced(self, g: int, weight: torch.Tensor):
        """(weight, counts, host counts) of group g's GEMMs: its experts' only
        where it is a group of experts."""
        if self.experts_of[g] is None:
            return weight, self.counts[g], self.counts_host[g]
        first, end = self.experts_of[g]
        host = self.counts_host[g]
        return weight[first:end], self.counts[g][first:end], None if host is None else host[first:end]

    def forward(self, g: int, tokens: torch.Tensor, defer_keep: bool = False) -> torch.Tensor:
        """Group g's rows [N_g, H] -> [N_g, H] (detached). ``defer_keep``: what
        backward keeps of the group is placed by :meth:`place_kept` (at the
        latest by :meth:`weight_grads`), not behind its GEMMs."""
        e = self.experts
        w_in, w_out = e.w_in.detach(), e.w_out.detach()
        h = e._matmul(tokens, *self._sliced(g, w_in))
        if not self.grad_on:
            return self._zero_past(g, e._matmul(e._act(h), *self._sliced(g, w_out)))
        h.requires_grad_()
        with torch.enable_grad():
            act = e._act(h)
            y = self._zero_past(g, e._matmul(act, *self._sliced(g, w_out)))
        self.hidden[g], self.outs[g] = h, y
        keep = self.waiting.append if defer_keep else (lambda item: self._keep(*item))
        if self.need_in:
            keep(("tokens", g, tokens))
        if self.need_out:
            keep(("acts", g, act.detach()))
        return y.detach()

    def _zero_past(self, g: int, y: torch.Tensor) -> torch.Tensor:
        """Group g's output with the rows past its own zeroed (``group_rows``)."""
        return y if self.group_rows is None else _ZeroPast.apply(y, self.taken[g])

    def place_kept(self) -> None:
        """Place what waits to be kept, once every group's counts are known."""
        if self.waiting and self._placeable():
            self._place_waiting()

    def _placeable(self) -> bool:
        """Whether kept rows can be placed now: the placement needs every
        group's counts, except for groups of experts with ``group_rows`` (each
        group's places are made as its counts come)."""
        if self.group_rows is None:
            return None not in self.rows
        return not self.micro_batches or all(c is not None for c in self.counts)

    def output(self, g: int) -> torch.Tensor:
        """Group g's output as :meth:`forward` returned it."""
        return self.outs[g].detach()

    def backward(self, g: int, grad_y: torch.Tensor, rows_grad: bool) -> torch.Tensor | None:
        """Gradient of group g's output -> gradient of its rows (if ``rows_grad``);
        keeps what the weight gradients need, and frees the group's graph."""
        e = self.experts
        (grad_h,) = torch.autograd.grad(self.outs[g], [self.hidden[g]], grad_y)
        self.hidden[g] = self.outs[g] = None
        # the rows' gradients first: what the exchange home waits for is queued before the keeping
        grad_rows = e._matmul(grad_h, *self._sliced(g, e.w_in.detach().transpose(1, 2))) if rows_grad else None
        if self.need_out:
            self._keep("grad_outs", g, grad_y)
        if self.need_in:
            self._keep("grad_hidden", g, grad_h)
        return grad_rows

    def weight_grads(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(grad of w_in, grad of w_out), once every group's backward has run;
        None for a weight that does not require grad."""
        e = self.experts
        if self.waiting:
            self._place_waiting()
        counts = self.counts[0] if len(self.counts) == 1 else sum(self.counts)
        hosts = self.counts_host
        counts_host = None if None in hosts else hosts[0] if len(hosts) == 1 else sum(hosts)
        grad_in = e._weight_grad(self.tokens, self.grad_hidden, counts, counts_host) if self.need_in else None
        grad_out = e._weight_grad(self.acts, self.grad_outs, counts, counts_host) if self.need_out else None
        self.tokens = self.acts = self.grad_outs = self.grad_hidden = None
        return grad_in, grad_out

    def param_grads(self, params) -> list:
        """:meth:`weight_grads` for ``params``, a selection of ``w_in`` / ``w_out``."""
        by_param = dict(zip((id(self.experts.w_in), id(self.experts.w_out)), self.weight_grads()))
        return [by_param[id(p)] for p in params]

    def _keep(self, name: str, g: int, rows: torch.Tensor) -> None:
        """Group g's rows placed expert-major in the buffer ``name`` (allocated on
        first use), row-major like the buffer of several groups, so that the
        weight-gradient GEMMs see the same layout for every G."""
        if len(self.rows) == 1:
            setattr(self, name, rows.contiguous())
            return
        if not self._placeable():
            self.waiting.append((name, g, rows))
            return
        self._place_waiting()
        held = getattr(self, name)
        if held is None:  # by groups with padding, a dump row past them all
            held = rows.new_empty(sum(self.rows) + (self.group_rows is not None), rows.shape[1])
        setattr(self, name, scatter_rows(held, self.places[g], rows))

    def _place_waiting(self) -> None:
        """Make the placement if need be, and place what waited for the counts."""
        if self.places is None and len(self.rows) > 1:  # (one group keeps its rows as they are)
            self.places = self._expert_major() if self.group_rows is None else self._expert_major_bounded()
        waiting, self.waiting = self.waiting, []
        for earlier in waiting:
            self._keep(*earlier)

    def _expert_major_bounded(self) -> list[torch.Tensor]:
        """Per micro-batch of B = ``group_rows`` rows, [B] the expert-major row of
        each of its rows over all micro-batches (as :meth:`_expert_major` places
        them), its rows past its own to the dump row past them all; on the device."""
        counts = torch.stack(self.counts)  # [G, E_local]
        groups, bound = counts.shape[0], self.group_rows
        total = counts.sum(0)
        shift = ((torch.cumsum(total, 0) - total)  # expert e's first row, expert-major
                 + (torch.cumsum(counts, 0) - counts)  # its rows in earlier micro-batches
                 - (torch.cumsum(counts, 1) - counts))  # minus its first row in its micro-batch
        local = torch.arange(bound, device=counts.device).expand(groups, bound).contiguous()
        expert = torch.searchsorted(torch.cumsum(counts, 1), local, right=True).clamp_(max=counts.shape[1] - 1)
        taken = torch.cat(self.taken).unsqueeze(1)
        places = torch.where(local < taken, local + shift.gather(1, expert), groups * bound)
        return list(places.unbind(0))

    def _expert_major(self) -> list[torch.Tensor]:
        """Per group, [N_g] the expert-major row of each of its rows. Row g of
        all groups' rows (group-major) goes to g plus a shift that depends only
        on its run (group, expert): the shifts are worked out on the host from
        the host counts, then spread over the rows on the device in a few
        kernels (their launches bind the host, not the GPU: made on first use,
        in group 0's forward once its GEMMs are queued)."""
        per_group = torch.stack([counts.to("cpu", torch.int64) for counts in self.counts_host])  # [G, E_local]
        total, sizes = per_group.sum(0), per_group.sum(1)
        shift = (
            (torch.cumsum(total, 0) - total)  # expert e's first row, expert-major
            + (torch.cumsum(per_group, 0) - per_group)  # its rows in earlier groups
            - (torch.cumsum(per_group, 1) - per_group)  # minus the run's first row in its group
            - (torch.cumsum(sizes, 0) - sizes)[:, None]  # minus the group's first row
        )
        device = self.counts[0].device
        rows = sum(self.rows)
        runs = torch.cat([counts.view(-1) for counts in self.counts])
        spread = torch.repeat_interleave(plan.to_device(shift.view(-1), device), runs, output_size=rows)
        return list((torch.arange(rows, device=device) + spread).split(self.rows))
