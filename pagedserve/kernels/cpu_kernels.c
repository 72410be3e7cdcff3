/* pagedserve's native CPU kernels: the small-batch hot paths between (and inside) the big matmuls.
 *
 * Plain C with SIMD intrinsics and OpenMP, no torch headers: it builds in well under a second with the
 * system compiler (pagedserve/kernels/__init__.py builds it once per machine with -march=native and
 * caches it) and is called through ctypes with raw pointers. OpenMP comes from the libgomp that torch
 * already loaded, so these kernels and torch's share one thread pool.
 *
 * Layout of this file: one kernel body for every instruction set, over a thin per-ISA layer.
 *   1. The ISA layer: a float vector type `vf` of VL lanes and a few inline helpers (load/store in the
 *      activation dtype, bf16 rounding, fma, exp, horizontal sums). AVX-512 (F, BW, VNNI; VL 16) and
 *      AVX2 + FMA + F16C (VL 8) today; the compiler's -march=native picks one at build time and
 *      `ps_isa()` reports which, so the choice is made once, where the library is built.
 *   2. Per-ISA matmul micro-kernels, the only code that is more than helpers: the int8 block product
 *      (vpdpbusd on AVX-512 VNNI; vpmaddwd on AVX2) and the bf16 tile (AMX tiles where the CPU has them and
 *      Linux grants them, ps_amx_init; else vdpbf16ps where AVX512-BF16 exists; elsewhere bf16 widened to
 *      float32 in registers and fused multiply-adds).
 *   3. The kernels themselves (linears, RMSNorm, SiLU x up, rotary + KV write, paged decode attention,
 *      the decode stack), written once over the helpers.
 * A new ISA (ARM NEON/SVE, ...) is a new section 1 (and optionally a faster section 2).
 *
 * Tensors are row-major. `bf16` flags say whether activations are bfloat16 (else float32). Rounding
 * follows transformers' order of operations in the model dtype (see each function), so outputs match
 * the torch reference path up to float32 summation order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <sys/mman.h>

/* Ask for transparent huge pages on the whole 2 MiB pages inside [p, p + bytes), before the memory is
 * first written. Weights streamed once per token then sit on 2 MiB pages: fewer TLB misses (each one a
 * two-level walk under a hypervisor), measured 3-11 % faster batch-1 weight streams on the 2-core VM.
 * Returns the bytes advised (0 where the kernel refused or the range holds no whole huge page). */
int64_t ps_advise_huge(void *p, int64_t bytes) {
#ifdef MADV_HUGEPAGE
  const uintptr_t huge = (uintptr_t)2 << 20, start = ((uintptr_t)p + huge - 1) & ~(huge - 1);
  const uintptr_t end = ((uintptr_t)p + (uintptr_t)bytes) & ~(huge - 1);
  if (end <= start || madvise((void *)start, end - start, MADV_HUGEPAGE) != 0) return 0;
  return (int64_t)(end - start);
#else
  (void)p; (void)bytes;
  return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PS_ISA 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PS_ISA 256
#else
#define PS_ISA 0
#endif

/* 512: AVX-512 (F, BW, VNNI); 256: AVX2 + FMA + F16C; 0: neither (pagedserve keeps the torch path). */
int ps_isa(void) { return PS_ISA; }

#if PS_ISA
#include <immintrin.h>
#include <omp.h>

/* ==== 1. the ISA layer ================================================================================ */

#if PS_ISA == 512
#define VL 16
typedef __m512 vf;

static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vabs(vf a) { return _mm512_abs_ps(a); }
static inline vf vcopysign(vf mag, vf sign) {  /* mag's magnitude (non-negative) with sign's sign bit */
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), _mm512_and_si512(
      _mm512_castps_si512(sign), _mm512_set1_epi32((int)0x80000000u))));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  /* a * b + c, one rounding */
static inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  /* c - a * b, one rounding */
static inline vf vloadf(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstoref(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vmaxr(vf v) { return _mm512_reduce_max_ps(v); }
static inline __mmask16 first_lanes(int64_t n) { return (__mmask16)((1u << n) - 1); }
/* The first n (< VL) floats at p, zeros after; stores write only the first n lanes. */
static inline vf vloadf_part(const float *p, int64_t n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
static inline void vstoref_part(float *p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
static inline vf vkeep(vf v, int64_t n) { return _mm512_maskz_mov_ps(first_lanes(n), v); }  /* lanes >= n -> 0 */
/* Lanes of v that are NaN / equal to a, as a bit mask (lane i: bit i). */
static inline unsigned vnan_bits(vf v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
static inline unsigned veq_bits(vf v, vf a) { return _mm512_cmp_ps_mask(v, a, _CMP_EQ_OQ); }

static inline vf vbf16(__m256i h) {  /* 16 bf16 -> float32 */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vf vload(const void *p, int bf16) {
  if (bf16) return vbf16(_mm256_loadu_si256((const __m256i *)p));
  return _mm512_loadu_ps((const float *)p);
}

/* Round to nearest even, as torch does (NaN stays NaN). */
static inline __m256i to_bf16(vf v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}
static inline void vstore(void *p, vf v, int bf16) {
  if (bf16)
    _mm256_storeu_si256((__m256i *)p, to_bf16(v));
  else
    _mm512_storeu_ps((float *)p, v);
}
/* v rounded to the activation dtype and back (a no-op for float32). */
static inline vf vround(vf v, int bf16) { return bf16 ? vbf16(to_bf16(v)) : v; }
/* fp8 bytes, one a 16-bit lane, as fp16 bits for F16C's widening: e5m2 is fp16's top byte; e4m3's sign, exponent
 * and mantissa bits go to fp16's places as they are, which reads 2^-8 times the value (the exponent biases are 7
 * and 15), its subnormals included. vfp8: VL of them to float32. */
static inline __m256i fp8_half(__m256i b, int e4m3) {
  if (!e4m3) return _mm256_slli_epi16(b, 8);
  return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                         _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
}
static inline vf vfp8(const uint8_t *p, int e4m3) {
  return _mm512_cvtph_ps(fp8_half(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), e4m3));
}
/* VL float32 lanes -> VL fp8 bytes at p, as torch converts (c10's fp8e4m3fn/fp8e5m2_from_fp32_value: round to
 * nearest even; subnormals by adding the smallest normal's scale in float32; e4m3 from 480 on NaN, e5m2 from 2^16 on
 * infinity; the sign bit kept): fp8_lanes in 32-bit lanes, then narrowed. */
static inline __m512i fp8_lanes(vf x, int e4m3) {
  const int drop = e4m3 ? 20 : 21;  /* float32 mantissa bits below the format's */
  const __m512i bits = _mm512_castps_si512(x), sign = _mm512_and_si512(bits, _mm512_set1_epi32(INT32_MIN));
  const __m512i a = _mm512_xor_si512(bits, sign);
  const __m512i rebias = _mm512_set1_epi32((int)(((uint32_t)(e4m3 ? 7 - 127 : 15 - 127) << 23)
                                                 + (1u << (drop - 1)) - 1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(a, rebias), _mm512_and_si512(_mm512_srli_epi32(a, drop),
                                                                              _mm512_set1_epi32(1)));
  r = _mm512_srli_epi32(r, drop);
  const __m512i denorm = _mm512_set1_epi32((int)((e4m3 ? 141u : 134u) << 23));
  const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a),
                                                                         _mm512_castsi512_ps(denorm))), denorm);
  r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((int)((e4m3 ? 121u : 113u) << 23))), sub);
  const __m512i big = _mm512_set1_epi32(e4m3 ? 0x7F : 0x7C);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32((int)(e4m3 ? 1087u << 20 : 143u << 23))),
                            big);
  if (!e4m3) r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)),
                                       _mm512_set1_epi32(0x7F));  /* NaN */
  return _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
}
static inline void vstore_fp8(uint8_t *p, vf x, int e4m3) {
  _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(fp8_lanes(x, e4m3)));
}

static inline vf vround_int(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* VL integral values in [-127, 127] -> VL int8 at p. */
static inline void vstore_i8(int8_t *p, vf v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v))); }
static inline vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  /* p * 2^n */
#define EXP_HI 88.3762626647949f

/* The VL horizontal sums of v[0..VL-1] as one vector (lane j = sum of v[j]'s lanes): pairs of vectors
 * are folded with unpacks, then 128-bit lanes with shuffles, ~45 instructions instead of 16 reductions. */
static inline vf vhsum_lanes(const vf v[VL]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  /* per 128-bit lane: the lane's partial sums of v[4i .. 4i+3] */
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  /* add the four 128-bit lanes: lane k of the result holds the totals of v[4k .. 4k+3] */
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

#else  /* PS_ISA == 256: AVX2 + FMA + F16C */
#define VL 8
typedef __m256 vf;

static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline vf vcopysign(vf mag, vf sign) { return _mm256_or_ps(mag, _mm256_and_ps(_mm256_set1_ps(-0.0f), sign)); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vloadf(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstoref(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vmaxr(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf vloadf_part(const float *p, int64_t n) { return _mm256_maskload_ps(p, first_lanes(n)); }
static inline void vstoref_part(float *p, vf v, int64_t n) { _mm256_maskstore_ps(p, first_lanes(n), v); }
static inline vf vkeep(vf v, int64_t n) { return _mm256_and_ps(v, _mm256_castsi256_ps(first_lanes(n))); }
static inline unsigned vnan_bits(vf v) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
static inline unsigned veq_bits(vf v, vf a) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, a, _CMP_EQ_OQ)); }

static inline vf vbf16(__m128i h) {  /* 8 bf16 -> float32 */
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf vload(const void *p, int bf16) {
  if (bf16) return vbf16(_mm_loadu_si128((const __m128i *)p));
  return _mm256_loadu_ps((const float *)p);
}
/* Round to nearest even, as torch does (NaN stays NaN); the result's top 16 bits are the bf16 value. */
static inline __m256i round_bits(vf v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
}
static inline __m128i to_bf16(vf v) {
  const __m256i r = _mm256_srli_epi32(round_bits(v), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline void vstore(void *p, vf v, int bf16) {
  if (bf16)
    _mm_storeu_si128((__m128i *)p, to_bf16(v));
  else
    _mm256_storeu_ps((float *)p, v);
}
static inline vf vround(vf v, int bf16) {
  if (!bf16) return v;
  return _mm256_castsi256_ps(_mm256_and_si256(round_bits(v), _mm256_set1_epi32((int)0xFFFF0000u)));
}
/* fp8 bytes, one a 16-bit lane, as fp16 bits for F16C's widening: e5m2 is fp16's top byte; e4m3's sign, exponent
 * and mantissa bits go to fp16's places as they are, which reads 2^-8 times the value (the exponent biases are 7
 * and 15), its subnormals included. vfp8: VL of them to float32. */
static inline __m128i fp8_half(__m128i b, int e4m3) {
  if (!e4m3) return _mm_slli_epi16(b, 8);
  return _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                      _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
}
static inline vf vfp8(const uint8_t *p, int e4m3) {
  return _mm256_cvtph_ps(fp8_half(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), e4m3));
}
/* VL float32 lanes -> VL fp8 bytes at p, as torch converts (c10's fp8e4m3fn/fp8e5m2_from_fp32_value: round to
 * nearest even; subnormals by adding the smallest normal's scale in float32; e4m3 from 480 on NaN, e5m2 from 2^16 on
 * infinity; the sign bit kept): fp8_lanes in 32-bit lanes, then narrowed. */
static inline __m256i fp8_lanes(vf x, int e4m3) {  /* |x|'s bits are below 2^31: signed compares */
  const int drop = e4m3 ? 20 : 21;
  const __m256i bits = _mm256_castps_si256(x), sign = _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN));
  const __m256i a = _mm256_xor_si256(bits, sign);
  const __m256i rebias = _mm256_set1_epi32((int)(((uint32_t)(e4m3 ? 7 - 127 : 15 - 127) << 23)
                                                 + (1u << (drop - 1)) - 1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(a, rebias), _mm256_and_si256(_mm256_srli_epi32(a, drop),
                                                                              _mm256_set1_epi32(1)));
  r = _mm256_srli_epi32(r, drop);
  const __m256i denorm = _mm256_set1_epi32((int)((e4m3 ? 141u : 134u) << 23));
  const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a),
                                                                         _mm256_castsi256_ps(denorm))), denorm);
  r = _mm256_blendv_epi8(r, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)((e4m3 ? 121u : 113u) << 23)), a));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(e4m3 ? 0x7F : 0x7C),
                         _mm256_cmpgt_epi32(a, _mm256_set1_epi32((int)(e4m3 ? 1087u << 20 : 143u << 23) - 1)));
  if (!e4m3) r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
  return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}
static inline void vstore_fp8(uint8_t *p, vf x, int e4m3) {
  const __m256i low = _mm256_shuffle_epi8(fp8_lanes(x, e4m3), _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1,
    -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));  /* each half's 4 bytes first */
  _mm_storel_epi64((__m128i *)p, _mm_unpacklo_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1)));
}

static inline vf vround_int(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline void vstore_i8(int8_t *p, vf v) {  /* VL integral values in [-127, 127] -> VL int8 at p */
  const __m256i i = _mm256_cvtps_epi32(v);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w, w));
}
static inline vf vscale2(vf p, vf n) {  /* p * 2^n for integral n in [-126, 127]: n added to the exponent */
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#define EXP_HI 88.0f  /* keeps n <= 127 for vscale2 (expf(88) = 1.65e38) */

/* lane j = sum of v[j]'s lanes, by three rounds of horizontal adds and one exchange of 128-bit halves. */
static inline vf vhsum_lanes(const vf v[VL]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

/* exp for float32 lanes: 2^n * p(r) with r in [-ln2/2, ln2/2], degree-6 polynomial (~1 ulp);
 * inputs below -87.3 give 0, as expf does. */
static inline vf vexp(vf x) {
  const vf log2e = vset1(1.44269504088896341f);
  const vf ln2_hi = vset1(0.693359375f), ln2_lo = vset1(-2.12194440e-4f);
  x = vmax(vmin(x, vset1(EXP_HI)), vset1(-87.3365478515625f));
  const vf n = vround_int(vmul(x, log2e));
  vf r = vfnma(n, ln2_hi, x);
  r = vfnma(n, ln2_lo, r);
  vf p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vscale2(p, n);
}

/* ---- scalar helpers (every ISA) ---------------------------------------------------------------------- */

static inline float scalar_round(float v, int bf16) {
  if (!bf16) return v;
  uint32_t u;
  memcpy(&u, &v, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return v;  /* NaN stays NaN */
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;  /* round to nearest even, as to_bf16 */
  memcpy(&v, &u, 4);
  return v;
}

static inline float load1(const void *base, int64_t index, int bf16) {
  if (!bf16) return ((const float *)base)[index];
  uint32_t u = (uint32_t)((const uint16_t *)base)[index] << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Store v (already representable in the activation dtype) at base[index]. */
static inline void store1(void *base, int64_t index, float v, int bf16) {
  if (!bf16) {
    ((float *)base)[index] = v;
    return;
  }
  uint32_t u;
  memcpy(&u, &v, 4);
  ((uint16_t *)base)[index] = (uint16_t)(u >> 16);
}

static inline const char *at(const void *base, int64_t index, int bf16) {
  return (const char *)base + index * (bf16 ? 2 : 4);
}

/* ==== 2. per-ISA matmul micro-kernels ================================================================= */

/* Weight-only int8 matmul (ps_linear_i8 below). Activations are widened exactly enough for the products
 * to stay exact in integers: each row of x becomes int16 with its own scale (max|x| / 32767), i.e. 15
 * bits where bf16 keeps 8, so the added error is below x's own bf16 rounding for every element within
 * 2^7 of the row's largest. The weights are int8 in blocks of 4 rows, each block stored
 * column-chunk-major, q_packed[n / 4][k / 64][n % 4][k % 64], so a block streams as one sequential run.
 *
 * i8_prepare turns x [M, K] into what i8_block reads (2 M K bytes) and xs [M] (each row's step);
 * i8_block gives acc[r][c] = dot(x[m + c], w[r]) (exact integers, as float) for the 4 rows of one
 * weight block and C (1 or 2) rows of x. */
/* Prefetch one 64-column chunk of a weight block's 4 rows (256 bytes at p). The AVX2 kernel runs it 1 KiB ahead
 * of its stream: +10 % at batch 1 and +15-30 % at 2-5 rows on the 2-core Zen 3, whose prefetchers alone fell
 * behind. */
#define I8_AHEAD 1024
static inline void i8_prefetch(const int8_t *p) {
  for (int i = 0; i < 256; i += 64) _mm_prefetch((const char *)(p + i), _MM_HINT_T0);
}

/* x [M, K] rounded to int16 per row, as the integer kernels read it: xs[m] = the row's step (its largest magnitude
 * / 32767), each value x / xs[m] to the nearest integer. AVX2's vpmaddwd and the int16 tiles (i8_gemm) take these
 * rows; AVX-512's vpdpbusd takes the same integers split into byte planes (i8_prepare). */
static inline void vstore_i16(int16_t *p, vf v) {  /* nearest, as the float-to-int conversions round */
#if PS_ISA == 512
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v)));
#else
  const __m256i a = _mm256_cvtps_epi32(v);
  _mm_storeu_si128((__m128i *)p, _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)));
#endif
}

/* The largest magnitude of row m of x [M, K] (K a multiple of VL): the integer kernels' step per row is it over
 * their largest integer (int8 kernel: 32767; GGUF block kernel: QV). */
static inline float row_absmax(const void *x, int64_t m, int64_t K, int bf16) {
  vf mx = vzero();
  for (int64_t k = 0; k < K; k += VL) mx = vmax(mx, vabs(vload(at(x, m * K + k, bf16), bf16)));
  return vmaxr(mx);
}

static inline void i8_rows_i16(const void *x, int64_t M, int64_t K, int bf16, int16_t *xq, float *xs) {
  for (int64_t m = 0; m < M; ++m) {
    const float amax = row_absmax(x, m, K, bf16);
    xs[m] = amax > 0.0f ? amax / 32767.0f : 1.0f;
    const vf inv = vset1(1.0f / xs[m]);
    for (int64_t k = 0; k < K; k += VL) vstore_i16(xq + m * K + k, vmul(vload(at(x, m * K + k, bf16), bf16), inv));
  }
}

#if PS_ISA == 512
/* AVX-512 VNNI: the int16 values are split into bytes, x = 256 * hi + lo (lo in 0..255, hi in -128..127),
 * and each byte plane meets the int8 weights in vpdpbusd (unsigned x signed bytes, 64 weights per
 * instruction, no widening of the weights): dot(x, w) = 256 * (dot(hi + 128, w) - 128 * sum(w)) + dot(lo, w),
 * with sum(w) per row computed at load. Two instructions per 64 weights and row of x: at batch 1 this
 * is what keeps the kernel at memory speed on the 2-core Zen 5 (widening to int16 and vpdpwssd took four,
 * and was compute-bound once the bandwidth rose). int32 lanes are flushed every 8192 columns
 * (8192 / 4 * 4 * 255 * 127 < 2^31). Planes: hi [M, K] (+ 128) then lo [M, K]. */
#define I8_SEGMENT 8192

static void i8_prepare(const void *x, int64_t M, int64_t K, int bf16, uint8_t *planes, float *xs) {
  uint8_t *xhi = planes, *xlo = planes + M * K;
  for (int64_t m = 0; m < M; ++m) {
    const float amax = row_absmax(x, m, K, bf16);
    xs[m] = amax > 0.0f ? amax / 32767.0f : 1.0f;
    const __m512 inv = _mm512_set1_ps(1.0f / xs[m]);
    for (int64_t k = 0; k < K; k += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(vload(at(x, m * K + k, bf16), bf16), inv));  /* nearest */
      const __m512i hi = _mm512_add_epi32(_mm512_srai_epi32(v, 8), _mm512_set1_epi32(128));
      _mm_storeu_si128((__m128i *)(xhi + m * K + k), _mm512_cvtepi32_epi8(hi));
      _mm_storeu_si128((__m128i *)(xlo + m * K + k), _mm512_cvtepi32_epi8(_mm512_and_si512(v, _mm512_set1_epi32(0xFF))));
    }
  }
}

/* The passes after the first (m > 0) read the block from cache and are compute-bound: there each weight vector is
 * held in a register for its 2 C vpdpbusd, which GCC otherwise gives a load apiece (2 Zen 5 cores, Qwen2.5-0.5B's and
 * SmolLM2-135M's shapes: 5 rows 1.03-1.14x, 6 rows 1.08-1.28x, 9 rows 1.05-1.12x). The first pass streams the block
 * from memory and keeps the folded loads (held there, 2 rows ran 0.9x). */
static inline __attribute__((always_inline)) void i8_block(const int8_t *w, const uint8_t *planes, int64_t M,
                                                           int64_t m, const int C, const int32_t *wsum,
                                                           int64_t K, const int8_t *ahead, float acc[4][2]) {
  (void)ahead;  /* the hardware prefetchers keep up here (AVX2's kernel prefetches) */
  const uint8_t *xhi[2], *xlo[2];
  for (int c = 0; c < 2; ++c) {
    const int64_t row = m + (c < C ? c : 0);
    xhi[c] = planes + row * K;
    xlo[c] = planes + M * K + row * K;
  }
  int64_t total[4][2] = {{0}};  /* exact: the byte planes recombine in 64-bit integers */
  for (int64_t k0 = 0; k0 < K; k0 += I8_SEGMENT) {
    const int64_t k1 = K - k0 < I8_SEGMENT ? K : k0 + I8_SEGMENT;
    __m512i hi[4][2], lo[4][2];
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < C; ++c) hi[r][c] = lo[r][c] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 64) {
      __m512i wv[4];
      for (int r = 0; r < 4; ++r) {
        wv[r] = _mm512_loadu_si512(w + k * 4 + r * 64);
        if (m > 0) __asm__("" : "+v"(wv[r]));  /* see above */
      }
      for (int c = 0; c < C; ++c) {
        const __m512i h = _mm512_loadu_si512(xhi[c] + k), l = _mm512_loadu_si512(xlo[c] + k);
        for (int r = 0; r < 4; ++r) {
          hi[r][c] = _mm512_dpbusd_epi32(hi[r][c], h, wv[r]);
          lo[r][c] = _mm512_dpbusd_epi32(lo[r][c], l, wv[r]);
        }
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < C; ++c)
        total[r][c] += 256 * (int64_t)_mm512_reduce_add_epi32(hi[r][c]) + _mm512_reduce_add_epi32(lo[r][c]);
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = (float)(total[r][c] - 32768 * (int64_t)wsum[r]);  /* 256 * 128 * sum(w) */
}

/* One row of x (the planes of row m of M) against two weight blocks far apart in memory (the pair loop of
 * ps_linear_i8): decode then streams two runs per thread. With one run per thread the 2-core Ice Lake read int8
 * weights at 13-16 GB/s where its bf16 linear (four blocks in flight) reads 18-19; with two, 16.8-19 GB/s: 1.11-1.24x
 * on Qwen2.5-0.5B's shapes and its 151936-row LM head (benchmarks/linear_ab.py --kind int8 --rows 1), batch-1 decode
 * 1.08x (Qwen2.5-Coder GGUF) and 1.18x (the 0.5B shape, --quantization int8). AVX-512 pairs batch 1 only
 * (I8_PAIR_ROWS): at 2-16 rows its block loop holds the weights in registers; and layers of 16 blocks a thread or more
 * (I8_PAIR_MIN_BLOCKS: 64 outputs on 2 threads ran 0.9x paired). The same exact sums as i8_block's (bit-equal).
 * `next0`/`next1` unused, as i8_block's `ahead`. */
#define I8_PAIR_ROWS 1
#define I8_PAIR_MIN_BLOCKS 16
static inline __attribute__((always_inline)) void i8_block_pair(const int8_t *w0, const int8_t *w1,
                                                                const uint8_t *planes, int64_t M, int64_t m,
                                                                int64_t K, const int32_t *wsum0,
                                                                const int32_t *wsum1, const int8_t *next0,
                                                                const int8_t *next1, float acc[2][4]) {
  (void)next0; (void)next1;
  const int8_t *ws[2] = {w0, w1};
  const uint8_t *xhi = planes + m * K, *xlo = planes + M * K + m * K;
  int64_t total[2][4] = {{0}};
  for (int64_t k0 = 0; k0 < K; k0 += I8_SEGMENT) {
    const int64_t k1 = K - k0 < I8_SEGMENT ? K : k0 + I8_SEGMENT;
    __m512i hi[2][4], lo[2][4];
    for (int b = 0; b < 2; ++b)
      for (int r = 0; r < 4; ++r) hi[b][r] = lo[b][r] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 64) {
      const __m512i h = _mm512_loadu_si512(xhi + k), l = _mm512_loadu_si512(xlo + k);
      for (int b = 0; b < 2; ++b)
        for (int r = 0; r < 4; ++r) {
          const __m512i wv = _mm512_loadu_si512(ws[b] + k * 4 + r * 64);
          hi[b][r] = _mm512_dpbusd_epi32(hi[b][r], h, wv);
          lo[b][r] = _mm512_dpbusd_epi32(lo[b][r], l, wv);
        }
    }
    for (int b = 0; b < 2; ++b)
      for (int r = 0; r < 4; ++r)
        total[b][r] += 256 * (int64_t)_mm512_reduce_add_epi32(hi[b][r]) + _mm512_reduce_add_epi32(lo[b][r]);
  }
  for (int r = 0; r < 4; ++r) {
    acc[0][r] = (float)(total[0][r] - 32768 * (int64_t)wsum0[r]);
    acc[1][r] = (float)(total[1][r] - 32768 * (int64_t)wsum1[r]);
  }
}

#else  /* AVX2 */
/* AVX2: the int16 activations meet the weights widened to int16 (vpmovsxbw) in vpmaddwd: 16 weights per
 * instruction, exact (each int32 lane adds two products of at most 32767 * 128). vpmaddubsw (bytes)
 * would saturate on the unsigned x signed byte planes. int32 lanes are flushed every 2048 columns
 * (2048 / 8 * 2 * 32767 * 128 < 2^31). No weight-sum correction: both sides are signed. x: int16 [M, K]. */
#define I8_SEGMENT 2048

static void i8_prepare(const void *x, int64_t M, int64_t K, int bf16, uint8_t *planes, float *xs) {
  i8_rows_i16(x, M, K, bf16, (int16_t *)planes, xs);
}

/* acc + x0 w0 + x1 w1 in each int32 lane (16 pairs of int16). With AVX-VNNI (Alder Lake and later Intel cores, the
 * E-core Xeons; -mavxvnni, which -march=native gives there) one vpdpwssd, else vpmaddwd then vpaddd: the
 * same integers (no lane overflows: |x| <= 32767, |w| <= 127, and the callers flush their sums before 2^31), so
 * the same results bit for bit, for one instruction instead of two. */
static inline __attribute__((always_inline)) __m256i dot_i16(__m256i acc, __m256i x, __m256i w) {
#ifdef __AVXVNNI__
  return _mm256_dpwssd_avx_epi32(acc, x, w);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
#endif
}

/* acc = dot_i16(acc, x, w), kept in its register and in program order: with the sums as plain values GCC
 * reassociated them into trees and spilled half of them every step. */
static inline __attribute__((always_inline)) void i8_madd(__m256i *acc, __m256i x, __m256i w) {
  *acc = dot_i16(*acc, x, w);
  __asm__("" : "+x"(*acc));
}

static inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* i8_block's sums with the prefetches aimed at `ahead` (k * 4 bytes on as the block streams): each weight is widened
 * once for the C rows of x from row m. */
static inline __attribute__((always_inline)) void i8_block_ahead(const int8_t *w, const int16_t *x, int64_t m,
                                                                 const int C, int64_t K, const int8_t *ahead,
                                                                 float acc[4][2]) {
  const int16_t *xr[2];
  for (int c = 0; c < 2; ++c) xr[c] = x + (m + (c < C ? c : 0)) * K;
  int64_t total[4][2] = {{0}};
  for (int64_t k0 = 0; k0 < K; k0 += I8_SEGMENT) {
    const int64_t k1 = K - k0 < I8_SEGMENT ? K : k0 + I8_SEGMENT;
    __m256i a[4][2];
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < C; ++c) a[r][c] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k += 64) {
      i8_prefetch(ahead + k * 4);
      for (int g = 0; g < 64; g += 16) {
        __m256i wv[4];
        for (int r = 0; r < 4; ++r) wv[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k * 4 + r * 64 + g)));
        for (int c = 0; c < C; ++c) {
          const __m256i xv = _mm256_loadu_si256((const __m256i *)(xr[c] + k + g));
          for (int r = 0; r < 4; ++r) i8_madd(&a[r][c], xv, wv[r]);
        }
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < C; ++c) total[r][c] += hsum_epi32(a[r][c]);
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = (float)total[r][c];
}

/* acc[r][c] = dot(x[m + c], w[r]) for the C rows of x from m, prefetching at `ahead` (w + I8_AHEAD streams). */
static inline __attribute__((always_inline)) void i8_block(const int8_t *w, const uint8_t *planes, int64_t M,
                                                           int64_t m, const int C, const int32_t *wsum,
                                                           int64_t K, const int8_t *ahead, float acc[4][2]) {
  (void)M; (void)wsum;
  i8_block_ahead(w, (const int16_t *)planes, m, C, K, ahead, acc);
}

/* One row of x against two weight blocks (8 weight rows) far apart in memory: decode then streams two runs
 * per thread (one run per thread held the 2-core Zen 3 at ~20 GB/s of its ~30, with the kernel able to take
 * 30 GB/s a core from cache). Exact integer sums, as i8_block's (bit-equal). Every batch below the prefill tile
 * takes the pair (I8_PAIR_ROWS): the first row's run brings the blocks in (1 KiB ahead); the later rows then run
 * i8_block_ahead on each block of the pair, now in L1/L2, two rows per widened weight, and the first of those
 * passes fetches the thread's next pair. Without that fetch the later rows ran with no memory traffic (5 rows
 * took 2.5x one row's time where computing them takes 1.3x); with a run of the pair per row (each weight
 * widened once per row) 5 rows took 1.8x, and 17-63 rows took the block loop below (AVX2 build of an AMX Xeon,
 * weights streamed: 5 rows 1.12x, 9 rows 1.16-1.44x, 17 rows 1.07-1.28x faster now). A batch of two rows keeps
 * a run per row: its second run fetches the next pair. */
