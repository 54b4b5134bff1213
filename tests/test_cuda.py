"""The GPU path on a real CUDA device (skipped where there is none; benchmarks/gpu_check.sh runs it):
logits equal transformers' own forward on the GPU, greedy tokens equal across tier budgets, VRAM bounded."""

import pytest
import torch
from tiny import TINY, tiny_checkpoint

import moestream
from moestream.cli import main
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.generation.generate import SamplingParams
from moestream.generation.serving import stream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
RECORD = 8 * 2**10  # the tiny models' fp32 expert records, as stored (4 KiB aligned)
# Beyond the resident weights and the VRAM expert budget: activations, the KV cache, CUDA's workspace.
VRAM_OVERHEAD = 64 * 2**20


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf_model, ckpt = tiny_checkpoint(request.param, root / "hf", seed=5)
    assert main(["convert", str(ckpt), str(root / "store"), "--experts-dtype", "fp32"]) == 0
    return request.param, hf_model.eval(), root / "store"


def _prompt(seed: int, n: int = 12) -> torch.Tensor:
    return torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_transformers_on_the_gpu(case):
    family, hf_model, store = case
    ids = _prompt(1)
    reference = hf_model.to("cuda")(ids.cuda()).logits.float()
    hf_model.to("cpu")
    # Below half the experts in each tier (16 records of 8 KiB): misses, copies and evictions every layer.
    model, _ = moestream.load(store, memory=4 * RECORD, device="cuda", gpu_memory=2 * RECORD, prefetch="off")
    try:
        with torch.inference_mode():
            got = model(ids.cuda()).logits.float()
        assert (got - reference).abs().max().item() <= 1e-4, family
        s = moestream.stats(model)
        assert s["misses"] > 0 and s["device_cache_slots"] == 2
    finally:
        moestream.close(model)


def test_greedy_tokens_equal_across_tier_budgets_with_vram_bounded(case):
    family, _, store = case
    prompt = _prompt(2).tolist()[0]
    answers = []
    for gpu, host in ((2 * RECORD, 2 * RECORD), (2 * RECORD, 64 * RECORD), (64 * RECORD, 2 * RECORD), (64 * RECORD, 64 * RECORD)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model, _ = moestream.load(store, memory=host, device="cuda", gpu_memory=gpu, prefetch="off")
        try:
            answers.append(stream(model, None, prompt, SamplingParams.timed(16)).token_ids)
            resident = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
            peak = torch.cuda.max_memory_allocated() - base
            assert peak <= resident + gpu + VRAM_OVERHEAD, (family, peak, resident, gpu)
        finally:
            moestream.close(model)
            del model
            torch.cuda.empty_cache()
    assert all(a == answers[0] for a in answers), family


@pytest.mark.parametrize("experts_dtype", ["int8", "int4"])
def test_quantized_experts_on_the_gpu_match_the_cpu_kernels(experts_dtype, tmp_path):
    """One store on both devices: int8 and int4 records run dequantized on CUDA (kernels.int8_dequantized /
    int4_dequantized, reading the portable nibbles as stored) and through torch's CPU kernels on the CPU
    (repacked where they land); the CPU kernels run int4 with bf16 activations."""
    # widths the int4 format takes (inputs a multiple of its group size)
    model = make_model("qwen3_moe", seed=6, **dict(TINY["qwen3_moe"], hidden_size=64, moe_intermediate_size=64, head_dim=16))
    ckpt = save_checkpoint(model, tmp_path / "hf")
    assert main(["convert", str(ckpt), str(tmp_path / "store"), "--experts-dtype", experts_dtype, "--dense-dtype", "int8"]) == 0
    ids = _prompt(3)
    cpu, _ = moestream.load(tmp_path / "store", memory=2**20)
    with torch.inference_mode():
        expected = cpu(ids).logits.float()
    moestream.close(cpu)
    gpu, _ = moestream.load(tmp_path / "store", memory=2**20, device="cuda", gpu_memory=2**20)
    try:
        with torch.inference_mode():
            got = gpu(ids.cuda()).logits.float().cpu()
        assert (got - expected).abs().max().item() <= 0.02 * expected.abs().max().item(), experts_dtype
    finally:
        moestream.close(gpu)
