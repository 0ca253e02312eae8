"""A real Megatron-Core ``MoELayer`` and ``GPTModel``, with Megatron's dispatcher and with ours.

Three parts, in one run over every local GPU (one process per GPU, NCCL), with
megatron-core 0.19 importable and no Transformer Engine needed (local specs,
``SequentialMLP`` experts):

1. ``layer``: one ``MoELayer`` (bf16, top-k router in fp32) built twice with the
   same weights; one keeps Megatron's ``alltoall`` dispatcher, the other gets ours
   through ``dispatch.integrations.megatron.install``. Same input, same output
   gradient: the outputs, the input gradients and every parameter gradient must
   agree within bf16 tolerance (max |a - b| / max |a| per tensor, worst rank).
   Then again with shared experts that each dispatcher runs beside its exchange
   (``moe_shared_expert_overlap=True``; ``install`` hands them over).
2. ``train``: a small two-layer ``GPTModel`` with MoE layers, built twice with the
   same weights, trained ``--steps`` steps on one fixed batch each way (Adam,
   gradients of the dense parameters averaged over the world): the losses must
   agree step by step. Three runs: top-2 of 2 experts per rank in fp32 and in bf16,
   and top-8 of 8 experts per rank in bf16 with token dropping (capacity factor
   1.0, drop policy ``probs``: Megatron's router drops, both dispatchers move what
   it kept).
3. ``graphs``: the two-layer ``GPTModel`` with Megatron's local CUDA graphs
   (``cuda_graph_impl="local"``) holding the dispatcher: ``moe_preprocess`` (the
   router and ``dispatch_preprocess``; dropless) and ``moe`` (whole layers, every
   stage; padded to capacity, capacity factor 1.0, on the NVLink engine with fixed
   rows). Trained ``--graph-steps`` steps eager and captured (the graphs are made
   after the first step, as Megatron's schedules make them, and replayed after),
   with Megatron's dispatcher and with ours: each captured run's losses must match
   its eager run's step by step, and ours Megatron's. The layers are Megatron's
   ``MoETransformerLayer`` (a plain ``TransformerLayer`` makes no graph of the MoE
   scopes).
4. ``overlap``: the same model trained by Megatron's schedule (two micro-batches a
   step) with and without ``overlap_moe_expert_parallel_comm`` (its combined 1F1B
   schedule runs each layer's stages as separate nodes, two micro-batches at once),
   with each dispatcher: the overlapped losses must match the plain ones step by
   step, and ours Megatron's.
5. ``timing``: forward + backward of one deepseek-v3-like ``MoELayer`` (H 7168,
   expert FFN 2048, ``--experts`` experts, top-8, sigmoid scores) with each
   dispatcher swapped into the same layer, ours also with the experts by
   ``--overlap-groups`` groups beside the exchange (``install(overlap=...)``, a row
   for each G), and
   the layer's experts alone on the rows ours hands them (forward + backward, no
   exchange) and the layer's router alone (forward + backward); CUDA events after
   warm-up and a barrier, median and p10-p90 over ``--iters``. Megatron's time
   outside its experts is its layer's less the experts alone, its dispatch and
   combine that less the router alone too; the report gives the share of each that
   ours saves.

    python3 bench/megatron_layer.py --out bench/results/

Writes ``megatron-layer-w{W}.json`` and ``.md`` to ``--out``; returns 1 when a
check fails or a part raises (each part runs even when one before it raised; the
error is in the report), 2 without CUDA or megatron-core (Megatron's router and ``alltoall``
dispatcher run only on CUDA; tests/test_megatron_layer.py checks the adapter in a
real ``MoELayer`` on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import traceback
import warnings

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dispatch

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dispatch  # noqa: E402
from dispatch.bench.common import (device, environment, launch, profile_text, spread, time_phases,  # noqa: E402
                                   world_size_for)
from dispatch.bench.megatron_baseline import _ensure_parallel_state, megatron_available  # noqa: E402

LAYER_TOLERANCE = 2e-2  # bf16: relative to the tensor's largest magnitude
LOSS_TOLERANCE = {"fp32": 1e-3, "bf16": 3e-2}  # relative, per step
GPT_SHAPE = {"vocab": 512, "seq": 128, "batch": 4}  # the trained GPTModels' vocabulary, sequence, batch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/megatron_layer.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="layer,train,graphs,overlap,timing",
                        help="comma-separated: layer, train, graphs, overlap, timing")
    parser.add_argument("--world-size", type=int, help="ranks to start (default: all GPUs)")
    parser.add_argument("--steps", type=int, default=50, help="training steps each way (default 50)")
    parser.add_argument("--graph-steps", type=int, default=10,
                        help="training steps of the graphs and overlap parts (default 10)")
    parser.add_argument("--experts", type=int, default=256, help="experts of the timed layer (default 256)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank of the timed layer (default 4096)")
    parser.add_argument("--iters", type=int, default=10, help="timed forward+backward passes (default 10)")
    parser.add_argument("--overlap-groups", type=int, default=None,
                        nargs="+",
                        help="groups of local experts of the timed overlapped layer, a row each (default: "
                             "install(overlap=True)'s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed passes first (default 3)")
    parser.add_argument("--trace", action="store_true",
                        help="timing: profile one more pass of each row (torch.profiler): the GPU's busy time "
                             "against the pass's wall time, the kernels and host operations that took longest, "
                             "the host's time to issue a pass (unprofiled); rank 0's timeline of each row in "
                             "OUT/traces/ (chrome trace JSON)")
    parser.add_argument("--host-profile", action="store_true",
                        help="timing: profile the host's Python over one more pass of each row (cProfile, rank 0), "
                             "the functions that took longest, in OUT/host-profile-<row>.txt")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine option for an extra 'ours' timing row, e.g. dispatch_wire=fp8 (repeatable)")
    parser.add_argument("--out", default="dispatch-results", help="folder for JSON and markdown results")
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = sorted(set(args.parts) - {"layer", "train", "graphs", "overlap", "timing"})
    if bad or not args.parts:
        parser.error(f"--parts must name some of layer, train, graphs, overlap, timing; got {bad or 'nothing'}")
    for name in ("steps", "graph_steps", "experts", "tokens", "iters", "overlap_groups"):
        value = getattr(args, name)
        if value is None:
            continue
        if min(value if isinstance(value, list) else [value]) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    args.extra_options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--option must be KEY=VALUE, got {item!r}")
        args.extra_options[key] = _option_value(value)
    if args.extra_options:
        try:  # refused here, not minutes later in the timing part
            dispatch.DispatchConfig.from_options(num_experts=8, **args.extra_options)
        except (TypeError, ValueError) as exc:
            parser.error(f"--option: {exc}")
    return args


def _option_value(text: str):
    """``true``/``false``/``none`` and integers as such; anything else as a string."""
    words = {"true": True, "false": False, "none": None}
    if text.lower() in words:
        return words[text.lower()]
    try:
        return int(text)
    except ValueError:
        return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("megatron_layer: needs CUDA GPUs (Megatron's router and alltoall dispatcher run on CUDA)", file=sys.stderr)
        return 2
    if not megatron_available():
        print('megatron_layer: megatron-core is not importable (pip install "moe-dispatch[megatron]")', file=sys.stderr)
        return 2
    world = world_size_for(args.world_size)
    if args.experts % world:
        print(f"megatron_layer: {args.experts} experts do not split over {world} ranks", file=sys.stderr)
        return 2
    path = os.path.join(args.out, f"megatron-layer-w{world}.json")
    if os.path.exists(path):
        os.remove(path)  # a result left by an earlier run must not pass for this one
    try:
        # Megatron's own dispatcher puts NCCL collectives in the graphs of the graphs part
        code = launch(_job, args, args.world_size, teardown="graphs" not in args.parts)
    except Exception as exc:  # a rank died outside the parts (start-up, report)
        print(f"megatron_layer: a rank failed: {exc}", file=sys.stderr)
        return 1
    if code:
        return code
    if not os.path.exists(path):
        print(f"megatron_layer: no result was written ({path})", file=sys.stderr)
        return 1
    with open(path) as f:
        return 0 if json.load(f)["passed"] else 1


def _job(args: argparse.Namespace) -> None:
    """One rank's part (``common.launch`` made the NCCL world)."""
    warnings.simplefilter("ignore")  # Megatron's notices about TE/Apex and config defaults
    _ensure_parallel_state(dist.get_world_size())
    result = {}
    if "layer" in args.parts:
        result["layer"] = _run_part("layer", check_layer)
        result["layer_shared"] = _run_part("layer with shared experts", check_layer, 1234, True)
    if "train" in args.parts:
        result["train"] = [
            _run_part(f"train {dtype} top-{topk}", check_training, dtype, args.steps, topk, capacity,
                      extra={"dtype": dtype, "topk": topk, "capacity_factor": capacity})
            for dtype, topk, capacity in (("fp32", 2, None), ("bf16", 2, None), ("bf16", 8, 1.0))
        ]
    if "graphs" in args.parts:
        result["graphs"] = [_run_part(f"graphs {name}", check_graphs, name, args.graph_steps, extra={"setting": name})
                            for name in GRAPH_SETTINGS]
    if "overlap" in args.parts:
        result["overlap"] = _run_part("overlap", check_overlap, args.graph_steps)
    if "timing" in args.parts:
        result["timing"] = _run_part("timing", time_layers, args)
    if dist.get_rank() == 0:
        report(result, args)


