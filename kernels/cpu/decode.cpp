// Paged decode attention for CPU: one query row per sequence over its cached context.
//
// Contract (kernels/cpu/decode.py is the Python side; kernels/reference/attention.py the oracle):
//   q            [S, H, D]   float32 or bfloat16, last dim contiguous
//   kv_cache     [2, KVH, NB, BS, D] one layer's cache, same dtype as q (K then V)
//   block_table  [S, MB] int64: the blocks of each sequence's context in logical order; a
//                reversed (BROS) block is stored as -(id + 1): it holds logical offset o at
//                slot BS - 1 - o, so a partial reversed block's tokens sit at its far end
//   ctx_lens     [S] int64: cached tokens each sequence attends (0 allowed with k_new)
//   k_new, v_new [S, KVH, D] or None: this step's own token, attended as one more key that is
//                not in the cache (the compiled decoder layers write the cache afterwards)
// Returns [S, H, D] in q's dtype. Query head j reads KV head j / (H / KVH).
//
// How (the ideas vLLM's and SGLang's CPU decode kernels share, on our cache layout):
// - Work items are (sequence, KV head, split of kSplit context tokens). All query heads of a
//   KV head are one item, so each K/V row is loaded once for the whole GQA group.
// - An item computes its scores for every query head into a small buffer (q.k vectorised
//   along D; 16 (AVX-512) or 8 (AVX2) keys' partial vectors are reduced together by a
//   transpose-and-add tree), then the exponentials, then P.V with register-tiled float32
//   accumulators. Each item yields (max, sum of exponentials, unnormalised output) per
//   query head, and a second pass merges a sequence's items with exact log-sum-exp weights.
// - The split size is fixed, not chosen from the batch, so a sequence's result does not
//   depend on which other sequences share its step (batch invariance).
// - Items are handed out dynamically, longest first, to the OpenMP threads.
// - Keys are visited in slot order; softmax does not depend on the order of its keys.
// - All arithmetic is float32; bf16 is widened on load (with AVX512-BF16, q.k uses the
//   hardware bf16 dot product, which accumulates exact bf16 products in float32).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace tandem {
namespace {

constexpr int kSplit = 256;  // context tokens per work item
constexpr int kMaxGroup = 16;  // query heads per KV head
constexpr int kMaxDim = 256;

struct Layout {
  int64_t kv_stride, head_stride, block_stride, slot_stride;  // cache strides, in elements
  int block_size;
};

// Prefetch one row of NC vectors (all its cache lines) into L1 (`T0`) or L2 (`T1`).
template <int Hint, typename T, int NC>
inline void prefetch_row(const T* row) {
  constexpr int bytes = NC * Simd::W * sizeof(T);
  const char* p = reinterpret_cast<const char*>(row);
  for (int b = 0; b < bytes; b += 64) _mm_prefetch(p + b, static_cast<_mm_hint>(Hint));
}

// Element offset (within one KV head) of each token in [t0, t1) of a sequence's context.
inline void token_rows(const int64_t* table, const Layout& L, int t0, int t1, int64_t* rows) {
  const int bs = L.block_size;
  for (int t = t0; t < t1;) {
    const int b = t / bs, o = t % bs;
    const int64_t id = table[b];
    const int n = std::min(bs - o, t1 - t);
    if (id >= 0) {
      const int64_t base = id * L.block_stride + o * L.slot_stride;
      for (int i = 0; i < n; ++i) rows[t - t0 + i] = base + i * L.slot_stride;
    } else {  // reversed: logical offset o lives at slot bs - 1 - o
      const int64_t base = (-id - 1) * L.block_stride;
      for (int i = 0; i < n; ++i) rows[t - t0 + i] = base + (bs - 1 - (o + i)) * L.slot_stride;
    }
    t += n;
  }
}

// scores[gi][j] = scale * q[gi] . K[rows[j]] for j < n (float32 accumulation). `rows` is
// readable up to the next multiple of W (padded with a valid row), so every tile is full.
template <typename T, int NC>
void qk_scores(const float* q, int g, const T* k, const T* v, const int64_t* rows, int n, float scale, float* scores,
               int ld) {
  using S = Simd;
  constexpr int W = S::W;
  for (int i = 0; i < n; i += W) {
    for (int j = i + 2 * W; j < std::min(n, i + 3 * W); ++j) prefetch_row<_MM_HINT_T0, T, NC>(k + rows[j]);
    for (int j = i; j < std::min(n, i + W); ++j) prefetch_row<_MM_HINT_T1, T, NC>(v + rows[j]);  // for pv, soon
    for (int gi = 0; gi < g; ++gi) {
      typename S::V qv[NC];
      for (int c = 0; c < NC; ++c) qv[c] = S::load(q + gi * NC * W + c * W);
      typename S::V acc[W];
      for (int j = 0; j < W; ++j) {
        const T* row = k + rows[i + j];
        typename S::V a = S::mul(qv[0], S::load(row));
        for (int c = 1; c < NC; ++c) a = S::fma(qv[c], S::load(row + c * W), a);
        acc[j] = a;
      }
      S::store(scores + gi * ld + i, S::mul(S::reduce_lanes(acc), S::set1(scale)));  // ld has W of slack
    }
  }
}

#if defined(TANDEM_DPBF16)
// The same with AVX512-BF16 dot products: q and K stay bf16, pairs multiply-add into float32.
template <int NC>
void qk_scores_dp(const bf16_t* q, int g, const bf16_t* k, const bf16_t* v, const int64_t* rows, int n, float scale,
                  float* scores, int ld) {
  constexpr int W = 16, NB = NC / 2;  // NB 512-bit chunks of 32 bf16 per row
  for (int i = 0; i < n; i += W) {
    for (int j = i + 2 * W; j < std::min(n, i + 3 * W); ++j) prefetch_row<_MM_HINT_T0, bf16_t, NC>(k + rows[j]);
    for (int j = i; j < std::min(n, i + W); ++j) prefetch_row<_MM_HINT_T1, bf16_t, NC>(v + rows[j]);
    for (int gi = 0; gi < g; ++gi) {
      __m512bh qv[NB];
      for (int c = 0; c < NB; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + gi * NC * W + c * 32);
      __m512 acc[W];
      for (int j = 0; j < W; ++j) {
        const bf16_t* row = k + rows[i + j];
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(row));
        for (int c = 1; c < NB; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(row + c * 32));
        acc[j] = a;
      }
      _mm512_storeu_ps(scores + gi * ld + i, _mm512_mul_ps(Simd::reduce_lanes(acc), _mm512_set1_ps(scale)));
    }
  }
}
#endif

