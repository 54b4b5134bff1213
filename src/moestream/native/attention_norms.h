// One layer's small ops as transformers computes them, for one token: RMSNorm, the rotary embedding, the
// softmax top-k router, and attention (q, k, v with their norms and rotary; decode_attention over a KV
// cache; the output projection). Part of fused_kernels.cpp (fused_build inlines it there, after matmuls.h,
// whose `project` the attention calls).

// transformers' RMSNorm on rows of x [..., H], in its rounding: the mean of squares and the scaling in
// float32, the normalized row rounded to x's dtype, then multiplied by the weight (in float32, rounded).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "rms_norm: weight must be [H]");
  auto in = x.contiguous();
  auto w = weight.contiguous();
  auto out = torch::empty_like(in);
  const int64_t rows = H ? in.numel() / H : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = in.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float epsilon = static_cast<float>(eps);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* a = xp + r * H;
        scalar_t* o = op + r * H;
        // The squares rounded to float32 as torch's pow rounds them, summed in double: torch's mean sums
        // them in a cascade of float32 partial sums, which a plain float32 running sum misses by tens of
        // units at a width of thousands (the agreement check then kept the module's own eight ops).
        double sum = 0.0;
        for (int64_t i = 0; i < H; ++i) {
          const float v = static_cast<float>(a[i]);
          sum += static_cast<double>(v * v);
        }
        const float variance = static_cast<float>(sum / static_cast<double>(H));
        const float inv = 1.f / std::sqrt(variance + epsilon);
        for (int64_t i = 0; i < H; ++i) {
          const scalar_t normed = static_cast<scalar_t>(static_cast<float>(a[i]) * inv);
          o[i] = static_cast<scalar_t>(static_cast<float>(wp[i]) * static_cast<float>(normed));
        }
      }
    });
  });
  return out;
}

// Rotary position embedding as transformers' apply_rotary_pos_emb computes it, x * cos + rotate_half(x) *
// sin, with each product and the sum rounded to x's dtype as torch's ops round them: x [B, heads, S, D]
// (any strides but the last), cos and sin [B or 1, S, D], broadcast over the heads.
static torch::Tensor rotate(const torch::Tensor& x_in, const torch::Tensor& cos, const torch::Tensor& sin) {
  auto x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  const int64_t B = x.size(0), heads = x.size(1), S = x.size(2), D = x.size(3), half = D / 2;
  const int64_t cos_batch = cos.size(0) == 1 ? 0 : S * D;
  auto out = torch::empty({B, heads, S, D}, x.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t sb = x.stride(0), sh = x.stride(1), ss = x.stride(2);
    at::parallel_for(0, B * heads * S, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / (heads * S), h = (r / S) % heads, t = r % S;
        const scalar_t* a = xp + b * sb + h * sh + t * ss;
        const scalar_t* c = cp + b * cos_batch + t * D;
        const scalar_t* s = sp + b * cos_batch + t * D;
        scalar_t* o = op + r * D;
        for (int64_t i = 0; i < D; ++i) {
          const float rotated = i < half ? -static_cast<float>(a[i + half]) : static_cast<float>(a[i - half]);
          const scalar_t first = static_cast<scalar_t>(static_cast<float>(a[i]) * static_cast<float>(c[i]));
          const scalar_t second = static_cast<scalar_t>(static_cast<float>(static_cast<scalar_t>(rotated)) * static_cast<float>(s[i]));
          o[i] = static_cast<scalar_t>(static_cast<float>(first) + static_cast<float>(second));
        }
      }
    });
  });
  return out;
}

std::vector<torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.dim() == 3, "rotary: q, k [B, heads, S, D]; cos, sin [B, S, D]");
  TORCH_CHECK(q.scalar_type() == cos.scalar_type() && k.scalar_type() == cos.scalar_type() && sin.scalar_type() == cos.scalar_type(),
              "rotary: q, k, cos and sin must share a dtype");
  const int64_t D = q.size(3);
  TORCH_CHECK(D % 2 == 0 && k.size(3) == D && cos.size(2) == D && sin.sizes() == cos.sizes(), "rotary: head dims differ");
  TORCH_CHECK(q.size(2) == cos.size(1) && k.size(2) == cos.size(1), "rotary: positions differ");
  TORCH_CHECK((cos.size(0) == 1 || cos.size(0) == q.size(0)) && k.size(0) == q.size(0), "rotary: batch sizes differ");
  auto c = cos.contiguous(), s = sin.contiguous();
  return {rotate(q, c, s), rotate(k, c, s)};
}

