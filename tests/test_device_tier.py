"""The GPU path's tier logic on a machine without a GPU: slot lifetimes driven by fake events, and whole
models run through the device tier on a stand-in device, token for token the CPU path's."""

import pytest
import torch
from tiny import tiny_checkpoint

import moestream
from moestream.cli import main
from moestream.conversion.quant import QuantFormat, expand_int4_bytes, pack, quantize, reference_dequantize
from moestream.core.compute.kernels import cpu_record, int4_dequantized, int8_dequantized, quantized_matmul
from moestream.core.devices import StandInDevice
from moestream.core.supply.cache import ExpertCache, State
from moestream.core.supply.device_tier import DeviceTier
from moestream.core.supply.policies import LRUPolicy
from moestream.errors import UsageError
from moestream.generation.generate import SamplingParams
from moestream.generation.serving import stream

SLOT = 64


def _host(slots: int) -> ExpertCache:
    host = ExpertCache(slots * SLOT, SLOT, LRUPolicy())
    for e in range(slots):
        entry = host.allocate((0, e), State.READY)
        host.slot_tensor(entry.slot).fill_(e + 1)
    return host


def _tier(device, slots: int) -> DeviceTier:
    return DeviceTier(device, slots * SLOT, SLOT, LRUPolicy(), lambda layer, raw: {"raw": raw})


def test_a_device_slot_is_reused_only_after_the_kernels_that_read_it_are_over():
    device = StandInDevice(manual=True)
    host, tier = _host(4), _tier(device, 2)
    staged = []
    for e in (0, 1):
        entry = tier.stage(host.lookup((0, e)), host, host.slot_tensor(host.lookup((0, e)).slot), SLOT)
        assert torch.equal(entry.tensors["raw"], torch.full((SLOT,), e + 1, dtype=torch.uint8))
        tier.done_with(entry)
        staged.append(entry)
    reader_events = device.computes[:]
    assert not any(event.done for event in reader_events)
    tier.release()  # nothing is over: every pin stays
    assert all(entry.pins == 1 for entry in staged)
    # A third expert: both slots are held by queued kernels, so the tier waits for the oldest one.
    third = tier.stage(host.lookup((0, 2)), host, host.slot_tensor(host.lookup((0, 2)).slot), SLOT)
    assert tier.waits >= 1
    reused = next(e for e in staged if e.slot == third.slot)
    assert reader_events[staged.index(reused)].done  # its reader's event was over before its slot went again
    assert torch.equal(third.tensors["raw"], torch.full((SLOT,), 3, dtype=torch.uint8))
    # A kernel that completes frees its slot without any wait.
    tier.done_with(third)
    waits = tier.waits
    for event in device.computes + device.copies:
        event.complete()
    tier.release()
    tier.stage(host.lookup((0, 3)), host, host.slot_tensor(host.lookup((0, 3)).slot), SLOT)
    assert tier.waits == waits


def test_a_host_slot_stays_pinned_until_its_copy_is_over():
    device = StandInDevice(manual=True)
    host, tier = _host(2), _tier(device, 2)
    source = host.lookup((0, 0))
    tier.done_with(tier.stage(source, host, host.slot_tensor(source.slot), SLOT))
    assert source.pins == 1  # the copy may still read it
    assert host.allocate((1, 0), State.LOADING) is not None  # evicts the other, never the copy's source
    assert host.allocate((1, 1), State.LOADING) is None
    assert (0, 0) in host
    device.copies[0].complete()
    tier.release()
    assert source.pins == 0
    assert host.allocate((1, 1), State.LOADING) is not None  # now it may go


def test_device_hits_pin_their_slot_and_count():
    host, tier = _host(2), _tier(StandInDevice(), 2)
    source = host.lookup((0, 1))
    tier.done_with(tier.stage(source, host, host.slot_tensor(source.slot), SLOT))
    tier.release()
    assert tier.lookup(0, 0) is None
    hit = tier.lookup(0, 1)
    assert hit is not None and hit.pins == 1 and tier.hits == 1
    tier.done_with(hit)
    tier.release()
    assert hit.pins == 0