#define I8_PAIR_ROWS INT64_MAX
#define I8_PAIR_MIN_BLOCKS 0
static inline __attribute__((always_inline)) void i8_block_pair(const int8_t *w0, const int8_t *w1,
                                                                const uint8_t *planes, int64_t M, int64_t m,
                                                                int64_t K, const int32_t *wsum0,
                                                                const int32_t *wsum1, const int8_t *next0,
                                                                const int8_t *next1, float acc[2][4]) {
  (void)M; (void)wsum0; (void)wsum1;
  const int16_t *x = (const int16_t *)planes + m * K;
  const int8_t *ws[2] = {w0, w1};
  int64_t total[2][4] = {{0}};
  for (int64_t k0 = 0; k0 < K; k0 += I8_SEGMENT) {
    const int64_t k1 = K - k0 < I8_SEGMENT ? K : k0 + I8_SEGMENT;
    __m256i a[2][4];
    for (int b = 0; b < 2; ++b)
      for (int r = 0; r < 4; ++r) a[b][r] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k += 64) {
      i8_prefetch(next0 + k * 4);
      i8_prefetch(next1 + k * 4);
      for (int g = 0; g < 64; g += 16) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + k + g));
        for (int b = 0; b < 2; ++b)
          for (int r = 0; r < 4; ++r)
            i8_madd(&a[b][r], xv, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(ws[b] + k * 4 + r * 64 + g))));
      }
    }
    for (int b = 0; b < 2; ++b)
      for (int r = 0; r < 4; ++r) total[b][r] += hsum_epi32(a[b][r]);
  }
  for (int b = 0; b < 2; ++b)
    for (int r = 0; r < 4; ++r) acc[b][r] = (float)total[b][r];
}
#endif

/* int8 weights as exact bf16 for the panels of prefill-sized batches (i8_fill_panel below). i8_bf16_pairs: one
 * output's 2 VL int8 weights at p (columns k .. k + 2 VL - 1) as VL 32-bit pairs of bf16, the even column in the
 * low half (the packed bf16 layout's pairs); an int8 value is exact in float32 and in bf16, so the top half of
 * its float32 is its bf16. transpose_lanes: VL such vectors (one per output) become VL vectors of one column
 * pair each, lane r holding output r's (a VL x VL transpose of 32-bit lanes; the AMX-INT8 path transposes groups
 * of 4 int8 columns with it). */
#if PS_ISA == 512
typedef __m512i vpairs;
static inline vpairs pairs_zero(void) { return _mm512_setzero_si512(); }
static inline void pairs_store(uint32_t *p, vpairs v) { _mm512_storeu_si512(p, v); }
/* The int8 weights as int16 pairs (the even column in the low half), for vpdpwssd: the integer tile's panels. */
static inline vpairs i8_i16_pairs(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vpairs i8_bf16_pairs(const int8_t *p) {
  const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));  /* lane: even | odd << 16 */
  const __m512 even = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 16));
  const __m512 odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 16));
  return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even), 16),
                         _mm512_and_si512(_mm512_castps_si512(odd), _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline void transpose_lanes(vpairs r[VL]) {
  vpairs t[16], u[16];
  for (int i = 0; i < 8; ++i) {  /* per 128-bit lane L: columns 4L, 4L + 1 (lo) / 4L + 2, 4L + 3 (hi) of two rows */
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  /* u[4g + i], lane L: column 4L + i of rows 4g .. 4g + 3 */
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int i = 0; i < 4; ++i) {  /* gather lane L of the four row groups: column 4L + i */
    const __m512i p0 = _mm512_shuffle_i32x4(u[i], u[4 + i], 0x88), p1 = _mm512_shuffle_i32x4(u[i], u[4 + i], 0xDD);
    const __m512i q0 = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0x88);
    const __m512i q1 = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0xDD);
    r[i] = _mm512_shuffle_i32x4(p0, q0, 0x88);
    r[4 + i] = _mm512_shuffle_i32x4(p1, q1, 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(p0, q0, 0xDD);
    r[12 + i] = _mm512_shuffle_i32x4(p1, q1, 0xDD);
  }
}
#else
typedef __m256i vpairs;
static inline vpairs pairs_zero(void) { return _mm256_setzero_si256(); }
static inline void pairs_store(uint32_t *p, vpairs v) { _mm256_storeu_si256((__m256i *)p, v); }
/* The int8 weights as int16 pairs (the even column in the low half), for vpmaddwd: the integer tile's panels. */
static inline vpairs i8_i16_pairs(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline vpairs i8_bf16_pairs(const int8_t *p) {
  const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));  /* lane: even | odd << 16 */
  const __m256 even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16));
  const __m256 odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16));
  return _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(even), 16),
                         _mm256_and_si256(_mm256_castps_si256(odd), _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline void transpose_lanes(vpairs r[VL]) {
  vpairs t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 2; ++g) {  /* u[4g + i], 128-bit lane L: column 4L + i of rows 4g .. 4g + 3 */
    u[4 * g] = _mm256_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm256_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm256_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm256_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
  }
}
#endif

/* Prefill-sized batches (I8_PANEL_ROWS rows and more) turn each block of weights into an exact bf16 panel and
 * run the bf16 linear's tile over it (i8_panels below); every smaller batch takes the integer kernel above, so a
 * row's result does not depend on how many rows run with it (a decode step, a speculative verification's rows
 * and a batch of a few requests give every row the same bits).
 * - AVX2 and AVX-512 without BF16 run an integer tile over int16 panels instead (i8_gemm, I8_GEMM), whose rows
 *   keep their exact sums: there every batch size gives a row the same bits, and activations of either dtype
 *   take it.
 * - Below I8_PANEL_ROWS the integer kernel runs on every ISA. Measured on the 2-core Zen 3 for Qwen2.5-0.5B's
 *   gate/up and down shapes, streamed from memory: it was as fast as float32 tiles at 1-48 rows (e.g. 9 rows 14.6
 *   vs 15.6 ms, 32 rows 51-58 vs 70-79 ms for 10 of them), so the tiles (widening int8 to float32 per 3 rows)
 *   were dropped.
 * - With them (AVX512-BF16; AMX tiles where Linux grants them) bf16 activations take the panels; float32 ones
 *   keep the integer kernel here and dequantize above 32 rows (Int8Linear). */
#define I8_PANEL_ROWS 64
#if PS_ISA == 512
/* AVX-512 batches of I8_TILE_ROWS .. I8_PANEL_ROWS - 1 rows (decode batches, where no AMX-INT8 takes them) with
 * K <= I8_TILE_MAX_K run the integer tile (i8_gemm) instead of the row kernel: its exact sums give every row the
 * bits it gets alone. 2 Zen 5 cores, Qwen2.5-0.5B's shapes streamed from memory (benchmarks/linear_ab.py --kind
 * int8): 9728x896 and 1152x896 0.97-1.04x at 16 rows, 1.1-1.2x at 20-24, 1.22-1.34x at 32, 1.37-1.5x at 63; the
 * tile was 0.75-0.9x for 896x4864 (its 4864-column panel and x outgrow L2), hence the K bound. Since the row
 * kernel's later passes hold the weights in registers (i8_block) it beats the tile below 32 rows: at 16 rows
 * 1.3-1.5x on Qwen2.5-0.5B's and SmolLM2-135M's shapes, at 24 1.0-1.18x, at 32 0.94-1.11x; against the tile that
 * runs the whole block at once (i8_gemm_run, 1.11-1.21x the two halves it ran before) 1.2-1.5x at 16 rows,
 * 0.96-1.2x at 24, 0.9-1.04x at 28. */
#define I8_TILE_ROWS 32
#define I8_TILE_MAX_K 1024
#endif
#if PS_ISA == 256 || !defined(__AVX512BF16__)
/* Prefill-sized batches take the integer tile (i8_gemm) instead of float32 panels: on AVX2 1.3-1.4x on
 * Qwen2.5-0.5B's shapes (AVX2 build on an AMX Xeon); on AVX-512 without BF16, vpdpwssd (32 products an
 * instruction, the sums' adds included) against 16 float32 FMAs. Below, the block kernel stays: on AVX2 at 17-56
 * rows the tile was 1.1x faster for gate/up but 0.8-0.9x for the down projection (K = 4864). */
#define I8_GEMM 1
#endif

/* bf16 linear (ps_linear_bf16 below): W packed as w[N/NB][K/2][NB][2] (outputs padded to NB with zeros),
 * so each block of NB outputs streams as one sequential run and needs no horizontal sums. bf16_rows
 * computes y rows [0, M) against every block. */
#if PS_ISA == 512 && defined(__AVX512BF16__)
/* AVX512-BF16: vdpbf16ps multiplies bf16 pairs and accumulates in float32, 32 weights an instruction. */
#define BF16_NB 64  /* outputs per weight block: 4 vectors of 16 */
#define BF16_MT 6   /* rows of x per register tile: 24 accumulators */
#define BF16_AHEAD 512  /* uint32 pairs ahead that the tile prefetches its weights (2 KiB: 8 steps of 256 bytes) */

/* G weight blocks (64 outputs each, all of K; blocks K * BF16_NB apart from wb) against MT rows of x, MT * G <=
 * BF16_MT: acc[m * G + g][j] collects block g's outputs j*16..j*16+15 for row m. Per pair of columns: each block's
 * 4 weight vectors (each 16 outputs x 2 columns, as vdpbf16ps pairs them) meet one broadcast pair of x per row.
 * Prefill takes one block and up to 6 rows; one row (a decode step) takes up to 4 blocks, so that 4 weight streams
 * are in flight (1.03-1.15x for batch-1 linears on a Zen 4). A row's sums are the same in the same order either
 * way. Inlined with MT and G constant so the tile stays in registers. */
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *wb, const uint16_t *x, int64_t K,
                                                            const int MT, const int G, __m512 out[BF16_MT][4]) {
  /* The sums live in this local tile and reach `out` once at the end: read through a char-typed copy (memcpy),
   * x may alias `out` as far as the compiler knows, which made it store all 24 sums on every step (1.5 KiB of
   * stores per 24 vdpbf16ps; 2.4x slower at prefill sizes on a Zen 5). */
  __m512 acc[BF16_MT][4];
  for (int t = 0; t < MT * G; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    for (int g = 0; g < G; ++g) {
      const uint16_t *wk = wb + g * BF16_NB * K + kp * 2 * BF16_NB;
      for (int l = 0; l < 4; ++l) _mm_prefetch((const char *)(wk + 2 * BF16_AHEAD + l * 32), _MM_HINT_T0);
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
      __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64), w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
      for (int m = 0; m < MT; ++m) {
        int32_t pair;
        memcpy(&pair, x + m * K + 2 * kp, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        __m512 *a = acc[m * G + g];
        a[0] = _mm512_dpbf16_ps(a[0], w0, xb);
        a[1] = _mm512_dpbf16_ps(a[1], w1, xb);
        a[2] = _mm512_dpbf16_ps(a[2], w2, xb);
        a[3] = _mm512_dpbf16_ps(a[3], w3, xb);
      }
    }
  }
  for (int t = 0; t < MT * G; ++t)
    for (int j = 0; j < 4; ++j) out[t][j] = acc[t][j];
}

/* bf16_tile for `rows` (1..BF16_MT) rows of one block, each count its own inlined copy so the tile stays in
 * registers. */
static void bf16_tile_rows(const uint16_t *wb, const uint16_t *x, int64_t K, int64_t rows, __m512 acc[BF16_MT][4]) {
  switch (rows) {
    case 1: bf16_tile(wb, x, K, 1, 1, acc); break;
    case 2: bf16_tile(wb, x, K, 2, 1, acc); break;
    case 3: bf16_tile(wb, x, K, 3, 1, acc); break;
    case 4: bf16_tile(wb, x, K, 4, 1, acc); break;
    case 5: bf16_tile(wb, x, K, 5, 1, acc); break;
    default: bf16_tile(wb, x, K, 6, 1, acc); break;
  }
}

/* The bias of block nb's four groups of 16 outputs in float32 (zeros past N or without a bias), and which
 * lanes of each group are real outputs. */
static inline void bf16_block_bias(const uint16_t *bias, int64_t nb, int64_t N, __m512 b[4], __mmask16 keep[4]) {
  for (int j = 0; j < 4; ++j) {
    const int64_t n0 = nb * BF16_NB + j * 16;
    const int64_t valid = N - n0 >= 16 ? 16 : (N - n0 > 0 ? N - n0 : 0);
    keep[j] = (__mmask16)((1u << valid) - 1);
    b[j] = bias && valid ? vbf16(_mm256_maskz_loadu_epi16(keep[j], bias + n0)) : _mm512_setzero_ps();
  }
}

/* One row's sums of a block (acc[j]: outputs j*16..j*16+15) + its bias, as bf16 at y (the block's first output),
 * the outputs past N left alone (bf16_block_bias' masks). */
static inline void bf16_store_block(uint16_t *y, const __m512 acc[4], const __m512 b[4], const __mmask16 keep[4]) {
  for (int j = 0; j < 4; ++j) _mm256_mask_storeu_epi16(y + j * 16, keep[j], to_bf16(_mm512_add_ps(acc[j], b[j])));
}

#define BF16_G 4  /* weight blocks a one-row tile takes at once */

/* y = x w^T (+ bias) for one row, blocks [from, to): BF16_G at a time, the last group shorter where they run out. */
static void bf16_row_blocks(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                            int64_t N, int64_t K, int64_t from, int64_t to) {
  for (int64_t nb = from; nb < to; nb += BF16_G) {
    const int64_t count = to - nb < BF16_G ? to - nb : BF16_G;
    __m512 acc[BF16_MT][4];
    const uint16_t *wb = w + nb * BF16_NB * K;
    switch (count) {  /* each count its own inlined tile */
      case 1: bf16_tile(wb, x, K, 1, 1, acc); break;
      case 2: bf16_tile(wb, x, K, 1, 2, acc); break;
      case 3: bf16_tile(wb, x, K, 1, 3, acc); break;
      default: bf16_tile(wb, x, K, 1, BF16_G, acc); break;
    }
    for (int64_t g = 0; g < count; ++g) {
      __m512 b[4];
      __mmask16 keep[4];
      bf16_block_bias(bias, nb + g, N, b, keep);
      bf16_store_block(y + (nb + g) * BF16_NB, acc[g], b, keep);
    }
  }
}

static void bf16_rows_dot(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                          int64_t M, int64_t N, int64_t K, int nthreads) {
  const int64_t blocks = (N + BF16_NB - 1) / BF16_NB;
  if (M == 1) {  /* each thread an even share of the blocks, G streams at a time */
    #pragma omp parallel num_threads(nthreads)
    {
      const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
      bf16_row_blocks(x, w, bias, y, N, K, blocks * t / T, blocks * (t + 1) / T);
    }
    return;
  }
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t nb = 0; nb < blocks; ++nb) {
    const uint16_t *wb = w + nb * BF16_NB * K;
    __m512 b[4];
    __mmask16 keep[4];
    bf16_block_bias(bias, nb, N, b, keep);
    for (int64_t m = 0; m < M; m += BF16_MT) {
      const int64_t rows = M - m < BF16_MT ? M - m : BF16_MT;
      __m512 acc[BF16_MT][4];
      bf16_tile_rows(wb, x + m * K, K, rows, acc);
      for (int64_t r = 0; r < rows; ++r) bf16_store_block(y + (m + r) * N + nb * BF16_NB, acc[r], b, keep);
    }
  }
}
/* Where a chunk of 512 rows fits the 1 MiB L2 (K <= 1024) take the rows chunk by chunk: 9728x896 at
 * M=2048 went from 366 to 434 GFLOP/s. Larger K keeps the whole M (its weight blocks already fill L2). */
static int64_t bf16_chunk_rows(int64_t M, int64_t K) { return K <= 1024 ? 512 : M; }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
/* AMX (Xeons from Sapphire Rapids on): TDPBF16PS adds a 16-row x 32-column bf16 tile of x times a 32 x 16 tile
 * of W to 16 x 16 float32 sums, pair of columns by pair of columns as vdpbf16ps does, at ~8x its rate (oneDNN
 * measured 1.6-2.1 TFLOP/s at prefill sizes on 2 cores of such a Xeon, the vdpbf16ps tile ~0.2 before its sums
 * were kept in registers; ~0.85 on 2 Zen 5 cores since). The packed
 * layout is already made of W tiles: outputs j*16..j*16+15 of block nb over column pairs kp..kp+15 are 16 rows
 * of 64 bytes, 256 bytes apart, at wb + (kp * NB + j * 16) * 2. Tiles: 0-3 the sums of the block's four groups
 * of 16 outputs, 4 a tile of x, 5 and 6 tiles of W. Rows of x come 16 at a time; a last, shorter group is
 * copied into zeroed rows first. Linux grants a process the 8 KiB tile state only on request (ps_amx_init). */
#include <sys/syscall.h>
#include <unistd.h>
#define PS_AMX 1
#define AMX_K 32  /* columns of x per tile */
static int amx_ready;

/* want = 1: ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA) and, where granted,
 * run the bf16 linear on AMX from now on (returns 1); want = 0: run it on vdpbf16ps. Call before linears run. */
int ps_amx_init(int want) {
  amx_ready = want && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return amx_ready;
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_config;

/* Eight tiles of 64 bytes a row: `rows` rows in tiles 0 .. x_tiles - 1 (the sums and x), 16 in the rest (W). The
 * bf16 linear uses 0-3 for sums, 4 for x and 5-6 for W (x_tiles 5). Tile state is per thread: each thread
 * configures its own. */
static void amx_configure(int rows, int x_tiles) {
  amx_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = t < x_tiles ? rows : 16;
  }
  _tile_loadconfig(&c);
}

/* Sums of 16 rows of x (row stride `ldx` elements) with block wb, all of K, into out[16][NB]. */
static inline void amx_block(const uint16_t *x, int64_t ldx, const uint16_t *wb, int64_t K, float out[16][BF16_NB]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += AMX_K) {
    const uint16_t *wk = wb + k * BF16_NB;  /* column pair k / 2, output 0 */
    _tile_loadd(4, x + k, ldx * 2);
    _tile_loadd(5, wk, BF16_NB * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wk + 32, BF16_NB * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, wk + 64, BF16_NB * 4);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, wk + 96, BF16_NB * 4);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, &out[0][0], BF16_NB * 4);
  _tile_stored(1, &out[0][16], BF16_NB * 4);
  _tile_stored(2, &out[0][32], BF16_NB * 4);
  _tile_stored(3, &out[0][48], BF16_NB * 4);
}

/* The last M % 16 rows of x [M, K], zero-padded to 16 rows; NULL where M is a multiple of 16, or where M < 16 and
 * not `short_too` (bf16_rows_amx's tiles are then M rows high; i8_panels' are always 16). */
static uint16_t *amx_tail(const uint16_t *x, int64_t M, int64_t K, int short_too) {
  const int64_t full = M / 16 * 16;
  if ((M < 16 && !short_too) || full == M) return NULL;
  uint16_t *tail = calloc(16 * K, 2);
  if (!tail) abort();
  memcpy(tail, x + full * K, (size_t)((M - full) * K * 2));
  return tail;
}

static void bf16_rows_amx(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                          int64_t M, int64_t N, int64_t K, int nthreads) {
  const int64_t blocks = (N + BF16_NB - 1) / BF16_NB;
  const int short_batch = M < 16;  /* then the x and sum tiles are M rows high: no padding */
  uint16_t *tail = amx_tail(x, M, K, 0);
  #pragma omp parallel num_threads(nthreads)
  {
    amx_configure(short_batch ? (int)M : 16, 5);
    float out[16][BF16_NB] __attribute__((aligned(64)));
    #pragma omp for schedule(static)
    for (int64_t nb = 0; nb < blocks; ++nb) {
      const uint16_t *wb = w + nb * BF16_NB * K;
      __m512 b[4];
      __mmask16 keep[4];
      bf16_block_bias(bias, nb, N, b, keep);
      for (int64_t m = 0; m < M; m += 16) {
        const int64_t rows = M - m < 16 ? M - m : 16;
        amx_block(rows == 16 || short_batch ? x + m * K : tail, K, wb, K, out);
        for (int64_t r = 0; r < rows; ++r)
          for (int j = 0; j < 4; ++j)
            _mm256_mask_storeu_epi16(y + (m + r) * N + nb * BF16_NB + j * 16, keep[j],
                                     to_bf16(_mm512_add_ps(_mm512_load_ps(&out[r][j * 16]), b[j])));
      }
    }
    _tile_release();
  }
  free(tail);
}
#endif

static void bf16_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int64_t M, int64_t N, int64_t K, int nthreads) {
#ifdef PS_AMX
  if (amx_ready && K % AMX_K == 0) {
    bf16_rows_amx(x, w, bias, y, M, N, K, nthreads);
    return;
  }
#endif
  bf16_rows_dot(x, w, bias, y, M, N, K, nthreads);
}

#else
/* No bf16 dot product: each pair of bf16 weights is widened to float32 in registers (the low half of a
 * 32-bit pair shifted up, the high half masked: two integer ops for 2 VL weights) and meets x, widened
 * to float32 once per call, in fused multiply-adds. NB = 2 VL outputs a block (one 64-byte line a column
 * pair on AVX2). Every row of x runs the same sums in the same order whatever the tile, so a row's
 * output does not depend on the other rows of the batch. */
#define BF16_NB (2 * VL)
#ifndef BF16_MT
#if PS_ISA == 512
#define BF16_MT 12  /* rows of x per register tile: 24 accumulators + 4 widened weights + broadcasts, of 32 */
#else
#define BF16_MT 6  /* rows of x per register tile: 12 accumulators + 2 widened weights + broadcasts */
#endif
#endif

static inline vf widen_even(const uint32_t *p) {  /* the first bf16 of each 32-bit pair, as float32 */
#if PS_ISA == 512
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
#else
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)p), 16));
#endif
}
static inline vf widen_odd(const uint32_t *p) {  /* the second bf16 of each pair */
#if PS_ISA == 512
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32((int)0xFFFF0000u)));
#else
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)p),
                                              _mm256_set1_epi32((int)0xFFFF0000u)));
#endif
}

/* bf16 x for the tiles: float32, each tile of MT rows (the last one `rows`) stored pair-interleaved,
 * xt[tile][K/2][rows][2], so the 2 MT broadcasts of a step come from one sequential stream (read as rows
 * K floats apart, x missed L1 and the tile ran at ~55 % of the FMA peak on Zen 3). */
static float *bf16_tile_x(const uint16_t *x, int64_t M, int64_t K) {
  float *xt = (float *)malloc(sizeof(float) * (size_t)(M * K));
  for (int64_t m0 = 0; m0 < M; m0 += BF16_MT) {
    const int64_t rows = M - m0 < BF16_MT ? M - m0 : BF16_MT;
    float *t = xt + m0 * K;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; k += 2) {
        t[k * rows + 2 * r] = load1(x, (m0 + r) * K + k, 1);
        t[k * rows + 2 * r + 1] = load1(x, (m0 + r) * K + k + 1, 1);
      }
  }
  return xt;
}

/* How far ahead (uint32 pairs; 1 KiB with AVX2's 64-byte steps) the tile prefetches its block's weights. A batch of
 * 2-16 rows runs one tile per block, one stream per thread, which the hardware prefetchers alone kept far below
 * the memory's speed: with it, 1.3-1.5x for 2-16 rows of Qwen2.5-0.5B's shapes streamed from memory (AVX2 build
 * of an AMX Xeon, benchmarks/linear_ab.py; 1.15-1.5x for vdpbf16ps's tile, whose AVX-512 BF16_AHEAD is below). */
#define BF16_AHEAD 256
/* acc[m][j] = the MT rows of x (one tile of bf16_tile_x) against the weight block's outputs j * VL ... */
static inline __attribute__((always_inline)) void bf16_tile(const uint32_t *wb, const float *xt, int64_t K,
                                                            const int MT, vf acc[BF16_MT][2]) {
  /* Sums in locals, copied out at the end: written through `acc` (which may alias x, as far as the compiler
   * knows) every accumulator was stored back on every step. */
  vf sum[BF16_MT][2];
  for (int m = 0; m < MT; ++m) sum[m][0] = sum[m][1] = vzero();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    const uint32_t *wk = wb + kp * BF16_NB;
    const float *xk = xt + kp * 2 * MT;
    for (int l = 0; l < BF16_NB / 16; ++l) _mm_prefetch((const char *)(wk + BF16_AHEAD + 16 * l), _MM_HINT_T0);
    /* The even k of the pair, then the odd one: two weight registers, one broadcast and the 2 MT sums
     * (15 of the 16 registers; both halves at once spilled sums to the stack). */
    const vf e0 = widen_even(wk), e1 = widen_even(wk + VL);
    for (int m = 0; m < MT; ++m) {
      const vf b = vset1(xk[2 * m]);
      sum[m][0] = vfma(e0, b, sum[m][0]);
      sum[m][1] = vfma(e1, b, sum[m][1]);
    }
    const vf o0 = widen_odd(wk), o1 = widen_odd(wk + VL);
    for (int m = 0; m < MT; ++m) {
      const vf b = vset1(xk[2 * m + 1]);
      sum[m][0] = vfma(o0, b, sum[m][0]);
      sum[m][1] = vfma(o1, b, sum[m][1]);
    }
  }
  for (int m = 0; m < MT; ++m) acc[m][0] = sum[m][0], acc[m][1] = sum[m][1];
}

/* bf16_tile for `rows` (1..BF16_MT) rows, each count its own inlined copy so the tile stays in registers. Not inlined
 * itself: inlined into bf16_rows (GCC 12 did so once the file grew), the 6-row tile shared the 16 AVX2 registers with
 * bf16_rows' live values and kept 5 of its 12 sums on the stack, every step: prefill linears 0.65-0.82x on a Zen 3. */
static __attribute__((noinline)) void bf16_tile_rows(const uint32_t *wb, const float *xt, int64_t K, int64_t rows,
                                                     vf acc[BF16_MT][2]) {
  switch (rows) {
    case 1: bf16_tile(wb, xt, K, 1, acc); break;
    case 2: bf16_tile(wb, xt, K, 2, acc); break;
    case 3: bf16_tile(wb, xt, K, 3, acc); break;
#if BF16_MT > 4
    case 4: bf16_tile(wb, xt, K, 4, acc); break;
    case 5: bf16_tile(wb, xt, K, 5, acc); break;
#endif
#if BF16_MT > 6
    case 6: bf16_tile(wb, xt, K, 6, acc); break;
    case 7: bf16_tile(wb, xt, K, 7, acc); break;
    case 8: bf16_tile(wb, xt, K, 8, acc); break;
    case 9: bf16_tile(wb, xt, K, 9, acc); break;
    case 10: bf16_tile(wb, xt, K, 10, acc); break;
    case 11: bf16_tile(wb, xt, K, 11, acc); break;
#endif
    default: bf16_tile(wb, xt, K, BF16_MT, acc); break;
  }
}

/* One row of x against BF16_G weight blocks at once: the same sums as bf16_tile's one-row copy, in the same
 * order, but 2 BF16_G independent ones instead of 2: a single row's two sums are each a chain of dependent
 * FMAs (4 cycles apiece), which held batch-1 decode below the memory's speed. */
#define BF16_G 4
static inline __attribute__((always_inline)) void bf16_tile_blocks(const uint32_t *const wb[BF16_G], const float *x,
                                                                   int64_t K, vf acc[BF16_G][2]) {
  vf sum[BF16_G][2];
  for (int g = 0; g < BF16_G; ++g) sum[g][0] = sum[g][1] = vzero();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    const vf be = vset1(x[2 * kp]);
    for (int g = 0; g < BF16_G; ++g) {
      const uint32_t *wk = wb[g] + kp * BF16_NB;
      sum[g][0] = vfma(widen_even(wk), be, sum[g][0]);
      sum[g][1] = vfma(widen_even(wk + VL), be, sum[g][1]);
    }
    const vf bo = vset1(x[2 * kp + 1]);
    for (int g = 0; g < BF16_G; ++g) {
      const uint32_t *wk = wb[g] + kp * BF16_NB;
      sum[g][0] = vfma(widen_odd(wk), bo, sum[g][0]);
      sum[g][1] = vfma(widen_odd(wk + VL), bo, sum[g][1]);
    }
  }
  for (int g = 0; g < BF16_G; ++g) acc[g][0] = sum[g][0], acc[g][1] = sum[g][1];
}

/* Row m's outputs of weight block nb (+ bias b), rounded to bf16. */
static inline void bf16_store_block(uint16_t *y, int64_t m, int64_t nb, int64_t N, vf s0, vf s1, const float *b) {
  uint16_t *out = y + m * N + nb * BF16_NB;
  s0 = vadd(s0, vloadf(b));
  s1 = vadd(s1, vloadf(b + VL));
  const int64_t valid = N - nb * BF16_NB < BF16_NB ? N - nb * BF16_NB : BF16_NB;
  if (valid == BF16_NB) {
    vstore(out, s0, 1);
    vstore(out + VL, s1, 1);
  } else {  /* the last, partial block */
    float tmp[BF16_NB];
    vstoref(tmp, s0);
    vstoref(tmp + VL, s1);
    for (int64_t j = 0; j < valid; ++j) store1(out, j, scalar_round(tmp[j], 1), 1);
  }
}

static void bf16_block_bias(const uint16_t *bias, int64_t nb, int64_t N, float b[BF16_NB]) {
  for (int j = 0; j < BF16_NB; ++j) {
    const int64_t n = nb * BF16_NB + j;
    b[j] = bias && n < N ? load1(bias, n, 1) : 0.0f;
  }
}