// A top-k router as transformers' softmax routers compute it, with the same torch ops called from here:
// logits = x W^T, probabilities = softmax in float32, their top k (divided by their sum if `normalize`,
// cast back to the logits' dtype if `cast`) -> (logits, weights, indices).
std::vector<torch::Tensor> softmax_topk_router(torch::Tensor x, torch::Tensor weight, int64_t k, bool normalize, bool cast) {
  auto logits = at::linear(x.reshape({-1, weight.size(1)}), weight);
  auto probabilities = at::softmax(logits, -1, at::kFloat);
  auto top = at::topk(probabilities, k, -1);
  auto values = std::get<0>(top);
  if (normalize) values.div_(values.sum(-1, true));
  if (cast) values = values.to(logits.scalar_type());
  return {logits, values, std::get<1>(top)};
}

// One token's attention inputs as transformers' Llama-family attention computes them, x [1, H] ->
// q [1, heads, 1, D], k and v [1, kv heads, 1, D]: the three projections (weights, params, bits, groups,
// the kernels their plans chose (`MatmulKernel`), table formats' values or empty: q, k, v), the optional RMSNorms of q and k (over each
// head, or over the whole projection before it is split into heads), then the rotary embedding of q and k.
std::vector<torch::Tensor> attention_decode_qkv(std::vector<torch::Tensor> weights, std::vector<torch::Tensor> params,
                                                std::vector<int64_t> bits, std::vector<int64_t> groups, std::vector<int64_t> kernels,
                                                std::vector<torch::Tensor> tables, c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                                                double q_eps, double k_eps, bool norm_per_head, int64_t head_dim,
                                                torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(weights.size() == 3 && params.size() == 3 && bits.size() == 3 && groups.size() == 3 && kernels.size() == 3 && tables.size() == 3,
              "attention_decode_qkv: q, k, v");
  const int8_t* values[3] = {table_values(tables[0]), table_values(tables[1]), table_values(tables[2])};
  const auto same_table = [&](int i) {
    return (values[i] == nullptr) == (values[0] == nullptr) && (values[0] == nullptr || std::memcmp(values[i], values[0], 16) == 0);
  };
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "attention_decode_qkv: x must be one contiguous row [1, H]");
  torch::Tensor states[3];
  // With int8 activations and one format for all three, x is quantized once for them (as each would).
  const bool shared = kernels[0] == kInt8Activations && kernels[1] == kInt8Activations && kernels[2] == kInt8Activations && bits[0] == bits[1] && bits[1] == bits[2] && groups[0] == groups[1] &&
                      groups[1] == groups[2] && (bits[0] == 4 || bits[0] == 6 || bits[0] == 8) && same_table(1) && same_table(2);
  thread_local lowbit::Activations xq;
  if (shared) quantize_for(x, bits[0], groups[0], xq);
  for (int i = 0; i < 3; ++i) {
    auto y = shared ? against(xq, weights[i], params[i], bits[i], x.scalar_type(), values[i])
                    : project(x, weights[i], params[i], kernels[i], bits[i], groups[i], values[i]);
    const c10::optional<torch::Tensor>& norm = i == 0 ? q_norm : k_norm;
    const double eps = i == 0 ? q_eps : k_eps;
    if (i < 2 && norm.has_value() && !norm_per_head) y = rms_norm(y, *norm, eps);
    y = y.view({1, 1, -1, head_dim});
    if (i < 2 && norm.has_value() && norm_per_head) y = rms_norm(y, *norm, eps);
    states[i] = y.transpose(1, 2);
  }
  auto rotated = rotary(states[0], states[1], cos, sin);
  return {rotated[0], rotated[1], states[2]};
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask, double scale);

// The rest of one token's attention: the model's attention function over the cached keys and values as
// transformers calls it for one query without a mask (`flash`: decode_attention, registered as the
// model's own; else sdpa, no causal flag, grouped heads in sdpa itself), heads joined, then the output
// projection -> [1, 1, H].
torch::Tensor attention_decode_out(torch::Tensor weight, torch::Tensor params, int64_t bits, int64_t group, int64_t kernel, torch::Tensor table,
                                   double scale, bool grouped, bool flash, torch::Tensor q, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(flash || k.scalar_type() != at::kChar, "attention_decode_out: an 8-bit KV cache is read by the flash-decoding kernel only");
  auto o = flash ? decode_attention(q, k, v, c10::nullopt, scale) : at::scaled_dot_product_attention(q, k, v, c10::nullopt, 0.0, false, scale, grouped);
  return project(o.transpose(1, 2).reshape({1, -1}), weight, params, kernel, bits, group, table_values(table)).view({1, 1, -1});
}

