"""A Megatron-Core GPT model whose MoE layers dispatch with this package (GPUs).

    torchrun --nproc-per-node 2 examples/megatron_layer.py [--steps 5]

Builds a two-layer GPTModel with MoE layers over an expert-parallel group of
every rank (Megatron's `alltoall` token-dispatcher settings), swaps every
MoELayer's dispatcher for ours (``install_all``), and trains a few steps; rank
0 prints the losses. Needs CUDA and megatron-core (pip install "moe-dispatch[megatron]").
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    try:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        print('this example needs megatron-core: pip install "moe-dispatch[megatron]"', file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        print("this example runs on GPUs under torchrun: torchrun --nproc-per-node N examples/megatron_layer.py",
              file=sys.stderr)
        return 2
    from dispatch.integrations.megatron import install_all

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    ep = torch.distributed.get_world_size()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512,
        num_moe_experts=2 * ep, moe_router_topk=2, moe_ffn_hidden_size=256,
        expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-2, bf16=True, params_dtype=torch.bfloat16, add_bias_linear=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=2 * ep)
    model = Float16Module(config, GPTModel(config, spec, vocab_size=1024, max_sequence_length=128).cuda())
    install_all(model, dispatch_wire="bf16")  # every MoELayer now dispatches with this package
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(torch.distributed.get_rank())
    position_ids = torch.arange(128, device="cuda").expand(2, 128)
    causal = torch.triu(torch.ones(128, 128, dtype=torch.bool, device="cuda"), 1)[None, None]
    for step in range(args.steps):
        tokens = torch.randint(1024, (2, 128), device="cuda", generator=gen)
        loss = model(tokens, position_ids, causal, labels=tokens).float().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if torch.distributed.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
