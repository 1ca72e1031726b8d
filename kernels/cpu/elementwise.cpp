// Fused elementwise kernels for a decoder layer's work around the GEMMs (issue 15): op by op,
// a 1,024-token float32 prefill step spent ~40% of its time in RMSNorm, RoPE, SiLU * up,
// residual adds and the cats and copies between them, each a separate pass over memory
// with its own dispatch and OpenMP region. Each op below is one pass.
//
// Contracts (kernels/reference/elementwise.py is the oracle, kernels/cpu/elementwise.py the
// Python side). float32 or bfloat16 tensors, last dimension contiguous, rows may be strided;
// bf16 is widened to float32 on load, all math is float32, one rounding on store:
//   add_rms_norm(residual!, delta?, weight, eps) -> out
//       residual += delta (in place, when delta is given); out = weight * rms_norm(residual).
//       In bf16 the norm reads the *rounded* new residual, as the op-by-op model does.
//   qk_norm_rope(qk!, positions, cos, sin, q_heads, q_norm?, k_norm?, eps)
//       qk [T, heads, D] (q heads then k heads, the fused QKV output's view); in place:
//       per-head RMSNorm with q_norm / k_norm (Qwen3; both or neither), then neox
//       (rotate-half) RoPE with cos/sin rows [max_pos, D] of the same dtype at positions[t].
//   silu_mul(gate_up) -> out  ([T, 2I] -> [T, I]; SiLU(first half) * second half)
//   write_kv(kv_data!, k, v, slots)
//       kv_data [L, 2, KVH, NB, BS, D], k and v [L, T, KVH, D]: token t of every layer to
//       slot slots[t] (block slot / BS, offset slot % BS). Bytes are copied, any dtype.
//
// Operation order follows the PyTorch reference where that makes float32 results identical
// (RoPE: two products then one sum, no FMA contraction: the build passes -ffp-contract=off);
// the RMSNorm sum of squares is a vector sum, so it may differ from torch's in the last bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>

#include "simd.h"

namespace tandem {
namespace {

using S = Simd;
constexpr int kMaxHeadDim = 512;

// Scalar float -> bf16 with round-to-nearest-even (the vector store's rounding), or a float as is.
inline void put(float* p, float x) { *p = x; }
inline void put(bf16_t* p, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7fff + ((bits >> 16) & 1);
  *p = static_cast<bf16_t>(bits >> 16);
}

// Rows per parallel chunk: about 64K elements. One thread does a decode step's call (64 rows of
// SmolLM2: 36K elements for add + RMSNorm, 49K for q/k RoPE, 25K for one layer's KV write) in
// 4-8 us (loadgen/bench/cpu_elementwise.py), about what an OpenMP fork/join costs on a quiet
// machine and far less than a region costs on a busy one, where a descheduled thread stalls
// it for a time slice; a prefill chunk's calls still split across every thread.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_elems)); }

template <typename T>
T* ptr(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) {
    return t.data_ptr<float>();
  } else {
    return reinterpret_cast<bf16_t*>(t.data_ptr<at::BFloat16>());
  }
}

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "tandem ", what,
              ": float32 or bfloat16 only");
  TORCH_CHECK(t.device().is_cpu(), "tandem ", what, ": CPU tensors only");
}

// -- add + RMSNorm --------------------------------------------------------------------------