static void bf16_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int64_t M, int64_t N, int64_t K, int nthreads) {
  const int64_t blocks = (N + BF16_NB - 1) / BF16_NB;
  float *xf = bf16_tile_x(x, M, K);
  /* One row: BF16_G blocks per tile while whole groups last, then block by block. */
  const int64_t grouped = M == 1 ? blocks / BF16_G * BF16_G : 0;
  #pragma omp parallel num_threads(nthreads)
  {
    #pragma omp for schedule(static) nowait
    for (int64_t nb = 0; nb < grouped; nb += BF16_G) {
      const uint32_t *wb[BF16_G];
      for (int g = 0; g < BF16_G; ++g) wb[g] = (const uint32_t *)(w + (nb + g) * BF16_NB * K);
      vf acc[BF16_G][2];
      bf16_tile_blocks(wb, xf, K, acc);
      for (int g = 0; g < BF16_G; ++g) {
        float b[BF16_NB];
        bf16_block_bias(bias, nb + g, N, b);
        bf16_store_block(y, 0, nb + g, N, acc[g][0], acc[g][1], b);
      }
    }
    #pragma omp for schedule(static)
    for (int64_t nb = grouped; nb < blocks; ++nb) {
      const uint32_t *wb = (const uint32_t *)(w + nb * BF16_NB * K);
      float b[BF16_NB];
      bf16_block_bias(bias, nb, N, b);
      for (int64_t m = 0; m < M; m += BF16_MT) {
        const int64_t rows = M - m < BF16_MT ? M - m : BF16_MT;
        vf acc[BF16_MT][2];
        bf16_tile_rows(wb, xf + m * K, K, rows, acc);
        for (int64_t r = 0; r < rows; ++r) bf16_store_block(y, m + r, nb, N, acc[r][0], acc[r][1], b);
      }
    }
  }
  free(xf);
}
/* Rows in chunks whose float32 copy fits in half of a 512 KiB L2, so it stays there while every weight
 * block passes over it. Same sums in the same order either way. */
static int64_t bf16_chunk_rows(int64_t M, int64_t K) {
  int64_t rows = ((int64_t)256 << 10) / (4 * K) / BF16_MT * BF16_MT;
  (void)M;
  return rows < BF16_MT ? BF16_MT : rows;
}
#endif

/* ==== 3. the kernels, once for every ISA ============================================================== */

/* ---- weight-only int8 linear ----------------------------------------------------------------------- */

/* y[m, n] = round(scale[n] * sum_k x[m, k] * q[n, k]) (+ bias[n], rounded again, as `F.linear` then
 * `+ bias` would in the model dtype). x, y, bias: activation dtype; scale float32 [N]; wsum int32 [N]
 * (sum of each row's int8 values). q is int8 in blocks of 4 rows, each block stored column-chunk-major:
 * q_packed[n / 4][k / 64][n % 4][k % 64] (rows padded to a multiple of 4 with zeros), so a block streams
 * from memory as one sequential run (4 short rows read side by side left the prefetchers idle: 17 GB/s
 * instead of ~30). Made for small M (decode). K % 64 == 0. */
/* out[m, n] = round(xs * scale[n] * acc) (+ bias[n], rounded again). The product is rounded to float32 before the
 * bias is added (the register barriers), in the scalar and the vector store alike: left to the compiler, a float32
 * product and its bias add were fused into one FMA in one of them and not in the other (AVX2 build), and rows
 * stored by the two then differed in the last bit. */
static inline void i8_store(void *y, const void *bias, const float *scale, float xs, float acc, int64_t m,
                            int64_t n, int64_t N, int bf16) {
  float product = xs * scale[n] * acc;
  __asm__("" : "+v"(product));
  float v = scalar_round(product, bf16);
  if (bias) v = scalar_round(v + load1(bias, n, bf16), bf16);
  store1(y, m * N + n, v, bf16);
}

/* Prefill-sized batches (M >= I8_PANEL_ROWS): each block of BF16_NB outputs is first written as bf16 pairs
 * into a panel in the bf16 linear's layout (the int8 values are exact in bf16), and the bf16 tile runs
 * every row of x over it: the widening is paid once per block instead of once per tile of rows, and the
 * outer-product tile needs few loads (an inner-product tile widening int8 per tile of rows was load- and
 * shuffle-bound at ~120 GFLOP/s on Zen 3). Exact products, float32 sums, one scale per output.
 * The panel is filled VL outputs x VL column pairs at a time (i8_bf16_pairs + transpose_lanes): filled one
 * weight at a time it cost about a sixth of the AVX2 tile's time. */
static inline __attribute__((always_inline)) void i8_fill_panel(const int8_t *q, int64_t nb, int64_t N,
                                                                int64_t K, uint32_t *panel, const int int16) {
  for (int64_t j0 = 0; j0 < BF16_NB; j0 += VL)
    for (int64_t k = 0; k < K; k += 2 * VL) {  /* 2 VL columns never cross a 64-column chunk */
      vpairs rows[VL];
      for (int r = 0; r < VL; ++r) {
        const int64_t n = nb * BF16_NB + j0 + r;  /* q_packed[n / 4][k / 64][n % 4][k % 64] */
        const int8_t *p = q + (n / 4) * 4 * K + (k / 64) * 256 + (n % 4) * 64 + k % 64;
        rows[r] = n >= N ? pairs_zero() : int16 ? i8_i16_pairs(p) : i8_bf16_pairs(p);
      }
      transpose_lanes(rows);
      for (int i = 0; i < VL; ++i) pairs_store(panel + (k / 2 + i) * BF16_NB + j0, rows[i]);
    }
}

/* Row m's VL outputs from n0: `product` rounded to the output's type, then + bias, rounded (the quantized kernels'
 * roundings, as their one-by-one stores do them). */
static inline void store_rounded(void *y, const void *bias, vf product, int64_t m, int64_t n0, int64_t N, int bf16) {
  vf v = vround(product, bf16);
  if (bias) v = vround(vadd(v, vload(at(bias, n0, bf16), bf16)), bf16);
  vstore((void *)at(y, m * N + n0, bf16), v, bf16);
}

/* Row m's outputs n0 .. n0 + valid - 1 from their sums, as i8_store does them one by one: VL at a time. */
static inline void i8_store_row(void *y, const void *bias, const float *scale, float xs, const float *sums,
                                int64_t m, int64_t n0, int64_t valid, int64_t N, int bf16) {
  int64_t j = 0;
  for (; j + VL <= valid; j += VL) {
    vf product = vmul(vmul(vset1(xs), vloadf(scale + n0 + j)), vloadf(sums + j));
    __asm__("" : "+v"(product));
    store_rounded(y, bias, product, m, n0 + j, N, bf16);
  }
  for (; j < valid; ++j) i8_store(y, bias, scale, xs, sums[j], m, n0 + j, N, bf16);
}

static uint32_t *i8_panel_alloc(int64_t K) {
  uint32_t *panel = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (size_t)(K / 2 * BF16_NB));
  if (!panel) abort();
  return panel;
}

/* Prefill-sized batches (I8_PANEL_ROWS rows and more) on AVX2 and on AVX-512 without BF16, and on AVX-512 batches of
 * I8_TILE_ROWS..I8_PANEL_ROWS - 1 rows with K <= I8_TILE_MAX_K (ps_linear_i8): the integer kernel's
 * products in a tile. Each block of BF16_NB outputs is widened once into a panel of int16 pairs, p[K / 2][BF16_NB]
 * (i8_fill_panel), and the tile runs I8_MT rows of x (i8_rows_i16) over it, one broadcast pair of int16 columns a
 * row and step, into 2 I8_MT vectors of int32 sums (i8_dot):
 * - AVX2: vpmaddwd multiplies 16 pairs and adds each pair's two products, and vpaddd adds them to the sums: a step
 *   is 2 I8_MT of each for 32 I8_MT products, where the float32 tile over widened panels took 4 I8_MT FMAs at the
 *   FMA peak (1.3-1.4x on the AVX2 build of an AMX Xeon; how much more on a Zen 3 depends on its vpmaddwd rate,
 *   unmeasured);
 * - AVX-512 VNNI: vpdpwssd does both for 32 pairs: 2 I8_MT instructions for 64 I8_MT products.
 * Exact: an int32 lane takes at most I8_FLUSH pairs (I8_FLUSH * 2 * 32767 * 128 < 2^31), then goes into int64
 * totals, so a row's sums are the exact integers the pair and block kernels give it, and its result is the one
 * it gets alone (bit for bit) whatever the batch: a prompt's prefill and its decode steps see the same linears. */
#define I8_MT 6       /* rows of x per tile: 12 sums, 2 weight registers and a broadcast (15 of AVX2's 16) */
#define I8_FLUSH 256  /* pairs of columns per int32 run */
#if PS_ISA == 512
typedef __m512i vi;
static inline vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline void vi_store(void *p, vi v) { _mm512_storeu_si512(p, v); }
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi i8_dot(vi acc, vi x, vi w) { return _mm512_dpwssd_epi32(acc, x, w); }
#else
typedef __m256i vi;
static inline vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void vi_store(void *p, vi v) { _mm256_storeu_si256((__m256i *)p, v); }
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi i8_dot(vi acc, vi x, vi w) { return dot_i16(acc, x, w); }
#endif

/* The tile of rows from m0 of x's int16 rows (i8_rows_i16) as the tile reads it, into xt[tile][K / 2][rows] pairs, so
 * a step's broadcasts come from one sequential stream. */
static void i8_tile_x(const int16_t *xq, int64_t m0, int64_t M, int64_t K, int32_t *xt) {
  const int64_t rows = M - m0 < I8_MT ? M - m0 : I8_MT;
  int32_t *t = xt + m0 * K / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const int16_t *row = xq + (m0 + r) * K;
    for (int64_t p = 0; p < K / 2; ++p) memcpy(t + p * rows + r, row + 2 * p, sizeof(int32_t));
  }
}

/* A row's pair of columns in every lane, loaded for each use where the tile broadcasts per instruction: as a plain
 * set1, GCC kept the MT broadcasts of the first weight vector for the second and spilled sums to make room. */
static inline vi i8_broadcast(const int32_t *p) {
  vi v;
  __asm__ volatile("vpbroadcastd %1, %0" : "=v"(v) : "m"(*p));
  return v;
}

#if PS_ISA == 512 || defined(__AVXVNNI__)
/* One run of at most I8_FLUSH pairs of columns for MT rows over the whole block: its I8_NW weight vectors (4 with
 * AVX512-BF16's 64-output blocks, 2 without BF16 and on AVX2) loaded once a pair of columns, each row's pair
 * broadcast once for all of them, the sums as named locals (in arrays, GCC kept half of them on the stack whatever
 * the loop's shape). AVX-512: 24 sums, 4 weights and a broadcast (29 of 32 registers); AVX-VNNI: 12, 2 and 1 (15 of
 * 16: vpdpwssd needs no register for the product). Against a broadcast per instruction (1.17 loads per vpdpwssd at
 * 4 vectors; 0.42 here): AVX-512 1.11-1.21x, AVX-VNNI build 1.14-1.33x (2 Zen 5 cores). */
#define I8_NW (BF16_NB / VL)
#define I8_ROW_ALL(r, s0, s1, s2, s3) \
  if (MT > r) { \
    const vi x = i8_broadcast(xp + r); \
    s0 = i8_dot(s0, x, w0); \
    s1 = i8_dot(s1, x, w1); \
    if (I8_NW > 2) { s2 = i8_dot(s2, x, w2); s3 = i8_dot(s3, x, w3); } \
  }
static inline __attribute__((always_inline)) void i8_gemm_run(const uint32_t *panel, const int32_t *xt, int64_t p0,
                                                              int64_t p1, const int MT, int32_t out[I8_MT][BF16_NB]) {
  vi a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5, e0, e1, e2, e3, e4, e5, f0, f1, f2, f3, f4, f5;
  a0 = a1 = a2 = a3 = a4 = a5 = b0 = b1 = b2 = b3 = b4 = b5 = vi_zero();
  e0 = e1 = e2 = e3 = e4 = e5 = f0 = f1 = f2 = f3 = f4 = f5 = vi_zero();
  for (int64_t p = p0; p < p1; ++p) {
    const int32_t *xp = xt + p * MT;
    const uint32_t *wp = panel + p * BF16_NB;
    const vi w0 = vi_load(wp), w1 = vi_load(wp + VL);
    const vi w2 = I8_NW > 2 ? vi_load(wp + 2 * VL) : w0, w3 = I8_NW > 2 ? vi_load(wp + 3 * VL) : w1;
    I8_ROW_ALL(0, a0, b0, e0, f0); I8_ROW_ALL(1, a1, b1, e1, f1); I8_ROW_ALL(2, a2, b2, e2, f2);
    I8_ROW_ALL(3, a3, b3, e3, f3); I8_ROW_ALL(4, a4, b4, e4, f4); I8_ROW_ALL(5, a5, b5, e5, f5);
  }
  const vi a[I8_MT] = {a0, a1, a2, a3, a4, a5}, b[I8_MT] = {b0, b1, b2, b3, b4, b5};
  const vi e[I8_MT] = {e0, e1, e2, e3, e4, e5}, f[I8_MT] = {f0, f1, f2, f3, f4, f5};
  for (int m = 0; m < MT; ++m) {
    vi_store(out[m], a[m]);
    vi_store(out[m] + VL, b[m]);
    if (I8_NW > 2) {
      vi_store(out[m] + 2 * VL, e[m]);
      vi_store(out[m] + 3 * VL, f[m]);
    }
  }
}
#undef I8_ROW_ALL
#else
/* Plain AVX2 (a block is 2 VL outputs): one weight vector at a time, each row's pair broadcast for every
 * instruction: 12 sums, one weight register, a broadcast and the madd's result (15 of 16). Both weight vectors at
 * once need all 16 (1.09-1.16x with GCC 12 on the Zen 5's AVX2 build, one shape 0.95x), and users compile this
 * with their own GCC, which has spilled such loops before. */
#define I8_ROW(r, acc, w) \
  if (MT > r) acc = i8_dot(acc, i8_broadcast(xp + r), w)
static inline __attribute__((always_inline)) void i8_gemm_run(const uint32_t *panel, const int32_t *xt, int64_t p0,
                                                              int64_t p1, const int MT, int32_t out[I8_MT][BF16_NB]) {
  vi a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5;
  a0 = a1 = a2 = a3 = a4 = a5 = b0 = b1 = b2 = b3 = b4 = b5 = vi_zero();
  for (int64_t p = p0; p < p1; ++p) {
    const int32_t *xp = xt + p * MT;
    const vi w0 = vi_load(panel + p * BF16_NB);
    I8_ROW(0, a0, w0); I8_ROW(1, a1, w0); I8_ROW(2, a2, w0); I8_ROW(3, a3, w0); I8_ROW(4, a4, w0); I8_ROW(5, a5, w0);
    const vi w1 = vi_load(panel + p * BF16_NB + VL);
    I8_ROW(0, b0, w1); I8_ROW(1, b1, w1); I8_ROW(2, b2, w1); I8_ROW(3, b3, w1); I8_ROW(4, b4, w1); I8_ROW(5, b5, w1);
  }
  const vi a[I8_MT] = {a0, a1, a2, a3, a4, a5}, b[I8_MT] = {b0, b1, b2, b3, b4, b5};
  for (int m = 0; m < MT; ++m) {
    vi_store(out[m], a[m]);
    vi_store(out[m] + VL, b[m]);
  }
}
#undef I8_ROW
#endif

/* i8_gemm_run for `rows` (1..I8_MT) rows, each count its own copy so the sums stay in registers (kept out of the
 * OpenMP body, where GCC spilled them). */
static __attribute__((noinline)) void i8_gemm_rows(const uint32_t *panel, const int32_t *xt, int64_t p0, int64_t p1,
                                                   int64_t rows, int32_t out[I8_MT][BF16_NB]) {
  switch (rows) {
    case 1: i8_gemm_run(panel, xt, p0, p1, 1, out); break;
    case 2: i8_gemm_run(panel, xt, p0, p1, 2, out); break;
    case 3: i8_gemm_run(panel, xt, p0, p1, 3, out); break;
    case 4: i8_gemm_run(panel, xt, p0, p1, 4, out); break;
    case 5: i8_gemm_run(panel, xt, p0, p1, 5, out); break;
    default: i8_gemm_run(panel, xt, p0, p1, I8_MT, out); break;
  }
}

static void i8_gemm(const void *x, const int8_t *q, const float *scale, const void *bias, void *y, int64_t M,
                    int64_t N, int64_t K, int bf16, int nthreads) {
  const int64_t blocks = (N + BF16_NB - 1) / BF16_NB;
  int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * K));
  float *xs = (float *)malloc(sizeof(float) * (size_t)M);
  int32_t *xt = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * K / 2));
  if (!xq || !xs || !xt) abort();
  #pragma omp parallel num_threads(nthreads)
  {
    /* x's int16 rows and their tiles, a tile of rows per thread at a time (serially they were ~2 % of prefill) */
    #pragma omp for schedule(static)
    for (int64_t m0 = 0; m0 < M; m0 += I8_MT) {
      const int64_t rows = M - m0 < I8_MT ? M - m0 : I8_MT;
      i8_rows_i16(at(x, m0 * K, bf16), rows, K, bf16, xq + m0 * K, xs + m0);
      i8_tile_x(xq, m0, M, K, xt);
    }
    uint32_t *panel = i8_panel_alloc(K);
    int64_t *total = (int64_t *)malloc(sizeof(int64_t) * (size_t)(M * BF16_NB));
    if (!total) abort();
    #pragma omp for schedule(static)
    for (int64_t nb = 0; nb < blocks; ++nb) {
      i8_fill_panel(q, nb, N, K, panel, 1);
      const int64_t valid = N - nb * BF16_NB < BF16_NB ? N - nb * BF16_NB : BF16_NB;
      /* A run of columns at a time for every tile of rows: the run's part of the panel (16 KiB) stays in L1. */
      memset(total, 0, sizeof(int64_t) * (size_t)(M * BF16_NB));
      for (int64_t p0 = 0; p0 < K / 2; p0 += I8_FLUSH) {
        const int64_t p1 = K / 2 - p0 < I8_FLUSH ? K / 2 : p0 + I8_FLUSH;
        for (int64_t m = 0; m < M; m += I8_MT) {
          const int64_t rows = M - m < I8_MT ? M - m : I8_MT;
          int32_t run[I8_MT][BF16_NB];
          i8_gemm_rows(panel, xt + m * K / 2, p0, p1, rows, run);
          for (int64_t r = 0; r < rows; ++r)
            for (int j = 0; j < BF16_NB; ++j) total[(m + r) * BF16_NB + j] += run[r][j];
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        float sums[BF16_NB];
        for (int j = 0; j < BF16_NB; ++j) sums[j] = (float)total[m * BF16_NB + j];
        i8_store_row(y, bias, scale, xs[m], sums, m, nb * BF16_NB, valid, N, bf16);
      }
    }
    free(total);
    free(panel);
  }
  free(xq);
  free(xt);
  free(xs);
}
/* Rows of the integer tile whose int16 copy stays in L2 while the panels pass over it, at least I8_PANEL_ROWS. */
static int64_t i8_gemm_chunk(int64_t K) {
  const int64_t fit = ((int64_t)256 << 10) / (2 * K) / I8_MT * I8_MT;
  return fit < I8_PANEL_ROWS ? I8_PANEL_ROWS : fit;
}
#ifdef I8_GEMM
#define i8_prefill i8_gemm
static int64_t i8_prefill_chunk(int64_t M, int64_t K) {
  (void)M;
  return i8_gemm_chunk(K);
}
#else
/* bf16 x only (ps_linear_i8 checks): the AMX tiles where granted, else the vdpbf16ps tile, over each panel;
 * before, these batches dequantized every weight in torch on each call (3.5x the bf16 linear's time). */
static void i8_panels(const void *x, const int8_t *q, const float *scale, const void *bias, void *y, int64_t M,
                      int64_t N, int64_t K, int bf16, int nthreads) {
  const uint16_t *xb = (const uint16_t *)x;
  const int64_t blocks = (N + BF16_NB - 1) / BF16_NB;
#ifdef PS_AMX
  const int amx = amx_ready && K % AMX_K == 0;
  uint16_t *tail = amx ? amx_tail(xb, M, K, 1) : NULL;  /* also for M < 16: a prefill's last chunk */
#endif
  #pragma omp parallel num_threads(nthreads)
  {
    uint32_t *panel = i8_panel_alloc(K);
    float sums[16][BF16_NB] __attribute__((aligned(64)));
#ifdef PS_AMX
    if (amx) amx_configure(16, 5);
#endif
    #pragma omp for schedule(static)
    for (int64_t nb = 0; nb < blocks; ++nb) {
      i8_fill_panel(q, nb, N, K, panel, 0);
      const int64_t valid = N - nb * BF16_NB < BF16_NB ? N - nb * BF16_NB : BF16_NB;
#ifdef PS_AMX
      if (amx) {
        for (int64_t m = 0; m < M; m += 16) {
          const int64_t rows = M - m < 16 ? M - m : 16;
          amx_block(rows == 16 ? xb + m * K : tail, K, (const uint16_t *)panel, K, sums);
          for (int64_t r = 0; r < rows; ++r)
            i8_store_row(y, bias, scale, 1.0f, sums[r], m + r, nb * BF16_NB, valid, N, bf16);
        }
        continue;
      }
#endif
      for (int64_t m = 0; m < M; m += BF16_MT) {
        const int64_t rows = M - m < BF16_MT ? M - m : BF16_MT;
        __m512 acc[BF16_MT][4];
        bf16_tile_rows((const uint16_t *)panel, xb + m * K, K, rows, acc);
        for (int64_t r = 0; r < rows; ++r) {
          for (int j = 0; j < 4; ++j) _mm512_store_ps(&sums[r][j * 16], acc[r][j]);
          i8_store_row(y, bias, scale, 1.0f, sums[r], m + r, nb * BF16_NB, valid, N, bf16);
        }
      }
    }
#ifdef PS_AMX
    if (amx) _tile_release();
#endif
    free(panel);
  }
#ifdef PS_AMX
  free(tail);
#endif
}
#endif
#ifndef I8_GEMM
#define i8_prefill i8_panels
/* Rows that stay in L2, as ps_linear_bf16's, but at least I8_PANEL_ROWS, each panel's fill paid over that many
 * (AVX2's 12-row chunks at K = 4864 made the down projection 1.3x slower). */
static int64_t i8_prefill_chunk(int64_t M, int64_t K) {
  const int64_t fit = bf16_chunk_rows(M, K);
  return fit < I8_PANEL_ROWS ? I8_PANEL_ROWS : fit;
}
#endif

#if defined(PS_AMX) && defined(__AMX_INT8__) && defined(__AVX512DQ__)
/* The integer kernel on AMX-INT8 tiles, for batches of I8_AMX_ROWS rows and more below the panels' size: TDPBUSD
 * multiplies a 16-row x 64-byte tile of unsigned bytes (a byte plane of x, as i8_prepare writes them for
 * vpdpbusd) with a tile of signed weight bytes, 16 groups of 4 columns x 16 outputs, into 16 x 16 int32 sums.
 * The products and sums are the same exact integers as vpdpbusd's, flushed at the same I8_SEGMENT, so a row's
 * result is bit for bit the one the vector kernel gives it (rows still never depend on the batch), at several
 * times its rate at larger batches (the vector kernel is compute-bound there: on the 2-core AMX Xeon, Qwen2.5-0.5B's
 * linears at 32 rows took 2.4 ms a layer, 1.1 on AMX, 0.7 for the bf16 linear on AMX) and from 2 rows on already
 * ahead of it with the weights streamed from memory (Qwen2.5-0.5B's shapes, 3-5 rows: 1.05-1.17x; 2 rows
 * 0.99-1.10x), which a speculative verification's 1 + k rows gain from.
 * Outputs come 32 at a time (two weight tiles); tiles: 0-3 the hi/lo sums of the two groups of 16 outputs,
 * 4-5 the hi/lo planes of x, 6-7 the weights. */
#define PS_AMX_I8 1
#define I8_AMX_ROWS 2
#define I8_AMX_NB 32

/* Outputs n0 .. n0 + 31 as weight tiles, b[K / 64][2][16 column groups][16 outputs][4]: each output's 64 bytes of
 * a column chunk are 16 groups of 4, so one 16 x 16 transpose of 32-bit lanes per tile (outputs past N: zeros). */
static void i8_fill_amx(const int8_t *q, int64_t n0, int64_t N, int64_t K, int8_t *b) {
  for (int64_t k = 0; k < K; k += 64)
    for (int t = 0; t < 2; ++t) {
      __m512i rows[16];
      for (int r = 0; r < 16; ++r) {
        const int64_t n = n0 + t * 16 + r;  /* q_packed[n / 4][k / 64][n % 4][k % 64] */
        rows[r] = n < N ? _mm512_loadu_si512(q + (n / 4) * 4 * K + (k / 64) * 256 + (n % 4) * 64)
                        : _mm512_setzero_si512();
      }
      transpose_lanes(rows);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(b + (k / 64) * 2048 + t * 1024 + i * 64, rows[i]);
    }
}

/* total[j] += 256 * hi[j] + lo[j] for 16 outputs: one tile row of each byte plane's sums, in 64-bit lanes. */
static inline void amx_i8_add(int64_t *total, const int32_t *hi, const int32_t *lo) {
  for (int h = 0; h < 16; h += 8) {
    const __m512i wide_hi = _mm512_cvtepi32_epi64(_mm256_loadu_si256((const __m256i *)(hi + h)));
    const __m512i wide_lo = _mm512_cvtepi32_epi64(_mm256_loadu_si256((const __m256i *)(lo + h)));
    const __m512i t = _mm512_add_epi64(_mm512_slli_epi64(wide_hi, 8), wide_lo);
    _mm512_storeu_si512(total + h, _mm512_add_epi64(_mm512_loadu_si512(total + h), t));
  }
}

/* planes: i8_prepare's hi and lo planes, with 16 rows of K bytes readable past the lo plane (the last group of
 * rows loads whole tiles; its rows past M are computed and dropped). */
static void i8_rows_amx(const int8_t *q, const uint8_t *planes, const float *xs, const float *scale,
                        const int32_t *wsum, const void *bias, void *y, int64_t M, int64_t N, int64_t K, int bf16,
                        int nthreads) {
  const uint8_t *xhi = planes, *xlo = planes + M * K;
  const int64_t blocks = (N + I8_AMX_NB - 1) / I8_AMX_NB;
  #pragma omp parallel num_threads(nthreads)
  {
    amx_configure(M < 16 ? (int)M : 16, 6);
    int8_t *b = (int8_t *)aligned_alloc(64, (size_t)(K / 64 * 2048));
    if (!b) abort();
    int32_t c[4][16][16] __attribute__((aligned(64)));
    #pragma omp for schedule(static)
    for (int64_t nb = 0; nb < blocks; ++nb) {
      const int64_t n0 = nb * I8_AMX_NB, valid = N - n0 < I8_AMX_NB ? N - n0 : I8_AMX_NB;
      const int8_t *next = n0 + 2 * I8_AMX_NB <= N ? q + (n0 + I8_AMX_NB) * K : NULL;  /* a whole next block */
      i8_fill_amx(q, n0, N, K, b);
      int64_t ws[I8_AMX_NB];  /* 256 * 128 * sum(w) per output, zeros past N */
      for (int j = 0; j < I8_AMX_NB; ++j) ws[j] = j < valid ? 32768 * (int64_t)wsum[n0 + j] : 0;
      for (int64_t m = 0; m < M; m += 16) {
        const int64_t rows = M - m < 16 ? M - m : 16;
        int64_t total[16][I8_AMX_NB] = {{0}};
        for (int64_t k0 = 0; k0 < K; k0 += I8_SEGMENT) {
          const int64_t k1 = K - k0 < I8_SEGMENT ? K : k0 + I8_SEGMENT;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t k = k0; k < k1; k += 64) {
            /* The same chunk of the next block's 8 runs of 4 rows, into L2 while this one computes: its fill
             * then no longer waits on memory (32-row decode steps of the 0.5B shape in int8 ~12 % faster;
             * a 32-row 152k-output lm_head 13-14 -> 10 ms). */
            if (m == 0 && next)
              for (int i = 0; i < 8; ++i)
                for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)(next + i * 4 * K + k * 4 + l), _MM_HINT_T1);
            _tile_loadd(4, xhi + m * K + k, K);
            _tile_loadd(5, xlo + m * K + k, K);
            _tile_loadd(6, b + k / 64 * 2048, 64);
            _tile_dpbusd(0, 4, 6);
            _tile_dpbusd(1, 5, 6);
            _tile_loadd(7, b + k / 64 * 2048 + 1024, 64);
            _tile_dpbusd(2, 4, 7);
            _tile_dpbusd(3, 5, 7);
          }
          _tile_stored(0, c[0], 64);  /* tile numbers are immediates */
          _tile_stored(1, c[1], 64);
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
          for (int64_t r = 0; r < rows; ++r) {
            amx_i8_add(total[r], c[0][r], c[1][r]);
            amx_i8_add(total[r] + 16, c[2][r], c[3][r]);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float sums[I8_AMX_NB];
          for (int j = 0; j < I8_AMX_NB; j += 8)  /* as i8_block: (float)(total - 256 * 128 * sum(w)), rounded once */
            _mm256_storeu_ps(sums + j, _mm512_cvtepi64_ps(_mm512_sub_epi64(_mm512_loadu_si512(total[r] + j),
                                                                             _mm512_loadu_si512(ws + j))));
          i8_store_row(y, bias, scale, xs[m + r], sums, m + r, n0, valid, N, bf16);
        }
      }
    }
    _tile_release();
    free(b);
  }
}
#endif

/* 1 where the AVX2 kernels' int8 sums run on AVX-VNNI (dot_i16: built with -mavxvnni, as -march=native is on a CPU
 * that has it). */
int ps_avx_vnni(void) {
#if PS_ISA == 256 && defined(__AVXVNNI__)
  return 1;
#else
  return 0;
#endif
}