def test_int8_on_a_device_without_its_kernel_dequantizes_exactly():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g, dtype=torch.float64)
    x = torch.randn(5, 64, generator=g)
    fmt = QuantFormat("int8")
    q = quantize(w.float(), fmt)
    reference = x.double() @ reference_dequantize(q, fmt).T
    record = pack(q, fmt, "w")
    got = int8_dequantized(x, record["w.qweight"], record["w.scales"])
    cpu = quantized_matmul(x, record["w.qweight"], record["w.scales"], fmt)
    assert torch.allclose(got.double(), reference, atol=1e-4, rtol=1e-4)
    assert torch.allclose(got, cpu, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,group", [("int4", 32), ("int4", 128), ("int3", 64), ("int2", 32)])
def test_the_int4_family_on_a_device_without_its_kernel_recovers_the_codes_as_stored(name, group):
    """CUDA has no kernel for torch's CPU int4 packing; the codes are read from the portable bytes as
    stored and dequantized: the same matrix as the format's float64 definition, the same matmul as the
    CPU kernel's on the same record made into its layout."""
    g = torch.Generator().manual_seed(len(name) + group)
    for n, k in ((48, 128), (256, 256)):
        w = torch.randn(n, k, generator=g)
        x = torch.randn(3, k, generator=g)
        fmt = QuantFormat.make(name, group)
        q = quantize(w, fmt)
        record = pack(q, fmt, "w")
        got = int4_dequantized(
            x,
            expand_int4_bytes(record["w.qweight"], fmt.bits) if fmt.bits < 4 else record["w.qweight"],
            record["w.scales_zeros"],
            fmt,
        )
        reference = x.double() @ reference_dequantize(q, fmt).T
        assert torch.allclose(got.double(), reference, atol=1e-4, rtol=1e-4), (name, group, n, k)
        cpu_bytes = cpu_record(record, fmt)
        cpu = quantized_matmul(x, cpu_bytes["w.qweight"], cpu_bytes["w.scales_zeros"], fmt)  # bf16 activations inside
        assert torch.allclose(got, cpu, atol=0.05 * reference.abs().max().item()), (name, group, n, k)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    out = {}
    for family, dtype in (("qwen3_moe", "fp32"), ("gpt_oss", "fp32"), ("deepseek_v3", "fp32"), ("mixtral", "int8")):
        root = tmp_path_factory.mktemp(family)
        _, ckpt = tiny_checkpoint(family, root / "hf", seed=4)
        assert main(["convert", str(ckpt), str(root / "store"), "--experts-dtype", dtype]) == 0
        out[family] = root / "store"
    return out


PROMPT = [17, 4, 99, 23, 5, 61, 8, 140]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("manual", [False, True], ids=["events-at-once", "events-only-when-waited"])
def test_a_model_through_the_device_tier_gives_the_cpu_tokens(stores, family, manual):
    cpu, _ = moestream.load(stores[family], memory=16 * 2**10, prefetch="off")
    expected = stream(cpu, None, PROMPT, SamplingParams.timed(12)).token_ids
    moestream.close(cpu)
    # Device tier: two slots (the minimum), then all of them; the host tier small, then large.
    for gpu, host in ((16 * 2**10, 16 * 2**10), (256 * 2**10, 16 * 2**10), (16 * 2**10, 2**20)):
        device = StandInDevice(manual=manual)
        model, _ = moestream.load(stores[family], memory=host, device=device, gpu_memory=gpu, prefetch="off")
        try:
            assert stream(model, None, PROMPT, SamplingParams.timed(12)).token_ids == expected
            s = moestream.stats(model)
            slot = host // s["cache_slots"]
            assert device.copies and s["device_cache_slots"] == gpu // slot
            if gpu > 16 * 2**10:
                assert s["device_hits"] > 0
            if manual and gpu == 16 * 2**10:
                assert s["device_waits"] > 0  # the waits for queued work happened, and changed nothing
        finally:
            moestream.close(model)


def test_cuda_is_refused_with_what_to_do_where_there_is_none(stores, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UsageError, match=r"torch.cuda.is_available\(\) is False.*--device cpu"):
        moestream.load(stores["qwen3_moe"], memory="1MiB", device="cuda")
    with pytest.raises(UsageError, match="'cpu' or 'cuda'"):
        moestream.load(stores["qwen3_moe"], memory="1MiB", device="tpu")
    assert main(["generate", str(stores["qwen3_moe"]), "--prompt", "hi", "--device", "cuda"]) == 2
    assert "moestream: error: device cuda: no CUDA GPU" in capsys.readouterr().err
    assert main(["generate", str(stores["qwen3_moe"]), "--prompt", "hi", "--gpu-memory", "1GiB"]) == 2
    assert "--gpu-memory is the VRAM budget of --device cuda" in capsys.readouterr().err


def test_a_device_budget_below_one_tokens_experts_is_refused(stores):
    with pytest.raises(UsageError, match="minimum is 16 KiB: pass --gpu-memory 16KiB"):
        moestream.load(stores["qwen3_moe"], memory="1MiB", device=StandInDevice(), gpu_memory=8 * 2**10)


def test_inspect_and_plan_state_the_vram_and_ram_split(stores, capsys):
    assert main(["inspect", str(stores["qwen3_moe"]), "--memory", "64KiB", "--gpu-memory", "32KiB"]) == 0
    out = capsys.readouterr().out
    assert "with --device cuda, VRAM" in out and "32 KiB of experts (4, 25.0%)" in out
    assert "64 KiB of page-locked expert cache (--memory; 8 experts, 50.0%)" in out and "minimum --gpu-memory" in out
    config = str(stores["qwen3_moe"])
    assert main(["plan", config, "--memory", "1GiB", "--gpu", "2GiB"]) == 0
    assert "with --device cuda on 2 GiB of VRAM: resident weights" in capsys.readouterr().out
    assert main(["plan", config, "--memory", "1GiB", "--gpu", "1GiB"]) == 0  # 1 GiB is all set aside for KV and activations
    assert "DOES NOT FIT" in capsys.readouterr().out
