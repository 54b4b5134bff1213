"""Decode on one CUDA GPU: moestream's two expert tiers against transformers + accelerate offload at the
same VRAM and RAM, and all experts in VRAM against transformers with the whole model on the GPU.

    python benchmarks/gpu_bench.py [--workdir DIR] [--layers 16] [--experts 64] [--hidden 1024] [--expert-width 512]
        [--share 0.25] [--tokens 32] [--rounds 2] [--json OUT]

It builds a synthetic Qwen3-MoE checkpoint (random bf16 weights, calibrated routing) and its moestream
store in --workdir (once), then, in one process, alternating --rounds times:
1. moestream with --device cuda, the VRAM expert budget and the host budget each --share of the
   expert bytes (so a quarter of the experts fit in each tier at 0.25);
2. transformers + accelerate (`device_map="auto"`) with `max_memory` giving the GPU the same bytes
   (resident weights plus the VRAM budget) and the CPU the same host budget, the rest offloaded to disk;
3. moestream with every expert in VRAM, and 4. transformers with the whole model on the GPU.
Decode tokens/s is `serving.timed` (greedy, exactly --tokens tokens after a 16-token prompt, the prefill
not counted), the same definition for every engine. Prints each run and the ratios of the medians; --json
writes them with the machine (GPU, CPU, torch, commit).
"""

import argparse
import gc
import statistics
import tempfile
from pathlib import Path

import machine
import torch

import moestream
from moestream.conversion.store import Store
from moestream.conversion.synthetic import VOCAB_SIZE, calibrated_router, make_model, save_checkpoint
from moestream.generation.serving import timed


def build(workdir: Path, args) -> tuple[Path, Path]:
    checkpoint, store = workdir / "hf", workdir / "store"
    if not (store / "manifest.json").exists():
        model = make_model(
            "qwen3_moe",
            seed=0,
            vocab_size=VOCAB_SIZE,
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
            moe_intermediate_size=args.expert_width,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=args.hidden // 8,
            num_experts=args.experts,
            num_experts_per_tok=6,
            norm_topk_prob=True,
            max_position_embeddings=512,
            dtype=torch.bfloat16,
        )
        calibrated_router(model)
        save_checkpoint(model, checkpoint)
        del model
        gc.collect()
        moestream.convert(checkpoint, store)
    return checkpoint, store


def rate(model, ids, tokens: int) -> float:
    timed(model, ids, 4)  # warm-up: kernels chosen, caches filled as in a running process
    return timed(model, ids, tokens).decode_tokens_per_second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--stand-in",
        action="store_true",
        help="a dry run without a GPU: moestream's device tier on devices.StandInDevice, the peers on the CPU",
    )
    parser.add_argument("--json", help="write the runs and ratios here too")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="moestream-gpu-"))
    checkpoint, store = build(workdir, args)
    manifest = Store(store).manifest
    experts = sum(layer.layout.stride * len(layer.offsets) for layer in manifest.layers)
    budget = int(experts * args.share)
    ids = torch.randint(3, VOCAB_SIZE, (1, 16), generator=torch.Generator().manual_seed(0))
    if args.stand_in:
        from moestream.core.devices import StandInDevice

        device, gpu, peer_map, max_memory_gpu = StandInDevice, "cpu", "cpu", "cpu"
    else:
        device, gpu, peer_map, max_memory_gpu = (lambda: "cuda"), "cuda", "auto", 0
    name = "stand-in device (CPU)" if args.stand_in else torch.cuda.get_device_name()
    print(f"machine: {machine.line()}")
    print(f"{name}: {args.layers} layers x {args.experts} experts, {experts / 2**30:.2f} GiB of experts")
    print(f"tiers: VRAM {budget / 2**20:.0f} MiB, host {budget / 2**20:.0f} MiB ({args.share:.0%} of the experts each)")

    results: dict[str, list[float]] = {}
    # The peer gets the same VRAM (resident weights plus the expert budget) and RAM; the rest goes to disk.
    max_memory = {max_memory_gpu: manifest.resident_bytes + budget, "cpu": budget}
    offload = workdir / "offload"

    def run(name: str, make) -> None:
        ours = name.startswith("moestream")
        model = make()
        try:
            results.setdefault(name, []).append(rate(model, ids, args.tokens))
            extra = ""
            if ours:
                s = moestream.stats(model)
                extra = f"; hit rate {s['hit_rate']:.1%}, {s['device_hits']} VRAM hits, {s['bytes_read'] / 2**20:.0f} MiB read"
            print(f"  {name}: {results[name][-1]:.2f} tok/s{extra}", flush=True)
        finally:
            if ours:
                moestream.close(model)
            del model
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    for r in range(args.rounds):
        print(f"round {r + 1}")
        run("moestream, two tiers", lambda: moestream.load(store, budget, device=device(), gpu_memory=budget)[0])
        run(
            "transformers + accelerate offload",
            lambda: AutoModelForCausalLM.from_pretrained(
                checkpoint,
                dtype=torch.bfloat16,
                device_map=peer_map,
                max_memory=max_memory,
                offload_folder=str(offload),
            ),
        )
        run(
            "moestream, all experts in VRAM",
            lambda: moestream.load(store, budget, device=device(), gpu_memory=int(experts * 1.05))[0],
        )
        run(
            "transformers, whole model on the GPU",
            lambda: AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(gpu),
        )
    median = {name: statistics.median(v) for name, v in results.items()}
    tiers = median["moestream, two tiers"] / median["transformers + accelerate offload"]
    vram = median["moestream, all experts in VRAM"] / median["transformers, whole model on the GPU"]
    print(f"two tiers / accelerate offload: {tiers:.1f}x (target >= 10x)")
    print(f"all in VRAM / transformers on the GPU: {vram:.2f}x (target >= 0.8x)")
    if args.json:
        options = {k: v for k, v in vars(args).items() if k != "json"}
        ratios = {"two_tiers_over_offload": tiers, "all_in_vram_over_transformers_on_gpu": vram}
        machine.write_json(args.json, {"device": name, "options": options, "decode_tokens_per_second": results, "ratios": ratios})


if __name__ == "__main__":
    main()
