// The few vector operations the CPU attention kernels need, for one ISA per build.
//
// Each build of the extension targets exactly one ISA (kernels/cpu/build.py passes the -m flags
// and a TANDEM_TARGET_* define), so a host only ever runs code its CPU has: `Simd` below is
// the AVX-512 or the AVX2 variant, never both. Everything is float32 arithmetic; bfloat16 is
// only a storage format here (loaded by widening, stored with round-to-nearest-even), except
// for the optional AVX512-BF16 dot product used for q.k in `decode.cpp`.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tandem {

using bf16_t = uint16_t;  // raw bfloat16 bits (c10::BFloat16 has the same layout)

#if defined(TANDEM_TARGET_AVX512)

struct Simd {
  using V = __m512;
  static constexpr int W = 16;  // float lanes

  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const bf16_t* p) {  // 16 bf16 -> 16 float (exact)
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store(bf16_t* p, V v) {  // round to nearest even (inputs are finite here)
#if defined(TANDEM_DPBF16)
    // one instruction (vcvtneps2bf16) instead of six; it flushes float32 denormals (below
    // 1.2e-38) to zero, which the integer rounding below keeps
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    x = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
#endif
  }
  static void store_n(float* p, V v, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  // bit i set where lane i of a equals lane i of b (ordered: NaN equals nothing), or is NaN
  static uint32_t eq_mask(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static uint32_t nan_mask(V a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }

  // r[i] = sum of the lanes of v[i], for 16 vectors: a transpose-and-add tree (45 shuffles
  // and adds instead of 16 horizontal reductions of ~8 dependent steps each).
  static V reduce_lanes(V* v) {
    V q[4];
    for (int g = 0; g < 4; ++g) {
      V* a = v + 4 * g;
      V s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
      V s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
      // per 128-bit lane: [a0, a1, a2, a3] partial sums of that lane
      q[g] = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
    }
    V p01 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], 0x88), _mm512_shuffle_f32x4(q[0], q[1], 0xDD));
    V p23 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], 0x88), _mm512_shuffle_f32x4(q[2], q[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, 0x88), _mm512_shuffle_f32x4(p01, p23, 0xDD));
  }

  static V exp(V x) { return exp_impl(x); }

 private:
  static V exp_impl(V x);
};

#elif defined(TANDEM_TARGET_AVX2)

struct Simd {
  using V = __m256;
  static constexpr int W = 8;

  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const bf16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store(bf16_t* p, V v) {
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    x = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store_n(float* p, V v, int n) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(p, tmp, sizeof(float) * n);
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float hmax(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static uint32_t eq_mask(V a, V b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
  static uint32_t nan_mask(V a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }

  // r[i] = sum of the lanes of v[i], for 8 vectors.
  static V reduce_lanes(V* v) {
    V q[2];
    for (int g = 0; g < 2; ++g) {
      V* a = v + 4 * g;
      V s01 = _mm256_add_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));
      V s23 = _mm256_add_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));
      q[g] = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, 0x44), _mm256_shuffle_ps(s01, s23, 0xEE));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(q[0], q[1], 0x20), _mm256_permute2f128_ps(q[0], q[1], 0x31));
  }

  static V exp(V x) { return exp_impl(x); }

 private:
  static V exp_impl(V x);
};

#else
#error "build with -DTANDEM_TARGET_AVX512 or -DTANDEM_TARGET_AVX2 (kernels/cpu/build.py does)"
#endif

// exp(x) for x <= 0 (softmax arguments after subtracting the maximum): 2^n * p(r) with
// x = n ln2 + r, |r| <= ln2/2, p a degree-6 polynomial (relative error ~2e-7, below float
// rounding of the softmax sums); arguments below -87.3 (exp underflows float) give 0.
inline Simd::V Simd::exp_impl(Simd::V x) {
  using S = Simd;
  const V lo = S::set1(-87.3f);
  V clamped = S::max(x, lo);
  V n = S::mul(clamped, S::set1(1.44269504088896341f));
#if defined(TANDEM_TARGET_AVX512)
  n = _mm512_roundscale_ps(n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  n = _mm256_round_ps(n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  V r = S::fma(n, S::set1(-0.693359375f), clamped);
  r = S::fma(n, S::set1(2.12194440e-4f), r);
  V p = S::set1(1.9875691500e-4f);
  p = S::fma(p, r, S::set1(1.3981999507e-3f));
  p = S::fma(p, r, S::set1(8.3334519073e-3f));
  p = S::fma(p, r, S::set1(4.1665795894e-2f));
  p = S::fma(p, r, S::set1(1.6666665459e-1f));
  p = S::fma(p, r, S::set1(5.0000001201e-1f));
  p = S::fma(p, S::mul(r, r), S::add(r, S::set1(1.0f)));
#if defined(TANDEM_TARGET_AVX512)
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  V out = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), out, _mm512_setzero_ps());
#else
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  V out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
#endif
}

// Scalar bf16 <-> float, for tails and single values.
inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace tandem