/* 1 where int8 linears run their 2-63-row batches on AMX-INT8 tiles (built with them, and Linux granted AMX). */
int ps_amx_int8(void) {
#ifdef PS_AMX_I8
  return amx_ready;
#else
  return 0;
#endif
}

/* Outputs per chunk of the block loops below (and of each block of AVX2's pairs): their sums are gathered, then
 * stored a row at a time, VL at once (i8_store_row, the same roundings). One i8_store per output had cost about a
 * third of a block's time at K = 576 (SmolLM2's layers) and 5 rows. On the 2-core Zen 5, Qwen2.5-0.5B's and
 * SmolLM2's shapes: AVX-512 build 1.04-1.29x at 5 rows (weights streamed or in cache), SmolLM2's batch-5 decode
 * 1.09x; AVX2 build 1.0-1.15x at 3-5 rows, 1.05-1.17x at 9-17. Reducing the 4 rows' sums together too (unpacks
 * instead of _mm512_reduce_add_epi32) made GCC shuffle the sums between registers in the loop (2 moves per
 * vpdpbusd; 0.9x in the model): check the loop with objdump after touching i8_block. */
#define I8_CHUNK 32

/* This OpenMP thread's share of `total` items, [*first, *end): contiguous runs, as a static schedule gives them. */
static inline void thread_share(int64_t total, int64_t *first, int64_t *end) {
  const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
  *first = total * t / threads;
  *end = total * (t + 1) / threads;
}

/* 1: prefill-sized batches skip the bf16 panels for the kernels below them, whose exact integer sums give a row
 * the bits it gets alone (PAGEDSERVE_BATCH_INVARIANT, as vLLM's VLLM_BATCH_INVARIANT: greedy text that does not
 * depend on which requests share a step; 0.72-0.97x at prefill sizes on a Zen 5). Set before linears run. */
static int batch_invariant;
void ps_set_batch_invariant(int on) { batch_invariant = on != 0; }

void ps_linear_i8(const void *x, const int8_t *q, const float *scale, const int32_t *wsum, const void *bias,
                  void *y, int64_t M, int64_t N, int64_t K, int bf16, int nthreads) {
#ifdef I8_GEMM
  const int any_x = 1;  /* the integer tile takes float32 activations too (and is batch-invariant) */
#else
  const int any_x = 0;  /* the bf16 panels take bf16 ones; float32 ones dequantize in Int8Linear above 32 rows */
#endif
  if (M >= I8_PANEL_ROWS && (any_x || bf16) && !(batch_invariant && !any_x)) {  /* prefill: the tile or panels */
    const int64_t chunk = i8_prefill_chunk(M, K);
    for (int64_t m = 0; m < M; m += chunk)
      i8_prefill(at(x, m * K, bf16), q, scale, bias, (void *)at(y, m * N, bf16), M - m < chunk ? M - m : chunk, N, K,
                 bf16, nthreads);
    return;
  }
#ifdef PS_AMX_I8
  const int amx_invariant = amx_ready;  /* AMX-INT8 tiles below: the same exact sums, 1.3-1.7x the int tile's */
#else
  const int amx_invariant = 0;
#endif
  if (M >= I8_PANEL_ROWS && batch_invariant && !amx_invariant) {  /* the integer tile at every K, not the panels */
    const int64_t chunk = i8_gemm_chunk(K);
    for (int64_t m = 0; m < M; m += chunk)
      i8_gemm(at(x, m * K, bf16), q, scale, bias, (void *)at(y, m * N, bf16), M - m < chunk ? M - m : chunk, N, K,
              bf16, nthreads);
    return;
  }
#ifdef PS_AMX_I8
  const int amx = amx_ready && M >= I8_AMX_ROWS;
#else
  const int amx = 0;
#endif
#ifdef I8_TILE_ROWS
  if (!amx && M >= I8_TILE_ROWS && K <= I8_TILE_MAX_K) {  /* the integer tile: the same exact sums */
    i8_gemm(x, q, scale, bias, y, M, N, K, bf16, nthreads);
    return;
  }
#endif
  const int64_t pad = amx ? 16 * K : 0;  /* rows that the AMX tiles of the last group may load past the planes */
  uint8_t *planes = (uint8_t *)malloc((size_t)(2 * M * K + pad));
  float *xs = (float *)malloc(sizeof(float) * (size_t)M);
  if (!planes || !xs) abort();
  memset(planes + 2 * M * K, 0, (size_t)pad);
  i8_prepare(x, M, K, bf16, planes, xs);
#ifdef PS_AMX_I8
  if (amx) {
    i8_rows_amx(q, planes, xs, scale, wsum, bias, y, M, N, K, bf16, nthreads);
    free(planes);
    free(xs);
    return;
  }
#endif
  int64_t first = 0;  /* the rows before it were done in pairs of blocks */
  if (M <= I8_PAIR_ROWS && N / 4 >= I8_PAIR_MIN_BLOCKS * nthreads) {  /* block i with block i + half */
    const int64_t half = N / 8;
    #pragma omp parallel num_threads(nthreads)
    {  /* each thread a run of pairs (as a static schedule), I8_CHUNK outputs of each block at a time */
      int64_t c0, c1;
      thread_share(half, &c0, &c1);
      float *out = (float *)malloc(sizeof(float) * (size_t)(2 * M * I8_CHUNK));  /* [block of the pair][row][..] */
      if (!out) abort();
      for (; c0 < c1; c0 += I8_CHUNK / 4) {
        const int64_t e = c1 - c0 > I8_CHUNK / 4 ? c0 + I8_CHUNK / 4 : c1;
        for (int64_t i = c0; i < e; ++i) {
          const int8_t *w0 = q + i * 4 * K, *w1 = q + (i + half) * 4 * K;
          const int32_t *s0 = wsum + i * 4, *s1 = wsum + (i + half) * 4;
          const int64_t next = i + 1 < c1 ? 4 * K : 0;  /* the thread's next pair */
          const int64_t single = M == 2 ? 2 : 1;  /* rows that stream the pair one row at a time */
          float *o = out + (i - c0) * 4;
          for (int64_t m = 0; m < single; ++m) {
            const int64_t ahead = m == 1 ? next : I8_AHEAD;  /* where this row's pass prefetches */
            float acc[2][4];
            i8_block_pair(w0, w1, planes, M, m, K, s0, s1, w0 + ahead, w1 + ahead, acc);
            for (int b = 0; b < 2; ++b)
              for (int r = 0; r < 4; ++r) o[(b * M + m) * I8_CHUNK + r] = acc[b][r];
          }
          for (int64_t m = single; m < M; m += 2) {  /* the pair is in cache now: one widened weight, two rows */
            for (int b = 0; b < 2; ++b) {
              const int8_t *w = b ? w1 : w0, *ahead = m == 1 ? w + next : w;  /* the first pass fetches the next */
              float acc[4][2];
              const int C = M - m > 1 ? 2 : 1;
              if (C == 2) i8_block(w, planes, M, m, 2, b ? s1 : s0, K, ahead, acc);  /* C a constant: the sums */
              else i8_block(w, planes, M, m, 1, b ? s1 : s0, K, ahead, acc);  /* stay in registers */
              for (int c = 0; c < C; ++c)
                for (int r = 0; r < 4; ++r) o[(b * M + m + c) * I8_CHUNK + r] = acc[r][c];
            }
          }
        }
        for (int b = 0; b < 2; ++b)
          for (int64_t m = 0; m < M; ++m)
            i8_store_row(y, bias, scale, xs[m], out + (b * M + m) * I8_CHUNK, m, (c0 + b * half) * 4, (e - c0) * 4, N,
                         bf16);
      }
      free(out);
    }
    first = 8 * half;
  }
  const int64_t blocks = (N - first + 3) / 4;
  #pragma omp parallel num_threads(nthreads)
  {  /* each thread a run of blocks (as a static schedule), I8_CHUNK outputs at a time */
    int64_t c0, c1;
    thread_share(blocks, &c0, &c1);
    float *out = (float *)malloc(sizeof(float) * (size_t)(M * I8_CHUNK));  /* the chunk's sums, row by row */
    if (!out) abort();
    for (; c0 < c1; c0 += I8_CHUNK / 4) {
      const int64_t n0 = first + 4 * c0, n1 = c1 - c0 > I8_CHUNK / 4 ? n0 + I8_CHUNK : first + 4 * c1;
      for (int64_t n = n0; n < n1; n += 4) {
        const int64_t rows = N - n < 4 ? N - n : 4;
        const int8_t *w = q + n * K;
        int32_t sums[4] = {0, 0, 0, 0};
        for (int r = 0; r < rows; ++r) sums[r] = wsum[n + r];
        for (int64_t m = 0; m < M; m += 2) {
          const int two = M - m > 1;
          float acc[4][2];
          if (two) i8_block(w, planes, M, m, 2, sums, K, w + I8_AHEAD, acc);
          else i8_block(w, planes, M, m, 1, sums, K, w + I8_AHEAD, acc);
          for (int c = 0; c <= two; ++c)
            for (int r = 0; r < 4; ++r) out[(m + c) * I8_CHUNK + n - n0 + r] = acc[r][c];
        }
      }
      const int64_t valid = (n1 < N ? n1 : N) - n0;
      for (int64_t m = 0; m < M; ++m) i8_store_row(y, bias, scale, xs[m], out + m * I8_CHUNK, m, n0, valid, N, bf16);
    }
    free(out);
  }
  free(planes);
  free(xs);
}

/* ---- bf16 linear ----------------------------------------------------------------------------------- */

/* Outputs per block of the packed layout (BF16_NB), for the Python side's pack/unpack. */
int ps_bf16_block(void) { return BF16_NB; }

/* 1 where the CPU multiplies bf16 natively (AVX512-BF16): there a dense bf16 matmul beats the int8
 * kernel at prefill sizes, so int8 layers dequantize above a few rows; elsewhere the int8 kernel takes
 * every batch size (AVX2: its integer tile for prefill runs faster than the bf16 linear, where oneDNN's
 * emulated bf16 would be several times slower). */
int ps_has_bf16_dot(void) {
#ifdef __AVX512BF16__
  return 1;
#else
  return 0;
#endif
}

/* w [N, K] bf16 -> packed [ceil(N/NB), K/2, NB, 2] (rows past N are zeros): the layout bf16_rows reads,
 * written in one pass (torch's permuted copy of 2-byte pairs took ~1 s for a 0.5B model's weights), PACK_PAIRS
 * pairs of columns at a time: each output row's next 64 bytes go into a PACK_PAIRS x NB tile of the block that
 * stays in L1 until it is whole. Row by row over the whole block (a 4-byte store every NB * 4 bytes, NB times
 * over K / 2 * NB * 4 bytes) NB = 64 made the 0.5B shape's loading 0.51 s in the server, 0.34 s now. */
#define PACK_PAIRS 16
void ps_pack_bf16(const uint32_t *w, uint32_t *packed, int64_t N, int64_t K, int nthreads) {
  const int64_t blocks = (N + BF16_NB - 1) / BF16_NB, pairs = K / 2;
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t nb = 0; nb < blocks; ++nb)
    for (int64_t kp0 = 0; kp0 < pairs; kp0 += PACK_PAIRS) {
      const int64_t kp1 = pairs - kp0 < PACK_PAIRS ? pairs : kp0 + PACK_PAIRS;
      uint32_t *tile = packed + (nb * pairs + kp0) * BF16_NB;
      for (int64_t j = 0; j < BF16_NB; ++j) {
        const int64_t n = nb * BF16_NB + j;
        const uint32_t *src = w + n * pairs;
        for (int64_t kp = kp0; kp < kp1; ++kp) tile[(kp - kp0) * BF16_NB + j] = n < N ? src[kp] : 0;
      }
    }
}

/* y [M, N] = round(x [M, K] @ W^T + bias) in bf16, the bias added in float32 before the one rounding
 * (as torch's and oneDNN's bf16 linear); W packed by ps_pack_bf16. K % 16 == 0. Prefill-sized M is taken
 * in chunks of rows (bf16_chunk_rows) so that x stays in L2 while the weight blocks pass over it. */
void ps_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int64_t M, int64_t N, int64_t K, int nthreads) {
  if (M <= 0) return;
  const int64_t chunk = bf16_chunk_rows(M, K);
  for (int64_t m = 0; m < M; m += chunk)
    bf16_rows(x + m * K, w, bias, y + m * N, M - m < chunk ? M - m : chunk, N, K, nthreads);
}

/* ---- RMSNorm, optionally fused with the residual add ----------------------------------------------- */

/* For each row: h = x (+ residual, rounded); residual_out = h; then either (weight) Llama's
 * out = round(weight * round(h * rsqrt(mean(h^2) + eps))) (transformers: hidden.float() normalised, cast to the model
 * dtype, times the weight) or (gain) Gemma's out = round(h * rsqrt(mean(h^2) + eps) * gain), gain = 1 + weight in
 * float32 (transformers' Gemma norm scales in float32 and rounds once). H % 16 == 0. */
static inline void rms_norm_row(const void *xr, const void *residual, void *residual_out, const void *weight,
                                const float *gain, void *out, int64_t H, float eps, int bf16) {
  vf ss = vzero();
  for (int64_t k = 0; k < H; k += VL) {
    vf h = vload(at(xr, k, bf16), bf16);
    if (residual) {
      h = vround(vadd(h, vload(at(residual, k, bf16), bf16)), bf16);
      vstore((void *)at(residual_out, k, bf16), h, bf16);
    }
    ss = vfma(h, h, ss);
  }
  const vf inv = vset1(1.0f / sqrtf(vsum(ss) / (float)H + eps));
  const void *src = residual ? (const void *)residual_out : xr;
  for (int64_t k = 0; k < H; k += VL) {  /* element by element: out may be xr (in place) */
    const vf normed = vmul(vload(at(src, k, bf16), bf16), inv);
    const vf scaled = gain ? vmul(normed, vloadf(gain + k))
                           : vmul(vround(normed, bf16), vload(at(weight, k, bf16), bf16));
    vstore((void *)at(out, k, bf16), scaled, bf16);
  }
}

static void rms_norm_rows(const void *x, const void *residual, void *residual_out, const void *weight,
                          const float *gain, void *out, int64_t M, int64_t H, float eps, int bf16, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 1)
  for (int64_t m = 0; m < M; ++m)
    rms_norm_row(at(x, m * H, bf16), residual ? at(residual, m * H, bf16) : NULL,
                 residual ? (void *)at(residual_out, m * H, bf16) : NULL, weight, gain, (void *)at(out, m * H, bf16),
                 H, eps, bf16);
}

void ps_rms_norm(const void *x, const void *residual, void *residual_out, const void *weight, void *out,
                 int64_t M, int64_t H, float eps, int bf16, int nthreads) {
  rms_norm_rows(x, residual, residual_out, weight, NULL, out, M, H, eps, bf16, nthreads);
}

void ps_rms_norm_gain(const void *x, const void *residual, void *residual_out, const float *gain, void *out,
                      int64_t M, int64_t H, float eps, int bf16, int nthreads) {
  rms_norm_rows(x, residual, residual_out, NULL, gain, out, M, H, eps, bf16, nthreads);
}

/* ---- act(gate) * up: SiLU or GELU (tanh) ------------------------------------------------------------ */

enum { PS_ACT_SILU, PS_ACT_GELU_TANH };  /* the gates the native MLP has (weight_format.NATIVE_ACTIVATIONS' order) */

/* tanh for float32 lanes as 1 - 2 / (exp(2|y|) + 1) with y's sign: near +-1 on float32's grid there, as torch's
 * vectorised tanh (Sleef) is, so that 1 + tanh(y) cancels as it does in torch (GELU's tail); near 0 within a few
 * float32 ulps of 1 in absolute terms. */
static inline vf vtanh(vf y) {
  const vf magnitude = vsub(vset1(1.0f), vdiv(vset1(2.0f), vadd(vexp(vmul(vset1(2.0f), vabs(y))), vset1(1.0f))));
  return vcopysign(magnitude, y);
}

/* gate_up [M, 2I] (gate first) -> out [M, I] = round(round(act(gate)) * up), as transformers: act runs in float32
 * and rounds to the model dtype, then the product rounds. SiLU: g / (1 + exp(-g)). GELU, tanh approximation
 * (Gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), written as torch's
 * vectorised kernel writes it (its 1 + tanh(u) is 0 far below zero, where g / (1 + exp(-2u)) would not be: the
 * rounded results then differ in 13 % of bf16 values, against 0.6 % this way, as many as torch's own scalar tanh
 * differs from its vectorised one). I % 16 == 0. */
void ps_gate_mul(const void *gate_up, void *out, int64_t M, int64_t I, int act, int bf16, int nthreads) {
  const int64_t chunks = I / VL;
  const vf one = vset1(1.0f), half = vset1(0.5f), beta = vset1(0.7978845608028654f), kappa = vset1(0.044715f);
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t c = 0; c < M * chunks; ++c) {
    const int64_t m = c / chunks, k = (c % chunks) * VL;
    const vf g = vload(at(gate_up, m * 2 * I + k, bf16), bf16);
    const vf u = vload(at(gate_up, m * 2 * I + I + k, bf16), bf16);
    vf s;
    if (act == PS_ACT_GELU_TANH) {
      const vf inner = vmul(beta, vadd(g, vmul(kappa, vmul(vmul(g, g), g))));
      s = vmul(vmul(half, g), vadd(one, vtanh(inner)));
    } else {
      s = vdiv(g, vadd(one, vexp(vsub(vzero(), g))));
    }
    vstore((void *)at(out, m * I + k, bf16), vmul(vround(s, bf16), u), bf16);
  }
}

/* ---- rotary embedding + KV write ------------------------------------------------------------------- */

/* An 8-bit KV pool (--kv-cache-dtype fp8*): each (slot, KV head) row of D fp8 values has a scale in the activation
 * dtype at scale[slot * Hkv + head] (amax / the format's largest value, layers/attention.LayerKVCache). FP8_NONE:
 * the pool holds the activation dtype. The attention reads such rows as value x scale rounded to the activation
 * dtype (the K/V the torch path gathers) into its widened or paired copies of rows, and from there runs as over a
 * 16/32-bit pool holding those values (vdpbf16ps where it is chosen): the same outputs, bit for bit. */
enum { FP8_NONE, FP8_E4M3, FP8_E5M2 };
#define KV_BYTES(fp8, bf16) ((fp8) ? 1 : (bf16) ? 2 : 4)

/* One (slot, KV head) row of D values x (the activation dtype) into an 8-bit pool as LayerKVCache.write stores it:
 * scale = max(amax / the format's largest value, 1e-12) in float32, kept rounded to the activation dtype at
 * scale[index]; the bytes x / scale (a float32 division) converted as torch converts them (vstore_fp8). */
static void fp8_row(const void *x, int64_t D, int bf16, int fp8, uint8_t *out, void *scale, int64_t index) {
  vf m = vzero();
  for (int64_t i = 0; i < D; i += VL) m = vmax(m, vabs(vload(at(x, i, bf16), bf16)));
  float s = vmaxr(m) / (fp8 == FP8_E4M3 ? 448.0f : 57344.0f);
  s = s < 1e-12f ? 1e-12f : s;
  store1(scale, index, scalar_round(s, bf16), bf16);
  const vf by = vset1(s);
  for (int64_t i = 0; i < D; i += VL) vstore_fp8(out + i, vdiv(vload(at(x, i, bf16), bf16), by), fp8 == FP8_E4M3);
}

/* qkv [T, Hq + 2 Hkv, D] (a fresh projection output): rotate the Hq query and Hkv key heads in place,
 * then copy each token's (rotated) K and its V into the pool at slots[t]. cos/sin [T, D] in the
 * activation dtype, or NULL for a layer without rotary (SmolLM3's NoPE layers: K written as projected).
 * Rounding as transformers: round(round(x * cos) + round(rotate_half(x) * sin)).
 * q_norm/k_norm [D] (per-head norms; NULL: none): each query / key head is first normalised in place as RMSNorm
 * does (rms_norm_row, `eps`), as transformers norms them before rotary: Qwen3's with Llama's rounding (weights in the
 * model dtype), or with `norm_gain` Gemma 3's (float32 gains 1 + weight, one rounding). D % 32 == 0. An 8-bit pool
 * (fp8; FP8_NONE's comment) takes each K/V row quantized over its own scale (fp8_row) into k_scale/v_scale. */
void ps_rope_kv_write(void *qkv, const void *cos, const void *sin, void *k_cache, void *v_cache, void *k_scale,
                      void *v_scale, int fp8, const int64_t *slots, const void *q_norm, const void *k_norm,
                      int norm_gain, float eps, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int bf16,
                      int nthreads) {
  const int64_t H = Hq + 2 * Hkv, half = D / 2, rotated = Hq + Hkv;
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 4)
  for (int64_t t = 0; t < T; ++t) {
    const void *c = cos ? at(cos, t * D, bf16) : NULL, *sn = sin ? at(sin, t * D, bf16) : NULL;
    for (int64_t h = 0; h < rotated; ++h) {
      void *x = (void *)at(qkv, (t * H + h) * D, bf16);
      const void *norm = h < Hq ? q_norm : k_norm;
      if (norm) rms_norm_row(x, NULL, NULL, norm_gain ? NULL : norm, norm_gain ? (const float *)norm : NULL, x, D,
                             eps, bf16);
      for (int64_t i = 0; c && i < half; i += VL) {
        const vf x1 = vload(at(x, i, bf16), bf16), x2 = vload(at(x, half + i, bf16), bf16);
        const vf c1 = vload(at(c, i, bf16), bf16), c2 = vload(at(c, half + i, bf16), bf16);
        const vf s1 = vload(at(sn, i, bf16), bf16), s2 = vload(at(sn, half + i, bf16), bf16);
        const vf neg_x2 = vsub(vzero(), x2);
        const vf o1 = vadd(vround(vmul(x1, c1), bf16), vround(vmul(neg_x2, s1), bf16));
        const vf o2 = vadd(vround(vmul(x2, c2), bf16), vround(vmul(x1, s2), bf16));
        vstore((void *)at(x, i, bf16), o1, bf16);
        vstore((void *)at(x, half + i, bf16), o2, bf16);
      }
    }
    const size_t row = (size_t)(Hkv * D) * (bf16 ? 2 : 4);
    if (fp8) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t index = slots[t] * Hkv + h;
        fp8_row(at(qkv, (t * H + Hq + h) * D, bf16), D, bf16, fp8, (uint8_t *)k_cache + index * D, k_scale, index);
        fp8_row(at(qkv, (t * H + Hq + Hkv + h) * D, bf16), D, bf16, fp8, (uint8_t *)v_cache + index * D, v_scale,
                index);
      }
      continue;
    }
    memcpy((void *)at(k_cache, slots[t] * Hkv * D, bf16), at(qkv, (t * H + Hq) * D, bf16), row);
    memcpy((void *)at(v_cache, slots[t] * Hkv * D, bf16), at(qkv, (t * H + Hq + Hkv) * D, bf16), row);
  }
}

/* ---- paged attention for decode tokens -------------------------------------------------------------- */

#define MAX_HEAD_VECS (256 / VL)  /* D <= 256 */

/* acc[0..D) = sum over l < len of weights[l] * V[slot[l], kvh]; NV = D / VL constant when inlined, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void weighted_sum(const float *weights, int64_t len, const void *v_cache,
                                                               const int64_t *slot, int64_t Hkv, int64_t kvh,
                                                               int64_t D, int bf16, float *acc, const int NV,
                                                               int resume) {
  vf a[MAX_HEAD_VECS];  /* resume: go on from the sums in acc (a later chunk of positions), in the same order */
  for (int i = 0; i < NV; ++i) a[i] = resume ? vloadf(acc + i * VL) : vzero();
  for (int64_t l = 0; l < len; ++l) {
    const void *vp = at(v_cache, (slot[l] * Hkv + kvh) * D, bf16);
    const vf w = vset1(weights[l]);
    for (int i = 0; i < NV; ++i) a[i] = vfma(w, vload(at(vp, i * VL, bf16), bf16), a[i]);
  }
  for (int i = 0; i < NV; ++i) vstoref(acc + i * VL, a[i]);
}

static void weighted_sum_any(const float *weights, int64_t len, const void *v_cache, const int64_t *slot,
                             int64_t Hkv, int64_t kvh, int64_t D, int bf16, float *acc, int resume) {
  for (int64_t i = 0; i < D; i += VL) {
    vf a = resume ? vloadf(acc + i) : vzero();
    for (int64_t l = 0; l < len; ++l)
      a = vfma(vset1(weights[l]), vload(at(v_cache, (slot[l] * Hkv + kvh) * D + i, bf16), bf16), a);
    vstoref(acc + i, a);
  }
}

/* weighted_sum for any D; the common head sizes keep their accumulators in registers (D = 256 on AVX2 as two
 * slices of 128 lanes, each lane's sum the same). */
#define SUM_SLICE (PS_ISA == 512 ? 256 : 128)
static void weighted_sum_d(const float *weights, int64_t len, const void *v_cache, const int64_t *slot, int64_t Hkv,
                           int64_t kvh, int64_t D, int bf16, float *acc, int resume) {
  switch (D) {
    case 64: weighted_sum(weights, len, v_cache, slot, Hkv, kvh, D, bf16, acc, 64 / VL, resume); break;
    case 128: weighted_sum(weights, len, v_cache, slot, Hkv, kvh, D, bf16, acc, 128 / VL, resume); break;
    case 256:
      for (int64_t i = 0; i < D; i += SUM_SLICE)
        weighted_sum(weights, len, at(v_cache, i, bf16), slot, Hkv, kvh, D, bf16, acc + i, SUM_SLICE / VL, resume);
      break;
    default: weighted_sum_any(weights, len, v_cache, slot, Hkv, kvh, D, bf16, acc, resume); break;
  }
}

/* scores s[0..len) = scale * q . K[slot[l], kvh] and their maximum. VL positions at a time: their VL
 * dot products are summed horizontally in one go (vhsum_lanes). */
static float attention_scores(const vf *qv, int64_t nv, const void *k_cache, const int64_t *slot, int64_t len,
                              int64_t Hkv, int64_t kvh, int64_t D, float scale, int bf16, float *s) {
  vf mxv = vset1(-INFINITY);
  int64_t l0 = 0;
  for (; l0 + VL <= len; l0 += VL) {
    vf d[VL];
    for (int j = 0; j < VL; ++j) {
      const void *kp = at(k_cache, (slot[l0 + j] * Hkv + kvh) * D, bf16);
      d[j] = vmul(qv[0], vload(kp, bf16));
      for (int64_t i = 1; i < nv; ++i) d[j] = vfma(qv[i], vload(at(kp, i * VL, bf16), bf16), d[j]);
    }
    const vf block = vmul(vhsum_lanes(d), vset1(scale));
    vstoref(s + l0, block);
    mxv = vmax(mxv, block);
  }
  float mx = vmaxr(mxv);
  for (int64_t l = l0; l < len; ++l) {
    const void *kp = at(k_cache, (slot[l] * Hkv + kvh) * D, bf16);
    vf d = vzero();
    for (int64_t i = 0; i < nv; ++i) d = vfma(qv[i], vload(at(kp, i * VL, bf16), bf16), d);
    s[l] = vsum(d) * scale;
    mx = s[l] > mx ? s[l] : mx;
  }
  return mx;
}

/* attention_scores over widened rows [n, D] (float32, contiguous), NV = D / VL constant when inlined: the same
 * operations in the same order (so the same scores), without the slot lookups and dtype branches. */
static inline __attribute__((always_inline)) float row_scores(const vf *qv, const float *rows, int64_t n, float scale,
                                                              float *s, const int NV) {
  vf mxv = vset1(-INFINITY);
  int64_t l0 = 0;
  for (; l0 + VL <= n; l0 += VL) {
    vf d[VL];
    for (int j = 0; j < VL; ++j) {
      const float *kp = rows + (l0 + j) * NV * VL;
      d[j] = vmul(qv[0], vloadf(kp));
      for (int i = 1; i < NV; ++i) d[j] = vfma(qv[i], vloadf(kp + i * VL), d[j]);
    }
    const vf block = vmul(vhsum_lanes(d), vset1(scale));
    vstoref(s + l0, block);
    mxv = vmax(mxv, block);
  }
  float mx = vmaxr(mxv);
  for (int64_t l = l0; l < n; ++l) {
    const float *kp = rows + l * NV * VL;
    vf d = vzero();
    for (int i = 0; i < NV; ++i) d = vfma(qv[i], vloadf(kp + i * VL), d);
    s[l] = vsum(d) * scale;
    mx = s[l] > mx ? s[l] : mx;
  }
  return mx;
}

#if PS_ISA == 512 && defined(__AVX512BF16__)
/* Scores of bf16 K rows by vdpbf16ps: each instruction multiplies 32 bf16 pairs of q and a K row and adds
 * them into 16 float32 lanes, so a row of D = 64 takes 2 instructions instead of 4 FMAs on rows widened to
 * float32 first, and K is not widened at all (only copied, for the heads of a group to share). The products
 * are exact in float32 either way; the lane sums round in another order than the FMA path's, so every
 * path that scores bf16 K rows of D % 32 == 0 takes this one where bf16_dot_attention (below) is on:
 * decode rows, runs, prefill rows and heads alone all keep the same bits.
 * s[0..n) = scale * q . row(l) with row(l) at cache + (slot[l] * Hkv + kvh) * D; NP = D / 32 constant
 * when inlined. VL positions at a time, summed horizontally as row_scores does. */