def _run_part(name: str, fn, *fn_args, extra: dict | None = None) -> dict:
    """``fn(*fn_args)``, or, when it raises on any rank, ``{"error": ..., "passed": False}``
    on every rank, so that the parts after it still run and the report says what failed.
    (A failure that strikes only some ranks between two collectives can still hang the
    others until the process group's timeout; the failures met so far raise on every rank.)"""
    rank = dist.get_rank()
    try:
        result, error = fn(*fn_args), None
    except Exception as exc:
        result, error = None, f"{type(exc).__name__}: {exc}"
        print(f"megatron_layer: rank {rank}: {name} raised\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    failed = torch.zeros(dist.get_world_size(), device="cuda" if dist.get_backend() == "nccl" else "cpu")
    failed[rank] = error is not None
    dist.all_reduce(failed)
    ranks = [r for r, f in enumerate(failed.tolist()) if f]
    if ranks:
        where = f"rank(s) {ranks}" + (f": {error}" if error else "")
        result = {**(extra or {}), "error": f"{name} raised on {where}", "passed": False}
    if rank == 0:
        print(f"megatron_layer: {name}: " + ("ERROR " + result["error"] if ranks else "done"), flush=True)
    return result


# ----------------------------------------------------------------------------- building


def moe_config(*, hidden: int, ffn: int, experts: int, topk: int, dtype: str = "bf16", **overrides):
    """A ``TransformerConfig`` for MoE layers with Megatron's ``alltoall`` dispatcher, local
    (non-TE) modules, dropless, no dropout, EP over the whole world, TP = PP = 1."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        transformer_impl="local",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=dtype == "bf16",
        params_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=dist.get_world_size(),
        expert_tensor_parallel_size=1,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=False,
        moe_grouped_gemm=False,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_moe_layer(config, seed: int):
    """A ``MoELayer`` (``SequentialMLP`` experts) on the current GPU, weights from ``seed``."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    builder = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return builder(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).cuda()


def _relative_error(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max |a - b| / max |a| (0 when both are None or a is all zeros and b equals it)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = a.float(), b.float()
    scale = a.abs().max().clamp_min(1e-30)
    return float((a - b).abs().max() / scale)


def _worst_over_ranks(values: dict[str, float]) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


# ----------------------------------------------------------------------------- 1. the layer


def check_layer(seed: int = 1234, shared: bool = False) -> dict:
    """Megatron's alltoall vs ours in the same ``MoELayer``: outputs and gradients;
    with ``shared``, with shared experts run beside the exchange by each dispatcher
    (``moe_shared_expert_overlap``)."""
    from dispatch.integrations.megatron import install

    extra = dict(moe_shared_expert_intermediate_size=256, moe_shared_expert_overlap=True) if shared else {}
    config = moe_config(hidden=512, ffn=256, experts=4 * dist.get_world_size(), topk=4, **extra)
    theirs = build_moe_layer(config, seed)
    ours = build_moe_layer(config, seed + 1)
    ours.load_state_dict(theirs.state_dict())
    install(ours)
    gen = torch.Generator(device="cuda").manual_seed(seed + dist.get_rank())
    x = torch.randn(256, 2, 512, device="cuda", generator=gen).to(torch.bfloat16)
    grad = torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16)
    results = {}
    for name, layer in (("megatron", theirs), ("ours", ours)):
        inp = x.clone().requires_grad_()
        out, _ = layer(inp)
        (out.float() * grad.float()).sum().backward()
        results[name] = {"output": out.detach(), "input.grad": inp.grad}
        results[name].update({f"{n}.grad": p.grad for n, p in layer.named_parameters()})
    errors = {key: _relative_error(results["megatron"][key], results["ours"][key]) for key in results["megatron"]}
    errors = _worst_over_ranks(errors)
    return {
        "shape": {"tokens": 512, "hidden": 512, "experts": config.num_moe_experts, "topk": 4},
        "shared_experts": shared,
        "tolerance": LAYER_TOLERANCE,
        "errors": errors,
        "passed": all(e <= LAYER_TOLERANCE for e in errors.values()) and len(errors) > 2,
    }


# ----------------------------------------------------------------------------- 2. training


def build_gpt(config, vocab: int, seq: int, seed: int, moe_layer_class: bool = False):
    """A ``GPTModel`` of local modules; with ``moe_layer_class``, its layers are Megatron's
    ``MoETransformerLayer`` (whose local CUDA graphs take the MoE scopes: a plain
    ``TransformerLayer`` makes no graph for ``moe``, ``moe_router`` or ``moe_preprocess``)."""
    import dataclasses as dc

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    # Megatron's local CUDA graphs need its graph-safe RNG tracker
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=config.cuda_graph_impl == "local", force_reset_rng=True)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if moe_layer_class:
        from megatron.core.transformer.transformer_layer import MoETransformerLayer

        spec = dc.replace(spec, module=MoETransformerLayer)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq).cuda()
    return _precision_wrapper(config, model)