template <typename T>
void add_rms_norm_rows(T* res, int64_t res_stride, const T* delta, int64_t delta_stride, const T* w, T* out,
                       int64_t out_stride, int64_t n, float eps, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    T* x = res + r * res_stride;
    T* o = out + r * out_stride;
    S::V acc = S::zero();
    float tail = 0.f;
    int64_t i = 0;
    if (delta) {
      const T* d = delta + r * delta_stride;
      for (; i + S::W <= n; i += S::W) {
        S::store(x + i, S::add(S::load(x + i), S::load(d + i)));
        S::V y = S::load(x + i);  // re-read: in bf16 the norm sees the rounded residual
        acc = S::fma(y, y, acc);
      }
      for (; i < n; ++i) {
        put(x + i, to_float(x[i]) + to_float(d[i]));
        const float y = to_float(x[i]);
        tail += y * y;
      }
    } else {
      for (; i + S::W <= n; i += S::W) {
        S::V y = S::load(x + i);
        acc = S::fma(y, y, acc);
      }
      for (; i < n; ++i) tail += to_float(x[i]) * to_float(x[i]);
    }
    const float mean = (S::hsum(acc) + tail) / static_cast<float>(n);
    const float rstd = 1.0f / std::sqrt(mean + eps);
    const S::V vr = S::set1(rstd);
    i = 0;
    for (; i + S::W <= n; i += S::W) S::store(o + i, S::mul(S::load(w + i), S::mul(S::load(x + i), vr)));
    for (; i < n; ++i) put(o + i, to_float(w[i]) * (to_float(x[i]) * rstd));
  }
}

at::Tensor add_rms_norm(at::Tensor residual, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  check_float(residual, "add_rms_norm");
  TORCH_CHECK(residual.dim() == 2 && residual.stride(1) == 1, "tandem add_rms_norm: residual must be [T, H], rows contiguous");
  const int64_t rows = residual.size(0), n = residual.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous() &&
                  weight.scalar_type() == residual.scalar_type(),
              "tandem add_rms_norm: weight must be [H], contiguous, residual's dtype");
  if (delta) {
    TORCH_CHECK(delta->sizes() == residual.sizes() && delta->stride(1) == 1 &&
                    delta->scalar_type() == residual.scalar_type(),
                "tandem add_rms_norm: delta must match residual");
  }
  at::Tensor out = at::empty({rows, n}, residual.options());
  if (rows == 0 || n == 0) return out;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    T* res = ptr<T>(residual);
    const T* d = delta ? ptr<T>(*delta) : nullptr;
    const int64_t ds = delta ? delta->stride(0) : 0;
    at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
      add_rms_norm_rows<T>(res, residual.stride(0), d, ds, ptr<T>(weight), ptr<T>(out), out.stride(0), n,
                           static_cast<float>(eps), r0, r1);
    });
  };
  if (residual.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(bf16_t{});
  }
  return out;
}

// -- q/k norm + RoPE ------------------------------------------------------------------------

// One token's heads: the position's cos/sin rows are widened to float once and reused by every
// head (a decode step's tokens each sit at their own position, so these are cache misses).
template <typename T>
void rope_token(T* x, int64_t heads, int64_t head_stride, int64_t q_heads, int64_t d, const T* cos, const T* sin,
                const T* q_norm, const T* k_norm, float eps) {
  float c[kMaxHeadDim], sn[kMaxHeadDim], buf[kMaxHeadDim];
  const int64_t half = d / 2;
  int64_t i = 0;
  for (; i + S::W <= d; i += S::W) {
    S::store(c + i, S::load(cos + i));
    S::store(sn + i, S::load(sin + i));
  }
  for (; i < d; ++i) {
    c[i] = to_float(cos[i]);
    sn[i] = to_float(sin[i]);
  }
  for (int64_t h = 0; h < heads; ++h) {
    T* row = x + h * head_stride;
    const T* norm_w = h < q_heads ? q_norm : k_norm;
    const float* src = buf;
    if (norm_w) {  // the same order as the RMSNorm module: (x * rstd), then * weight
      S::V acc = S::zero();
      float tail = 0.f;
      for (i = 0; i + S::W <= d; i += S::W) {
        const S::V y = S::load(row + i);
        acc = S::fma(y, y, acc);
        S::store(buf + i, y);
      }
      for (; i < d; ++i) {
        buf[i] = to_float(row[i]);
        tail += buf[i] * buf[i];
      }
      const float rstd = 1.0f / std::sqrt((S::hsum(acc) + tail) / static_cast<float>(d) + eps);
      const S::V vr = S::set1(rstd);
      for (i = 0; i + S::W <= d; i += S::W) S::store(buf + i, S::mul(S::load(norm_w + i), S::mul(S::load(buf + i), vr)));
      for (; i < d; ++i) buf[i] = to_float(norm_w[i]) * (buf[i] * rstd);
    } else if constexpr (std::is_same_v<T, float>) {
      src = row;  // rotated in place: each half is read before it is written
    } else {
      for (i = 0; i + S::W <= d; i += S::W) S::store(buf + i, S::load(row + i));
      for (; i < d; ++i) buf[i] = to_float(row[i]);
    }
    // x * cos + rotate_half(x) * sin, rotate_half(x) = (-b, a)
    for (i = 0; i + S::W <= half; i += S::W) {
      const S::V a = S::load(src + i), b = S::load(src + half + i);
      S::store(row + i, S::sub(S::mul(a, S::load(c + i)), S::mul(b, S::load(sn + i))));
      S::store(row + half + i, S::add(S::mul(b, S::load(c + half + i)), S::mul(a, S::load(sn + half + i))));
    }
    for (; i < half; ++i) {
      const float a = src[i], b = src[half + i];
      put(row + i, a * c[i] - b * sn[i]);
      put(row + half + i, b * c[half + i] + a * sn[half + i]);
    }
  }
}