#define BF16_DOT_SCORES 1
static inline __m512bh bf16_pairs(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
static inline __attribute__((always_inline)) float dot_scores_np(const uint16_t *q, const uint16_t *cache,
                                                                 const int64_t *slot, int64_t n, int64_t Hkv,
                                                                 int64_t kvh, int64_t D, float scale, float *s,
                                                                 const int NP) {
#define DOT_ROW(l) (slot ? cache + (slot[l] * Hkv + kvh) * D : cache + (l) * D)  /* slot NULL: rows [n, D] */
  __m512bh qp[MAX_HEAD_VECS / 2];
  for (int i = 0; i < NP; ++i) qp[i] = bf16_pairs(q + i * 32);
  vf mxv = vset1(-INFINITY);
  int64_t l0 = 0;
  for (; l0 + VL <= n; l0 += VL) {
    vf d[VL];
    for (int j = 0; j < VL; ++j) {
      const uint16_t *kp = DOT_ROW(l0 + j);
      d[j] = _mm512_dpbf16_ps(vzero(), qp[0], bf16_pairs(kp));
      for (int i = 1; i < NP; ++i) d[j] = _mm512_dpbf16_ps(d[j], qp[i], bf16_pairs(kp + i * 32));
    }
    const vf block = vmul(vhsum_lanes(d), vset1(scale));
    vstoref(s + l0, block);
    mxv = vmax(mxv, block);
  }
  float mx = vmaxr(mxv);
  for (int64_t l = l0; l < n; ++l) {
    const uint16_t *kp = DOT_ROW(l);
    vf d = _mm512_dpbf16_ps(vzero(), qp[0], bf16_pairs(kp));
    for (int i = 1; i < NP; ++i) d = _mm512_dpbf16_ps(d, qp[i], bf16_pairs(kp + i * 32));
    s[l] = vsum(d) * scale;
    mx = s[l] > mx ? s[l] : mx;
  }
  return mx;
#undef DOT_ROW
}

/* dot_scores_np for any D % 32 == 0; slot NULL: the rows are contiguous (a chunk copied for a group). */
static float dot_scores(const uint16_t *q, const uint16_t *cache, const int64_t *slot, int64_t n, int64_t Hkv,
                        int64_t kvh, int64_t D, float scale, float *s) {
  if (!slot) {
    switch (D) {
      case 64: return dot_scores_np(q, cache, NULL, n, 1, 0, D, scale, s, 2);
      case 128: return dot_scores_np(q, cache, NULL, n, 1, 0, D, scale, s, 4);
      default: return dot_scores_np(q, cache, NULL, n, 1, 0, D, scale, s, (int)(D / 32));
    }
  }
  switch (D) {
    case 64: return dot_scores_np(q, cache, slot, n, Hkv, kvh, D, scale, s, 2);
    case 128: return dot_scores_np(q, cache, slot, n, Hkv, kvh, D, scale, s, 4);
    default: return dot_scores_np(q, cache, slot, n, Hkv, kvh, D, scale, s, (int)(D / 32));
  }
}

/* n weights (float32 values that bf16 holds exactly: softmax_weights rounded them) as bf16 pairs
 * (w[2p], w[2p + 1]) in out[p], a missing second one 0; n <= 64. */
static inline void weight_pairs(const float *w, int64_t n, uint32_t *out) {
  for (int64_t k = 0; k < n; k += 32) {
    const int64_t m = n - k;
    const __mmask16 lo = m >= 16 ? 0xFFFF : (__mmask16)((1u << m) - 1);
    const __mmask16 hi = m >= 32 ? 0xFFFF : m <= 16 ? 0 : (__mmask16)((1u << (m - 16)) - 1);
    const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, w + k + 16), _mm512_maskz_loadu_ps(lo, w + k));
    _mm512_storeu_si512((void *)(out + k / 2), (__m512i)pairs);
  }
}
#else
#define BF16_DOT_SCORES 0
#endif

/* 1: bf16 attention by vdpbf16ps where the build has it (above), 0: by float32 FMAs on widened rows as on other
 * CPUs. The instruction's cost is the CPU's: 1.2-1.55x a layer on a Zen 5, 0.81-0.93x on an Intel Xeon with AMX
 * (benchmarks/RESULTS.md), so the caller chooses per CPU (memory/probe.bf16_attention_by_dot) before attention runs;
 * every attention path reads it in attend_rows, so they keep the same bits whichever it is. Returns the state. */
static int bf16_dot_attention = BF16_DOT_SCORES;
int ps_set_bf16_attention(int on) { return bf16_dot_attention = BF16_DOT_SCORES && on != 0; }

/* s[l] = exp(s[l] - mx) in place; returns 1 / sum. As torch's CPU flash attention: the weights meet V
 * rounded to the activation dtype and still unnormalised; the float32 sum of the unrounded ones
 * divides at the end. With `normalized` (capped scores in bf16: transformers' eager attention, which Gemma 2 runs)
 * the weights are normalised first, exp * (1 / sum) rounded to bf16 as its softmax in float32 cast back gives them,
 * and 1 is returned. */
static float softmax_weights(float *s, int64_t len, float mx, int bf16, int normalized) {
  vf sum = vzero();
  int64_t l = 0;
  for (; l + VL <= len; l += VL) {
    const vf e = vexp(vsub(vloadf(s + l), vset1(mx)));
    vstoref(s + l, e);
    sum = vadd(sum, e);
  }
  if (l < len) {
    const vf e = vkeep(vexp(vsub(vloadf_part(s + l, len - l), vset1(mx))), len - l);
    vstoref_part(s + l, e, len - l);
    sum = vadd(sum, e);
  }
  const float inv_sum = 1.0f / vsum(sum);
  if (bf16) {
    const vf by = vset1(normalized ? inv_sum : 1.0f);
    int64_t l2 = 0;
    for (; l2 + VL <= len; l2 += VL) vstoref(s + l2, vround(vmul(vloadf(s + l2), by), 1));
    if (l2 < len) vstoref_part(s + l2, vround(vmul(vloadf_part(s + l2, len - l2), by), 1), len - l2);
  }
  return bf16 && normalized ? 1.0f : inv_sum;
}

/* Positions per chunk that the query heads of one KV head share (grouped-query attention): a chunk's K (then
 * V) rows are read from the pool and widened to float32 once (K copied as bf16 for dot_scores), into a buffer
 * every head of the group then reads from L1, instead of each head gathering and widening them again (7 heads
 * per KV head in Qwen2.5-0.5B).
 * A multiple of VL, so that each position takes the same path through attention_scores (a VL-position
 * block or the tail) as without chunks, and every sum keeps its order: the results are bit-identical. */
#define ATTN_CHUNK 64

/* Rows prefetched ahead of widen_rows. The pool is read once a step, from memory, in pieces of one head's row
 * (128 bytes at D = 64) a slot apart: latency-bound. The prefetches run on past the chunk's end into the next
 * chunk's rows (avail), so that they are in flight while the chunk is scored. Against 16 rows ahead within the
 * chunk (2 threads of a Zen 5, KV from memory, 1500 positions): 1.6x (9/3 heads) and 1.5x (14/2) a layer at
 * batch 1, 1.15x for a 5-row verification; the AVX2 build alike. */
#define ATTN_AHEAD 64

/* The lanes [h0, h1) of a slot's row, of `size` bytes each (prefetch_row: all D of them). */
static inline __attribute__((always_inline)) void prefetch_lanes(const void *cache, int64_t slot, int64_t Hkv,
                                                                  int64_t kvh, int64_t D, int64_t h0, int64_t h1,
                                                                  int size) {
  const char *p = (const char *)cache + (slot * Hkv + kvh) * D * size;
  for (int64_t b = h0 * size; b < h1 * size; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

static void prefetch_row(const void *cache, int64_t slot, int64_t Hkv, int64_t kvh, int64_t D, int size) {
  prefetch_lanes(cache, slot, Hkv, kvh, D, 0, D, size);
}

/* An 8-bit pool's row factor: its scale, with e4m3's 2^-8 (fp8_half) undone (one exact power of two). */
static inline vf fp8_factor(const void *scale, int64_t row, int bf16, int fp8) {
  return vset1(load1(scale, row, bf16) * (fp8 == FP8_E4M3 ? 256.0f : 1.0f));
}

/* An fp8 value x its scale rounded to bf16 (fp8_bf16: as bits; fp8_round: and back). Where the CPU has AVX512-BF16
 * by its conversion instruction: it flushes float32 subnormals, which to_bf16 keeps, but these products are 2e-15
 * or more (e4m3's least value 2^-9 x the least scale 1e-12). With to_bf16 an fp8 pool's attention ran 0.54-0.82x a
 * bf16 pool's, with it 0.76-0.94x (2 Zen 4 threads, 14/2 heads of 64, 1000-4000 positions, 1 and 6 rows). */
#if PS_ISA == 512 && defined(__AVX512BF16__)
static inline __m256i fp8_bf16(vf v) { return (__m256i)_mm512_cvtneps_pbh(v); }
static inline vf fp8_round(vf v, int bf16) { return bf16 ? vbf16(fp8_bf16(v)) : v; }
#else
static inline vf fp8_round(vf v, int bf16) { return vround(v, bf16); }
#endif

/* Widen the lanes [h0, h1) of rows 0 .. n - 1 of slot[] to float32 (or copy them as they are: `copy`, bf16 rows for
 * dot_scores), at their places in rows of D; rows up to avail (> n) are the context's next ones, whose lanes are
 * prefetched ATTN_AHEAD on. An 8-bit pool's (`fp8`) as value x its row's scale rounded to the activation dtype
 * (FP8_NONE's comment), also where they are copied as bf16: a 16-bit pool's rows of those values. widen_rows:
 * all D lanes; attend_split's threads each take some lanes of the same rows. widen_rows stays a function of its
 * own with the lanes fixed: inlined into attend_rows with variable lanes, the attention ran 4-7 % slower a layer
 * (native build, Zen 4). */
static inline __attribute__((always_inline)) void widen_lanes(const void *cache, const int64_t *slot, int64_t n,
                                                               int64_t avail, int64_t Hkv, int64_t kvh, int64_t D,
                                                               int64_t h0, int64_t h1, int bf16, int copy,
                                                               const void *scale, int fp8, float *rows) {
  for (int64_t l = 0; l < n; ++l) {
    if (l + ATTN_AHEAD < avail) prefetch_lanes(cache, slot[l + ATTN_AHEAD], Hkv, kvh, D, h0, h1, KV_BYTES(fp8, bf16));
    const int64_t row = slot[l] * Hkv + kvh;
    const void *p = at(cache, row * D, bf16);
    if (fp8) {
      const vf by = fp8_factor(scale, row, bf16, fp8);
      const uint8_t *p8 = (const uint8_t *)cache + row * D;
      for (int64_t i = h0; i < h1; i += VL) {
        const vf v = vmul(vfp8(p8 + i, fp8 == FP8_E4M3), by);
#if PS_ISA == 512 && defined(__AVX512BF16__)
        if (copy)  /* (dot_scores' bf16 rows: only where the CPU has AVX512-BF16) */
          _mm256_storeu_si256((__m256i *)((uint16_t *)(rows + l * (D / 2)) + i), fp8_bf16(v));
        else
#endif
          vstoref(rows + l * D + i, fp8_round(v, bf16));
      }
    } else if (copy)  /* bf16 rows (D % 32 == 0), moved as float32 vectors of pairs */
      for (int64_t i = h0 / 2; i < h1 / 2; i += VL) vstoref(rows + l * (D / 2) + i, vloadf((const float *)p + i));
    else
      for (int64_t i = h0; i < h1; i += VL) vstoref(rows + l * D + i, vload(at(p, i, bf16), bf16));
  }
}

static void widen_rows(const void *cache, const int64_t *slot, int64_t n, int64_t avail, int64_t Hkv, int64_t kvh,
                       int64_t D, int bf16, int copy, const void *scale, int fp8, float *rows) {
  widen_lanes(cache, slot, n, avail, Hkv, kvh, D, 0, D, bf16, copy, scale, fp8, rows);
}

#if BF16_DOT_SCORES
/* vpermt2w indices that pair two rows x, y of bf16 for vdpbf16ps: (x[d], y[d]) as one 32-bit lane, for d 0-15
 * (idx[0]) and 16-31 (idx[1]) of 32 values. */
static inline void pair_index(__m512i idx[2]) {
  int16_t lanes[2][32];
  for (int k = 0; k < 32; ++k) {
    lanes[0][k] = (int16_t)(k / 2 + (k % 2) * 32);
    lanes[1][k] = (int16_t)(16 + k / 2 + (k % 2) * 32);
  }
  idx[0] = _mm512_loadu_si512((const void *)lanes[0]);
  idx[1] = _mm512_loadu_si512((const void *)lanes[1]);
}

/* V rows 0 .. n - 1 of slot[] as pairs of rows for vdpbf16ps: pair p holds, for each d, (V[2p][d], V[2p + 1][d])
 * (0 past row n - 1) as one 32-bit lane, D lanes in order (so D / 16 vectors a pair, as a float32 row has); the
 * lanes [h0, h1) only (multiples of 32), prefetching as widen_lanes. pair_rows: all D lanes, as widen_rows. An 8-bit
 * pool's rows (`fp8`) as bf16 value x scale, as widen_lanes copies them. */
static inline __m512i fp8_bf16s(const uint8_t *p, vf by, int fp8) {  /* 32 of them */
  return _mm512_inserti64x4(_mm512_castsi256_si512(fp8_bf16(vmul(vfp8(p, fp8 == FP8_E4M3), by))),
                            fp8_bf16(vmul(vfp8(p + 16, fp8 == FP8_E4M3), by)), 1);
}

static inline __attribute__((always_inline)) void pair_lanes(const void *cache, const int64_t *slot, int64_t n,
                                                              int64_t avail, int64_t Hkv, int64_t kvh, int64_t D,
                                                              int64_t h0, int64_t h1, const void *scale, int fp8,
                                                              float *rows) {
  __m512i idx[2];
  pair_index(idx);
  for (int64_t l = 0; l < n; l += 2) {
    for (int64_t j = l; j < l + 2; ++j)
      if (j + ATTN_AHEAD < avail) prefetch_lanes(cache, slot[j + ATTN_AHEAD], Hkv, kvh, D, h0, h1, KV_BYTES(fp8, 1));
    const int64_t ra = slot[l] * Hkv + kvh, rb = l + 1 < n ? slot[l + 1] * Hkv + kvh : -1;
    const uint16_t *a = (const uint16_t *)cache + ra * D;
    const uint16_t *b = rb >= 0 ? (const uint16_t *)cache + rb * D : NULL;
    const vf by_a = fp8 ? fp8_factor(scale, ra, 1, fp8) : vzero();
    const vf by_b = fp8 && b ? fp8_factor(scale, rb, 1, fp8) : by_a;
    uint16_t *out = (uint16_t *)(rows + (l / 2) * D);
    for (int64_t h = h0; h < h1; h += 32) {
      const __m512i x = fp8 ? fp8_bf16s((const uint8_t *)cache + ra * D + h, by_a, fp8)
                            : _mm512_loadu_si512((const void *)(a + h));
      const __m512i y = !b ? _mm512_setzero_si512()
                           : fp8 ? fp8_bf16s((const uint8_t *)cache + rb * D + h, by_b, fp8)
                                 : _mm512_loadu_si512((const void *)(b + h));
      _mm512_storeu_si512((void *)(out + 2 * h), _mm512_permutex2var_epi16(x, idx[0], y));
      _mm512_storeu_si512((void *)(out + 2 * h + 32), _mm512_permutex2var_epi16(x, idx[1], y));
    }
  }
}

static void pair_rows(const void *cache, const int64_t *slot, int64_t n, int64_t avail, int64_t Hkv, int64_t kvh,
                      int64_t D, const void *scale, int fp8, float *rows) {
  pair_lanes(cache, slot, n, avail, Hkv, kvh, D, 0, D, scale, fp8, rows);
}

/* One head's weighted sums straight from the pool (no group or run to share a copy with): the operations of
 * weighted_sum_group's pairs (G = 1) over chunks of ATTN_CHUNK positions, the rows paired in registers. */
static inline __attribute__((always_inline)) void pool_pair_sums_nv(const float *w, int64_t len, const void *v_cache,
                                                                    const int64_t *slot, int64_t Hkv, int64_t kvh,
                                                                    int64_t D, float *acc, const int NV) {
  __m512i idx[2];
  pair_index(idx);
  vf a[MAX_HEAD_VECS];
  for (int i = 0; i < NV; ++i) a[i] = vzero();
  for (int64_t c0 = 0; c0 < len; c0 += ATTN_CHUNK) {
    const int64_t n = len - c0 < ATTN_CHUNK ? len - c0 : ATTN_CHUNK;
    uint32_t wp[ATTN_CHUNK / 2];
    weight_pairs(w + c0, n, wp);
    for (int64_t l = 0; l < n; l += 2) {
      if (c0 + l + ATTN_AHEAD < len) prefetch_row(v_cache, slot[c0 + l + ATTN_AHEAD], Hkv, kvh, D, 2);
      if (c0 + l + 1 + ATTN_AHEAD < len) prefetch_row(v_cache, slot[c0 + l + 1 + ATTN_AHEAD], Hkv, kvh, D, 2);
      const uint16_t *x = (const uint16_t *)v_cache + (slot[c0 + l] * Hkv + kvh) * D;
      const uint16_t *y = l + 1 < n ? (const uint16_t *)v_cache + (slot[c0 + l + 1] * Hkv + kvh) * D : NULL;
      const __m512bh wg = (__m512bh)_mm512_set1_epi32((int)wp[l / 2]);
      for (int i = 0; i < NV; i += 2) {
        const __m512i xv = _mm512_loadu_si512((const void *)(x + i * 16));
        const __m512i yv = y ? _mm512_loadu_si512((const void *)(y + i * 16)) : _mm512_setzero_si512();
        a[i] = _mm512_dpbf16_ps(a[i], wg, (__m512bh)_mm512_permutex2var_epi16(xv, idx[0], yv));
        a[i + 1] = _mm512_dpbf16_ps(a[i + 1], wg, (__m512bh)_mm512_permutex2var_epi16(xv, idx[1], yv));
      }
    }
  }
  for (int i = 0; i < NV; ++i) vstoref(acc + i * VL, a[i]);
}

static void pool_pair_sums(const float *w, int64_t len, const void *v_cache, const int64_t *slot, int64_t Hkv,
                           int64_t kvh, int64_t D, float *acc) {
  if (D == 64)
    pool_pair_sums_nv(w, len, v_cache, slot, Hkv, kvh, D, acc, 64 / VL);
  else if (D == 128)
    pool_pair_sums_nv(w, len, v_cache, slot, Hkv, kvh, D, acc, 128 / VL);
  else
    pool_pair_sums_nv(w, len, v_cache, slot, Hkv, kvh, D, acc, 256 / VL);
}
#endif

/* The weighted sums of G query heads at once over widened rows [n, D] (float32, contiguous): head g's
 * acc[g * D ..] (+)= sum over l of w[g * w_stride + l] * rows[l], for NV vectors of each row. Each row is loaded once
 * for the G heads, and the G * NV accumulators are independent chains (one head's NV = 4 on AVX-512 at D = 64 wait
 * on the FMA latency); each head still sums over l in weighted_sum's order, so its result is the same.
 * The row's NV vectors are held in registers beside the sums (ROW_HELD): left to itself GCC folds the row's loads
 * into every FMA, G loads per vector, and the loop waited on loads (2 Zen 5 cores, KV from memory, a 6-row
 * verification: 9/3 heads of 64 1.15x, 12/2 and 32/8 of 128 1.15-1.18x a layer; one row up to 1.07x). */
#define VREGS (PS_ISA == 512 ? 32 : 16)  /* vector registers */
#define ROW_HELD(G, NV) ((G) > 1 && ((G) + 1) * (NV) + 1 <= VREGS)  /* sums, the row and a weight fit */
#define MAX_GROUP 7
static inline __attribute__((always_inline)) void weighted_sum_group(const float *w, int64_t w_stride, int64_t n,
                                                                     const float *rows, int64_t D, float *acc,
                                                                     const int NV, const int G, int resume,
                                                                     const int DOT) {
  vf a[MAX_GROUP][MAX_HEAD_VECS];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = resume ? vloadf(acc + g * D + i * VL) : vzero();
#if BF16_DOT_SCORES
  if (DOT) {  /* rows: pairs of positions (pair_rows); each head's weights as bf16 pairs */
    uint32_t wp[MAX_GROUP][ATTN_CHUNK / 2];
    for (int g = 0; g < G; ++g) weight_pairs(w + g * w_stride, n, wp[g]);
    for (int64_t p = 0; p < (n + 1) / 2; ++p) {
      __m512bh v[MAX_HEAD_VECS];
      for (int i = 0; i < NV; ++i) {
        v[i] = bf16_pairs((const uint16_t *)(rows + p * D + i * VL));
        if (ROW_HELD(G, NV)) __asm__("" : "+v"(v[i]));
      }
      for (int g = 0; g < G; ++g) {
        const __m512bh wg = (__m512bh)_mm512_set1_epi32((int)wp[g][p]);
        for (int i = 0; i < NV; ++i) a[g][i] = _mm512_dpbf16_ps(a[g][i], wg, v[i]);
      }
    }
  } else
#endif
  for (int64_t l = 0; l < n; ++l) {
    vf v[MAX_HEAD_VECS];
    for (int i = 0; i < NV; ++i) {
      v[i] = vloadf(rows + l * D + i * VL);
      if (ROW_HELD(G, NV)) __asm__("" : "+x"(v[i]));
    }
    for (int g = 0; g < G; ++g) {
      const vf wg = vset1(w[g * w_stride + l]);
      for (int i = 0; i < NV; ++i) a[g][i] = vfma(wg, v[i], a[g][i]);
    }
  }
  (void)DOT;
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) vstoref(acc + g * D + i * VL, a[g][i]);
}

/* weighted_sum_group over `group` heads, `most` at a time, the parts as even as they go, over slices of NVT of the
 * row's NV vectors (each slice's sums are those lanes' own: the same result). */
static inline __attribute__((always_inline)) void weighted_sums_sliced(const float *w, int64_t w_stride, int64_t n,
                                                                       const float *rows, int64_t D, float *acc,
                                                                       int64_t group, int resume, const int NV,
                                                                       const int NVT, int most, const int DOT) {
  most = most < 1 ? 1 : (most > MAX_GROUP ? MAX_GROUP : most);
  const int64_t parts = (group + most - 1) / most;
  for (int i0 = 0; i0 < NV; i0 += NVT)
    for (int64_t g = 0, p = 0; g < group; ++p) {
      const int G = (int)((group - g + (parts - p) - 1) / (parts - p));
      if (G > most) __builtin_unreachable();  /* (even parts of at most `most`): no code for larger groups */
      const float *wg = w + g * w_stride, *rs = rows + i0 * VL;
      float *ag = acc + g * D + i0 * VL;
      switch (G) {
        case 1: weighted_sum_group(wg, w_stride, n, rs, D, ag, NVT, 1, resume, DOT); break;
        case 2: weighted_sum_group(wg, w_stride, n, rs, D, ag, NVT, 2, resume, DOT); break;
        case 3: weighted_sum_group(wg, w_stride, n, rs, D, ag, NVT, 3, resume, DOT); break;
        case 4: weighted_sum_group(wg, w_stride, n, rs, D, ag, NVT, 4, resume, DOT); break;
        case 5: weighted_sum_group(wg, w_stride, n, rs, D, ag, NVT, 5, resume, DOT); break;
        case 6: weighted_sum_group(wg, w_stride, n, rs, D, ag, NVT, 6, resume, DOT); break;
        default: weighted_sum_group(wg, w_stride, n, rs, D, ag, NVT, MAX_GROUP, resume, DOT); break;
      }
      g += G;
    }
}

/* Shared heads: the whole row (AVX-512) or the widest slice of it (AVX2: half of D = 64, a quarter of D = 128) that
 * leaves room for the sums of two heads or more beside it; AVX2 build at D = 128, 12/2 heads: 1.15-1.19x. */
#define ROW_SLICE(NV) \
  (ROW_HELD(2, NV) ? (NV) : ROW_HELD(2, (NV) / 2) ? (NV) / 2 : ROW_HELD(2, (NV) / 4) ? (NV) / 4 : (NV) / 8)
static inline __attribute__((always_inline)) void weighted_sums_nv(const float *w, int64_t w_stride, int64_t n,
                                                                   const float *rows, int64_t D, float *acc,
                                                                   int64_t group, int resume, const int NV,
                                                                   const int DOT) {
  if (group == 1)
    weighted_sums_sliced(w, w_stride, n, rows, D, acc, group, resume, NV, NV, 1, DOT);
  else
    weighted_sums_sliced(w, w_stride, n, rows, D, acc, group, resume, NV, ROW_SLICE(NV),
                         (VREGS - 1) / ROW_SLICE(NV) - 1, DOT);
}

/* rows: float32 rows, or pairs of bf16 rows for `dot` (pair_rows: D 64, 128 or 256) */
static void weighted_sums(const float *w, int64_t w_stride, int64_t n, const float *rows, const int64_t *iota,
                          int64_t D, float *acc, int64_t group, int resume, int dot) {
  switch (D * 2 + (dot != 0)) {
    case 128: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 64 / VL, 0); break;
    case 256: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 128 / VL, 0); break;
    case 512: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 256 / VL, 0); break;
#if BF16_DOT_SCORES
    case 129: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 64 / VL, 1); break;
    case 257: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 128 / VL, 1); break;
    case 513: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 256 / VL, 1); break;
#endif
    default:
      for (int64_t g = 0; g < group; ++g)
        weighted_sum_any(w + g * w_stride, n, rows, iota, 1, 0, D, 0, acc + g * D, resume);
  }
}

/* One query head's scores over a chunk of n positions and their maximum: from the pool (slot[0..n)), or from
 * the chunk's rows widened to float32 (`widen`), or copied as bf16 when dot_scores takes them (`dot`). */
static float head_scores(const void *q, const void *k_cache, const int64_t *slot, const float *rows,
                         const int64_t *iota, int64_t n, int64_t Hkv, int64_t kvh, int64_t D, float scale, int bf16,
                         int dot, int widen, float *sc) {
#if BF16_DOT_SCORES
  if (dot)
    return widen ? dot_scores(q, (const uint16_t *)rows, NULL, n, 1, 0, D, scale, sc)
                 : dot_scores(q, k_cache, slot, n, Hkv, kvh, D, scale, sc);
#endif
  (void)dot;
  vf qv[MAX_HEAD_VECS];
  const int64_t nv = D / VL;
  for (int64_t i = 0; i < nv; ++i) qv[i] = vload(at(q, i * VL, bf16), bf16);
  if (!widen) return attention_scores(qv, nv, k_cache, slot, n, Hkv, kvh, D, scale, bf16, sc);
  if (D == 64) return row_scores(qv, rows, n, scale, sc, 64 / VL);
  if (D == 128) return row_scores(qv, rows, n, scale, sc, 128 / VL);
  if (D == 256) return row_scores(qv, rows, n, scale, sc, 256 / VL);
  return attention_scores(qv, nv, rows, iota, n, 1, 0, D, scale, 0, sc);
}

/* Rows that read the same context: row b joins the run of row b - 1 when its context is that row's plus one
 * position (lens[b] == lens[b - 1] + 1, the same slots before it), as the 1 + k rows of a speculative
 * verification are. run[b] = the run's length at its first row, 0 inside a run. A task is one piece of a run and
 * one KV head, and each piece widens the context again: runs are cut into the fewest pieces that give every
 * thread as many tasks (up to 4 each), and at MAX_RUN rows. A verification of 5 rows with 2 KV heads on 2 threads
 * is then 2 tasks, not 4 reading the context twice (1.1-1.3x); with 3 KV heads, 6 (3 tasks leave one thread
 * idle a third of the time). */
#define MAX_RUN 16
static void context_runs(const int64_t *slots, int64_t slot_stride, const int64_t *lens, int64_t B, int64_t Hkv,
                         int64_t max_run, int nthreads, int64_t *run) {
  int64_t runs = 0;
  for (int64_t b = 0, first = 0; b < B; ++b) {
    const int joins = b > 0 && lens[b] == lens[b - 1] + 1 &&
                      (slot_stride == 0 || !memcmp(slots + b * slot_stride, slots + (b - 1) * slot_stride,
                                                   sizeof(int64_t) * (size_t)lens[b - 1]));
    if (!joins) {
      first = b;
      ++runs;
    }
    run[b] = 0;
    ++run[first];
  }
  const int64_t tasks = runs * Hkv;
  int64_t pieces = 1;  /* per run */
  while ((tasks * pieces) % nthreads && tasks * pieces < 4 * (int64_t)nthreads) ++pieces;
  for (int64_t b = 0; b < B;) {
    const int64_t n = run[b];
    int64_t piece = (n + pieces - 1) / pieces;
    piece = piece > max_run ? max_run : piece;
    for (int64_t r = 0; r < n; ++r) run[b + r] = r % piece ? 0 : (n - r < piece ? n - r : piece);
    b += n;
  }
}

/* Gemma 2's attention logit softcapping, in place: s[0..n) = softcap * tanh(s / softcap), as transformers computes
 * it (after the scale, before the softmax). In bf16 with its eager attention's roundings, which Gemma 2 runs: q.k
 * rounded to bf16 (recovered as s / scale), then the scaled score, the quotient, the tanh and the product, each
 * rounded; softmax_weights then normalises before it rounds. The output is then bit for bit the torch path's
 * (layers/attention.attend; tested): with float32 scores a tiny model with a cap of 2 was 0.19 off transformers'
 * logprobs, against 0.13 for torch ops. Returns the cap of `max` (the scores' maximum before): each step keeps the
 * order, and the same lane operations on the same value give the capped scores' maximum exactly. */
static inline vf cap_lanes(vf s, vf scale, vf cap, int bf16) {
  if (bf16) s = vround(vmul(vround(vdiv(s, scale), 1), scale), 1);  /* q.k rounded (s / scale: it), then scaled */
  return vround(vmul(vround(vtanh(vround(vdiv(s, cap), bf16)), bf16), cap), bf16);
}

static float cap_scores(float *s, int64_t n, float max, float scale, float softcap, int bf16) {
  const vf cap = vset1(softcap), sc = vset1(scale);
  int64_t l = 0;
  for (; l + VL <= n; l += VL) vstoref(s + l, cap_lanes(vloadf(s + l), sc, cap, bf16));
  if (l < n) vstoref_part(s + l, cap_lanes(vloadf_part(s + l, n - l), sc, cap, bf16), n - l);
  float capped[VL];
  vstoref(capped, cap_lanes(vset1(max), sc, cap, bf16));
  return capped[0];
}