// In place: scores[gi][:n] -> exp(scores - max); returns per head (max, sum).
inline void softmax_parts(float* scores, int g, int n, int ld, float* peak, float* total) {
  using S = Simd;
  constexpr int W = S::W;
  for (int gi = 0; gi < g; ++gi) {
    float* s = scores + gi * ld;
    float mx = -std::numeric_limits<float>::infinity();
    int j = 0;
    if (n >= W) {
      typename S::V mv = S::load(s);
      for (j = W; j + W <= n; j += W) mv = S::max(mv, S::load(s + j));
      mx = S::hmax(mv);
    }
    for (; j < n; ++j) mx = std::max(mx, s[j]);
    typename S::V mvec = S::set1(mx), sum = S::zero();
    for (j = 0; j + W <= n; j += W) {
      typename S::V e = S::exp(S::sub(S::load(s + j), mvec));
      S::store(s + j, e);
      sum = S::add(sum, e);
    }
    float tail = 0.f;
    for (; j < n; ++j) {
      s[j] = std::exp(s[j] - mx);
      tail += s[j];
    }
    peak[gi] = mx;
    total[gi] = S::hsum(sum) + tail;
  }
}

// out[gi][:] = sum_j p[gi][j] * V[rows[j]] for GT query heads at once (accumulators in registers).
template <typename T, int NC, int GT>
void pv_tile(const float* p, int ld, const T* v, const int64_t* rows, int n, float* out) {
  using S = Simd;
  constexpr int W = S::W;
  typename S::V acc[GT][NC];
  for (int h = 0; h < GT; ++h)
    for (int c = 0; c < NC; ++c) acc[h][c] = S::zero();
  for (int j = 0; j < n; ++j) {
    const T* row = v + rows[j];
    if (j + 8 < n) prefetch_row<_MM_HINT_T0, T, NC>(v + rows[j + 8]);
    typename S::V x[NC];
    for (int c = 0; c < NC; ++c) x[c] = S::load(row + c * W);
    for (int h = 0; h < GT; ++h) {
      typename S::V w = S::set1(p[h * ld + j]);
      for (int c = 0; c < NC; ++c) acc[h][c] = S::fma(w, x[c], acc[h][c]);
    }
  }
  for (int h = 0; h < GT; ++h)
    for (int c = 0; c < NC; ++c) S::store(out + h * (NC * W + 2) + c * W, acc[h][c]);
}