void qk_norm_rope(at::Tensor qk, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t q_heads, const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                  double eps) {
  check_float(qk, "qk_norm_rope");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "tandem qk_norm_rope: qk must be [T, heads, D], D contiguous");
  const int64_t t = qk.size(0), heads = qk.size(1), d = qk.size(2);
  TORCH_CHECK(d % 2 == 0 && d <= kMaxHeadDim, "tandem qk_norm_rope: head_dim must be even and at most ", kMaxHeadDim);
  TORCH_CHECK(q_heads >= 0 && q_heads <= heads, "tandem qk_norm_rope: q_heads out of range");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == t &&
                  positions.is_contiguous(),
              "tandem qk_norm_rope: positions must be [T] int64, contiguous");
  for (const at::Tensor* c : {&cos, &sin}) {
    TORCH_CHECK(c->dim() == 2 && c->size(1) == d && c->is_contiguous() && c->scalar_type() == qk.scalar_type(),
                "tandem qk_norm_rope: cos/sin must be [max_pos, D], contiguous, qk's dtype");
  }
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "tandem qk_norm_rope: q_norm and k_norm together");
  for (const auto* w : {&q_norm, &k_norm}) {
    if (*w) {
      TORCH_CHECK((*w)->dim() == 1 && (*w)->size(0) == d && (*w)->is_contiguous() &&
                      (*w)->scalar_type() == qk.scalar_type(),
                  "tandem qk_norm_rope: norm weights must be [D], contiguous, qk's dtype");
    }
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "tandem qk_norm_rope: position ", pos[i], " outside the table");
  if (t == 0 || heads == 0) return;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    T* base = ptr<T>(qk);
    const T* cs = ptr<T>(cos);
    const T* sn = ptr<T>(sin);
    const T* qw = q_norm ? ptr<T>(*q_norm) : nullptr;
    const T* kw = k_norm ? ptr<T>(*k_norm) : nullptr;
    const int64_t s0 = qk.stride(0), s1 = qk.stride(1);
    at::parallel_for(0, t, grain(heads * d), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t p = pos[r];
        rope_token<T>(base + r * s0, heads, s1, q_heads, d, cs + p * d, sn + p * d, qw, kw, static_cast<float>(eps));
      }
    });
  };
  if (qk.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(bf16_t{});
  }
}

// -- SiLU(gate) * up ------------------------------------------------------------------------

// sigmoid(g) from exp(-|g|), which never overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below.
// A true divide: this loop is bound by the FMA pipes (exp's polynomial), and the divider runs
// beside them; a reciprocal estimate plus a Newton step measured 10% (AVX-512) to 45% (AVX2)
// slower at 64 rows on Zen 5 (loadgen/bench/cpu_elementwise.py).
inline S::V sigmoid(S::V g) {
#if defined(TANDEM_TARGET_AVX512)
  const S::V neg_abs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32(static_cast<int>(0x80000000))));
  const S::V e = S::exp(neg_abs);
  const S::V num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, S::zero(), _CMP_GE_OQ), e, S::set1(1.f));
  return _mm512_div_ps(num, S::add(S::set1(1.f), e));
