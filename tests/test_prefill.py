"""A long prompt reads each expert it needs once per layer, even when the cache holds far fewer experts
than the prompt routes to (the layer then runs in waves), and the waves change no numbers."""

import torch
from tiny import TINY

import moestream
from moestream.conversion.skeleton import experts_modules
from moestream.conversion.store import Store
from moestream.conversion.synthetic import make_model, save_checkpoint


def test_prefill_reads_each_needed_expert_once_per_layer(tmp_path):
    config = dict(TINY["qwen3_moe"], num_experts=32, num_experts_per_tok=4)
    ckpt = save_checkpoint(make_model("qwen3_moe", seed=13, **config), tmp_path / "hf")
    store = moestream.convert(ckpt, tmp_path / "store", experts_dtype="fp32", progress=False)
    stride = Store(store).manifest.max_record_stride
    prompt = torch.randint(0, 250, (1, 96), generator=torch.Generator().manual_seed(2))

    logits = {}
    for slots in (4, 64):  # 4: the minimum, far below the ~30 experts a layer needs; 64: everything
        model, _ = moestream.load(store, slots * stride)
        routed = {}
        for layer, (_, module) in enumerate(experts_modules(model)):
            module.register_forward_hook(
                lambda mod, args, out, layer=layer, routed=routed: routed.setdefault(layer, set()).update(
                    args[1].reshape(-1).tolist()
                )
            )
        with torch.no_grad():
            logits[slots] = model(prompt).logits
        stats = moestream.stats(model)["layers"]
        for layer, needed in routed.items():
            assert len(needed) > slots or slots == 64
            assert stats[layer]["misses"] == len(needed), (slots, layer)  # one read per distinct expert
            assert stats[layer]["bytes_read"] == len(needed) * stride
    assert torch.equal(logits[4], logits[64])