def _precision_wrapper(config, model):
    """A bf16/fp16 model inside Megatron's ``Float16Module``, as Megatron's training loop
    runs it: every parameter cast to the half type (``GPTModel`` builds its learned
    position embeddings in fp32, which would otherwise make the hidden states fp32 and
    fail in the first bf16 linear), fp32 outputs. ``state_dict`` / ``load_state_dict``
    pass through to the model, so copying weights between two wrapped models works."""
    if not (config.bf16 or config.fp16):
        return model
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, model)


def _average_gradients(model) -> None:
    """Dense gradients averaged over the world, expert gradients divided by it (the
    loss is the mean of the ranks' losses)."""
    world = dist.get_world_size()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if "experts.local_experts" not in name:
            dist.all_reduce(p.grad)
        p.grad.div_(world)


def _train(model, batch, steps: int, graphs: list | None = None) -> list[float]:
    """Adam on one fixed batch; dense gradients averaged over the world, expert
    gradients divided by it (the loss is the mean of the ranks' losses). With a
    ``graphs`` list, Megatron's local CUDA graphs are made after the first step's
    backward (as its schedules make them; what it says of them is appended to the
    list, None if it made none) and replayed from the second step on. Their backward
    graphs add the weight gradients into ``param.main_grad`` (the buffers Megatron's
    DDP gives every parameter), which this loop then provides and adds to ``grad``."""
    tokens, labels, position_ids, mask = batch
    world = dist.get_world_size()
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    if graphs is not None:
        for p in params:
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, position_ids, mask, labels=labels).float().mean()
        loss.backward()
        if graphs is not None:
            if step == 0:  # the step was eager: its gradients are in grad, kept from the capture's warm-ups
                from megatron.core.transformer.cuda_graphs import create_cudagraphs

                kept = [None if p.grad is None else p.grad.clone() for p in params]
                graphs.append(create_cudagraphs())
                for p, g in zip(params, kept):  # none of the step's gradients is in main_grad
                    p.grad = g
                    p.main_grad.zero_()
            for p in params:  # graphed modules' weight gradients: main_grad (fp32 sum from zero: exact)
                total = p.main_grad if p.grad is None else p.main_grad + p.grad.float()
                p.grad = total.to(p.dtype)
                p.main_grad.zero_()
        _average_gradients(model)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses


