"""Megatron-Core's own token-dispatcher test scenarios, with our dispatcher in place
of its ``alltoall`` one and their assertions unchanged.

    here, once:  echo /.megatron-lm/ >> .git/info/exclude
                 mkdir -p .megatron-lm && git -C MEGATRON_LM_CLONE archive core_v0.19.0 tests/__init__.py \
                   tests/unit_tests/__init__.py tests/unit_tests/test_utilities.py \
                   tests/unit_tests/transformer/__init__.py tests/unit_tests/transformer/moe/__init__.py \
                   tests/unit_tests/transformer/moe/test_token_dispatcher.py | tar -x -C .megatron-lm
                 (then carry .megatron-lm with the device call)
    device:      torchrun --nproc-per-node 2 bench/megatron_scenarios.py [--megatron-lm .megatron-lm] [--out DIR]

Megatron-LM's ``tests/unit_tests/transformer/moe/test_token_dispatcher.py`` (the
release of the installed megatron-core; kept in the git-ignored ``.megatron-lm/``,
never committed) holds ``MoEModelTestContainer``, whose methods are the scenarios of
its ``alltoall`` dispatcher tests: dropless forward and backward (also with the
deterministic branches), token dropping by capacity, dropping with padding to
capacity, and router padding for fp8. Its tests run them at 8-GPU shapes; this
script runs them with the arguments of those tests at every shape the world holds
(tensor, expert and expert-tensor parallel sizes whose product divides it), each
twice: with Megatron's dispatcher, then with ``MegatronDispatcher`` built by
``MoELayer`` in its place. A scenario passes when the container's method returns on
every rank. Prints one line per run and writes ``megatron-scenarios-w{W}.json``;
exits 1 when one passes with Megatron's dispatcher and not with ours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

# the scenarios of Megatron's test_a2a_token_dispatcher.py (its arguments), by container method
SCENARIOS = {
    "dropless": ("dispatcher_dropless_test", dict(moe_router_load_balancing_type="aux_loss")),
    "dropless, deterministic": ("dispatcher_dropless_test", dict(moe_router_load_balancing_type="aux_loss")),
    "capacity": ("dispatcher_capacity_test", dict(moe_router_load_balancing_type="aux_loss",
                                                  moe_token_drop_policy="probs", moe_expert_capacity_factor=0.5,
                                                  moe_pad_expert_input_to_capacity=False)),
    "capacity, padded": ("dispatcher_drop_and_pad_test", dict(moe_router_load_balancing_type="aux_loss",
                                                              moe_token_drop_policy="probs",
                                                              moe_expert_capacity_factor=0.6,
                                                              moe_pad_expert_input_to_capacity=True)),
    "router padding for fp8": ("dispatcher_router_padding_for_fp8_test",
                               dict(moe_router_load_balancing_type="aux_loss", moe_pad_expert_input_to_capacity=False,
                                    hidden_size=4)),
}


def shapes(world: int) -> list[tuple[int, int, int]]:
    """(tensor parallel, expert parallel, expert tensor parallel) sizes for a world
    of ``world`` ranks: each of them alone at the world's size, and the world itself."""
    out = [(1, world, 1), (world, 1, world), (world, 1, 1), (1, 1, world)] if world > 1 else []
    return out + [(1, 1, 1)]


def _run(name: str, method: str, kwargs: dict, shape: tuple, ours: bool) -> str | None:
    """One scenario on this rank; the error text, or None when it passed."""
    from megatron.core.transformer.moe import moe_layer
    from tests.unit_tests.test_utilities import Utils
    from tests.unit_tests.transformer.moe.test_token_dispatcher import MoEModelTestContainer

    from dispatch.integrations.megatron import MegatronDispatcher

    tp, ep, etp = shape
    original = moe_layer.MoEAlltoAllTokenDispatcher
    deterministic = torch.are_deterministic_algorithms_enabled
    error = None
    try:
        if ours:
            moe_layer.MoEAlltoAllTokenDispatcher = MegatronDispatcher
        if "deterministic" in name:  # as Megatron's test does it: the deterministic branches only
            torch.are_deterministic_algorithms_enabled = lambda: True
        container = MoEModelTestContainer(tp_size=tp, ep_size=ep, pp_size=1, moe_tp_size=etp, num_moe_experts=8,
                                          moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                                          moe_permute_fusion=False, **kwargs)
        getattr(container, method)()
    except Exception as exc:  # the report says what failed
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if os.environ.get("SCENARIOS_TRACEBACK"):
            traceback.print_exc()
    finally:
        moe_layer.MoEAlltoAllTokenDispatcher = original
        torch.are_deterministic_algorithms_enabled = deterministic
        torch.cuda.synchronize()
        Utils.destroy_model_parallel()
    return error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", default=".megatron-lm", help="Megatron-LM's source tree (its tests/)")
    parser.add_argument("--out", default=None, help="folder for megatron-scenarios-w{W}.json")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.megatron_lm, "tests", "unit_tests", "test_utilities.py")):
        print(f"megatron_scenarios: no Megatron-LM tests under {args.megatron_lm} (see the head of this script)",
              file=sys.stderr)
        return 2
    if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
        print("megatron_scenarios: run it under torchrun, one process per GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.abspath(args.megatron_lm))
    warnings.simplefilter("ignore")
    from tests.unit_tests.test_utilities import Utils

    Utils.initialize_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    rows, regressions = [], 0
    for shape in shapes(world):
        for name, (method, kwargs) in SCENARIOS.items():
            outcome = {}
            for who in ("megatron", "ours"):
                error = _run(name, method, kwargs, shape, who == "ours")
                failed = torch.tensor([error is not None], dtype=torch.int32, device="cuda")
                dist.all_reduce(failed)
                outcome[who] = error or ("failed on another rank" if failed.item() else None)
            regressions += outcome["megatron"] is None and outcome["ours"] is not None
            rows.append(dict(scenario=name, tp=shape[0], ep=shape[1], etp=shape[2], **outcome))
            if rank == 0:
                verdict = {None: "pass"}
                print(f"TP {shape[0]} EP {shape[1]} ETP {shape[2]}  {name:24s} megatron "
                      f"{verdict.get(outcome['megatron'], 'FAIL: ' + str(outcome['megatron']))} | ours "
                      f"{verdict.get(outcome['ours'], 'FAIL: ' + str(outcome['ours']))}", flush=True)
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"megatron-scenarios-w{world}.json"), "w") as f:
            json.dump(dict(world=world, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    dist.destroy_process_group()
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