#else
  const S::V neg_abs = _mm256_or_ps(g, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000))));
  const S::V e = S::exp(neg_abs);
  const S::V num = _mm256_blendv_ps(e, S::set1(1.f), _mm256_cmp_ps(g, S::zero(), _CMP_GE_OQ));
  return _mm256_div_ps(num, S::add(S::set1(1.f), e));
#endif
}

template <typename T>
void silu_mul_rows(const T* in, int64_t in_stride, T* out, int64_t out_stride, int64_t n, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = in + r * in_stride;
    const T* u = g + n;
    T* o = out + r * out_stride;
    int64_t i = 0;
    for (; i + S::W <= n; i += S::W) {
      const S::V gv = S::load(g + i);
      S::store(o + i, S::mul(S::mul(gv, sigmoid(gv)), S::load(u + i)));
    }
    for (; i < n; ++i) {
      const float x = to_float(g[i]);
      put(o + i, x / (1.0f + std::exp(-x)) * to_float(u[i]));
    }
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "tandem silu_mul: gate_up must be [T, 2I], rows contiguous");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  if (rows == 0 || n == 0) return out;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
      silu_mul_rows<T>(ptr<T>(gate_up), gate_up.stride(0), ptr<T>(out), out.stride(0), n, r0, r1);
    });
  };
  if (gate_up.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(bf16_t{});
  }
  return out;
}

// -- paged KV write -------------------------------------------------------------------------

void write_kv(at::Tensor kv_data, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(kv_data.dim() == 6 && kv_data.size(1) == 2 && kv_data.stride(5) == 1,
              "tandem write_kv: kv_data must be [L, 2, KVH, NB, BS, D], D contiguous");
  const int64_t layers = kv_data.size(0), kvh = kv_data.size(2), nb = kv_data.size(3), bs = kv_data.size(4),
                d = kv_data.size(5);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "tandem write_kv: slots must be [T] int64, contiguous");
  const int64_t t = slots.size(0);
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 4 && x->size(0) == layers && x->size(1) == t && x->size(2) == kvh && x->size(3) == d &&
                    x->stride(3) == 1 && x->scalar_type() == kv_data.scalar_type(),
                "tandem write_kv: k and v must be [L, T, KVH, D], D contiguous, the cache's dtype");
  }
  TORCH_CHECK(kv_data.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "tandem write_kv: CPU tensors");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < nb * bs, "tandem write_kv: slot ", slot[i], " outside the cache");
  if (t == 0 || layers == 0 || kvh == 0) return;
  const int64_t esize = kv_data.element_size(), row_bytes = d * esize;
  char* dst = static_cast<char*>(kv_data.data_ptr());
  const char* src[2] = {static_cast<const char*>(k.data_ptr()), static_cast<const char*>(v.data_ptr())};
  const at::Tensor* srct[2] = {&k, &v};
  // one work item per (layer, K or V, token): all of its heads
  at::parallel_for(0, layers * 2 * t, grain(kvh * d), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t layer = i / (2 * t), kv = (i / t) % 2, tok = i % t;
      const at::Tensor& s = *srct[kv];
      const int64_t block = slot[tok] / bs, off = slot[tok] % bs;
      for (int64_t h = 0; h < kvh; ++h) {
        const char* from = src[kv] + (layer * s.stride(0) + tok * s.stride(1) + h * s.stride(2)) * esize;
        char* to = dst + (layer * kv_data.stride(0) + kv * kv_data.stride(1) + h * kv_data.stride(2) +
                          block * kv_data.stride(3) + off * kv_data.stride(4)) *
                             esize;
        std::memcpy(to, from, row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def(
      "qk_norm_rope(Tensor(a!) qk, Tensor positions, Tensor cos, Tensor sin, int q_heads, Tensor? q_norm, "
      "Tensor? k_norm, float eps) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("write_kv(Tensor(a!) kv_data, Tensor k, Tensor v, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(TANDEM_OPS, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("write_kv", &write_kv);
}

}  // namespace tandem