/* Rows of queries, each attending over its own context in the paged KV pool (attend_rows below).
 * q: [B, Hq, D] with row stride q_stride (elements) between rows; k_cache/v_cache: [S, Hkv, D];
 * row b's context is lens[b] positions whose slots are slots[b * slot_stride ..] (int64; slot_stride 0: every
 * row reads the same list, as a prefill chunk's rows do); out: [B, Hq, D] contiguous. Runs of rows that read
 * the same context take at most max_run rows at a time (context_runs). */
static void attend_rows(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                        const void *k_scale, const void *v_scale, int fp8, const int64_t *slots, int64_t slot_stride,
                        const int64_t *lens, void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t max_len,
                        int64_t max_run, float scale, float softcap, int bf16, int nthreads);

/* One query token per sequence attends over its context in the paged KV pool.
 * q: [B, Hq, D] with row stride q_stride (elements) between sequences; k_cache/v_cache: [S, Hkv, D];
 * slots: [B, max_len] int64 (slot of each context position); lens: [B]; out: [B, Hq, D] contiguous.
 * Scores, softmax and the weighted sum run in float32, with torch's roundings in bf16 (see
 * softmax_weights), so greedy tokens stay those of transformers' SDPA path (bf16 by vdpbf16ps where the CPU has
 * it: scores by dot_scores, V's sums over pair_rows or pool_pair_sums). D % 16 == 0, D <= 256.
 * Where several query heads share a KV head, they share each chunk of its rows (ATTN_CHUNK), and so do the rows
 * of a run (context_runs: a verification's 1 + k rows read one widened copy of the context, not 1 + k). Each row
 * and head takes the same operations in the same order as it would alone (its own chunk lengths, hence its own
 * blocks and tail), so its result does not depend on the rows beside it. softcap > 0: the scores capped first
 * (Gemma 2, cap_scores); 0: none. An 8-bit pool (fp8 FP8_E4M3 or FP8_E5M2) has its rows' scales in k_scale and
 * v_scale ([S, Hkv], the activation dtype; FP8_NONE's comment), else they are NULL. */
void ps_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                         const void *k_scale, const void *v_scale, int fp8, const int64_t *slots, const int64_t *lens,
                         void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t max_len, float scale,
                         float softcap, int bf16, int nthreads) {
  attend_rows(q, q_stride, k_cache, v_cache, k_scale, v_scale, fp8, slots, max_len, lens, out, B, Hq, Hkv, D, max_len,
              MAX_RUN, scale, softcap, bf16, nthreads);
}

/* A prefill chunk of T query rows at positions start .. start + T - 1 attends causally over its sequence's
 * start + T positions, whose slots are slots[0 .. start + T - 1]: row i is a decode row with start + i + 1
 * positions of context, and the chunk one run of rows (the decode path's operations and roundings, row by row),
 * cut into pieces of at most max_run rows, each widening the context once per KV head. The scores buffer of a
 * thread holds max_run x (Hq / Hkv) x (start + T) floats: the caller keeps it within its budget with max_run.
 * Against torch's SDPA (2 cores of a Zen 5, 428 queries, 14/2 heads of 64): 1.5 ms instead of 5.3. softcap and an
 * 8-bit pool as ps_decode_attention's. */
void ps_prefill_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                          const void *k_scale, const void *v_scale, int fp8, const int64_t *slots, int64_t start,
                          int64_t T, void *out, int64_t Hq, int64_t Hkv, int64_t D, int64_t max_run, float scale,
                          float softcap, int bf16, int nthreads) {
  int64_t *lens = (int64_t *)malloc(sizeof(int64_t) * (size_t)T);
  if (!lens) abort();
  for (int64_t i = 0; i < T; ++i) lens[i] = start + i + 1;
  attend_rows(q, q_stride, k_cache, v_cache, k_scale, v_scale, fp8, slots, 0, lens, out, T, Hq, Hkv, D, start + T,
              max_run < 1 ? 1 : (max_run > MAX_RUN ? MAX_RUN : max_run), scale, softcap, bf16, nthreads);
  free(lens);
}

/* softmax_weights in parts, for attend_split: the exps of positions [from, to) of s[0..len) in place (from a multiple
 * of VL), the sum of all of them, and the roundings of [from, to): the same operations on the same values. */
static void exp_positions(float *s, int64_t from, int64_t to, int64_t len, float mx) {
  for (int64_t l = from; l < to; l += VL) {
    if (l + VL <= len)
      vstoref(s + l, vexp(vsub(vloadf(s + l), vset1(mx))));
    else
      vstoref_part(s + l, vkeep(vexp(vsub(vloadf_part(s + l, len - l), vset1(mx))), len - l), len - l);
  }
}

static float exp_sum(const float *s, int64_t len) {
  vf sum = vzero();
  int64_t l = 0;
  for (; l + VL <= len; l += VL) sum = vadd(sum, vloadf(s + l));
  if (l < len) sum = vadd(sum, vloadf_part(s + l, len - l));
  return vsum(sum);
}

static void round_positions(float *s, int64_t from, int64_t to, int64_t len, float by) {
  for (int64_t l = from; l < to; l += VL) {
    if (l + VL <= len)
      vstoref(s + l, vround(vmul(vloadf(s + l), vset1(by)), 1));
    else
      vstoref_part(s + l, vround(vmul(vloadf_part(s + l, len - l), vset1(by)), 1), len - l);
  }
}

/* weighted_sums over the lanes [h0, h0 + lanes) of the rows and sums only (each lane's sum is its own). */
static void weighted_sums_lanes(const float *w, int64_t w_stride, int64_t n, const float *rows, int64_t D, int64_t h0,
                                int64_t lanes, float *acc, int64_t group, int resume, int dot) {
  rows += h0;
  acc += h0;
  switch (lanes / VL * 2 + (dot != 0)) {
    case 2: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 1, 0); break;
    case 4: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 2, 0); break;
    case 8: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 4, 0); break;
    case 16: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 8, 0); break;
    case 32: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 16, 0); break;
#if BF16_DOT_SCORES
    case 3: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 1, 1); break;
    case 5: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 2, 1); break;
    case 9: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 4, 1); break;
    case 17: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 8, 1); break;
    case 33: weighted_sums_nv(w, w_stride, n, rows, D, acc, group, resume, 16, 1); break;
#endif
    default: abort();  /* attend_split's lane parts are among these */
  }
}

/* attend_rows where its tasks (runs x KV heads) are fewer than the threads (a Gemma 3 row at batch 1: one KV head
 * for 2 threads) and the contexts long enough to pay for three more barriers: every thread works on every task. The
 * scores go by chunks of positions (one thread's chunks after another's), the softmax by ranges of positions (its sums
 * by whole rows), and V's weighted sums by parts of each head's lanes. Each score, exp, rounding and lane of a sum
 * takes the same operations in the same order as in attend_rows' own task (widened rows; those are bit-equal to the
 * pool paths), so the output is bit-equal to it (tested against one thread: a row alone, a run, a prefill chunk).
 * `parts`: lane parts per task (D / parts a multiple of VL, and of 32 for dot_v). */
static void attend_split(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                         const void *k_scale, const void *v_scale, int fp8, const int64_t *slots, int64_t slot_stride,
                         const int64_t *lens, void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                         int64_t max_len, const int64_t *run, float scale, float softcap, int bf16, int dot, int dot_v,
                         int64_t parts, int nthreads) {
  const int64_t group = Hq / Hkv, lanes = D / parts;
  int64_t tasks = 0;
  for (int64_t b = 0; b < B; ++b) tasks += run[b] ? Hkv : 0;
  int64_t *task_b0 = (int64_t *)malloc(sizeof(int64_t) * (size_t)tasks);
  int64_t *first_head = (int64_t *)malloc(sizeof(int64_t) * (size_t)(tasks + 1));  /* task -> its first score row */
  int64_t *first_chunk = (int64_t *)malloc(sizeof(int64_t) * (size_t)(tasks + 1));
  if (!task_b0 || !first_head || !first_chunk) abort();
  first_head[0] = first_chunk[0] = 0;
  for (int64_t b = 0, t = 0; b < B; ++b)
    for (int64_t kvh = 0; run[b] && kvh < Hkv; ++kvh, ++t) {
      task_b0[t] = b;
      first_head[t + 1] = first_head[t] + run[b] * group;
      first_chunk[t + 1] = first_chunk[t] + (lens[b + run[b] - 1] + ATTN_CHUNK - 1) / ATTN_CHUNK;
    }
  const int64_t heads = first_head[tasks], chunks = first_chunk[tasks];
  float *scores = (float *)malloc(sizeof(float) * ((size_t)heads * (size_t)max_len + VL));
  float *mxs = (float *)malloc(sizeof(float) * (size_t)(heads * nthreads));  /* each thread's maxima */
  float *inv_sum = (float *)malloc(sizeof(float) * (size_t)heads);
  if (!scores || !mxs || !inv_sum) abort();
  for (int64_t i = 0; i < heads * nthreads; ++i) mxs[i] = -INFINITY;
  #pragma omp parallel num_threads(nthreads)
  {
    const int64_t th = omp_get_thread_num(), T = omp_get_num_threads();
    float *rows = (float *)malloc(sizeof(float) * (size_t)(ATTN_CHUNK * D));
    float *acc = (float *)malloc(sizeof(float) * (size_t)(MAX_RUN * group * D));
    if (!rows || !acc) abort();
    int64_t iota[ATTN_CHUNK];
    for (int64_t l = 0; l < ATTN_CHUNK; ++l) iota[l] = l;
    /* the scores: chunks [th * chunks / T, (th + 1) * chunks / T) of all tasks' chunks in a row */
    for (int64_t u = th * chunks / T, t = 0; u < (th + 1) * chunks / T; ++u) {
      while (u >= first_chunk[t + 1]) ++t;
      const int64_t b0 = task_b0[t], kvh = t % Hkv, R = run[b0], c0 = (u - first_chunk[t]) * ATTN_CHUNK;
      const int64_t len_max = lens[b0 + R - 1], *slot = slots + (b0 + R - 1) * slot_stride;
      const int64_t n_max = len_max - c0 < ATTN_CHUNK ? len_max - c0 : ATTN_CHUNK;
      widen_rows(k_cache, slot + c0, n_max, len_max - c0, Hkv, kvh, D, bf16, dot, k_scale, fp8, rows);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t b = b0 + r, len = lens[b];
        if (c0 >= len) continue;
        const int64_t n = len - c0 < ATTN_CHUNK ? len - c0 : ATTN_CHUNK;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t i = first_head[t] + r * group + g;
          float *s = scores + i * max_len + c0;
          float m = head_scores(at(q, b * q_stride + (kvh * group + g) * D, bf16), k_cache, slot + c0, rows, iota, n,
                                Hkv, kvh, D, scale, bf16, dot, 1, s);
          if (softcap > 0.0f) m = cap_scores(s, n, m, scale, softcap, bf16);
          mxs[th * heads + i] = m > mxs[th * heads + i] ? m : mxs[th * heads + i];
        }
      }
    }
    #pragma omp barrier
    /* the exps: each score row's blocks of VL positions [th * nb / T, (th + 1) * nb / T) */
    for (int64_t t = 0; t < tasks; ++t)
      for (int64_t i = first_head[t]; i < first_head[t + 1]; ++i) {
        const int64_t len = lens[task_b0[t] + (i - first_head[t]) / group], nb = (len + VL - 1) / VL;
        float mx = mxs[i];
        for (int64_t o = 1; o < T; ++o) mx = mxs[o * heads + i] > mx ? mxs[o * heads + i] : mx;
        exp_positions(scores + i * max_len, th * nb / T * VL, (th + 1) * nb / T * VL, len, mx);
      }
    #pragma omp barrier
    for (int64_t t = 0; t < tasks; ++t)  /* the sums, a row each */
      for (int64_t i = first_head[t]; i < first_head[t + 1]; ++i)
        if (i % T == th)
          inv_sum[i] = 1.0f / exp_sum(scores + i * max_len, lens[task_b0[t] + (i - first_head[t]) / group]);
    #pragma omp barrier
    if (bf16) {
      for (int64_t t = 0; t < tasks; ++t)
        for (int64_t i = first_head[t]; i < first_head[t + 1]; ++i) {
          const int64_t len = lens[task_b0[t] + (i - first_head[t]) / group], nb = (len + VL - 1) / VL;
          round_positions(scores + i * max_len, th * nb / T * VL, (th + 1) * nb / T * VL, len,
                          softcap > 0.0f ? inv_sum[i] : 1.0f);
        }
      #pragma omp barrier
    }
    /* V's weighted sums: units (task, part of the lanes), [th * units / T, (th + 1) * units / T) */
    const int64_t units = tasks * parts;
    for (int64_t u = th * units / T; u < (th + 1) * units / T; ++u) {
      const int64_t t = u / parts, h0 = (u % parts) * lanes, b0 = task_b0[t], kvh = t % Hkv, R = run[b0];
      const int64_t len_max = lens[b0 + R - 1], *slot = slots + (b0 + R - 1) * slot_stride;
      for (int64_t c0 = 0; c0 < len_max; c0 += ATTN_CHUNK) {
        const int64_t n_max = len_max - c0 < ATTN_CHUNK ? len_max - c0 : ATTN_CHUNK;
#if BF16_DOT_SCORES
        if (dot_v)
          pair_lanes(v_cache, slot + c0, n_max, len_max - c0, Hkv, kvh, D, h0, h0 + lanes, v_scale, fp8, rows);
        else
#endif
        widen_lanes(v_cache, slot + c0, n_max, len_max - c0, Hkv, kvh, D, h0, h0 + lanes, bf16, 0, v_scale, fp8,
                    rows);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t len = lens[b0 + r];
          if (c0 >= len) continue;
          const int64_t n = len - c0 < ATTN_CHUNK ? len - c0 : ATTN_CHUNK;
          weighted_sums_lanes(scores + (first_head[t] + r * group) * max_len + c0, max_len, n, rows, D, h0, lanes,
                              acc + r * group * D, group, c0 > 0, dot_v);
        }
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t i = first_head[t] + r * group + g;
          const float by = bf16 && softcap > 0.0f ? 1.0f : inv_sum[i];
          for (int64_t h = h0; h < h0 + lanes; h += VL)
            vstore((void *)at(out, ((b0 + r) * Hq + kvh * group + g) * D + h, bf16),
                   vmul(vloadf(acc + (r * group + g) * D + h), vset1(by)), bf16);
        }
    }
    free(rows);
    free(acc);
  }
  free(task_b0);
  free(first_head);
  free(first_chunk);
  free(scores);
  free(mxs);
  free(inv_sum);
}

/* Whether attend_rows' tasks go to attend_split, and in how many lane parts each: only where they are fewer than the
 * threads (some would have none), the contexts long enough for its barriers (SPLIT_MIN_LANES) and the head size
 * one it has lane parts for; then parts of 2, 4, ... lanes per task until they spread evenly over the threads (or 4 a
 * thread). 2 threads of the AMX Xeon, one row: 4/1 heads of 256 (Gemma 3) 1.34-1.70x at 512-4000 positions (AVX2
 * build 1.43-1.68x); 9/3 heads of 64 (3 tasks on 2 threads, one of them idle a third of the time) split were
 * 0.85-0.95x (AVX2 build 0.94-1.08x), so tasks that leave threads idle only part of the time are left whole. */
#define SPLIT_MIN_LANES (256 * 256)  /* positions x head size: 256 positions at 256, 1024 at 64 (300: 0.96x) */
static int64_t split_parts(const int64_t *run, const int64_t *lens, int64_t B, int64_t Hkv, int64_t D, int dot_v,
                           int nthreads) {
  int64_t tasks = 0, longest = 0;
  for (int64_t b = 0; b < B; ++b)
    if (run[b]) {
      tasks += Hkv;
      longest = lens[b + run[b] - 1] > longest ? lens[b + run[b] - 1] : longest;
    }
  if (tasks >= nthreads || (D != 64 && D != 128 && D != 256) || longest * D < SPLIT_MIN_LANES) return 0;
  const int64_t least = dot_v ? 32 : VL;  /* lanes in a part */
  int64_t parts = 2;
  while ((tasks * parts) % nthreads && tasks * parts < 4 * nthreads && D / (parts * 2) >= least) parts *= 2;
  return D / parts >= least ? parts : 0;
}

static void attend_rows(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                        const void *k_scale, const void *v_scale, int fp8, const int64_t *slots, int64_t slot_stride,
                        const int64_t *lens, void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t max_len,
                        int64_t max_run, float scale, float softcap, int bf16, int nthreads) {
  const int64_t group = Hq / Hkv, nv = D / VL;
  const int dot = bf16_dot_attention && bf16 && D % 32 == 0;  /* scores by dot_scores, K rows kept in bf16 */
  const int dot_v = dot && (D == 64 || D == 128 || D == 256);  /* V's weighted sums by vdpbf16ps too (pair_rows) */
  int64_t *run = (int64_t *)malloc(sizeof(int64_t) * (size_t)B);
  if (!run) abort();
  context_runs(slots, slot_stride, lens, B, Hkv, max_run, nthreads, run);
  int64_t most = 1;  /* rows in the longest piece */
  for (int64_t b = 0; b < B; ++b) most = run[b] > most ? run[b] : most;
  const int64_t parts = split_parts(run, lens, B, Hkv, D, dot_v, nthreads);
  if (parts) {
    attend_split(q, q_stride, k_cache, v_cache, k_scale, v_scale, fp8, slots, slot_stride, lens, out, B, Hq, Hkv, D,
                 max_len, run, scale, softcap, bf16, dot, dot_v, parts, nthreads);
    free(run);
    return;
  }
  #pragma omp parallel num_threads(nthreads)
  {
    const size_t heads = (size_t)(most * group);  /* (row of the run, head of the group) */
    float *scores = (float *)malloc(sizeof(float) * (heads * (size_t)max_len + VL));
    float *acc = (float *)malloc(sizeof(float) * heads * (size_t)D);
    float *inv_sum = (float *)malloc(sizeof(float) * heads);
    float *mx = (float *)malloc(sizeof(float) * heads);
    float *rows = (float *)malloc(sizeof(float) * (size_t)(ATTN_CHUNK * D));
    if (!scores || !acc || !inv_sum || !mx || !rows) abort();
    int64_t iota[ATTN_CHUNK];  /* the widened rows' own "slots" */
    for (int64_t l = 0; l < ATTN_CHUNK; ++l) iota[l] = l;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t task = B * Hkv - 1; task >= 0; --task) {  /* last rows first: a prefill's longest contexts */
      const int64_t b0 = task / Hkv, kvh = task % Hkv, R = run[b0];
      if (R == 0) continue;  /* a row inside a run: its first row's task does it */
      const int64_t len_max = lens[b0 + R - 1], *slot = slots + (b0 + R - 1) * slot_stride;  /* the longest row */
      /* Widened rows unless one head alone reads them (group 1 and one row: straight from the pool, since a
       * widened copy read by one head only cost 1.19x at 32 x 1000 positions) from a 16/32-bit pool; chunk by
       * chunk */
      const int widen = group > 1 || R > 1 || fp8;
      const int64_t chunk = widen ? ATTN_CHUNK : len_max;
      for (int64_t c0 = 0; c0 < len_max; c0 += chunk) {
        const int64_t n_max = len_max - c0 < chunk ? len_max - c0 : chunk;
        if (widen) widen_rows(k_cache, slot + c0, n_max, len_max - c0, Hkv, kvh, D, bf16, dot, k_scale, fp8, rows);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t b = b0 + r, len = lens[b];
          if (c0 >= len) continue;
          const int64_t n = len - c0 < chunk ? len - c0 : chunk;  /* this row's own chunk, as alone */
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kvh * group + g, rg = r * group + g;
            float *s = scores + rg * max_len + c0;
            float m = head_scores(at(q, b * q_stride + h * D, bf16), k_cache, slot + c0, rows, iota, n, Hkv, kvh, D,
                                  scale, bf16, dot, widen, s);
            if (softcap > 0.0f) m = cap_scores(s, n, m, scale, softcap, bf16);
            mx[rg] = c0 == 0 || m > mx[rg] ? m : mx[rg];
          }
        }
      }
      if (widen)  /* V's first rows arrive while the weights are computed */
        for (int64_t l = 0; l < ATTN_AHEAD && l < len_max; ++l)
          prefetch_row(v_cache, slot[l], Hkv, kvh, D, KV_BYTES(fp8, bf16));
      for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < group; ++g)
          inv_sum[r * group + g] = softmax_weights(scores + (r * group + g) * max_len, lens[b0 + r],
                                                   mx[r * group + g], bf16, softcap > 0.0f);
      /* the weighted sums of V, chunk by chunk as the scores */
      for (int64_t c0 = 0; c0 < len_max; c0 += chunk) {
        const int64_t n_max = len_max - c0 < chunk ? len_max - c0 : chunk;
#if BF16_DOT_SCORES
        if (widen && dot_v)
          pair_rows(v_cache, slot + c0, n_max, len_max - c0, Hkv, kvh, D, v_scale, fp8, rows);
        else
#endif
        if (widen) widen_rows(v_cache, slot + c0, n_max, len_max - c0, Hkv, kvh, D, bf16, 0, v_scale, fp8, rows);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t len = lens[b0 + r];
          if (c0 >= len) continue;
          const int64_t n = len - c0 < chunk ? len - c0 : chunk;
          float *sc = scores + r * group * max_len + c0, *ar = acc + r * group * D;
          if (widen)
            weighted_sums(sc, max_len, n, rows, iota, D, ar, group, c0 > 0, dot_v);
#if BF16_DOT_SCORES
          else if (dot_v)  /* one head alone: paired in registers (through pair_rows' buffer: 0.67-0.91x, 8/8 heads) */
            pool_pair_sums(sc, n, v_cache, slot, Hkv, kvh, D, ar);
#endif
          else
            weighted_sum_d(sc, n, v_cache, slot, Hkv, kvh, D, bf16, ar, c0 > 0);
        }
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < group; ++g)
          for (int64_t i = 0; i < nv; ++i)
            vstore((void *)at(out, ((b0 + r) * Hq + kvh * group + g) * D + i * VL, bf16),
                   vmul(vloadf(acc + (r * group + g) * D + i * VL), vset1(inv_sum[r * group + g])), bf16);
    }
    free(scores);
    free(acc);
    free(inv_sum);
    free(mx);
    free(rows);
  }
  free(run);
}

/* ---- the whole decoder stack for a decode-only batch ------------------------------------------------ */

/* One decode step of a Llama-style decoder (pre-norm, fused qkv with rotary, paged attention, gated MLP):
 * the decoder layer is written once, as its two halves below (ps_layer_attention, ps_layer_mlp), with the
 * same kernels, order and roundings as the per-layer path (models/llama.py); ps_decode_stack loops over them
 * in one call, without ~10 Python calls and their tensors per layer, and with tensor parallelism
 * models/llama.py calls the halves itself, all-reducing after each.
 * A layer is one row of PS_LAYER_FIELDS int64 (pointers and kinds, laid out as the PS_L_* below; each of the
 * 4 linears is {kind (0 bf16 packed, 1 int8, 2 ggml blocks), weight, bias or 0, scales (int8; blocks: their kind,
 * ps_linear_q's), row sums (int8; blocks: 0)}):
 * - q/k norm: the per-head norms' weights (Qwen3, Gemma 3), or 0;
 * - attn_out/mlp_out norm: Gemma 2/3's sandwich norms of the attention's and the MLP's outputs before they join
 *   the residual stream (post_attention_layernorm, post_feedforward_layernorm; post_norm is then
 *   pre_feedforward_layernorm), or 0;
 * - k/v scale, kv format: an 8-bit pool's scales and format (FP8_E4M3, FP8_E5M2), or 0 and FP8_NONE (FP8_NONE's
 *   comment);
 * - flags: PS_NORM_GAIN (every norm's weight is a float32 gain, Gemma's 1 + weight), PS_GELU_TANH (the MLP's gate
 *   is GELU's tanh approximation, else SiLU);
 * - view: which of ps_decode_stack's step views the layer reads (its rotary tables and its sliding window's
 *   context: Gemma 2/3's sliding-window layers have their own; SmolLM3's layers without rotary a view whose
 *   tables are NULL).
 * cos/sin [B, D]; slots [B]; ctx_slots [B, max_len] and lens [B] as ps_decode_attention (in ps_decode_stack, each a
 * step view's: sliding-window layers with a K/V pool of their own write and read their own slots). int8 linears need
 * B <= 32 where the caller says so (KernelBackend: CPUs with bf16 dot products). */
enum { PS_L_IN_NORM, PS_L_POST_NORM, PS_L_QKV, PS_L_O = PS_L_QKV + 5, PS_L_GATE_UP = PS_L_O + 5,
       PS_L_DOWN = PS_L_GATE_UP + 5, PS_L_K_CACHE = PS_L_DOWN + 5, PS_L_V_CACHE, PS_L_K_SCALE, PS_L_V_SCALE,
       PS_L_KV_FORMAT, PS_L_Q_NORM, PS_L_K_NORM, PS_L_ATTN_OUT_NORM, PS_L_MLP_OUT_NORM, PS_L_FLAGS, PS_L_VIEW,
       PS_LAYER_FIELDS };
enum { PS_NORM_GAIN = 1, PS_GELU_TANH = 2 };
enum { PS_V_COS, PS_V_SIN, PS_V_SLOTS, PS_V_CTX_SLOTS, PS_V_LENS, PS_V_MAX_LEN, PS_VIEW_FIELDS };  /* a view's int64s */

int ps_layer_fields(void) { return PS_LAYER_FIELDS; }

/* The table's layout for the Python side, which builds rows by these names (NativeDecodeStack):
 * offsets of in_norm, post_norm, qkv, o, gate_up, down, k_cache, v_cache, k_scale, v_scale, kv_format, q_norm,
 * k_norm, attn_out_norm, mlp_out_norm, flags, view; the flags' bits norm_gain and gelu_tanh; then the fields per
 * linear, per layer and per step view. Writes at most n values and returns how many the layout has (the
 * caller checks it expected exactly that many: a field added here must be added there). */
int ps_layer_layout(int64_t *out, int n) {
  const int64_t layout[] = {PS_L_IN_NORM, PS_L_POST_NORM, PS_L_QKV, PS_L_O, PS_L_GATE_UP, PS_L_DOWN, PS_L_K_CACHE,
                            PS_L_V_CACHE, PS_L_K_SCALE, PS_L_V_SCALE, PS_L_KV_FORMAT, PS_L_Q_NORM, PS_L_K_NORM,
                            PS_L_ATTN_OUT_NORM, PS_L_MLP_OUT_NORM, PS_L_FLAGS, PS_L_VIEW, PS_NORM_GAIN, PS_GELU_TANH,
                            PS_L_O - PS_L_QKV, PS_LAYER_FIELDS, PS_VIEW_FIELDS};
  const int count = (int)(sizeof(layout) / sizeof(layout[0]));
  for (int i = 0; i < count && i < n; ++i) out[i] = layout[i];
  return count;
}

void ps_linear_q(const void *x, const uint8_t *packed, int kind, const void *bias, void *y, int64_t M, int64_t N,
                 int64_t K, int bf16, int nthreads);

static void stack_linear(const int64_t *lin, const void *x, void *y, int64_t M, int64_t N, int64_t K, int bf16,
                         int nthreads) {
  if (lin[0] == 2)
    ps_linear_q(x, (const uint8_t *)lin[1], (int)lin[3], (const void *)lin[2], y, M, N, K, bf16, nthreads);
  else if (lin[0] == 1)
    ps_linear_i8(x, (const int8_t *)lin[1], (const float *)lin[3], (const int32_t *)lin[4], (const void *)lin[2],
                 y, M, N, K, bf16, nthreads);
  else
    ps_linear_bf16((const uint16_t *)x, (const uint16_t *)lin[1], (const uint16_t *)lin[2], (uint16_t *)y,
                   M, N, K, nthreads);
}

/* The layer's norm in column `field` of rows x [B, H] (with `residual`: of x + residual, the sum kept in it) into
 * out (which may be x), scaling as the layer's flags say. */
static void stack_norm(const int64_t *layer, int field, const void *x, void *residual, void *out, int64_t B,
                       int64_t H, float eps, int bf16, int nthreads) {
  const void *w = (const void *)layer[field];
  const int gain = (layer[PS_L_FLAGS] & PS_NORM_GAIN) != 0;
  rms_norm_rows(x, residual, residual, gain ? NULL : w, gain ? (const float *)w : NULL, out, B, H, eps, bf16,
                nthreads);
}

/* The attention half of decoder layer `layer`: h = in_norm(x + residual) (the sum kept in `residual`; on
 * the first layer, `first`, residual = x), qkv = h W_qkv, (q/k norms,) rotary + K/V write, paged attention,
 * y = attn W_o (with tensor parallelism this rank's partial sum). x, y, residual: [B, H]. softcap: Gemma 2's cap of
 * the scores, 0 for none (ps_decode_attention). */
