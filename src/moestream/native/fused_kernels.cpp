// Only the headers these kernels use. <torch/extension.h> brings the whole C++ frontend (nn, optim, data)
// and doubled the compile that a first load waits for (docs/DECISIONS.md, "Building the fused kernels").
// ATen's Tensor (its methods included), then one header per ATen function called as at::NAME or torch::NAME
// (ATen/ops/NAME.h: a new function needs its line here), then torch's pybind11 casters for tensors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/index_copy.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <cmath>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "cpu_features.h"
#include "decode_attention.h"
#include "lowbit_dot.h"
#include "lowbit_gemm.h"
#include "prefill_attention.h"

namespace torch {  // as <torch/extension.h> has it (torch/types.h)
using namespace at;  // torch::Tensor, torch::empty
}

// The kernels, by what they serve (each file's first lines say what it holds).
#include "matmuls.h"
#include "attention_norms.h"
#include "import_passes.h"

// Every kernel runs without the GIL (it touches no Python object): the model's thread computing a layer
// must not hold up the I/O threads, which need the GIL to finish a read and start the next one
// (docs/DECISIONS.md, "Kernels without the GIL").
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, no_gil);
  m.def("rotary", &rotary, no_gil);
  m.def("silu_gate", &silu_gate, no_gil);
  m.def("experts_decode", &experts_decode, no_gil);
  m.def("experts_prefill", &experts_prefill, no_gil);
  m.def("softmax_topk_router", &softmax_topk_router, no_gil);
  m.def("attention_decode_qkv", &attention_decode_qkv, no_gil);
  m.def("attention_decode_out", &attention_decode_out, no_gil);
  m.def("int4_matmul", &int4_matmul, no_gil);
  m.def("int8_matmul", &int8_matmul, no_gil);
  m.def("table_matmul", &table_matmul, no_gil);
  m.def("lowbit_isa", &lowbit_isa);
  m.def("lowbit_variant", &lowbit_variant);
  m.def("lowbit_gemm_rows", &lowbit_gemm_rows);
  m.def("decode_attention", &decode_attention, no_gil);
  m.def("decode_attention_simd", &decode_attention_simd);
  m.def("prefill_attention", &prefill_attention, no_gil);
  m.def("prefill_attention_ready", &prefill_attention_ready);
  m.def("prefill_attention_switch", &prefill_attention_switch);
  m.def("repack_int4", &repack_int4, no_gil);
  m.def("repair_nibbles", &repair_nibbles, no_gil);
  m.def("q6_k_int8", &q6_k_int8, no_gil);
  m.def("q6_k_int4", &q6_k_int4, no_gil);
}