template <typename T, int NC>
void pv(const float* p, int g, int ld, const T* v, const int64_t* rows, int n, float* out) {
  constexpr int GT = std::max(1, std::min(4, 24 / NC));  // query heads whose accumulators fit the registers
  constexpr int row = NC * Simd::W + 2;
  for (int h = 0; h < g; h += GT) {
    switch (std::min(GT, g - h)) {  // the V row is loaded once per tile of query heads
      case 4: pv_tile<T, NC, std::min(GT, 4)>(p + h * ld, ld, v, rows, n, out + h * row); break;
      case 3: pv_tile<T, NC, std::min(GT, 3)>(p + h * ld, ld, v, rows, n, out + h * row); break;
      case 2: pv_tile<T, NC, std::min(GT, 2)>(p + h * ld, ld, v, rows, n, out + h * row); break;
      default: pv_tile<T, NC, 1>(p + h * ld, ld, v, rows, n, out + h * row);
    }
  }
}

struct Problem {
  int seqs, heads, kv_heads, group, dim;
  float scale;
  const int64_t* table;
  int64_t table_stride;
  const int64_t* lens;
  int64_t q_s0, q_s1, k_new_s0, k_new_s1, v_new_s0, v_new_s1, out_s0, out_s1;
  Layout layout;
};

// One work item: KV head h of sequence s, context tokens [t0, t1). Writes, per query head,
// [max, sum, out[D]] to `part` (row stride D + 2).
template <typename T, int NC>
void attend_item(const Problem& P, const T* q, const T* cache, int s, int h, int t0, int t1, float* part) {
  const int g = P.group, D = P.dim, n = t1 - t0;
  thread_local std::vector<int64_t> rows;
  thread_local std::vector<float> scores;
  rows.resize(kSplit + Simd::W);
  scores.resize(static_cast<size_t>(kMaxGroup) * (kSplit + Simd::W));
  const int ld = kSplit + Simd::W;
  token_rows(P.table + s * P.table_stride, P.layout, t0, t1, rows.data());
  std::fill(rows.begin() + n, rows.begin() + (n + Simd::W - 1) / Simd::W * Simd::W, rows[n - 1]);  // full tiles
  const T* k = cache + h * P.layout.head_stride;
  const T* v = k + P.layout.kv_stride;
  for (int j = 0; j < std::min(n, 2 * Simd::W); ++j) prefetch_row<_MM_HINT_T0, T, NC>(k + rows[j]);
  const T* qh = q + s * P.q_s0 + static_cast<int64_t>(h) * g * P.q_s1;
  float peak[kMaxGroup], total[kMaxGroup];
#if defined(TANDEM_DPBF16)
  if constexpr (std::is_same_v<T, bf16_t> && NC % 2 == 0) {
    alignas(64) bf16_t qb[kMaxGroup * kMaxDim];
    for (int gi = 0; gi < g; ++gi) std::memcpy(qb + gi * D, qh + gi * P.q_s1, D * sizeof(bf16_t));
    qk_scores_dp<NC>(qb, g, k, v, rows.data(), n, P.scale, scores.data(), ld);
  } else
#endif
  {
    alignas(64) float qf[kMaxGroup * kMaxDim];
    for (int gi = 0; gi < g; ++gi)
      for (int d = 0; d < D; ++d) qf[gi * D + d] = to_float(qh[gi * P.q_s1 + d]);
    qk_scores<T, NC>(qf, g, k, v, rows.data(), n, P.scale, scores.data(), ld);
  }
  softmax_parts(scores.data(), g, n, ld, peak, total);
  pv<T, NC>(scores.data(), g, ld, v, rows.data(), n, part + 2);
  for (int gi = 0; gi < g; ++gi) {
    part[gi * (D + 2)] = peak[gi];
    part[gi * (D + 2) + 1] = total[gi];
  }
}