void ps_layer_attention(const int64_t *layer, const void *x, void *residual, int first, void *y, const void *cos,
                        const void *sin, const int64_t *slots, const int64_t *ctx_slots, const int64_t *lens,
                        int64_t B, int64_t max_len, int64_t H, int64_t Hq, int64_t Hkv, int64_t D, float eps,
                        float scale, float softcap, int bf16, int nthreads) {
  const size_t es = bf16 ? 2 : 4, qkv_n = (size_t)((Hq + 2 * Hkv) * D);
  char *h = (char *)aligned_alloc(64, (es * (size_t)B * ((size_t)H + qkv_n + (size_t)(Hq * D)) + 63) / 64 * 64);
  char *qkv = h + es * B * H, *attn = qkv + es * B * qkv_n;
  if (first) memcpy(residual, x, es * B * H);
  stack_norm(layer, PS_L_IN_NORM, x, first ? NULL : residual, h, B, H, eps, bf16, nthreads);
  stack_linear(layer + PS_L_QKV, h, qkv, B, (int64_t)qkv_n, H, bf16, nthreads);
  const int fp8 = (int)layer[PS_L_KV_FORMAT];
  void *k_scale = (void *)layer[PS_L_K_SCALE], *v_scale = (void *)layer[PS_L_V_SCALE];
  ps_rope_kv_write(qkv, cos, sin, (void *)layer[PS_L_K_CACHE], (void *)layer[PS_L_V_CACHE], k_scale, v_scale, fp8,
                   slots, (const void *)layer[PS_L_Q_NORM], (const void *)layer[PS_L_K_NORM],
                   (layer[PS_L_FLAGS] & PS_NORM_GAIN) != 0, eps, B, Hq, Hkv, D, bf16, nthreads);
  ps_decode_attention(qkv, (int64_t)qkv_n, (const void *)layer[PS_L_K_CACHE], (const void *)layer[PS_L_V_CACHE],
                      k_scale, v_scale, fp8, ctx_slots, lens, attn, B, Hq, Hkv, D, max_len, scale, softcap, bf16,
                      nthreads);
  stack_linear(layer + PS_L_O, attn, y, B, H, Hq * D, bf16, nthreads);
  free(h);
}

/* The MLP half: (with sandwich norms y = attn_out_norm(y), on the whole sum where tensor parallelism reduced it,)
 * h = post_norm(y + residual) (the sum kept in `residual`), out = act(h W_gate) * (h W_up) W_down (with tensor
 * parallelism this rank's partial sum; the caller applies mlp_out_norm, if any, to the reduced sum). y (overwritten
 * with sandwich norms), out, residual: [B, H]. */
void ps_layer_mlp(const int64_t *layer, void *y, void *residual, void *out, int64_t B, int64_t H, int64_t I,
                  float eps, int bf16, int nthreads) {
  const size_t es = bf16 ? 2 : 4;
  char *h = (char *)aligned_alloc(64, (es * (size_t)B * ((size_t)H + 3 * (size_t)I) + 63) / 64 * 64);
  char *gate_up = h + es * B * H, *act = gate_up + es * B * 2 * I;
  if (layer[PS_L_ATTN_OUT_NORM]) stack_norm(layer, PS_L_ATTN_OUT_NORM, y, NULL, y, B, H, eps, bf16, nthreads);
  stack_norm(layer, PS_L_POST_NORM, y, residual, h, B, H, eps, bf16, nthreads);
  stack_linear(layer + PS_L_GATE_UP, h, gate_up, B, 2 * I, H, bf16, nthreads);
  ps_gate_mul(gate_up, act, B, I, (layer[PS_L_FLAGS] & PS_GELU_TANH) ? PS_ACT_GELU_TANH : PS_ACT_SILU, bf16,
              nthreads);
  stack_linear(layer + PS_L_DOWN, act, out, B, H, I, bf16, nthreads);
  free(h);
}

/* Every layer of a decode-only step: x [B, H] embeddings (scaled as the model does) -> out [B, H] =
 * final_norm(last output + residual), the final norm scaling as the layers' flags say. `views` [n, PS_VIEW_FIELDS]
 * int64: per step view (a layer's PS_L_VIEW picks one) the pointers to cos, sin, slots, ctx_slots, lens and max_len. */
void ps_decode_stack(const void *x, void *out, const int64_t *layers, int64_t n_layers, const void *final_norm,
                     const int64_t *views, int64_t B, int64_t H, int64_t Hq, int64_t Hkv,
                     int64_t D, int64_t I, float eps, float scale, float softcap, int bf16, int nthreads) {
  const size_t es = bf16 ? 2 : 4;
  char *residual = (char *)aligned_alloc(64, (3 * es * (size_t)(B * H) + 63) / 64 * 64);
  char *a = residual + es * B * H, *y = a + es * B * H;
  for (int64_t l = 0; l < n_layers; ++l) {
    const int64_t *p = layers + l * PS_LAYER_FIELDS, *v = views + p[PS_L_VIEW] * PS_VIEW_FIELDS;
    ps_layer_attention(p, l == 0 ? x : (const void *)y, residual, l == 0, a, (const void *)v[PS_V_COS],
                       (const void *)v[PS_V_SIN], (const int64_t *)v[PS_V_SLOTS], (const int64_t *)v[PS_V_CTX_SLOTS],
                       (const int64_t *)v[PS_V_LENS], B, v[PS_V_MAX_LEN], H, Hq, Hkv, D, eps, scale, softcap,
                       bf16, nthreads);
    ps_layer_mlp(p, a, residual, y, B, H, I, eps, bf16, nthreads);
    if (p[PS_L_MLP_OUT_NORM]) stack_norm(p, PS_L_MLP_OUT_NORM, y, NULL, y, B, H, eps, bf16, nthreads);
  }
  const int64_t last[PS_LAYER_FIELDS] = {[PS_L_IN_NORM] = (int64_t)final_norm,
                                         [PS_L_FLAGS] = n_layers ? layers[PS_L_FLAGS] : 0};
  stack_norm(last, PS_L_IN_NORM, y, residual, out, B, H, eps, bf16, nthreads);
  free(residual);
}

#endif  /* PS_ISA */

/* ---- greedy sampling: each row's argmax ------------------------------------------------------------- */

/* The first index of the largest of x[0 .. n - 1] (a NaN counts as the largest: the first NaN), in *value the
 * value there. Two passes: the maximum (and whether a NaN is there), then the first lane equal to it. */
static int64_t argmax_run(const float *x, int64_t n, float *value) {
  vf mx = vset1(-INFINITY);  /* vmax(v, mx) keeps mx where v is NaN: NaNs are seen through nan alone */
  unsigned nan = 0;
  int64_t i = 0;
  for (; i + VL <= n; i += VL) {
    const vf v = vloadf(x + i);
    nan |= vnan_bits(v);
    mx = vmax(v, mx);
  }
  float m = vmaxr(mx);
  for (; i < n; ++i) {
    if (x[i] != x[i]) nan = 1;
    else if (x[i] > m) m = x[i];
  }
  const vf target = vset1(m);
  for (i = 0; i + VL <= n; i += VL) {
    const vf v = vloadf(x + i);
    const unsigned hit = nan ? vnan_bits(v) : veq_bits(v, target);
    if (hit) {
      *value = x[i + __builtin_ctz(hit)];
      return i + __builtin_ctz(hit);
    }
  }
  for (; i < n; ++i)
    if (nan ? x[i] != x[i] : x[i] == m) break;
  *value = x[i];
  return i;
}

/* out[m] = the index of the largest value of row m of x [M, V] (float32, contiguous): the first one on ties, the
 * first NaN where there is one, as torch.max(x, dim=-1).indices (greedy sampling's token). Rows fewer than the
 * threads are cut into runs that combine in order. Against torch.max's (2 threads of a Zen 5): 1 x 49152 logits
 * 4.8 us instead of 27, 5 x 49152 11 instead of 77, 1 x 151936 6.8 instead of 78, 32 x 151936 142 instead of 1269. */
#define ARGMAX_MAX_PARTS 64
void ps_argmax_rows(const float *x, int64_t M, int64_t V, int64_t *out, int nthreads) {
  int64_t parts = M >= nthreads ? 1 : (nthreads + M - 1) / M;
  parts = parts > ARGMAX_MAX_PARTS ? ARGMAX_MAX_PARTS : parts;
  parts = parts > V / 4096 ? (V / 4096 > 1 ? V / 4096 : 1) : parts;  /* runs of at least 4096 values */
  int64_t *index = (int64_t *)malloc(sizeof(int64_t) * (size_t)(M * parts));
  float *value = (float *)malloc(sizeof(float) * (size_t)(M * parts));
  if (!index || !value) abort();
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (M * V >= 16384)
  for (int64_t t = 0; t < M * parts; ++t) {
    const int64_t m = t / parts, p = t % parts, v0 = V * p / parts, v1 = V * (p + 1) / parts;
    index[t] = v0 + argmax_run(x + m * V + v0, v1 - v0, &value[t]);
  }
  for (int64_t m = 0; m < M; ++m) {  /* in order: a later run wins only with a larger value, or the first NaN */
    int64_t best = m * parts;
    for (int64_t t = best + 1; t < (m + 1) * parts && value[best] == value[best]; ++t)
      if (value[t] > value[best] || value[t] != value[t]) best = t;
    out[m] = index[best];
  }
  free(index);
  free(value);
}

/* ---- loading: weights to per-row int8 --------------------------------------------------------------------
 * --quantization int8 (and a quantized GGUF served as int8) store each weight row as int8 with one float32
 * scale: scale = max|row| / 127 (at least 1e-12), q = round-half-even(value / scale) clamped to +-127, the
 * arithmetic of layers/linear.py's quantize_int8_per_channel. The torch path costs most of a GGUF's start-up;
 * these do the same in one pass per row on every thread, bit for bit (multiply and add rounded separately,
 * as numpy and torch do: no fused multiply-add, hence the optimize attribute). */
static float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);  /* inf, nan */
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  /* subnormal half: normalise */
    uint32_t e = 113, m = mantissa;
    while (!(m & 0x400)) { m <<= 1; --e; }
    bits = sign | (e << 23) | ((m & 0x3FF) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline uint16_t read_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t read_u32(const uint8_t *p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* ggml's 32-value blocks, by GGMLQuantizationType: 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0. */
enum { PS_Q4_0 = 2, PS_Q4_1 = 3, PS_Q5_0 = 6, PS_Q5_1 = 7, PS_Q8_0 = 8 };

int64_t ps_gguf_block_bytes(int qtype) {
  switch (qtype) {
    case PS_Q4_0: return 18;
    case PS_Q4_1: return 20;
    case PS_Q5_0: return 22;
    case PS_Q5_1: return 24;
    case PS_Q8_0: return 34;
    default: return 0;
  }
}

__attribute__((optimize("fp-contract=off")))
static void dequant_block(const uint8_t *b, int qtype, float *out) {
  const float d = half_to_float(read_u16(b));
  switch (qtype) {
    case PS_Q8_0:
      for (int j = 0; j < 32; ++j) out[j] = (float)(int8_t)b[2 + j] * d;
      break;
    case PS_Q4_0:
      for (int j = 0; j < 16; ++j) {
        out[j] = (float)((b[2 + j] & 0x0F) - 8) * d;
        out[j + 16] = (float)((b[2 + j] >> 4) - 8) * d;
      }
      break;
    case PS_Q4_1: {
      const float m = half_to_float(read_u16(b + 2));
      for (int j = 0; j < 16; ++j) {
        float lo = (float)(b[4 + j] & 0x0F) * d, hi = (float)(b[4 + j] >> 4) * d;
        out[j] = lo + m;
        out[j + 16] = hi + m;
      }
      break;
    }
    case PS_Q5_0: {
      const uint32_t qh = read_u32(b + 2);
      for (int j = 0; j < 16; ++j) {
        const int lo = (b[6 + j] & 0x0F) | (((qh >> j) << 4) & 0x10);
        const int hi = (b[6 + j] >> 4) | ((qh >> (j + 12)) & 0x10);
        out[j] = (float)(lo - 16) * d;
        out[j + 16] = (float)(hi - 16) * d;
      }
      break;
    }
    case PS_Q5_1: {
      const float m = half_to_float(read_u16(b + 2));
      const uint32_t qh = read_u32(b + 4);
      for (int j = 0; j < 16; ++j) {
        const int lo = (b[8 + j] & 0x0F) | (((qh >> j) << 4) & 0x10);
        const int hi = (b[8 + j] >> 4) | ((qh >> (j + 12)) & 0x10);
        float vlo = (float)lo * d, vhi = (float)hi * d;
        out[j] = vlo + m;
        out[j + 16] = vhi + m;
      }
      break;
    }
  }
}

/* As layers/linear.py's quantize_int8_per_channel: s = max|row| / 127 (at least 1e-12), q = round(row / s)
 * half to even, clamped to +-127. Vectors, then the K % VL tail one by one: the same operations on each
 * value (max is exact in any order; an IEEE division and round-to-nearest-even per value). */
static void quantize_row(const float *row, int64_t K, int8_t *q, float *scale) {
  const int64_t KV = K / VL * VL;
  vf mx = vzero();
  for (int64_t k = 0; k < KV; k += VL) mx = vmax(mx, vabs(vloadf(row + k)));
  float amax = vmaxr(mx);
  for (int64_t k = KV; k < K; ++k) amax = fmaxf(amax, fabsf(row[k]));
  float s = amax / 127.0f;
  if (s < 1e-12f) s = 1e-12f;  /* clamp(min=1e-12) */
  const vf vs = vset1(s), hi = vset1(127.0f), lo = vset1(-127.0f);
  for (int64_t k = 0; k < KV; k += VL) vstore_i8(q + k, vmin(vmax(vround_int(vdiv(vloadf(row + k), vs)), lo), hi));
  for (int64_t k = KV; k < K; ++k) {
    float v = nearbyintf(row[k] / s);  /* the default rounding mode: half to even, as torch.round */
    v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
    q[k] = (int8_t)v;
  }
  *scale = s;
}

/* q: [N, K] int8 -> sums [N] int32 (the AVX-512 int8 kernel's correction for its unsigned x bytes). */
void ps_row_sums_i8(const int8_t *q, int64_t N, int64_t K, int32_t *sums, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t n = 0; n < N; ++n) {
    int32_t total = 0;
    for (int64_t k = 0; k < K; ++k) total += q[n * K + k];
    sums[n] = total;
  }
}

/* blocks: [N, K / 32] ggml blocks of `qtype` -> q [N, K] int8, scales [N] float32. Returns 0, or -1 for a
 * type it does not decode (the caller keeps the torch path). K is a multiple of 32. */
int ps_requant_gguf_i8(const uint8_t *blocks, int qtype, int64_t N, int64_t K, int8_t *q, float *scales,
                       int nthreads) {
  const int64_t block_bytes = ps_gguf_block_bytes(qtype), row_bytes = block_bytes * (K / 32);
  if (block_bytes == 0 || K % 32) return -1;
#pragma omp parallel num_threads(nthreads)
  {
    float *row = (float *)malloc((size_t)K * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t *b = blocks + n * row_bytes;
      for (int64_t c = 0; c < K / 32; ++c) dequant_block(b + c * block_bytes, qtype, row + c * 32);
      quantize_row(row, K, q + n * K, scales + n);
    }
    free(row);
  }
  return 0;
}

/* w: [N, K] float32 (bf16 = 0) or bfloat16 -> q [N, K] int8, scales [N] float32. */
void ps_quantize_rows_i8(const void *w, int bf16, int64_t N, int64_t K, int8_t *q, float *scales, int nthreads) {
#pragma omp parallel num_threads(nthreads)
  {
    float *row = bf16 ? (float *)malloc((size_t)K * sizeof(float)) : NULL;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float *src = (const float *)w + n * K;
      if (bf16) {
        const uint16_t *h = (const uint16_t *)w + n * K;
        for (int64_t k = 0; k < K; ++k) {
          const uint32_t bits = (uint32_t)h[k] << 16;
          memcpy(row + k, &bits, sizeof(float));
        }
        src = row;
      }
      quantize_row(src, K, q + n * K, scales + n);
    }
    free(row);
  }
}

/* ---- block-quantized weights served as stored: ggml's Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K ---------------------
 * A GGUF's 4- and 5-bit matrices run from their own bits (ps_linear_q) instead of being requantized to int8: 5-6
 * bits a weight streamed instead of 8, which is what batch-1 decode is bound by. Each block of 32 weights of a row
 * is w = d q + m with q unsigned (0..15, or 0..31 with a fifth bit). Where d and m come from (a kind's Q_K bit):
 * - ggml's 32-value types: d and m fp16, per block. Q4_1 and Q5_1 store both; Q4_0 and Q5_0 store d, m = -8 d and
 *   -16 d (exact in fp16: a power of two times d; the packer refuses a tensor where it overflows);
 * - K-quants (Q4_K, Q5_K; superblocks of 256): d = D sc and m = -(Dmin mn), with D and Dmin fp16 per superblock and
 *   sc and mn 6-bit per block, multiplied in float32 (exact: 17 bits), as ggml does.
 * - Rows as loaded (ps_pack_gguf_q; layers/linear.py's BlockWeight, which fuses and reorders rows): qs[n][K / 2], each
 *   block's 16 nibble bytes (byte j: low nibble = weight j, high nibble = weight 16 + j; ggml's own layout for the
 *   32-value types); ss[n][ceil(K / 128)][16] bytes, the scales of each group of 4 blocks (128 columns): 4 x (d, m)
 *   fp16, or D, Dmin fp16, sc[4], mn[4] (and 4 zero bytes) for K-quants; for 5 bits qh[n][ceil(K / 128)][2] uint64,
 *   per group the fifth bits of its low nibbles (bit 16 b + j: block b's weight j) then of its high nibbles.
 * - As the kernel streams them (ps_pack_q_rows): blocks of 4 rows (zero rows padding N), each a run of records, one
 *   per group of 128 columns (zeros past K): the 4 rows' 64 nibble bytes, their 4 x 16 scale bytes, and for 5 bits
 *   64 bytes of their fifth bits sliced by byte (Q_REC bytes), so a block streams as one sequential run, as the int8
 *   kernel's do. Fifth-bit byte t, bit 2 r + s: row r's bit for nibble byte t (block t / 16, weight t % 16, + 16 for
 *   s = 1): one load serves the 4 rows, and a row's bits for 32 nibble bytes are a shift and a mask (AVX2 has no
 *   byte masks; spreading 32 bits into 32 bytes took 5 instructions).
 * Activations are rounded per row to integers v (|v| <= 32256, step xs = max|x| / 32256: 15 bits, as the int8
 * kernel's) and split into two signed bytes, v = 256 hi + lo (hi in -126..126, lo in -128..127), so unsigned x
 * signed byte products (vpdpbusd; AVX2: vpmaddubsw + vpmaddwd) take the nibbles as they are. A block's sum over
 * q v is exact in integers; per row y = xs (sum_b d_b sum_j q_j v_j + sum_b m_b sum_j v_j) (+ bias), the terms
 * added in float32.
 * - Decode-sized batches (q_rows): x's planes laid out in the nibbles' order, 64 (AVX2: 32) nibbles an instruction;
 *   AVX-512: each 128-bit lane of the sums holds one block's, scaled by its d once per group; AVX2: the 4 rows' block
 *   sums folded into one vector first (vphaddd), so a 4-row block keeps one float sum per row of x and unpacks its
 *   weights once for Q_C rows of x. Every row runs the same instructions whatever M is, so a row gets the same bits
 *   in every such batch. One row streams two runs a thread (blocks b and b + half: 1.22-1.25x one run on the 2-core
 *   Ice Lake, gate/up, down and q/k/v shapes). Each kind runs its own copy of the loop (q_rows_of_kind). On the
 *   2-core Zen 3 (benchmarks/linear_ab.py --kind q5_0, Qwen2.5-0.5B's shapes) the AVX2 form ran 1.26-1.5x the
 *   per-row float sums it replaced at one row, 1.26-1.37x at 2 rows, 1.5-2.1x at 3-6 rows.
 * - From Q_TILE_ROWS rows (prompts, bigger decode batches; not in batch-invariant mode), q_tile: panels of VL rows' q
 *   values as int16 pairs ([K / 2][VL]: one vector holds 2 columns of VL outputs), each row's block sum exact in one
 *   int32 lane, x broadcast 2 columns at a time (vpdpwssd; AVX2 vpmaddwd) for Q_NV panels at once; its float sums
 *   come in another order, so those rows may differ from a lone row's in the last bits (as the int8 kernel's bf16
 *   panels on AVX512-BF16). Against the int8 kernel's tile on the same shapes (Ice Lake, 64-256 rows): 0.8-0.98x
 *   with 2 panels a tile (1.3-1.4x the one panel of 12 rows it had, whose broadcast served one vpdpwssd); the AVX2
 *   build 0.8-0.86x. */
#if PS_ISA == 512
#define QG 128  /* columns per decode step: a 64-byte load of nibbles */
#define Q_XV_SHARE 0.25f  /* a block's sums span 4 lanes, each adding a quarter of its m term */
#define Q_C 2  /* rows of x per pass over a 4-row block (q_rows) */
#define Q_TILE_ROWS 12  /* from here the tile (2 panels a tile): 1.07-1.13x the row kernel at 12 rows; at 8 0.8-0.97x */
#else
#define QG 64   /* a 32-byte load */
#define Q_XV_SHARE 1.0f  /* a lane holds one row's whole block */
#define Q_C 4  /* rows of x per pass over a 4-row block: one float sum each, the unpacked weights shared */
/* The row kernel with 4 rows of x a pass against the tile (Zen 3, Qwen2.5-0.5B's shapes, Q5_0): 1.16-1.65x at 8 rows,
 * 1.0-1.16x at 12, 0.83-1.19x at 16, 0.76-0.95x at 24-32 (the 3-row kernel had lost to the tile from 8 rows). */
#define Q_TILE_ROWS 12
#endif
enum { Q_FIVE = 1, Q_K = 2 };  /* a matrix's kind: fifth bits; K-quant scales */
/* bytes per record: 4 x 64 nibbles, 4 x 16 scale bytes, and for 5 bits 64 bytes of fifth bits */
#define Q_REC(kind) (((kind) & Q_FIVE) ? 384 : 320)
#define Q_AHEAD 1024  /* bytes ahead of its stream that a block prefetches */
#define Q_TILE_CHUNK 512  /* rows a tile call takes at most (its copy of x as int16 stays within 512 K 2 bytes) */
#define Q_PAIR_MIN_BLOCKS 8  /* 4-row blocks per thread from which one row streams two runs a thread */
#define QV 32256.0f  /* the largest |v|: 126 * 256, which keeps hi within a signed byte */

static inline vf vfloor(vf v) {
#if PS_ISA == 512
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
  return _mm256_floor_ps(v);
#endif
}

/* Row m of x's step xs: its largest magnitude / QV (1 for a row of zeros). */
static inline float q_row_step(const void *x, int64_t m, int64_t K, int bf16) {
  const float amax = row_absmax(x, m, K, bf16);
  return amax > 0.0f ? amax / QV : 1.0f;
}
/* VL values of x (times inv = 1 / xs) -> their integers v and v's two bytes, v = 256 hi + lo, as exact floats. */
static inline void q_split(vf x, vf inv, vf *v, vf *hi, vf *lo) {
  const vf top = vset1(QV);
  *v = vmin(vmax(vround_int(vmul(x, inv)), vsub(vzero(), top)), top);  /* x / xs rounds to at most QV + a rounding */
  *hi = vfloor(vmul(vadd(*v, vset1(128.0f)), vset1(1.0f / 256.0f)));
  *lo = vfnma(*hi, vset1(256.0f), *v);
}

/* For q_rows: x [M, K] -> per row planes [G][4][QG / 2] int8 (hi's low-nibble half, hi's high-nibble half, then
 * lo's; G steps of QG columns over ceil(K / 128) * 128, zero past K), xv [G][VL] float (lane l: the sum of v over the
 * block of lane l, times Q_XV_SHARE), xs [M]. */
static void q_prepare(const void *x, int64_t M, int64_t K, int bf16, int8_t *planes, float *xv, float *xs) {
  const int64_t G = (K + 127) / 128 * (128 / QG), lanes = VL / (QG / 32);  /* lanes a block's sums span */
  memset(planes, 0, (size_t)(M * G * 2 * QG));
  memset(xv, 0, sizeof(float) * (size_t)(M * G * VL));
  for (int64_t m = 0; m < M; ++m) {
    xs[m] = q_row_step(x, m, K, bf16);
    const vf inv = vset1(1.0f / xs[m]);
    int8_t *row = planes + m * G * 2 * QG;
    float *sums = xv + m * G * VL;
    for (int64_t k = 0; k < K; k += VL) {  /* VL columns in one half of one block */
      vf v, hi, lo;
      q_split(vload(at(x, m * K + k, bf16), bf16), inv, &v, &hi, &lo);
      const int64_t b = k / 32, j = k % 32, g = b / (QG / 32), bb = b % (QG / 32);
      const int64_t pos = g * 2 * QG + (j >= 16 ? QG / 2 : 0) + bb * 16 + j % 16;
      vstore_i8(row + pos, hi);
      vstore_i8(row + pos + QG, lo);
      sums[g * VL + bb * lanes] += vsum(v) * Q_XV_SHARE;
    }
    for (int64_t g = 0; g < G; ++g)  /* spread each block's sum over its lanes */
      for (int64_t l = 0; l < VL; ++l) sums[g * VL + l] = sums[g * VL + l / lanes * lanes];
  }
}

#if PS_ISA == 512
/* A group's d and m for each lane (a 128-bit lane a block) from one row's 16 scale bytes at p. */
static inline void q_scales(const uint8_t *p, int kind, __m512 *dv, __m512 *mv) {
  if (kind & Q_K) {
    const __m512 bytes = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512i pick = _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4);
    const __m512 big = _mm512_set1_ps(_cvtsh_ss(read_u16(p))), big_min = _mm512_set1_ps(-_cvtsh_ss(read_u16(p + 2)));
    *dv = _mm512_mul_ps(_mm512_permutexvar_ps(pick, bytes), big);
    *mv = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_add_epi32(pick, _mm512_set1_epi32(4)), bytes), big_min);
    return;
  }
  const __m512i pick_d = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
  const __m512 dm = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));
  *dv = _mm512_permutexvar_ps(pick_d, dm);
  *mv = _mm512_permutexvar_ps(_mm512_add_epi32(pick_d, _mm512_set1_epi32(1)), dm);
}

/* out[r][c] = the sums of row r of the NB 4-row blocks whose records start at rec[0], rec[1] (4 NB rows) against the
 * C rows of x at xp/xv. */
static inline __attribute__((always_inline)) void q_rows(const uint8_t *const rec[2], const int NB, int64_t G,
                                                         int kind, const int8_t *const xp[Q_C],
                                                         const float *const xv[Q_C], const int C,
                                                         float out[8][Q_C]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
  const int64_t size = Q_REC(kind);
  const int five = kind & Q_FIVE;
  __m512 acc[8][Q_C];
  for (int r = 0; r < 4 * NB; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i xh0[2], xh1[2], xl0[2], xl1[2];
    for (int c = 0; c < C; ++c) {
      const int8_t *xc = xp[c] + g * 2 * QG;
      xh0[c] = _mm512_loadu_si512(xc);
      xh1[c] = _mm512_loadu_si512(xc + 64);
      xl0[c] = _mm512_loadu_si512(xc + 128);
      xl1[c] = _mm512_loadu_si512(xc + 192);
    }
    for (int blk = 0; blk < NB; ++blk) {
      const uint8_t *p = rec[blk] + g * size;
      for (int64_t line = 0; line < size; line += 64) _mm_prefetch((const char *)(p + Q_AHEAD + line), _MM_HINT_T0);
      const __m512i bits = five ? _mm512_loadu_si512(p + 320) : _mm512_setzero_si512();
      for (int r = 0; r < 4; ++r) {
        __m512 *a = acc[4 * blk + r];
        const __m512i v = _mm512_loadu_si512(p + 64 * r);
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if (five) {
          lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(bits, _mm512_set1_epi8((char)(1 << 2 * r))), lo, fifth);
          hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(bits, _mm512_set1_epi8((char)(2 << 2 * r))), hi, fifth);
        }
        __m512 dv, mv;
        q_scales(p + 256 + 16 * r, kind, &dv, &mv);
        for (int c = 0; c < C; ++c) {
          const __m512i zero = _mm512_setzero_si512();
          const __m512i sh = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, xh0[c]), hi, xh1[c]);
          const __m512i sl = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, xl0[c]), hi, xl1[c]);
          const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(sh, 8), sl);
          a[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dv, a[c]);
          a[c] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(xv[c] + g * VL), a[c]);
        }
      }
    }
  }
  for (int r = 0; r < 4 * NB; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

/* acc + x0 w0 + x1 w1 in each int32 lane (16 pairs of int16: exact here). */
static inline __m512i q_dot_pairs(__m512i acc, __m512i x, __m512i w) { return _mm512_dpwssd_epi32(acc, x, w); }
static inline __m512i q_set1(int32_t v) { return _mm512_set1_epi32(v); }
/* 2 VL bytes -> VL 32-bit lanes of two int16 each (the first byte in the low half). */
static inline __m512i q_u16_pairs(const uint8_t *p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
}
typedef __m512i vq;
static inline vq q_load(const void *p) { return _mm512_loadu_si512(p); }
static inline vf q_float(vq v) { return _mm512_cvtepi32_ps(v); }
static inline vq q_zero(void) { return _mm512_setzero_si512(); }
/* Row r of a record at p (64 nibble bytes: 4 blocks' as ggml stores them, and their fifth bits) -> the 128 q values
 * in column order. */
static inline void q_natural(const uint8_t *p, int r, int five, vq out[2]) {
  const __m512i v = _mm512_loadu_si512(p + 64 * r), low4 = _mm512_set1_epi8(0x0F);
  __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  if (five) {
    const __m512i bits = _mm512_loadu_si512(p + 320), fifth = _mm512_set1_epi8(0x10);
    lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(bits, _mm512_set1_epi8((char)(1 << 2 * r))), lo, fifth);
    hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(bits, _mm512_set1_epi8((char)(2 << 2 * r))), hi, fifth);
  }
  /* 128-bit lane b of lo: block b's weights 0..15, of hi: its 16..31 */
  out[0] = _mm512_permutex2var_epi64(lo, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi);
  out[1] = _mm512_permutex2var_epi64(lo, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), hi);
}
#define Q_MT 6  /* rows of x per tile */
#define Q_NV 2  /* panels (VL outputs each) per tile: 2 Q_MT int32 and 2 Q_MT float sums, 2 weights, a broadcast */
#else
/* 32 fifth-bit bytes -> byte i = 0x10 where bit k of byte i is set, else 0 (k constant once inlined). */
static inline __m256i q_fifth_bits(__m256i bits, int k) {
  const __m256i moved = k <= 4 ? _mm256_slli_epi16(bits, 4 - k) : _mm256_srli_epi16(bits, k - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));  /* a bit shifted in from the next byte lands off bit 4 */
}