def check_training(dtype: str, steps: int, topk: int = 2, capacity_factor: float | None = None,
                   seed: int = 4321) -> dict:
    """A two-layer MoE ``GPTModel`` (``topk`` experts of ``topk`` per rank per token,
    tokens dropped past ``capacity_factor`` by Megatron's router) trained both ways:
    per-step loss agreement."""
    from dispatch.integrations.megatron import install_all

    vocab, seq, batch_size = GPT_SHAPE["vocab"], GPT_SHAPE["seq"], GPT_SHAPE["batch"]
    dropping = {} if capacity_factor is None else dict(moe_expert_capacity_factor=capacity_factor,
                                                       moe_token_drop_policy="probs")
    config = moe_config(
        hidden=256, ffn=256, experts=max(topk, 2) * dist.get_world_size(), topk=topk, dtype=dtype, num_layers=2,
        **dropping,
    )
    theirs = build_gpt(config, vocab, seq, seed)
    ours = build_gpt(config, vocab, seq, seed + 1)
    ours.load_state_dict(theirs.state_dict())
    installed = install_all(ours)
    batch = _fixed_batch(vocab, seq, batch_size, seed)
    theirs_losses = _train(theirs, batch, steps)
    ours_losses = _train(ours, batch, steps)
    diffs = [abs(a - b) / abs(a) for a, b in zip(theirs_losses, ours_losses)]
    return {
        "dtype": dtype,
        "topk": topk,
        "experts": config.num_moe_experts,
        "capacity_factor": capacity_factor,
        "moe_layers": len(installed),
        "steps": steps,
        "tolerance": LOSS_TOLERANCE[dtype],
        "megatron": theirs_losses,
        "ours": ours_losses,
        "max_relative_diff": max(diffs),
        "loss_decreased": ours_losses[-1] < ours_losses[0],
        "passed": max(diffs) <= LOSS_TOLERANCE[dtype] and ours_losses[-1] < ours_losses[0],
    }


# ----------------------------------------------------------------------------- 3. CUDA graphs


GRAPH_SETTINGS = {
    "moe_preprocess": dict(cuda_graph_modules=["moe_router", "moe_preprocess"]),
    "moe, padded to capacity": dict(cuda_graph_modules=["moe"], moe_expert_capacity_factor=1.0,
                                    moe_pad_expert_input_to_capacity=True, moe_token_drop_policy="probs"),
    # more experts than the engine moves per token (32): ours dispatches by groups of local experts
    "moe, padded to capacity, 64 experts": dict(cuda_graph_modules=["moe"], moe_expert_capacity_factor=1.0,
                                                moe_pad_expert_input_to_capacity=True, moe_token_drop_policy="probs",
                                                experts=64),
}


def _fixed_batch(vocab: int, seq: int, batch_size: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed + dist.get_rank())
    tokens = torch.randint(vocab, (batch_size, seq), device="cuda", generator=gen)
    labels = torch.randint(vocab, (batch_size, seq), device="cuda", generator=gen)
    position_ids = torch.arange(seq, device="cuda").expand(batch_size, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device="cuda"), 1)[None, None]  # True: masked
    return tokens, labels, position_ids, mask


def _each_way(configs: dict, weights_config, seed: int, train, before_build=None) -> tuple[dict, dict]:
    """The two-layer MoE ``GPTModel`` (``MoETransformerLayer``s, same weights) built for
    each (dispatcher, mode): Megatron's, then ours installed, for each mode's config in
    ``configs``, each after ``before_build()`` if given; ``train(model, mode)`` gives its
    losses. Returns (losses by ``"{who} {mode}"``, ours' installed dispatchers by mode)."""
    from dispatch.integrations.megatron import install_all

    vocab, seq = GPT_SHAPE["vocab"], GPT_SHAPE["seq"]
    weights = build_gpt(weights_config, vocab, seq, seed, moe_layer_class=True).state_dict()
    losses, installed = {}, {}
    for who in ("megatron", "ours"):
        for mode, config in configs.items():
            if before_build is not None:
                before_build()
            model = build_gpt(config, vocab, seq, seed + 1, moe_layer_class=True)
            model.load_state_dict(weights)
            if who == "ours":
                installed[mode] = install_all(model)
            losses[f"{who} {mode}"] = train(model, mode)
            del model
    return losses, installed


def _worst(losses: dict, a: str, b: str) -> float:
    """The largest relative difference, step by step, of two runs' losses."""
    return max(abs(x - y) / abs(x) for x, y in zip(losses[a], losses[b]))