// One query position per row against a KV cache (decode_attention.h): q [B, H, 1, D], k and v [B, KVH, T, D]
// (float32 or bf16, or an 8-bit cache's rows [B, KVH, T, D + 4]: D int8 codes, then the float32 scale's bytes;
// their last dimension contiguous, any other strides: a growing cache's views), an optional
// mask [B or 1, 1, 1, T] (bool: true attends; or additive float) -> [B, H, 1, D] in q's dtype. The
// positions are cut into pieces of 256 counted from the last one: a batch's rows are right-aligned (a shorter
// row's padding masked at the front), so a row meets the same pieces, summed in the same order, as it does
// alone, and its answer has the same bits in a batch as alone, whatever the number of threads.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1, "decode_attention: q [B, H, 1, D], k and v [B, KVH, T, D]");
  const bool int8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3) + (int8 ? 4 : 0) && q.size(1) % k.size(1) == 0,
              "decode_attention: shapes do not match");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16 || int8),
              "decode_attention: keys and values in float32, bf16 or int8 rows with their scales");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: the head dimension must be contiguous");
  flash_decode::Layout s{q.size(0), q.size(1), k.size(1), k.size(2), q.size(3), k.stride(0), k.stride(1), k.stride(2),
                             v.stride(0), v.stride(1), v.stride(2), 0};
  const int64_t B = s.rows, H = s.heads, KVH = s.kv_heads, T = s.positions, D = s.dim, G = H / KVH;
  auto queries = at::mul(q.to(at::kFloat), scale).contiguous();  // [B, H, 1, D]
  torch::Tensor bias;
  if (mask.has_value()) {
    auto m = *mask;
    TORCH_CHECK(m.dim() == 4 && m.size(-1) == T && m.size(1) == 1 && m.size(2) == 1 && (m.size(0) == 1 || m.size(0) == B),
                "decode_attention: mask [B or 1, 1, 1, T]");
    m = m.scalar_type() == at::kBool ? torch::zeros(m.sizes(), at::kFloat).masked_fill_(m.logical_not(), -INFINITY) : m.to(at::kFloat);
    bias = m.reshape({m.size(0), T}).contiguous();
    s.mask_batch = m.size(0) == 1 ? 0 : T;
  }
  constexpr int64_t length = 256;
  const int64_t pieces = std::max<int64_t>(1, (T + length - 1) / length);
  auto top = torch::empty({B * KVH * pieces, G}, at::kFloat);
  auto sums = torch::empty({B * KVH * pieces, G}, at::kFloat);
  auto acc = torch::empty({B * KVH * pieces, G, D}, at::kFloat);
  const float* qp = queries.data_ptr<float>();
  const float* mp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float *tp = top.data_ptr<float>(), *lp = sums.data_ptr<float>(), *ap = acc.data_ptr<float>();
  const bool bf16 = k.scalar_type() == at::kBFloat16;
  at::parallel_for(0, B * KVH * pieces, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * length), row(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (KVH * pieces), kv = item / pieces % KVH, i = item % pieces;
      const int64_t t1 = T - (pieces - 1 - i) * length, t0 = std::max<int64_t>(0, t1 - length);
      float *m = tp + item * G, *l = lp + item * G, *a = ap + item * G * D;
      if (t0 == t1) {
        std::fill(m, m + G, -INFINITY), std::fill(l, l + G, 0.f), std::fill(a, a + G * D, 0.f);
        continue;
      }
      const float* qg = qp + (b * H + kv * G) * D;
      if (int8)
        flash_decode::piece_int8(s, qg, k.data_ptr<int8_t>(), v.data_ptr<int8_t>(), mp, b, kv, t0, t1, m, l, a, scores.data(), row.data());
      else if (bf16)
        flash_decode::piece_bf16(s, qg, reinterpret_cast<const uint16_t*>(k.data_ptr()), reinterpret_cast<const uint16_t*>(v.data_ptr()),
                                     mp, b, kv, t0, t1, m, l, a, scores.data(), row.data());
      else
        flash_decode::piece_float(s, qg, k.data_ptr<float>(), v.data_ptr<float>(), mp, b, kv, t0, t1, m, l, a, scores.data(), row.data());
    }
  });
  auto out = torch::empty({B, H, 1, D}, at::kFloat);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> m(pieces), l(pieces);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, kv = h / G, g = h % G;
      const int64_t first = (b * KVH + kv) * pieces;
      for (int64_t i = 0; i < pieces; ++i) m[i] = tp[(first + i) * G + g], l[i] = lp[(first + i) * G + g];
      flash_decode::merge(pieces, m.data(), l.data(), ap + first * G * D + g * D, G * D, D, op + bh * D);
    }
  });
  return out.to(q.scalar_type());
}