/* The int32 lanes' sums of two pairs (w0, x0) and (w1, x1): their 16-bit products added before widening (at most
 * 4 x 31 x 128, no saturation). */
static inline __m256i q_dot(__m256i w0, __m256i x0, __m256i w1, __m256i x1) {
#ifdef __AVXVNNI__
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w0, x0), w1, x1);
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

/* 256 q_dot(w0, h0, w1, h1) + q_dot(w0, l0, w1, l1) for x's planes at x (h0, h1, l0, l1: 32 bytes each). */
static inline __m256i q_dot_split(__m256i w0, __m256i w1, const int8_t *x) {
  const __m256i h0 = _mm256_loadu_si256((const __m256i *)x), h1 = _mm256_loadu_si256((const __m256i *)(x + 32));
  const __m256i l0 = _mm256_loadu_si256((const __m256i *)(x + 64)), l1 = _mm256_loadu_si256((const __m256i *)(x + 96));
#ifdef __AVXVNNI__
  return _mm256_add_epi32(_mm256_slli_epi32(q_dot(w0, h0, w1, h1), 8), q_dot(w0, l0, w1, l1));
#else  /* the shift folded into vpmaddwd's multiplier */
  const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(w0, h0), _mm256_maddubs_epi16(w1, h1));
  const __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(w0, l0), _mm256_maddubs_epi16(w1, l1));
  return _mm256_add_epi32(_mm256_madd_epi16(ph, _mm256_set1_epi16(256)), _mm256_madd_epi16(pl, _mm256_set1_epi16(1)));
#endif
}

/* One row's d of a group's 4 blocks, then their m, from its 16 scale bytes at p. */
static inline __m256 q_row_scales(const uint8_t *p, int kind) {
  if (kind & Q_K) {  /* D sc, -(Dmin mn): sc[4], mn[4] at p + 4 */
    const __m256 sm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 4))));
    const __m128 big = _mm_set1_ps(_cvtsh_ss(read_u16(p))), big_min = _mm_set1_ps(-_cvtsh_ss(read_u16(p + 2)));
    return _mm256_mul_ps(sm, _mm256_set_m128(big_min, big));
  }
  const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));  /* d0 m0 d1 m1 .. */
  return _mm256_permutevar8x32_ps(dm, _mm256_set_epi32(7, 5, 3, 1, 6, 4, 2, 0));
}

/* A record's 4 rows' d and m per step h, lane b * 4 + r: row r's block 2h + b (the lanes of q_rows' sums). */
static inline void q_scales(const uint8_t *p, int kind, __m256 dv[2], __m256 mv[2]) {
  __m256 r[4];
  for (int i = 0; i < 4; ++i) r[i] = q_row_scales(p + 256 + 16 * i, kind);
  const __m256 d01 = _mm256_unpacklo_ps(r[0], r[1]), d23 = _mm256_unpacklo_ps(r[2], r[3]);  /* blocks 0, 1 */
  const __m256 e01 = _mm256_unpackhi_ps(r[0], r[1]), e23 = _mm256_unpackhi_ps(r[2], r[3]);  /* blocks 2, 3 */
  const __m256 b0 = _mm256_shuffle_ps(d01, d23, 0x44), b1 = _mm256_shuffle_ps(d01, d23, 0xEE);  /* d rows | m rows */
  const __m256 b2 = _mm256_shuffle_ps(e01, e23, 0x44), b3 = _mm256_shuffle_ps(e01, e23, 0xEE);
  dv[0] = _mm256_permute2f128_ps(b0, b1, 0x20);
  mv[0] = _mm256_permute2f128_ps(b0, b1, 0x31);
  dv[1] = _mm256_permute2f128_ps(b2, b3, 0x20);
  mv[1] = _mm256_permute2f128_ps(b2, b3, 0x31);
}

/* out[r][c] = the sums of row r of the NB 4-row blocks at rec[0], rec[1] against the C rows of x at xp/xv. Each
 * row's block sum is exact in int32; vphaddd folds the 4 rows' into one vector (lane b * 4 + r: row r's block 2h + b
 * of step h), scaled by d and m there: one float sum per 4 rows and row of x, 4 rows' scales per shuffle, and a
 * step's unpacked weights serve C rows of x. */
static inline __attribute__((always_inline)) void q_rows(const uint8_t *const rec[2], const int NB, int64_t G,
                                                         int kind, const int8_t *const xp[Q_C],
                                                         const float *const xv[Q_C], const int C,
                                                         float out[8][Q_C]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const int64_t size = Q_REC(kind);
  const int five = kind & Q_FIVE;
  __m256 acc[2][Q_C];
  for (int blk = 0; blk < NB; ++blk)
    for (int c = 0; c < C; ++c) acc[blk][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int blk = 0; blk < NB; ++blk) {
      const uint8_t *p = rec[blk] + g * size;
      for (int64_t line = 0; line < size; line += 64) _mm_prefetch((const char *)(p + Q_AHEAD + line), _MM_HINT_T0);
      __m256 dv[2], mv[2];
      q_scales(p, kind, dv, mv);
      for (int h = 0; h < 2; ++h) {  /* two steps of 64 columns */
        const int64_t step = 2 * g + h;
        const __m256i bits = five ? _mm256_loadu_si256((const __m256i *)(p + 320 + 32 * h)) : _mm256_setzero_si256();
        __m256i lo[4], hi[4];
        for (int r = 0; r < 4; ++r) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * r + 32 * h));
          lo[r] = _mm256_and_si256(v, low4);
          hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if (five) {
            lo[r] = _mm256_add_epi8(lo[r], q_fifth_bits(bits, 2 * r));
            hi[r] = _mm256_add_epi8(hi[r], q_fifth_bits(bits, 2 * r + 1));
          }
        }
        for (int c = 0; c < C; ++c) {
          const int8_t *x = xp[c] + step * 2 * QG;
          const __m256i t01 = _mm256_hadd_epi32(q_dot_split(lo[0], hi[0], x), q_dot_split(lo[1], hi[1], x));
          const __m256i t23 = _mm256_hadd_epi32(q_dot_split(lo[2], hi[2], x), q_dot_split(lo[3], hi[3], x));
          acc[blk][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(t01, t23)), dv[h], acc[blk][c]);
          acc[blk][c] = _mm256_fmadd_ps(mv[h], _mm256_loadu_ps(xv[c] + step * VL), acc[blk][c]);
        }
      }
    }
  }
  for (int blk = 0; blk < NB; ++blk)
    for (int c = 0; c < C; ++c) {
      float lanes[8];
      _mm256_storeu_ps(lanes, acc[blk][c]);
      for (int r = 0; r < 4; ++r) out[4 * blk + r][c] = lanes[r] + lanes[4 + r];
    }
}

static inline __m256i q_dot_pairs(__m256i acc, __m256i x, __m256i w) { return dot_i16(acc, x, w); }
static inline __m256i q_set1(int32_t v) { return _mm256_set1_epi32(v); }
static inline __m256i q_u16_pairs(const uint8_t *p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
}
typedef __m256i vq;
static inline vq q_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vf q_float(vq v) { return _mm256_cvtepi32_ps(v); }
static inline vq q_zero(void) { return _mm256_setzero_si256(); }
/* Half h of row r of a record at p (32 nibble bytes: 2 blocks', and their fifth bits) -> 64 q values in column
 * order. */
static inline void q_natural_half(const uint8_t *p, int r, int h, int five, vq *out0, vq *out1) {
  const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * r + 32 * h)), low4 = _mm256_set1_epi8(0x0F);
  __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  if (five) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *)(p + 320 + 32 * h));
    lo = _mm256_add_epi8(lo, q_fifth_bits(bits, 2 * r));
    hi = _mm256_add_epi8(hi, q_fifth_bits(bits, 2 * r + 1));
  }
  *out0 = _mm256_permute2x128_si256(lo, hi, 0x20);  /* block 0: weights 0..15, 16..31 */
  *out1 = _mm256_permute2x128_si256(lo, hi, 0x31);
}
static inline void q_natural(const uint8_t *p, int r, int five, vq out[4]) {
  q_natural_half(p, r, 0, five, &out[0], &out[1]);
  q_natural_half(p, r, 1, five, &out[2], &out[3]);
}
#define Q_MT 6
#define Q_NV 1  /* 12 sums, a weight and a broadcast (14 of 16; 2 panels of 3 rows measured 0.9-1.0x this) */
#endif

/* q_rows with its kind, NB and C compile-time constants: in each copy the fifth-bit and K-quant branches fold away
 * and the loops over rows of x unroll (one copy for every kind had tested the kind inside the loop). */
#define Q_ROWS_AS(KIND)                                                    \
  do {                                                                     \
    if (NB == 2) q_rows(rec, 2, G, (KIND), xp, xv, 1, out);                \
    else if (C == 1) q_rows(rec, 1, G, (KIND), xp, xv, 1, out);            \
    else if (C == 2) q_rows(rec, 1, G, (KIND), xp, xv, 2, out);            \
    else if (C < Q_C) q_rows(rec, 1, G, (KIND), xp, xv, Q_C - 1, out);     \
    else q_rows(rec, 1, G, (KIND), xp, xv, Q_C, out);                      \
  } while (0)
static void q_rows_of_kind(const uint8_t *const rec[2], int NB, int64_t G, int kind, const int8_t *const xp[Q_C],
                           const float *const xv[Q_C], int C, float out[8][Q_C]) {
  switch (kind) {
    case 0: Q_ROWS_AS(0); break;
    case Q_FIVE: Q_ROWS_AS(Q_FIVE); break;
    case Q_K: Q_ROWS_AS(Q_K); break;
    default: Q_ROWS_AS(Q_FIVE | Q_K); break;
  }
}
#undef Q_ROWS_AS

/* ---- the prefill tile ---- */
/* A panel of VL output rows (4-row blocks i0 .. i0 + VL / 4 - 1) for q_tile: q as int16 pairs [G * 64][VL] (columns
 * 2c, 2c + 1 of the VL rows a vector, as the int8 kernel's integer tile reads its panels), d and m [G * 4][VL]
 * float. */
static void q_fill_panel(const uint8_t *packed, int64_t i0, int64_t blocks4, int64_t G, int kind, uint32_t *q,
                         float *d, float *mn) {
  const int64_t size = Q_REC(kind);
  const int five = kind & Q_FIVE;
  uint8_t bytes[VL][128];  /* one group's q values, in column order, per output */
  for (int64_t g = 0; g < G; ++g) {
    for (int o = 0; o < VL; ++o) {
      const int64_t i = i0 + o / 4, r = o % 4;
      if (i >= blocks4) {
        memset(bytes[o], 0, 128);
        for (int b = 0; b < 4; ++b) d[(g * 4 + b) * VL + o] = mn[(g * 4 + b) * VL + o] = 0.0f;
        continue;
      }
      const uint8_t *p = packed + (i * G + g) * size;
      vq natural[128 / sizeof(vq)];
      q_natural(p, (int)r, five, natural);
      memcpy(bytes[o], natural, 128);
      const uint8_t *sc = p + 256 + 16 * r;  /* this row's scale bytes (q_scales' values, one block at a time) */
      for (int b = 0; b < 4; ++b) {
        d[(g * 4 + b) * VL + o] = kind & Q_K ? (float)sc[4 + b] * _cvtsh_ss(read_u16(sc))
                                             : _cvtsh_ss(read_u16(sc + 4 * b));
        mn[(g * 4 + b) * VL + o] = kind & Q_K ? (float)sc[8 + b] * -_cvtsh_ss(read_u16(sc + 2))
                                              : _cvtsh_ss(read_u16(sc + 4 * b + 2));
      }
    }
    for (int64_t s = 0; s < 128 / (2 * VL); ++s) {  /* 2 VL columns: VL pairs of VL outputs */
      vpairs t[VL];
      for (int o = 0; o < VL; ++o) t[o] = q_u16_pairs(bytes[o] + s * 2 * VL);
      transpose_lanes(t);
      for (int c = 0; c < VL; ++c) pairs_store(q + (g * 64 + s * VL + c) * VL, t[c]);
    }
  }
}

/* For q_tile: x's rows as int16 v in column order ([M][G * 128], zero past K), the block sums of v [M][G * 4], xs
 * [M]: the integers q_prepare splits into bytes for q_rows. */
static void q_prepare_tile(const void *x, int64_t M, int64_t K, int64_t G, int bf16, int16_t *xv, float *bsum,
                           float *xs) {
  memset(xv, 0, sizeof(int16_t) * (size_t)(M * G * 128));
  memset(bsum, 0, sizeof(float) * (size_t)(M * G * 4));
  for (int64_t m = 0; m < M; ++m) {
    xs[m] = q_row_step(x, m, K, bf16);
    const vf inv = vset1(1.0f / xs[m]);
    for (int64_t k = 0; k < K; k += VL) {
      vf v, hi, lo;
      q_split(vload(at(x, m * K + k, bf16), bf16), inv, &v, &hi, &lo);
      vstore_i16(xv + m * G * 128 + k, v);
      bsum[m * G * 4 + k / 32] += vsum(v);
    }
  }
}

/* acc[m][v] = panel v's VL outputs for MT rows of x from m0 (Q_NV panels: q, d, mn each Q_NV panels' worth, a panel
 * apart): per block of 32 columns, 16 pair steps of exact int32 sums (each row's broadcast serving every panel),
 * then its d and m in float. */
static inline __attribute__((always_inline)) void q_tile(const uint32_t *q, const float *d, const float *mn,
                                                         const int16_t *xv, const float *bsum, int64_t G, int64_t K,
                                                         int64_t m0, const int MT, vf acc[Q_MT][Q_NV]) {
  const int32_t *x32 = (const int32_t *)xv;
  const int64_t row = G * 64, panel = G * 64 * VL, scales = G * 4 * VL;  /* column pairs a row; a panel's sizes */
  vf sum[Q_MT][Q_NV];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < Q_NV; ++v) sum[m][v] = vzero();
  for (int64_t b = 0; b < K / 32; ++b) {  /* the group's blocks past K: zeros, not computed */
    vq isum[Q_MT][Q_NV];
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < Q_NV; ++v) isum[m][v] = q_zero();
    for (int64_t kp = b * 16; kp < b * 16 + 16; ++kp) {
      vq w[Q_NV];
      for (int v = 0; v < Q_NV; ++v) w[v] = q_load(q + v * panel + kp * VL);
      for (int m = 0; m < MT; ++m) {
        const vq x = q_set1(x32[(m0 + m) * row + kp]);
        for (int v = 0; v < Q_NV; ++v) {
          isum[m][v] = q_dot_pairs(isum[m][v], x, w[v]);
          __asm__("" : "+v"(isum[m][v]));  /* kept in its register (GCC otherwise copied each around every step) */
        }
      }
    }
    for (int v = 0; v < Q_NV; ++v) {
      const vf dv = vloadf(d + v * scales + b * VL), mv = vloadf(mn + v * scales + b * VL);
      for (int m = 0; m < MT; ++m) {
        sum[m][v] = vfma(q_float(isum[m][v]), dv, sum[m][v]);
        sum[m][v] = vfma(mv, vset1(bsum[(m0 + m) * G * 4 + b]), sum[m][v]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < Q_NV; ++v) acc[m][v] = sum[m][v];
}

static void q_tile_rows(const uint32_t *q, const float *d, const float *mn, const int16_t *xv, const float *bsum,
                        int64_t G, int64_t K, int64_t m0, int64_t rows, vf acc[Q_MT][Q_NV]) {
  switch (rows) {
    case 1: q_tile(q, d, mn, xv, bsum, G, K, m0, 1, acc); break;
    case 2: q_tile(q, d, mn, xv, bsum, G, K, m0, 2, acc); break;
#if Q_MT > 3
    case 3: q_tile(q, d, mn, xv, bsum, G, K, m0, 3, acc); break;
    case 4: q_tile(q, d, mn, xv, bsum, G, K, m0, 4, acc); break;
    case 5: q_tile(q, d, mn, xv, bsum, G, K, m0, 5, acc); break;
#endif
    default: q_tile(q, d, mn, xv, bsum, G, K, m0, Q_MT, acc); break;
  }
}

/* Row m's output n (its float sum `sum`): xs times it, rounded, then + bias (rounded), as the int8 kernel's. */
static inline void q_store(void *y, const void *bias, float xs, float sum, int64_t m, int64_t n, int64_t N, int bf16) {
  float v = scalar_round(xs * sum, bf16);
  if (bias) v = scalar_round(v + load1(bias, n, bf16), bf16);
  store1(y, m * N + n, v, bf16);
}

static void q_linear_tile(const void *x, const uint8_t *packed, int kind, const void *bias, void *y, int64_t M,
                          int64_t N, int64_t K, int bf16, int nthreads) {
  const int64_t G = (K + 127) / 128, blocks4 = (N + 3) / 4, tiles = (N + Q_NV * VL - 1) / (Q_NV * VL);
  int16_t *xv = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * G * 128));
  float *bsum = (float *)malloc(sizeof(float) * (size_t)(M * G * 4)), *xs = (float *)malloc(sizeof(float) * (size_t)M);
  if (!xv || !bsum || !xs) abort();
  q_prepare_tile(x, M, K, G, bf16, xv, bsum, xs);
  #pragma omp parallel num_threads(nthreads)
  {
    const int64_t panel = G * 64 * VL, scales = G * 4 * VL;  /* a panel's q and its d (or m) */
    uint32_t *q = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (size_t)(Q_NV * panel));
    float *d = (float *)aligned_alloc(64, sizeof(float) * (size_t)(2 * Q_NV * scales)), *mn = d + Q_NV * scales;
    if (!q || !d) abort();
    int64_t t0, t1;
    thread_share(tiles, &t0, &t1);
    for (int64_t t = t0; t < t1; ++t) {
      for (int v = 0; v < Q_NV; ++v)  /* past N, zero panels */
        q_fill_panel(packed, (t * Q_NV + v) * (VL / 4), blocks4, G, kind, q + v * panel, d + v * scales,
                     mn + v * scales);
      for (int64_t m = 0; m < M; m += Q_MT) {
        const int64_t rows = M - m < Q_MT ? M - m : Q_MT;
        vf acc[Q_MT][Q_NV];
        q_tile_rows(q, d, mn, xv, bsum, G, K, m, rows, acc);
        for (int64_t r = 0; r < rows; ++r)
          for (int v = 0; v < Q_NV; ++v) {
            const int64_t n0 = (t * Q_NV + v) * VL, valid = N - n0 < VL ? N - n0 : VL;
            if (valid == VL) {
              store_rounded(y, bias, vmul(vset1(xs[m + r]), acc[r][v]), m + r, n0, N, bf16);  /* as q_store */
              continue;
            }
            float out[VL];
            vstoref(out, acc[r][v]);
            for (int64_t j = 0; j < valid; ++j) q_store(y, bias, xs[m + r], out[j], m + r, n0 + j, N, bf16);
          }
      }
    }
    free(q);
    free(d);
  }
  free(xv);
  free(bsum);
  free(xs);
}

/* y [M, N] = x [M, K] W^T (+ bias) for W packed by ps_pack_q_rows (`kind`: Q_FIVE | Q_K bits, as ps_pack_gguf_q
 * returned); K a multiple of 32. */
void ps_linear_q(const void *x, const uint8_t *packed, int kind, const void *bias, void *y, int64_t M, int64_t N,
                 int64_t K, int bf16, int nthreads) {
  if (M >= Q_TILE_ROWS && !batch_invariant) {  /* chunks of rows: x's integers take as much memory as x */
    for (int64_t m = 0; m < M; m += Q_TILE_CHUNK)
      q_linear_tile(at(x, m * K, bf16), packed, kind, bias, (void *)at(y, m * N, bf16),
                    M - m < Q_TILE_CHUNK ? M - m : Q_TILE_CHUNK, N, K, bf16, nthreads);
    return;
  }
  const int64_t G = (K + 127) / 128, steps = G * (128 / QG), blocks = (N + 3) / 4, size = Q_REC(kind);
  int8_t *planes = (int8_t *)malloc((size_t)(M * steps * 2 * QG));
  float *xv = (float *)malloc(sizeof(float) * (size_t)(M * steps * VL));
  float *xs = (float *)malloc(sizeof(float) * (size_t)M);
  if (!planes || !xv || !xs) abort();
  q_prepare(x, M, K, bf16, planes, xv, xs);
  /* One row of x: each thread streams two runs, block b with block b + half (as the int8 kernel's pairs: one run a
   * thread read below the memory's speed). */
  const int64_t half = M == 1 && blocks >= 2 * Q_PAIR_MIN_BLOCKS * nthreads ? blocks / 2 : 0;
  #pragma omp parallel num_threads(nthreads)
  {
    int64_t b0, b1;
    const int8_t *xp1[Q_C] = {planes};
    const float *xv1[Q_C] = {xv};
    thread_share(half, &b0, &b1);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t *recs[2] = {packed + b * G * size, packed + (b + half) * G * size};
      float out[8][Q_C];
      q_rows_of_kind(recs, 2, G, kind, xp1, xv1, 1, out);
      for (int r = 0; r < 8; ++r) {
        const int64_t n = 4 * (r < 4 ? b : b + half) + r % 4;
        if (n < N) q_store(y, bias, xs[0], out[r][0], 0, n, N, bf16);
      }
    }
    thread_share(blocks - 2 * half, &b0, &b1);
    for (int64_t b = 2 * half + b0; b < 2 * half + b1; ++b) {
      const int64_t n0 = 4 * b;
      const int R = N - n0 < 4 ? (int)(N - n0) : 4;
      const uint8_t *recs[2] = {packed + b * G * size, NULL};
      for (int64_t m = 0; m < M; m += Q_C) {
        const int C = M - m < Q_C ? (int)(M - m) : Q_C;
        const int8_t *xp[Q_C];
        const float *xvr[Q_C];
        for (int c = 0; c < Q_C; ++c) {  /* past M: row m's, not computed */
          xp[c] = planes + (m + (c < C ? c : 0)) * steps * 2 * QG;
          xvr[c] = xv + (m + (c < C ? c : 0)) * steps * VL;
        }
        float out[8][Q_C];
        q_rows_of_kind(recs, 1, G, kind, xp, xvr, C, out);
        for (int c = 0; c < C; ++c)
          for (int r = 0; r < R; ++r) q_store(y, bias, xs[m + c], out[r][c], m + c, n0 + r, N, bf16);
      }
    }
  }
  free(planes);
  free(xv);
  free(xs);
}

static inline uint16_t float_to_half_exact(float f, int *ok) {  /* f's fp16 bits; *ok = 0 where f is not one */
  const uint16_t h = (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
  if (half_to_float(h) != f) *ok = 0;
  return h;
}

enum { PS_Q4_K = 12, PS_Q5_K = 13 };

/* K-quants' 6-bit scale and min of block j (0..7) from a superblock's 12 packed bytes (ggml's get_scale_min_k4). */
static inline void k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

/* One block of 32 (block c of a row) of a supported type: its q values (0..31) and its row's scale bytes for it. */
static void q_decode_block(const uint8_t *row, int qtype, int64_t c, uint8_t q[32], uint8_t *scales, int *ok) {
  if (qtype == PS_Q4_K || qtype == PS_Q5_K) {
    const uint8_t *p = row + (c / 8) * (qtype == PS_Q4_K ? 144 : 176);
    const int j = (int)(c % 8), shift = 4 * (j % 2);  /* block j: nibbles of bytes 32 (j / 2) .. of qs */
    const uint8_t *qs = p + (qtype == PS_Q4_K ? 16 : 48) + 32 * (j / 2), *qh = p + 16;
    for (int i = 0; i < 32; ++i)
      q[i] = (uint8_t)(((qs[i] >> shift) & 0xF) | (qtype == PS_Q5_K ? ((qh[i] >> j) & 1) << 4 : 0));
    const int b = (int)(c % 4);
    memcpy(scales, p, 4);  /* D, Dmin */
    k_scale_min(j, p + 4, scales + 4 + b, scales + 8 + b);
    return;
  }
  const int five = qtype == PS_Q5_0 || qtype == PS_Q5_1, has_m = qtype == PS_Q4_1 || qtype == PS_Q5_1;
  const uint8_t *p = row + c * ps_gguf_block_bytes(qtype), *qs = p + (has_m ? 4 : 2) + (five ? 4 : 0);
  const uint32_t bits = five ? read_u32(p + (has_m ? 4 : 2)) : 0;
  for (int i = 0; i < 16; ++i) {
    q[i] = (uint8_t)((qs[i] & 0xF) | (((bits >> i) & 1) << 4));
    q[16 + i] = (uint8_t)((qs[i] >> 4) | (((bits >> (16 + i)) & 1) << 4));
  }
  const uint16_t d = read_u16(p);
  const uint16_t m = has_m ? read_u16(p + 2) : float_to_half_exact(half_to_float(d) * (five ? -16.0f : -8.0f), ok);
  memcpy(scales + 4 * (c % 4), &d, 2);
  memcpy(scales + 4 * (c % 4) + 2, &m, 2);
}

/* Bytes of one row of K values of `qtype` as ps_pack_gguf_q takes it (Q4_0, Q4_1, Q5_0, Q5_1 in blocks of 32; Q4_K,
 * Q5_K in superblocks of 256), or 0: another type, or K not of whole blocks. */
int64_t ps_q_row_bytes(int qtype, int64_t K) {
  if (qtype == PS_Q4_K || qtype == PS_Q5_K) return K % 256 ? 0 : K / 256 * (qtype == PS_Q4_K ? 144 : 176);
  if (qtype == PS_Q8_0 || K % 32) return 0;
  return K / 32 * ps_gguf_block_bytes(qtype);
}

/* blocks: [N, row bytes] ggml blocks of `qtype` (Q4_0, Q4_1, Q5_0, Q5_1; Q4_K, Q5_K) -> rows as loaded: qs [N, K / 2],
 * ss [N, ceil(K / 128), 16] and, for 5 bits, qh [N, ceil(K / 128), 2] uint64 (the layout above). Returns the kind
 * (Q_FIVE | Q_K bits), or -1 for another type, K not of whole blocks, or an m that fp16 cannot hold (-8 d or -16 d
 * overflowing). */
int ps_pack_gguf_q(const uint8_t *blocks, int qtype, int64_t N, int64_t K, uint8_t *qs, uint8_t *ss, uint64_t *qh,
                   int nthreads) {
  const int kq = qtype == PS_Q4_K || qtype == PS_Q5_K;
  const int five = qtype == PS_Q5_0 || qtype == PS_Q5_1 || qtype == PS_Q5_K;
  const int64_t B = K / 32, G = (K + 127) / 128, row_bytes = ps_q_row_bytes(qtype, K);
  if (row_bytes == 0) return -1;
  int ok = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(&& : ok)
  for (int64_t n = 0; n < N; ++n) {
    int row_ok = 1;
    memset(ss + n * G * 16, 0, (size_t)(G * 16));
    if (five) memset(qh + n * G * 2, 0, sizeof(uint64_t) * (size_t)(G * 2));
    for (int64_t c = 0; c < B; ++c) {
      uint8_t q[32];
      const int64_t g = c / 4, shift = 16 * (c % 4);
      q_decode_block(blocks + n * row_bytes, qtype, c, q, ss + (n * G + g) * 16, &row_ok);
      for (int i = 0; i < 16; ++i) qs[n * (K / 2) + c * 16 + i] = (uint8_t)((q[i] & 0xF) | ((q[16 + i] & 0xF) << 4));
      if (five)
        for (int i = 0; i < 16; ++i) {
          qh[(n * G + g) * 2] |= (uint64_t)(q[i] >> 4) << (shift + i);
          qh[(n * G + g) * 2 + 1] |= (uint64_t)(q[16 + i] >> 4) << (shift + i);
        }
    }
    ok = ok && row_ok;
  }
  return ok ? (five ? Q_FIVE : 0) | (kq ? Q_K : 0) : -1;
}

/* Rows as loaded (qs, ss, qh or NULL) -> the kernel's records: packed [ceil(N / 4)][ceil(K / 128)][Q_REC] bytes. */
void ps_pack_q_rows(const uint8_t *qs, const uint8_t *ss, const uint64_t *qh, int64_t N, int64_t K, uint8_t *packed,
                    int nthreads) {
  const int kind = qh != NULL ? Q_FIVE : 0;
  const int64_t G = (K + 127) / 128, size = Q_REC(kind), blocks = (N + 3) / 4, B = K / 32;
  uint64_t spread[256];  /* bit i of a byte -> bit 0 of byte i (little-endian) */
  for (unsigned v = 0; v < 256; ++v) {
    spread[v] = 0;
    for (int i = 0; i < 8; ++i) spread[v] |= (uint64_t)((v >> i) & 1) << (8 * i);
  }
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t i = 0; i < blocks; ++i) {
    memset(packed + i * G * size, 0, (size_t)(G * size));
    for (int r = 0; r < 4 && 4 * i + r < N; ++r) {
      const int64_t n = 4 * i + r;
      for (int64_t g = 0; g < G; ++g) {
        uint8_t *p = packed + (i * G + g) * size;
        const int64_t nb = B - 4 * g < 4 ? B - 4 * g : 4;
        memcpy(p + 64 * r, qs + n * (K / 2) + g * 64, (size_t)(16 * nb));
        memcpy(p + 256 + 16 * r, ss + (n * G + g) * 16, 16);
        for (int s = 0; qh && s < 2; ++s)  /* fifth-bit byte t, bit 2 r + s: bit t of the row's mask s */
          for (int t = 0; t < 64; t += 8) {
            uint64_t bytes;
            memcpy(&bytes, p + 320 + t, 8);
            bytes |= spread[(qh[(n * G + g) * 2 + s] >> t) & 0xFF] << (2 * r + s);
            memcpy(p + 320 + t, &bytes, 8);
          }
      }
    }
  }
}

#ifndef PS_AMX
int ps_amx_init(int want) {  /* no AMX in this build: the bf16 linear keeps its vector kernel */
  (void)want;
  return 0;
}
#endif