def check_graphs(setting: str, steps: int, seed: int = 2468) -> dict:
    """The two-layer MoE ``GPTModel`` with Megatron's local CUDA graphs set as
    ``GRAPH_SETTINGS[setting]``, trained eager and captured, with each dispatcher
    (same weights, same batch): per-step losses, captured against eager and ours
    against Megatron's."""
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    extra = dict(GRAPH_SETTINGS[setting])
    graph_fields = {k: extra.pop(k) for k in list(extra) if k.startswith("cuda_graph")}
    experts = extra.pop("experts", 4 * dist.get_world_size())
    common = dict(hidden=256, ffn=256, experts=experts, topk=2, num_layers=2, **extra)
    configs = {"captured": moe_config(**common, cuda_graph_impl="local", **graph_fields), "eager": moe_config(**common)}
    batch = _fixed_batch(GPT_SHAPE["vocab"], GPT_SHAPE["seq"], GPT_SHAPE["batch"], seed)
    made = []

    def train(model, mode):
        # a copy of the batch per model: Megatron's graph record marks its graphs' inputs (the
        # attention mask, an input of every layer's graph) with use counts that a second model's
        # record would add to, and its capture would then wait for uses that never come
        fresh = tuple(t.clone() for t in batch)
        return _train(model, fresh, steps, graphs=made if mode == "captured" else None)

    # Megatron's graph record is global: one model's graphs at a time. Cleared before a model
    # is built: its graph managers take the graph memory pool, which the clearing drops.
    losses, installed = _each_way(configs, configs["eager"], seed, train, before_build=delete_cuda_graphs)
    delete_cuda_graphs()
    for d in installed["captured"]:  # replays read nothing on the host: what the kernels recorded, now
        d.check()
    graphs_made = all(m is not None for m in made)
    diffs = {"ours captured vs eager": _worst(losses, "ours eager", "ours captured"),
             "megatron captured vs eager": _worst(losses, "megatron eager", "megatron captured"),
             "ours vs megatron, captured": _worst(losses, "megatron captured", "ours captured")}
    tolerance = LOSS_TOLERANCE["bf16"]
    return {
        "setting": setting,
        "graphs": {k: [str(getattr(m, "name", m)) for m in v] if isinstance(v, list) else v
                   for k, v in graph_fields.items()} | {"cuda_graph_impl": "local"},
        "engine": sorted({"/".join(d.engine.transport.key) for d in installed["captured"]}),
        # every stage inside the graphs: the rows fixed by the capacity
        "fixed_rows": sorted({d.fixed_rows for d in installed["captured"]}),
        "experts": experts,
        "expert_groups": sorted({len(d.expert_groups or [None]) for d in installed["captured"]}),
        "capture": made,  # Megatron's capture time and memory, megatron's model then ours (None: no graphs)
        "steps": steps,
        "losses": losses,
        "max_relative_diff": diffs,
        "tolerance": tolerance,
        "passed": all(d <= tolerance for d in diffs.values()) and graphs_made
        and losses["ours captured"][-1] < losses["ours captured"][0],
    }


# ----------------------------------------------------------------------------- 4. EP-communication overlap


