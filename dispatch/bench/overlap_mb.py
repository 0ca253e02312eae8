"""``dispatch-bench overlap --micro-batches``: M micro-batches through
MoEMicroBatches against the same work with nothing overlapped, and against
MoEExchange on each in a row (see ``dispatch.bench.overlap``'s T_mb)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from dispatch.micro_batches import MoEMicroBatches


def micro_batch_step(case, backward: bool, serial: bool = False, sm_carveout: int | None = None,
                     max_rows: int | None = None, sm_partition: int | None = None):
    """The micro-batches of ``case`` (an overlap ``Case``: ``x``, then ``more``)
    through MoEMicroBatches (each dispatch with ``max_rows``), its GEMMs leaving
    ``sm_carveout`` SMs to the exchange beside them; ``serial``: every kernel on
    the caller's stream in the order issued (:func:`one_stream`; no carveout);
    ``sm_partition``: MoEMicroBatches' (the exchange on that many SMs split off,
    the GEMMs on the rest). Returns a step that returns the outputs."""
    layer = MoEMicroBatches(case.dispatcher, case.experts, sm_carveout=None if serial else sm_carveout,
                            max_rows=max_rows, sm_partition=None if serial else sm_partition)

    def run():
        xs = [x.detach().requires_grad_(backward) for x in (case.x, *case.more)]
        ws = [case.topk_weights.detach().requires_grad_(backward) for _ in xs]
        with one_stream(layer, case.x.device) if serial else contextlib.nullcontext():
            outs = layer(xs, [case.topk_idx] * len(xs), ws)
            if backward:
                torch.autograd.backward(outs, [case.grad] * len(outs))
        if backward:
            case.experts.zero_grad(set_to_none=True)
        return outs

    return run


def layer_steps(case, seq, backward: bool):
    """A step of the layer ``seq`` on each micro-batch of ``case`` in a row, the
    experts' gradients summed over them as a training step accumulates them
    (T_mb_layer's step)."""
    def run():
        for x in (case.x, *case.more):
            out = seq(x.detach().requires_grad_(backward), case.topk_idx,
                      case.topk_weights.detach().requires_grad_(backward))
            if backward:
                out.backward(case.grad)
        case.experts.zero_grad(set_to_none=True)

    return run


@contextlib.contextmanager
def one_stream(layer: MoEMicroBatches, device: torch.device):
    """Inside, on CUDA: ``layer``'s exchanges, their plans and the NVSHMEM
    transport's data kernels run on the caller's stream, in the order issued:
    the schedule's work with nothing beside anything (T_mb_serial)."""
    if device.type != "cuda":
        yield
        return
    caller = torch.cuda.current_stream(device)
    streams, exchange = layer.dispatcher._streams, getattr(layer.dispatcher.transport, "exchange", None)
    saved = (streams.__dict__.get("stream"), layer._plans, getattr(exchange, "_own", None))
    streams.stream, layer._plans = (lambda device, priority: caller), caller
    if saved[2] is not None:
        exchange._own = caller  # (the stream its kernels take where no SM partition is in use)
    try:
        yield
    finally:
        if saved[0] is None:
            del streams.stream  # (the class's method again)
        else:
            streams.stream = saved[0]
        layer._plans = saved[1]
        if saved[2] is not None:
            exchange._own = saved[2]


def micro_batches(case, seq, backward: bool, timed, peak, group, sm_carveout: int | None,
                  max_rows: int | None, sm_partition: int | None = None, graph_ms=None,
                  graph_rows: int | None = None) -> dict:
    """T_mb (the micro-batches through MoEMicroBatches, the GEMMs leaving
    ``sm_carveout`` SMs free), T_mb_serial (the same on one stream), T_mb_layer
    (the layer ``seq`` on each in a row, the experts' gradients summed over
    them as a training step accumulates them), and the largest difference of
    the outputs from ``seq``'s (collective); the dispatches with ``max_rows``.
    With ``backward``, also the peak memory (``peak(fn)``, MiB or None) of
    T_mb_layer's step and of T_mb's. With ``graph_ms`` (``graph_ms(step)``: the
    time of a replay of ``step`` captured), T_mb and T_mb_serial of the step
    captured whole, each dispatch with ``max_rows=graph_rows``."""
    xs = (case.x, *case.more)
    layers = layer_steps(case, seq, backward)
    t_layer = timed(layers)[0]
    t_serial = timed(micro_batch_step(case, backward, serial=True, max_rows=max_rows))[0]
    overlapped = micro_batch_step(case, backward, sm_carveout=sm_carveout, max_rows=max_rows,
                                  sm_partition=sm_partition)
    t_mb = timed(overlapped)[0]
    peaks = (peak(layers), peak(overlapped)) if backward else (None, None)
    with torch.no_grad():
        want = [seq(x, case.topk_idx, case.topk_weights) for x in xs]
        got = (micro_batch_step(case, False, sm_carveout=sm_carveout, max_rows=max_rows, sm_partition=sm_partition)()
               + micro_batch_step(case, False, serial=True, max_rows=max_rows)())
    diff = max(((g.float() - w.float()).abs().max().item() if g.numel() else 0.0) for g, w in zip(got, want * 2))
    diff = torch.tensor([diff], device=case.x.device)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    graphs = {}
    if graph_ms is not None:  # the serial schedule first, then the overlapped one, each captured whole
        graphs["t_mb_serial_graph_ms"] = graph_ms(micro_batch_step(case, backward, serial=True, max_rows=graph_rows))
        graphs["t_mb_graph_ms"] = graph_ms(micro_batch_step(case, backward, sm_carveout=sm_carveout,
                                                            max_rows=graph_rows))
    return {"t_mb_layer_ms": t_layer, "t_mb_serial_ms": t_serial, "t_mb_ms": t_mb, "max_abs_diff_mb": float(diff),
            "peak_mib_mb_layer": peaks[0], "peak_mib_mb": peaks[1], **graphs}


def micro_batch_cell(row: dict) -> str:
    """"T_mb_layer / T_mb_serial / T_mb (hidden_mb)": "20.000 / 12.345 / 10.000 (0.41)",
    then where measured "; peak MiB 900 / 1800" (T_mb_layer's step, T_mb's); "-" where not measured."""
    if row.get("t_mb_ms") is None:
        return "-"
    cell = f"{row['t_mb_layer_ms']:.3f} / {row['t_mb_serial_ms']:.3f} / {row['t_mb_ms']:.3f} ({row['hidden_mb']:.2f})"
    if row.get("peak_mib_mb") is not None:
        cell += f"; peak MiB {row['peak_mib_mb_layer']:.0f} / {row['peak_mib_mb']:.0f}"
    if row.get("t_mb_graph_ms") is not None:
        cell += (f"; captured T_mb_serial / T_mb {row['t_mb_serial_graph_ms']:.3f} / {row['t_mb_graph_ms']:.3f} "
                 f"({row['hidden_mb_graph']:.2f})")
    return cell
