"""moetriton in transformers models: the training step of small MoE models with moetriton as the experts
implementation ("moetriton") and with every sparse-MoE block computed by moetriton's MoE layer
(`replace_moe_blocks`: "moetriton_block", router and shared experts included), beside transformers' own
`grouped_mm` and `eager` experts.

    python -m benchmarks.transformers_backend            # CUDA GPU, bf16: mixtral, qwen3_moe, deepseek_v3
    TRITON_INTERPRET=1 python -m benchmarks.transformers_backend --tiny   # CPU smoke run, one step

Each row: one model (a 2-layer *ForCausalLM from a local config, no download), one experts implementation,
the median time of a training step (forward with the balancing loss, backward; no optimizer) over --steps
steps after two warm-up steps, timed with CUDA events around each step, and the step's peak allocated
memory (torch.cuda.max_memory_allocated after a reset, minus the memory held before the step). Attention
and everything outside the MoE blocks are transformers' in every row, and so is the router but in the
"moetriton_block" rows. Writes <out>/<machine>/transformers_backend.csv.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from .common import add_out_option, write_results

IMPLS = ("moetriton", "moetriton_block", "grouped_mm", "eager")

# model type -> (its MoE options, tokens per step as [batch, sequence]) at a mid size: the experts' shapes
# of each family scaled down to two layers on one GPU.
MODELS = {
    "mixtral": (
        dict(hidden_size=2048, intermediate_size=5632, num_local_experts=8, num_experts_per_tok=2),
        (4, 2048),
    ),
    "qwen3_moe": (
        dict(
            hidden_size=2048,
            moe_intermediate_size=768,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=True,
        ),
        (4, 2048),
    ),
    "deepseek_v3": (
        dict(
            hidden_size=2048,
            moe_intermediate_size=1024,
            n_routed_experts=64,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            n_shared_experts=1,
            first_k_dense_replace=0,
            kv_lora_rank=256,
            q_lora_rank=512,
            qk_rope_head_dim=32,
            qk_nope_head_dim=64,
            v_head_dim=64,
            head_dim=32,  # the rotary part's width, as DeepSeek-V3's own config sets it
        ),
        (4, 2048),
    ),
}
TINY_SIZES = dict(
    head_dim=8,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
)


def _model(name: str, implementation: str, device: torch.device, dtype: torch.dtype, tiny: bool):
    import transformers

    options, _ = MODELS[name]
    sizes = {key: TINY_SIZES[key] for key in ("intermediate_size", *options) if tiny and key in TINY_SIZES}
    config = transformers.AutoConfig.for_model(
        name,
        num_hidden_layers=2,
        num_attention_heads=16 if not tiny else 4,
        num_key_value_heads=16 if not tiny else 4,
        vocab_size=32000 if not tiny else 64,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        router_aux_loss_coef=0.01,
        **{"intermediate_size": 4096, "head_dim": 128 if not tiny else 8, **options, **sizes},
    )
    torch.manual_seed(0)
    block = implementation == "moetriton_block"  # the blocks replaced; their experts module never runs
    experts = "eager" if block else implementation
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=experts)
    if block:
        from moetriton.torch.transformers import replace_moe_blocks

        replace_moe_blocks(model)
    return model.to(device=device, dtype=dtype), config


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_row(name: str, implementation: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    model, config = _model(name, implementation, device, dtype, args.tiny)
    batch = (2, 8) if args.tiny else MODELS[name][1]
    tokens = torch.randint(3, config.vocab_size, batch, device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(tokens, labels=tokens, output_router_logits=True).loss.backward()

    for _ in range(0 if args.tiny else 2):
        step()
    _sync(device)
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - started) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) - held if device.type == "cuda" else 0
    return dict(
        model=name,
        impl=implementation,
        tokens=batch[0] * batch[1],
        dtype=str(dtype).removeprefix("torch."),
        step_ms=statistics.median(times),
        peak_step_gib=peak / 2**30,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {tuple(MODELS)}")
    parser.add_argument("--impl", default=",".join(IMPLS), help=f"comma-separated, from {IMPLS}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="tiny models on CPU, one step (smoke test)")
    add_out_option(parser)
    args = parser.parse_args(argv)
    models = [name for name in args.models.split(",") if name]
    impls = [impl for impl in args.impl.split(",") if impl]
    for name in models:
        if name not in MODELS:
            parser.error(f"--models: expected names from {tuple(MODELS)}, got {name!r}")
    for impl in impls:
        if impl not in IMPLS:
            parser.error(f"--impl: expected names from {IMPLS}, got {impl!r}")
    if args.tiny:
        args.steps = 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type != "cuda" and not args.tiny:
        print(
            "the transformers backend benchmark needs a CUDA GPU (or --tiny, a CPU smoke run); nothing to do"
        )
        return 0
    from moetriton.torch.transformers import register

    register()
    dtype = torch.float32 if args.tiny else torch.bfloat16
    rows = []
    for name in models:
        for impl in impls:
            try:
                row = run_row(name, impl, args, device, dtype)
            except torch.OutOfMemoryError as error:
                row = dict(model=name, impl=impl, note=f"OOM: {str(error).splitlines()[0]}")
            gc.collect()  # the row's model goes before the next one is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            described = " ".join(
                f"{key} {value:.3f}" if isinstance(value, float) else f"{value}" for key, value in row.items()
            )
            print(described, flush=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"wrote {write_results('transformers_backend', rows, device_name, 1, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