// Merge a sequence's items for KV head h (and its own new token, if given) into the output.
template <typename T>
void merge(const Problem& P, const T* q, const float* parts, int items, const T* k_new, const T* v_new, int s, int h,
           T* out) {
  using S = Simd;
  constexpr int W = S::W;
  const int g = P.group, D = P.dim;
  const int64_t stride = static_cast<int64_t>(P.kv_heads) * g * (D + 2);  // between a sequence's items
  for (int gi = 0; gi < g; ++gi) {
    const float* first = parts + gi * (D + 2);
    float own = -std::numeric_limits<float>::infinity();
    const T* kn = k_new ? k_new + s * P.k_new_s0 + h * P.k_new_s1 : nullptr;
    const T* vn = v_new ? v_new + s * P.v_new_s0 + h * P.v_new_s1 : nullptr;
    if (kn) {
      const T* qr = q + s * P.q_s0 + static_cast<int64_t>(h * g + gi) * P.q_s1;
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot += to_float(qr[d]) * to_float(kn[d]);
      own = dot * P.scale;
    }
    float peak = own;
    for (int i = 0; i < items; ++i) peak = std::max(peak, first[i * stride]);
    float total = kn ? std::exp(own - peak) : 0.f;
    alignas(64) float acc[kMaxDim];
    for (int d = 0; d < D; ++d) acc[d] = vn ? total * to_float(vn[d]) : 0.f;
    for (int i = 0; i < items; ++i) {
      const float* part = first + i * stride;
      const float w = std::exp(part[0] - peak);
      total += w * part[1];
      typename S::V wv = S::set1(w);
      for (int d = 0; d < D; d += W) S::store(acc + d, S::fma(wv, S::load(part + 2 + d), S::load(acc + d)));
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;  // no key at all: zeros, not NaN
    T* o = out + s * P.out_s0 + static_cast<int64_t>(h * g + gi) * P.out_s1;
    typename S::V iv = S::set1(inv);
    for (int d = 0; d < D; d += W) S::store(o + d, S::mul(S::load(acc + d), iv));
  }
}

template <typename T, int NC>
void run(const Problem& P, const T* q, const T* cache, const T* k_new, const T* v_new, T* out) {
  // Items: (sequence, split) pairs, each for every KV head; a sequence's splits are adjacent.
  std::vector<int> first(P.seqs + 1, 0);
  for (int s = 0; s < P.seqs; ++s) first[s + 1] = first[s] + static_cast<int>((P.lens[s] + kSplit - 1) / kSplit);
  const int splits = first[P.seqs];
  std::vector<int> split_seq(splits);
  for (int s = 0; s < P.seqs; ++s)
    for (int i = first[s]; i < first[s + 1]; ++i) split_seq[i] = s;
  std::vector<int> order(static_cast<size_t>(splits) * P.kv_heads);
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  auto length = [&](int item) {
    const int sp = item / P.kv_heads, s = split_seq[sp];
    return std::min<int64_t>(kSplit, P.lens[s] - static_cast<int64_t>(sp - first[s]) * kSplit);
  };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return length(a) > length(b); });
  const int row = P.group * (P.dim + 2);
  std::vector<float> parts(std::max<size_t>(1, order.size() * row));
  std::atomic<int> next{0};
  const int threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(order.size())));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int i; (i = next.fetch_add(1, std::memory_order_relaxed)) < static_cast<int>(order.size());) {
      const int item = order[i], sp = item / P.kv_heads, h = item % P.kv_heads, s = split_seq[sp];
      const int t0 = (sp - first[s]) * kSplit;
      const int t1 = static_cast<int>(std::min<int64_t>(t0 + kSplit, P.lens[s]));
      attend_item<T, NC>(P, q, cache, s, h, t0, t1, parts.data() + static_cast<size_t>(item) * row);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(P.seqs) * P.kv_heads, 8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int s = static_cast<int>(i / P.kv_heads), h = static_cast<int>(i % P.kv_heads);
      const float* p = parts.data() + (static_cast<size_t>(first[s]) * P.kv_heads + h) * row;
      merge<T>(P, q, p, first[s + 1] - first[s], k_new, v_new, s, h, out);
    }
  });
}