// The hand-written loops decode_attention may take: "avx512", "avx2" or "loops" (the compiler's alone, as a
// CPU without AVX2 runs); returns the ones this CPU took before the call. (The tests run each on one CPU.)
std::string decode_attention_simd(const std::string& cap) {
#if defined(__x86_64__) && defined(__GNUC__)
  const std::string previous = flash_decode::has_avx512() ? "avx512" : flash_decode::has_avx2() ? "avx2" : "loops";
  TORCH_CHECK(cap == "avx512" || cap == "avx2" || cap == "loops", "decode_attention_simd: avx512, avx2 or loops, not ", cap);
  flash_decode::simd_cap() = cap == "avx512" ? 2 : cap == "avx2" ? 1 : 0;
  return previous;
#else
  return "loops";
#endif
}

// A prompt's attention (prefill_attention.h) on a CPU with AVX-512 (BF16's dot products for bf16): q [B, H, Q, D],
// k and v [B, KVH, T, D], all bf16 or all float32 (their last dimension contiguous, any other strides), D a
// multiple of 32 up to 256, and either a bool mask [B or 1, 1, Q, T] (true attends) or none: then query i's keys
// are 0 .. T - Q + i (`causal`) or all of them -> [B, Q, H, D] in q's dtype, the layout transformers' attention
// functions return.
template <typename T>
static void prefill_attention_as(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const uint8_t* mask,
                                 int64_t mask_batch, bool causal, double scale, torch::Tensor& out) {
  flash_prefill::Problem<T> p{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3),
                              reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(k.data_ptr()),
                              reinterpret_cast<const T*>(v.data_ptr()),
                              q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                              mask, mask_batch, k.size(2), causal, static_cast<float>(scale), reinterpret_cast<T*>(out.data_ptr())};
  const int64_t threads = at::get_num_threads();
  flash_prefill::attention(p, [&](auto&& work) {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t worker = begin; worker < end; ++worker) work(worker);
    });
  });
}

torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask, double scale,
                                bool causal) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3) &&
                  q.size(1) % k.size(1) == 0,
              "prefill_attention: q [B, H, Q, D], k and v [B, KVH, T, D]");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && k.scalar_type() == dtype && v.scalar_type() == dtype,
              "prefill_attention: q, k and v all in bf16 or all in float32");
  TORCH_CHECK(flash_prefill::available(dtype == at::kBFloat16),
              "prefill_attention: this CPU has no AVX-512", dtype == at::kBFloat16 ? " BF16" : "", " (or the kernel is switched off)");
  TORCH_CHECK(q.size(3) % 32 == 0 && q.size(3) <= 256, "prefill_attention: a head dimension that is a multiple of 32, up to 256");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "prefill_attention: the head dimension must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3), T = k.size(2);
  const bool no_mask_causal = causal && !mask.has_value();
  TORCH_CHECK(!no_mask_causal || T >= Q, "prefill_attention: a causal call needs at least as many keys as queries");
  auto out = torch::empty({B, Q, H, D}, q.options());
  torch::Tensor bytes;
  int64_t mask_batch = 0;
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(1) == 1 && m.size(2) == Q && m.size(3) == T &&
                    (m.size(0) == 1 || m.size(0) == B),
                "prefill_attention: a bool mask [B or 1, 1, Q, T]");
    bytes = m.contiguous();
    mask_batch = m.size(0) == 1 ? 0 : Q * T;
  }
  const auto* mask_bytes = bytes.defined() ? reinterpret_cast<const uint8_t*>(bytes.data_ptr()) : nullptr;
  if (dtype == at::kBFloat16)
    prefill_attention_as<uint16_t>(q, k, v, mask_bytes, mask_batch, no_mask_causal, scale, out);
  else
    prefill_attention_as<float>(q, k, v, mask_bytes, mask_batch, no_mask_causal, scale, out);
  return out;
}

// Whether prefill_attention runs here for bf16 (a CPU with AVX-512 BF16) or float32 (AVX-512), the kernel not
// switched off.
bool prefill_attention_ready(bool bf16) { return flash_prefill::available(bf16); }

// Switch the prefill attention kernel on or off (the tests compare it with sdpa, and run what a CPU without
// it runs); returns whether it was on.
bool prefill_attention_switch(bool on) {
  const bool was = flash_prefill::enabled();
  flash_prefill::enabled() = on;
  return was;
}