def _train_scheduled(model, micro_batches: list, steps: int) -> list[float]:
    """Adam, each step one pass of Megatron's schedule without pipelining
    (``get_forward_backward_func``) over ``micro_batches``: with
    ``overlap_moe_expert_parallel_comm`` it runs them by its combined 1F1B schedule,
    two micro-batches at once, each layer's stages as separate nodes. Loss: the mean
    over micro-batches and ranks."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}  # a copy: the schedule divides the loss in place

    def forward_step(data_iterator, model, return_schedule_plan=False):
        tokens, labels, position_ids, mask = next(data_iterator)
        if return_schedule_plan:  # the combined 1F1B schedule asks for the model's plan
            return model.build_schedule_plan(tokens, position_ids, mask, labels=labels), loss_func
        return model(tokens, position_ids, mask, labels=labels), loss_func

    run = get_forward_backward_func()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = run(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
                  num_microbatches=len(micro_batches), seq_length=GPT_SHAPE["seq"],
                  micro_batch_size=micro_batches[0][0].shape[0], forward_only=False)
        _average_gradients(model)
        opt.step()
        mean = torch.stack([o["loss"] for o in out]).float().mean()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def check_overlap(steps: int, seed: int = 1357) -> dict:
    """The two-layer MoE ``GPTModel`` trained by Megatron's schedule with and without
    ``overlap_moe_expert_parallel_comm`` (two micro-batches a step), each dispatcher:
    per-step losses, overlapped against plain and ours against Megatron's."""
    common = dict(hidden=256, ffn=256, experts=4 * dist.get_world_size(), topk=2, num_layers=2)
    configs = {"overlapped": moe_config(**common, overlap_moe_expert_parallel_comm=True), "plain": moe_config(**common)}
    micro_batches = [_fixed_batch(GPT_SHAPE["vocab"], GPT_SHAPE["seq"], GPT_SHAPE["batch"] // 2, seed + 17 * i)
                     for i in range(2)]
    losses, installed = _each_way(configs, configs["plain"], seed,
                                  lambda model, mode: _train_scheduled(model, micro_batches, steps))
    diffs = {"ours overlapped vs plain": _worst(losses, "ours plain", "ours overlapped"),
             "megatron overlapped vs plain": _worst(losses, "megatron plain", "megatron overlapped"),
             "ours vs megatron, overlapped": _worst(losses, "megatron overlapped", "ours overlapped")}
    tolerance = LOSS_TOLERANCE["bf16"]
    return {
        "engine": sorted({"/".join(d.engine.transport.key) for d in installed["overlapped"]}),
        "split_nodes": sorted({d.split_nodes for d in installed["overlapped"]}),
        "micro_batches": len(micro_batches),
        "steps": steps,
        "losses": losses,
        "max_relative_diff": diffs,
        "tolerance": tolerance,
        "passed": all(d <= tolerance for d in diffs.values())
        and losses["ours overlapped"][-1] < losses["ours overlapped"][0],
    }


# ----------------------------------------------------------------------------- 5. timing


def time_layers(args: argparse.Namespace, seed: int = 99) -> dict:
    """deepseek-v3-like ``MoELayer`` forward + backward with each dispatcher swapped in,
    the dispatchers' timed runs taken in turns (round robin)."""
    from dispatch.integrations.megatron import OVERLAP_GROUPS, MegatronDispatcher

    config = moe_config(
        hidden=7168, ffn=2048, experts=args.experts, topk=8,
        moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5,
        moe_router_enable_expert_bias=True,
    )
    layer = build_moe_layer(config, seed)
    groups = _groups(layer)
    dispatchers = {"megatron alltoall": layer.token_dispatcher}
    variants = {"ours": {}, "ours check_inputs=False": {"check_inputs": False}}
    if args.extra_options:
        variants["ours " + " ".join(f"{k}={v}" for k, v in args.extra_options.items())] = args.extra_options
    for name, options in variants.items():
        dispatchers[name] = MegatronDispatcher(
            layer.num_local_experts, layer.local_expert_indices, config, groups, options=options
        )
    overlapped = []
    for overlap in sorted({min(g, layer.num_local_experts) for g in args.overlap_groups or [OVERLAP_GROUPS]}):
        name = f"ours overlap G={overlap}"
        dispatchers[name] = MegatronDispatcher(layer.num_local_experts, layer.local_expert_indices, config, groups)
        dispatchers[name].pipeline(layer, overlap)  # as install(layer, overlap=G); the steps set the stage
        overlapped.append(name)
    gen = torch.Generator(device="cuda").manual_seed(seed + dist.get_rank())
    x = torch.randn(args.tokens, 1, 7168, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16)

    def step_with(dispatcher):
        def step():
            layer.token_dispatcher = dispatcher
            if getattr(dispatcher, "exchange", None) is not None:  # ours with the experts by groups
                layer.routed_experts_compute = dispatcher.experts_by_groups
            elif hasattr(dispatcher, "guard"):  # ours, the layer's own experts stage guarded (as install does)
                dispatcher.guard(layer)
            else:
                vars(layer).pop("routed_experts_compute", None)
            layer.zero_grad(set_to_none=True)
            x.grad = None
            out, _ = layer(x)
            out.backward(grad)
            return out

        return step

    steps = {name: step_with(dispatcher) for name, dispatcher in dispatchers.items()}
    rows_in = _keep_expert_inputs(dispatchers["ours"])
    outs = {name: step().detach() for name, step in steps.items()}
    reference = outs["megatron alltoall"]
    steps["experts alone"] = _experts_alone(layer, *rows_in.pop(), seed)
    steps["router alone"] = _router_alone(layer, x, seed)
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    # round robin, each round in another order: drift and what ran just before weigh on
    # every dispatcher alike
    names, samples = list(steps), {name: [] for name in steps}
    for i in range(args.iters):
        for name in names[i % len(names):] + names[: i % len(names)]:
            run = time_phases(lambda timer: steps[name](), 1, 0, device())
            samples[name].append(run[0]["total"])
    rows = []
    for name in names:
        stats = spread(samples[name])
        error = (_worst_over_ranks({"output": _relative_error(reference, outs[name])})["output"] if name in outs
                 else None)
        rows.append({
            "name": name,
            "median_ms": stats["median"],
            "p10_ms": stats["p10"],
            "p90_ms": stats["p90"],
            "output_error_vs_megatron": error,
        })
    if args.host_profile:
        for name in names:
            _host_profile(steps[name], args.out, name)
    trace_dir = os.path.join(args.out, "traces") if args.trace else None
    traces = {name: _trace(steps[name], trace_dir, name) for name in names} if args.trace else None
    layer.token_dispatcher = dispatchers["megatron alltoall"]
    vars(layer).pop("routed_experts_compute", None)
    median = {r["name"]: r["median_ms"] for r in rows}
    exchange = median["megatron alltoall"] - median["experts alone"]  # Megatron's time outside its experts
    # Megatron's time in its dispatcher (dispatch and combine, forward and backward): outside its
    # experts and its router, which run alike whatever the dispatcher
    own = exchange - median["router alone"]
    return {
        "shape": {"tokens_per_rank": args.tokens, "hidden": 7168, "ffn": 2048, "experts": args.experts, "topk": 8},
        "rows": rows,
        "overlapped": overlapped,
        "megatron_exchange_ms": exchange,
        "saved_share": {name: (median["megatron alltoall"] - median[name]) / exchange if exchange > 0 else None
                        for name in overlapped},
        "megatron_dispatch_combine_ms": own,
        "saved_share_of_dispatch_combine": {
            name: (median["megatron alltoall"] - median[name]) / own if own > 0 else None
            for name in ("ours", *overlapped)},
        "traces": traces,
    }


TRACE_TOP = 6  # kernels and host operations a trace names
TRACE_HOST_PASSES = 5  # unprofiled passes whose host time a trace reports


def covered(spans: list) -> float:
    """The length of the union of the intervals ``spans`` [(start, end)]."""
    total, reach = 0.0, None
    for lo, hi in sorted(spans):
        if reach is None or lo > reach:
            total, reach = total + hi - lo, hi
        elif hi > reach:
            total, reach = total + hi - reach, hi
    return total


def _trace(step, trace_dir: str | None = None, name: str = "") -> dict:
    """One profiled pass of ``step`` on every rank (after a barrier); this rank's
    wall time of it (to the GPU's end), the GPU's busy time (the union of its kernels'
    and copies' intervals, every stream), and the longest kernels (by device time)
    and host operations (by their own host time), in ms; before it, the median host
    time of TRACE_HOST_PASSES unprofiled passes until ``step`` returns (the GPU
    waited for after each, untimed). Rank 0 writes the profiled pass's timeline to
    ``trace_dir/<name>.json`` where given."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    issued = []
    for _ in range(TRACE_HOST_PASSES):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        issued.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    table = prof.key_averages()
    top_gpu = sorted(table, key=lambda a: a.self_device_time_total, reverse=True)[:TRACE_TOP]
    top_cpu = sorted(table, key=lambda a: a.self_cpu_time_total, reverse=True)[:TRACE_TOP]
    if trace_dir is not None and dist.get_rank() == 0:
        os.makedirs(trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace_dir, re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".json"))
    return {
        "host_issue_ms": statistics.median(issued) * 1e3,
        "wall_ms": wall * 1e3,
        "gpu_busy_ms": covered(spans) / 1e3,
        "kernels": len(spans),
        "top_gpu": [[a.key[:60], a.self_device_time_total / 1e3, a.count] for a in top_gpu],
        "top_host": [[a.key[:60], a.self_cpu_time_total / 1e3, a.count] for a in top_cpu],
    }


HOST_PROFILE_TOP = 60  # functions a host profile lists, by own time and by cumulative time


def _host_profile(step, out: str, name: str) -> None:
    """One pass of ``step`` on every rank (after a barrier, the GPU waited for after
    it) with rank 0's Python profiled (cProfile); rank 0 writes the functions that
    took longest by own time, and this package's by cumulative time, in
    microseconds, to ``out/host-profile-<name>.txt``."""
    import cProfile

    dist.barrier()
    torch.cuda.synchronize()
    profiler = cProfile.Profile() if dist.get_rank() == 0 else None
    if profiler is not None:
        profiler.enable()
    step()
    if profiler is not None:
        profiler.disable()
    torch.cuda.synchronize()
    if profiler is None:
        return
    text = profile_text(profiler, 1, HOST_PROFILE_TOP)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "host-profile-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".txt"), "w") as f:
        f.write(f"{name}: one pass, rank 0's host (cProfile)\n{text}\n")


def _keep_expert_inputs(dispatcher) -> list:
    """A list that the next ``dispatcher.dispatch_postprocess`` appends what it hands
    the experts to (tokens, counts, probs; detached); the stage is its own again after
    (the timed runs call it unwrapped)."""
    kept, postprocess = [], dispatcher.dispatch_postprocess

    def keep(hidden_states, probs):
        out = postprocess(hidden_states, probs)
        kept.append(tuple(t.detach() for t in out))
        del dispatcher.dispatch_postprocess
        return out

    dispatcher.dispatch_postprocess = keep
    return kept


def _experts_alone(layer, tokens, counts, probs, seed: int):
    """A step: ``layer.experts`` forward + backward on rows a dispatch handed them,
    with no exchange (the experts' own time in the layer)."""
    gen = torch.Generator(device="cuda").manual_seed(seed + 1 + dist.get_rank())
    grad = torch.randn(tokens.shape, device="cuda", generator=gen).to(tokens.dtype)

    def step():
        layer.zero_grad(set_to_none=True)
        rows = tokens.clone().requires_grad_()
        weights = probs.clone().requires_grad_()
        out, _ = layer.experts(rows, counts, weights)
        out.backward(grad)
        return out

    return step


def _router_alone(layer, x, seed: int):
    """A step: the layer's router forward + backward on the layer's input (its
    probabilities' gradient random where the routing map is True, zero elsewhere, as
    a dispatch's combine gives it), nothing dispatched (the router's own time in the
    layer, whatever the dispatcher)."""
    gen = torch.Generator(device="cuda").manual_seed(seed + 2 + dist.get_rank())

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        probs, routing_map = layer.route(x)
        grad = torch.randn(probs.shape, device="cuda", generator=gen).to(probs.dtype)
        probs.backward(torch.where(routing_map, grad, torch.zeros_like(grad)))
        return probs

    return step


def _groups(layer):
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(ep=layer.ep_group, expt_tp=layer.token_dispatcher.tp_group)


# ----------------------------------------------------------------------------- report


def report(result: dict, args: argparse.Namespace) -> None:
    world = dist.get_world_size()
    lines = [f"Megatron-Core MoELayer: Megatron's alltoall dispatcher vs ours, {world} GPUs", ""]
    passed = True
    for key, what in (("layer", "layer check"), ("layer_shared", "layer check, shared experts beside the exchange")):
        if key not in result:
            continue
        layer = result[key]
        passed &= layer["passed"]
        if "error" in layer:
            lines.append(f"{what}: ERROR {layer['error']} FAIL")
            continue
        worst = max(layer["errors"].items(), key=lambda kv: kv[1])
        lines.append(
            f"{what} ({len(layer['errors'])} tensors: output, input grad, every parameter grad): "
            f"worst {worst[0]} {worst[1]:.2e} (tolerance {layer['tolerance']:.0e}) "
            f"{'PASS' if layer['passed'] else 'FAIL'}"
        )
    for run in result.get("train", []):
        passed &= run["passed"]
        what = f"{run['dtype']}, top-{run['topk']}" + (
            f", capacity factor {run['capacity_factor']}" if run.get("capacity_factor") is not None else "")
        if "error" in run:
            lines.append(f"GPTModel training, {what}: ERROR {run['error']} FAIL")
            continue
        lines.append(
            f"GPTModel training, {what} of {run['experts']} experts, {run['moe_layers']} MoE layers, "
            f"{run['steps']} steps: loss "
            f"{run['ours'][0]:.4f} -> {run['ours'][-1]:.4f}, max relative diff to megatron "
            f"{run['max_relative_diff']:.2e} (tolerance {run['tolerance']:.0e}) {'PASS' if run['passed'] else 'FAIL'}"
        )
    for run in result.get("graphs", []):
        passed &= run["passed"]
        if "error" in run:
            lines.append(f"GPTModel with local CUDA graphs, {run['setting']}: ERROR {run['error']} FAIL")
            continue
        diffs = ", ".join(f"{k} {v:.2e}" for k, v in run["max_relative_diff"].items())
        groups = max(run["expert_groups"])
        lines.append(
            f"GPTModel with local CUDA graphs, {run['setting']} (ours on {', '.join(run['engine'])}"
            f"{', rows fixed by the capacity' if True in run['fixed_rows'] else ''}"
            f"{f', dispatches by {groups} groups of experts' if groups > 1 else ''}"
            f"; graphs made: "
            f"{'yes' if all(m is not None for m in run['capture']) else 'NO'}), "
            f"{run['steps']} steps: loss {run['losses']['ours captured'][0]:.4f} -> "
            f"{run['losses']['ours captured'][-1]:.4f}, max relative diff: {diffs} "
            f"(tolerance {run['tolerance']:.0e}) {'PASS' if run['passed'] else 'FAIL'}"
        )
    if "overlap" in result:
        run = result["overlap"]
        passed &= run["passed"]
        if "error" in run:
            lines.append(f"GPTModel with overlap_moe_expert_parallel_comm: ERROR {run['error']} FAIL")
        else:
            diffs = ", ".join(f"{k} {v:.2e}" for k, v in run["max_relative_diff"].items())
            lines.append(
                f"GPTModel with overlap_moe_expert_parallel_comm (ours on {', '.join(run['engine'])}), "
                f"{run['micro_batches']} micro-batches a step, {run['steps']} steps: loss "
                f"{run['losses']['ours overlapped'][0]:.4f} -> {run['losses']['ours overlapped'][-1]:.4f}, "
                f"max relative diff: {diffs} (tolerance {run['tolerance']:.0e}) {'PASS' if run['passed'] else 'FAIL'}"
            )
    if "timing" in result and "error" in result["timing"]:
        passed = False
        lines += ["", f"MoELayer timing: ERROR {result['timing']['error']}"]
    elif "timing" in result:
        timing = result["timing"]
        s = timing["shape"]
        lines += [
            "",
            f"MoELayer forward+backward, T={s['tokens_per_rank']}/rank, H={s['hidden']}, expert FFN {s['ffn']}, "
            f"E={s['experts']}, K={s['topk']}, bf16, SequentialMLP experts",
            "",
            "| dispatcher | median ms | p10-p90 ms | output rel. error vs megatron |",
            "| --- | --- | --- | --- |",
        ]
        for r in timing["rows"]:
            error = r["output_error_vs_megatron"]
            lines.append(
                f"| {r['name']} | {r['median_ms']:.2f} | {r['p10_ms']:.2f}-{r['p90_ms']:.2f} | "
                f"{'-' if error is None else f'{error:.2e}'} |"
            )
        passed &= all(r["output_error_vs_megatron"] is None or r["output_error_vs_megatron"] <= LAYER_TOLERANCE
                      for r in timing["rows"])
        saves = "; ".join(f"{name} saves {'-' if share is None else f'{share:.2f}'} of it"
                          for name, share in timing["saved_share"].items())
        lines += ["", f"Megatron's layer less its experts alone: {timing['megatron_exchange_ms']:.2f} ms; "
                      f"{saves} against Megatron's layer"]
        own = timing.get("megatron_dispatch_combine_ms")
        if own is not None:
            saves = "; ".join(f"{name} {'-' if share is None else f'{share:.2f}'}"
                              for name, share in timing["saved_share_of_dispatch_combine"].items())
            lines.append(f"Megatron's dispatch and combine (its layer less the experts alone and the router alone): "
                         f"{own:.2f} ms; the share of it saved against Megatron's layer: {saves}")
        for name, trace in (timing.get("traces") or {}).items():
            lines += ["", f"trace of one pass, {name} (rank 0): the host issues a pass in {trace['host_issue_ms']:.2f} ms "
                          f"(unprofiled); profiled: wall {trace['wall_ms']:.2f} ms, GPU busy "
                          f"{trace['gpu_busy_ms']:.2f} ms ({trace['kernels']} kernels and copies)"]
            for what, key in (("kernels", "top_gpu"), ("host", "top_host")):
                lines.append(f"  {what}: " + "; ".join(f"{n} {ms:.2f} ms x{c}" for n, ms, c in trace[key]))
    env = environment()
    lines += ["", "environment: " + ", ".join(f"{k} {v}" for k, v in env.items())]
    text = "\n".join(lines)
    print(text, flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"megatron-layer-w{world}")
    with open(stem + ".json", "w") as f:
        json.dump({"environment": env, "passed": bool(passed), **result}, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(f"# {lines[0]}\n\n" + "\n".join(lines[2:]) + "\n")


if __name__ == "__main__":
    sys.exit(main())
