"""The names a user chooses among, on the command line and in the Python API, with their defaults: store
formats, engine modes, cache policies.

Plain values, no torch: every verb's `--help` builds its parser from these without importing the engine
(commands/), and the modules that implement a choice take its names from here, so that the two cannot
drift apart (tests/test_cli.py checks each list against its implementation's table).
"""

# ---- the store (conversion/) ----------------------------------------------------------------------------

#: Expert weights kept as floats (conversion/convert.py maps each to its torch dtype).
FLOAT_FORMATS = ("bf16", "fp16", "fp32")
#: Low-bit formats (conversion/quant.py): int8 per output channel, int6/int4/int3/int2 per group, affine.
QUANT_FORMATS = ("int8", "int6", "int4", "int3", "int2")
#: 4-bit codes into a fixed table of 16 values, a scale per 32 (conversion/quant.py): what a GGUF's MXFP4
#: (gpt-oss) and IQ4_NL/IQ4_XS blocks hold, kept exactly. Chosen by the converter for such blocks, not asked for.
TABLE_FORMATS = ("mxfp4", "iq4nl")
#: `convert --experts-dtype`.
EXPERT_FORMATS = FLOAT_FORMATS + QUANT_FORMATS
#: `convert --dense-dtype`: resident linear layers (attention, shared experts, dense MLPs) in the model's
#: float dtype, or quantized into these kernel formats (core/compute/dense.py runs them).
DENSE_FORMATS = ("float", "int8", "int6", "int4")
#: Weights per scale of int6/int4/int3/int2.
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32

# ---- the engine (core/) -----------------------------------------------------------------------------------

#: `--verify`: when expert records are checked against their manifest checksums (docs/FORMAT.md,
#: "Verification"). "first": the first time each record is read by this process (the default: damage on
#: disk is caught before the bytes are used, and re-reads of an evicted expert cost no hashing); "always":
#: every read; "off": never.
VERIFY_MODES = ("first", "always", "off")
#: `--compute-dtype`: the dtype float weights and activations compute in (core/compute/kernels.py).
COMPUTE_DTYPES = ("auto", "bf16", "fp32")
#: `--activations`: what the CPU's low-bit matmuls take. "auto": int8 where the compiled kernels exist and
#: are measured faster on the model's shapes (core/compute/plan.py, `choose_activations`).
ACTIVATIONS = ("auto", "int8", "float")
#: `--attention`: the model's attention function. "auto": the compiled flash-decoding kernel for one query
#: where it is compiled and the model's attention is sdpa, the compiled prefill kernel for a float32 or bf16 prompt
#: on a CPU with AVX-512 (bf16: with BF16), sdpa for other prompts (core/compute/attention.py).
ATTENTION = ("auto", "sdpa")
#: `--kv-cache-dtype`: what a decode step's KV cache holds. "auto": keys and values in the model's dtype;
#: "int8": each position's row of a head as int8 codes and one float32 scale, about half the bytes a step
#: reads at long context (core/compute/attention.py, generation/kv_layer.py).
KV_CACHE_DTYPES = ("auto", "int8")
#: `--prefetch`: speculative reads of the next layer's likely experts (core/supply/prefetch.py).
PREFETCH_MODES = ("auto", "on", "off")
#: `--policy`: the expert cache's eviction policies (core/supply/policies.py).
POLICIES = ("lru", "lfu", "arc", "forecast")
# forecast: on the routing of four trained models (benchmarks/traces) it is at or above LFU at every budget
# from 5% to 30% of the experts, and LFU at or above LRU and ARC (decode visits the layers cyclically, so
# once the cache holds less than one token's experts LRU and ARC evict each expert just before its next
# use); decoding the fixture at 8 MiB is as fast as with LFU (docs/DECISIONS.md, "Default cache policy:
# forecast").
DEFAULT_POLICY = "forecast"
#: VRAM a GPU run keeps free beside the resident weights and the expert budget: the KV cache, activations,
#: CUDA's own workspace.
GPU_HEADROOM = 2**30

# ---- measurement (tools/) ---------------------------------------------------------------------------------

#: `eval --reference-dtype`: a checkpoint reference loaded in this torch dtype instead of its own.
REFERENCE_DTYPES = ("float32", "bfloat16", "float16")
#: `eval`: the text's first tokens evaluated, tokens per window, and the stores' expert cache budget.
EVAL_MAX_TOKENS = 1024
EVAL_CONTEXT = 256
EVAL_MEMORY = "1GiB"
#: `plan --overhead`: memory for the Python/torch runtime, activations and KV cache.
PLAN_OVERHEAD = "512MiB"