template <typename T>
void dispatch_dim(const Problem& P, const T* q, const T* cache, const T* k_new, const T* v_new, T* out) {
  switch (P.dim / Simd::W) {
    case 1: return run<T, 1>(P, q, cache, k_new, v_new, out);
    case 2: return run<T, 2>(P, q, cache, k_new, v_new, out);
    case 4: return run<T, 4>(P, q, cache, k_new, v_new, out);
    case 6: return run<T, 6>(P, q, cache, k_new, v_new, out);
    case 8: return run<T, 8>(P, q, cache, k_new, v_new, out);
    case 16: return run<T, 16>(P, q, cache, k_new, v_new, out);
#if defined(TANDEM_TARGET_AVX2)
    case 32: return run<T, 32>(P, q, cache, k_new, v_new, out);
#endif
    default: TORCH_CHECK(false, "tandem decode: unsupported head_dim ", P.dim);
  }
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                  const at::Tensor& ctx_lens, const std::optional<at::Tensor>& k_new,
                  const std::optional<at::Tensor>& v_new, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "tandem decode: bad shapes");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "tandem decode: q and cache dtypes differ");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "tandem decode: float32 or bfloat16");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong, "tandem decode: int64 tables");
  TORCH_CHECK(block_table.is_contiguous() && ctx_lens.is_contiguous(), "tandem decode: contiguous tables");
  TORCH_CHECK(q.stride(2) == 1 && kv_cache.stride(4) == 1, "tandem decode: head_dim must be contiguous");
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "tandem decode: k_new and v_new together");
  Problem P;
  P.seqs = q.size(0);
  P.heads = q.size(1);
  P.dim = q.size(2);
  P.kv_heads = kv_cache.size(1);
  TORCH_CHECK(P.heads % P.kv_heads == 0 && P.heads / P.kv_heads <= kMaxGroup, "tandem decode: bad head grouping");
  TORCH_CHECK(kv_cache.size(4) == P.dim && P.dim % Simd::W == 0 && P.dim <= kMaxDim, "tandem decode: bad head_dim");
  TORCH_CHECK(block_table.size(0) == P.seqs && ctx_lens.size(0) == P.seqs, "tandem decode: table rows");
  P.group = P.heads / P.kv_heads;
  P.scale = static_cast<float>(scale);
  P.table = block_table.data_ptr<int64_t>();
  P.table_stride = block_table.size(1);
  P.lens = ctx_lens.data_ptr<int64_t>();
  for (int s = 0; s < P.seqs; ++s)
    TORCH_CHECK(P.lens[s] >= 0 && P.lens[s] <= P.table_stride * kv_cache.size(3), "tandem decode: context beyond table");
  P.q_s0 = q.stride(0);
  P.q_s1 = q.stride(1);
  P.layout = {kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
              static_cast<int>(kv_cache.size(3))};
  at::Tensor out = at::empty({P.seqs, P.heads, P.dim}, q.options());
  P.out_s0 = out.stride(0);
  P.out_s1 = out.stride(1);
  P.k_new_s0 = P.k_new_s1 = P.v_new_s0 = P.v_new_s1 = 0;
  if (k_new) {
    for (const at::Tensor* t : {&*k_new, &*v_new}) {
      TORCH_CHECK(t->dim() == 3 && t->size(0) == P.seqs && t->size(1) == P.kv_heads && t->size(2) == P.dim,
                  "tandem decode: k_new/v_new must be [S, kv_heads, head_dim]");
      TORCH_CHECK(t->stride(2) == 1 && t->scalar_type() == q.scalar_type(), "tandem decode: k_new/v_new layout or dtype");
    }
    P.k_new_s0 = k_new->stride(0);
    P.k_new_s1 = k_new->stride(1);
    P.v_new_s0 = v_new->stride(0);
    P.v_new_s1 = v_new->stride(1);
  }
  if (P.seqs == 0) return out;
  if (q.scalar_type() == at::kFloat) {
    dispatch_dim<float>(P, q.data_ptr<float>(), kv_cache.data_ptr<float>(), k_new ? k_new->data_ptr<float>() : nullptr,
                        v_new ? v_new->data_ptr<float>() : nullptr, out.data_ptr<float>());
  } else {
    auto ptr = [](const at::Tensor& t) { return reinterpret_cast<bf16_t*>(t.data_ptr<at::BFloat16>()); };
    dispatch_dim<bf16_t>(P, ptr(q), ptr(kv_cache), k_new ? ptr(*k_new) : nullptr, v_new ? ptr(*v_new) : nullptr, ptr(out));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(TANDEM_OPS, m) {
  m.def(
      "decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor ctx_lens, Tensor? k_new, Tensor? v_new, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(TANDEM_OPS, CPU, m) { m.impl("decode", &decode); }

}  // namespace tandem
