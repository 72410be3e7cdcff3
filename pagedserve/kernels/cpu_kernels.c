/* pagedserve's native CPU kernels: the small-batch hot paths between (and inside) the big matmuls.
 *
 * Plain C with AVX-512 intrinsics and OpenMP, no torch headers: it builds in well under a second with
 * the system compiler (pagedserve/kernels/__init__.py builds it once per machine and caches it) and is
 * called through ctypes with raw pointers. OpenMP comes from the libgomp that torch already loaded,
 * so these kernels and torch's share one thread pool.
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
#include <immintrin.h>

int ps_isa(void) { return 512; }

/* ---- bf16 <-> fp32 ---------------------------------------------------------------------------------- */

static inline __m512 load16(const void *p, int bf16) {
  if (bf16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
  return _mm512_loadu_ps((const float *)p);
}

/* Round to nearest even, as torch does (NaN stays NaN). */
static inline __m256i to_bf16x16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

static inline void store16(void *p, __m512 v, int bf16) {
  if (bf16)
    _mm256_storeu_si256((__m256i *)p, to_bf16x16(v));
  else
    _mm512_storeu_ps((float *)p, v);
}

/* v rounded to the activation dtype and back (a no-op for float32). */
static inline __m512 round_dtype(__m512 v, int bf16) {
  if (!bf16) return v;
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
}

static inline float scalar_round(float v, int bf16) {
  if (!bf16) return v;
  uint32_t u;
  memcpy(&u, &v, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return v;  /* NaN stays NaN */
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;  /* round to nearest even, as to_bf16x16 */
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

static inline const char *at(const void *base, int64_t index, int bf16) {
  return (const char *)base + index * (bf16 ? 2 : 4);
}

/* exp for float32 lanes: 2^n * p(r) with r in [-ln2/2, ln2/2], degree-6 polynomial (~1 ulp);
 * inputs below -87.3 give 0, as expf does. */
static inline __m512 exp16(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365478515625f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

/* ---- weight-only int8 linear ----------------------------------------------------------------------- */

/* Weight-only int8 matmul. Activations are widened exactly enough for the products to stay exact in
 * integers: each row of x becomes int16 with its own scale (max|x| / 32767), i.e. 15 bits where bf16
 * keeps 8, so the added error is below x's own bf16 rounding for every element within 2^7 of the row's
 * largest. The int16 values are split into bytes, x = 256 * hi + lo (lo in 0..255, hi in -128..127), and
 * each byte plane meets the int8 weights in vpdpbusd (unsigned x signed bytes, 64 weights per
 * instruction, no widening of the weights): dot(x, w) = 256 * (dot(hi + 128, w) - 128 * sum(w)) + dot(lo, w),
 * with sum(w) per row computed at load. Two instructions per 64 weights and row of x: at batch 1 this
 * is what keeps the kernel at memory speed on the 2-core Zen 5 (widening to int16 and vpdpwssd took four,
 * and was compute-bound once the bandwidth rose). int32 lanes are flushed to float32 every 8192
 * columns (8192 / 4 * 4 * 255 * 127 < 2^31). */
#define I8_SEGMENT 8192

/* acc[r][c] = dot(x[c], w[r]) for 4 weight rows and C (1 or 2) rows of x; w is one block of the layout
 * q_packed[n / 4][k / 64][n % 4][k % 64]; xhi/xlo are the byte planes of x (hi already + 128). */
static inline __attribute__((always_inline)) void i8_block(const int8_t *w, const uint8_t *const xhi[2],
                                                           const uint8_t *const xlo[2], const int32_t *wsum,
                                                           int64_t K, const int C, float acc[4][2]) {
  int64_t total[4][2] = {{0}};  /* exact: the byte planes recombine in 64-bit integers */
  for (int64_t k0 = 0; k0 < K; k0 += I8_SEGMENT) {
    const int64_t k1 = K - k0 < I8_SEGMENT ? K : k0 + I8_SEGMENT;
    __m512i hi[4][2], lo[4][2];
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < C; ++c) hi[r][c] = lo[r][c] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 64) {
      __m512i wv[4];
      for (int r = 0; r < 4; ++r) wv[r] = _mm512_loadu_si512(w + k * 4 + r * 64);
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

/* y[m, n] = round(scale[n] * sum_k x[m, k] * q[n, k]) (+ bias[n], rounded again, as `F.linear` then
 * `+ bias` would in the model dtype). x, y, bias: activation dtype; scale float32 [N]; wsum int32 [N]
 * (sum of each row's int8 values). q is int8 in blocks of 4 rows, each block stored column-chunk-major:
 * q_packed[n / 4][k / 64][n % 4][k % 64] (rows padded to a multiple of 4 with zeros), so a block streams
 * from memory as one sequential run (4 short rows read side by side left the prefetchers idle: 17 GB/s
 * instead of ~30). Made for small M (decode). K % 64 == 0. */
void ps_linear_i8(const void *x, const int8_t *q, const float *scale, const int32_t *wsum, const void *bias,
                  void *y, int64_t M, int64_t N, int64_t K, int bf16, int nthreads) {
  uint8_t *xhi = (uint8_t *)malloc((size_t)(M * K)), *xlo = (uint8_t *)malloc((size_t)(M * K));
  float *xs = (float *)malloc(sizeof(float) * (size_t)M);
  for (int64_t m = 0; m < M; ++m) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(at(x, m * K + k, bf16), bf16)));
    const float amax = _mm512_reduce_max_ps(mx);
    xs[m] = amax > 0.0f ? amax / 32767.0f : 1.0f;
    const __m512 inv = _mm512_set1_ps(1.0f / xs[m]);
    for (int64_t k = 0; k < K; k += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(at(x, m * K + k, bf16), bf16), inv));  /* nearest */
      const __m512i hi = _mm512_add_epi32(_mm512_srai_epi32(v, 8), _mm512_set1_epi32(128));
      _mm_storeu_si128((__m128i *)(xhi + m * K + k), _mm512_cvtepi32_epi8(hi));
      _mm_storeu_si128((__m128i *)(xlo + m * K + k), _mm512_cvtepi32_epi8(_mm512_and_si512(v, _mm512_set1_epi32(0xFF))));
    }
  }
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t n = 0; n < N; n += 4) {
    const int64_t rows = N - n < 4 ? N - n : 4;
    const int8_t *w = q + n * K;
    int32_t sums[4] = {0, 0, 0, 0};
    for (int r = 0; r < rows; ++r) sums[r] = wsum[n + r];
    for (int64_t m = 0; m < M; m += 2) {
      const int two = M - m > 1;
      const uint8_t *hi[2] = {xhi + m * K, xhi + (m + two) * K}, *lo[2] = {xlo + m * K, xlo + (m + two) * K};
      float acc[4][2];
      if (two) i8_block(w, hi, lo, sums, K, 2, acc);
      else i8_block(w, hi, lo, sums, K, 1, acc);
      for (int c = 0; c <= two; ++c) {
        for (int r = 0; r < rows; ++r) {
          float v = scalar_round(xs[m + c] * scale[n + r] * acc[r][c], bf16);
          if (bias) v = scalar_round(v + load1(bias, n + r, bf16), bf16);
          const int64_t i = (m + c) * N + n + r;
          if (bf16) {
            uint32_t u;
            memcpy(&u, &v, 4);
            ((uint16_t *)y)[i] = (uint16_t)(u >> 16);  /* v already holds a bf16 value */
          } else {
            ((float *)y)[i] = v;
          }
        }
      }
    }
  }
  free(xhi);
  free(xlo);
  free(xs);
}

/* ---- bf16 linear ----------------------------------------------------------------------------------- */

#ifdef __AVX512BF16__
#define BF16_NB 64  /* outputs per weight block: 4 vectors of 16 */
#define BF16_MT 6   /* rows of x per register tile: 24 accumulators */

/* One weight block (64 outputs, all of K) against MT rows of x: acc[m][j] collects outputs j*16..j*16+15.
 * Per pair of columns: 4 weight vectors (each 16 outputs x 2 columns, as vdpbf16ps pairs them) meet one
 * broadcast pair of x per row. Inlined with MT constant so the tile stays in registers. */
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *wb, const uint16_t *x, int64_t K,
                                                            const int MT, __m512 acc[BF16_MT][4]) {
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    const uint16_t *wk = wb + kp * 2 * BF16_NB;
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
    __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64), w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
    for (int m = 0; m < MT; ++m) {
      int32_t pair;
      memcpy(&pair, x + m * K + 2 * kp, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, xb);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, xb);
    }
  }
}

/* w [N, K] bf16 -> packed [ceil(N/64), K/2, 64, 2] (rows past N are zeros): the layout below, written
 * in one pass (torch's permuted copy of 2-byte pairs took ~1 s for a 0.5B model's weights). */
void ps_pack_bf16(const uint32_t *w, uint32_t *packed, int64_t N, int64_t K, int nthreads) {
  const int64_t blocks = (N + BF16_NB - 1) / BF16_NB, pairs = K / 2;
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t nb = 0; nb < blocks; ++nb)
    for (int64_t j = 0; j < BF16_NB; ++j) {
      const int64_t n = nb * BF16_NB + j;
      uint32_t *dst = packed + nb * pairs * BF16_NB + j;
      if (n >= N) {
        for (int64_t kp = 0; kp < pairs; ++kp) dst[kp * BF16_NB] = 0;
      } else {
        const uint32_t *src = w + n * pairs;
        for (int64_t kp = 0; kp < pairs; ++kp) dst[kp * BF16_NB] = src[kp];
      }
    }
}

/* y [M, N] = round(x [M, K] @ W^T + bias) in bf16, the bias added in float32 before the one rounding
 * (as torch's and oneDNN's bf16 linear). W is packed as w[N/64][K/2][64][2] (outputs padded to 64
 * with zeros): each block streams as one sequential run, and no horizontal sums are needed.
 * K % 2 == 0. Returns 0 where the CPU lacks AVX512-BF16 (the caller keeps oneDNN). */
static void bf16_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int64_t M, int64_t N, int64_t K, int nthreads);

int ps_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                   int64_t M, int64_t N, int64_t K, int nthreads) {
  /* Prefill-sized M: every weight block meets all M rows of x, so x is re-read once per block of 64
   * outputs. Where a chunk of 512 rows fits the 1 MiB L2 (K <= 1024) take the rows chunk by chunk:
   * 9728x896 at M=2048 went from 366 to 434 GFLOP/s. Larger K keeps the whole M (its weight blocks
   * already fill L2; chunking measured slower). Same sums in the same order either way. */
  const int64_t chunk = K <= 1024 ? 512 : M;
  for (int64_t m = 0; m < M; m += chunk)
    bf16_rows(x + m * K, w, bias, y + m * N, M - m < chunk ? M - m : chunk, N, K, nthreads);
  return 1;
}

static void bf16_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int64_t M, int64_t N, int64_t K, int nthreads) {
  const int64_t blocks = (N + BF16_NB - 1) / BF16_NB;
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t nb = 0; nb < blocks; ++nb) {
    const uint16_t *wb = w + nb * BF16_NB * K;
    __m512 b[4];
    __mmask16 keep[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t n0 = nb * BF16_NB + j * 16;
      const int64_t valid = N - n0 >= 16 ? 16 : (N - n0 > 0 ? N - n0 : 0);
      keep[j] = (__mmask16)((1u << valid) - 1);
      b[j] = bias && valid ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                 _mm256_maskz_loadu_epi16(keep[j], bias + n0)), 16))
                           : _mm512_setzero_ps();
    }
    for (int64_t m = 0; m < M; m += BF16_MT) {
      const int64_t rows = M - m < BF16_MT ? M - m : BF16_MT;
      __m512 acc[BF16_MT][4];
      switch (rows) {
        case 1: bf16_tile(wb, x + m * K, K, 1, acc); break;
        case 2: bf16_tile(wb, x + m * K, K, 2, acc); break;
        case 3: bf16_tile(wb, x + m * K, K, 3, acc); break;
        case 4: bf16_tile(wb, x + m * K, K, 4, acc); break;
        case 5: bf16_tile(wb, x + m * K, K, 5, acc); break;
        default: bf16_tile(wb, x + m * K, K, 6, acc); break;
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int j = 0; j < 4; ++j)
          _mm256_mask_storeu_epi16(y + (m + r) * N + nb * BF16_NB + j * 16, keep[j],
                                   to_bf16x16(_mm512_add_ps(acc[r][j], b[j])));
    }
  }
}
#else
void ps_pack_bf16(const uint32_t *w, uint32_t *packed, int64_t N, int64_t K, int nthreads) {
  (void)w; (void)packed; (void)N; (void)K; (void)nthreads;
}
int ps_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                   int64_t M, int64_t N, int64_t K, int nthreads) {
  (void)x; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
  return 0;
}
#endif

/* ---- RMSNorm, optionally fused with the residual add ----------------------------------------------- */

/* For each row: h = x (+ residual, rounded); residual_out = h; out = round(weight * round(h * rsqrt(mean(h^2) + eps))).
 * (transformers: hidden.float() normalised, cast to the model dtype, times the weight.) H % 16 == 0. */
void ps_rms_norm(const void *x, const void *residual, void *residual_out, const void *weight, void *out,
                 int64_t M, int64_t H, float eps, int bf16, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 1)
  for (int64_t m = 0; m < M; ++m) {
    const void *xr = at(x, m * H, bf16);
    __m512 ss = _mm512_setzero_ps();
    for (int64_t k = 0; k < H; k += 16) {
      __m512 h = load16(at(xr, k, bf16), bf16);
      if (residual) {
        h = round_dtype(_mm512_add_ps(h, load16(at(residual, m * H + k, bf16), bf16)), bf16);
        store16((void *)at(residual_out, m * H + k, bf16), h, bf16);
      }
      ss = _mm512_fmadd_ps(h, h, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
    const void *src = residual ? (const void *)at(residual_out, m * H, bf16) : xr;
    for (int64_t k = 0; k < H; k += 16) {
      __m512 normed = round_dtype(_mm512_mul_ps(load16(at(src, k, bf16), bf16), inv), bf16);
      store16((void *)at(out, m * H + k, bf16), _mm512_mul_ps(normed, load16(at(weight, k, bf16), bf16)), bf16);
    }
  }
}

/* ---- SiLU(gate) * up ------------------------------------------------------------------------------- */

/* gate_up [M, 2I] (gate first) -> out [M, I] = round(round(silu(gate)) * up). I % 16 == 0. */
void ps_silu_mul(const void *gate_up, void *out, int64_t M, int64_t I, int bf16, int nthreads) {
  const int64_t chunks = I / 16;
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t c = 0; c < M * chunks; ++c) {
    const int64_t m = c / chunks, k = (c % chunks) * 16;
    __m512 g = load16(at(gate_up, m * 2 * I + k, bf16), bf16);
    __m512 u = load16(at(gate_up, m * 2 * I + I + k, bf16), bf16);
    __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    store16((void *)at(out, m * I + k, bf16), _mm512_mul_ps(round_dtype(s, bf16), u), bf16);
  }
}

/* ---- rotary embedding + KV write ------------------------------------------------------------------- */

/* qkv [T, Hq + 2 Hkv, D] (a fresh projection output): rotate the Hq query and Hkv key heads in place,
 * then copy each token's (rotated) K and its V into the pool at slots[t]. cos/sin [T, D] in the
 * activation dtype. Rounding as transformers: round(round(x * cos) + round(rotate_half(x) * sin)).
 * D % 32 == 0. */
void ps_rope_kv_write(void *qkv, const void *cos, const void *sin, void *k_cache, void *v_cache,
                      const int64_t *slots, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int bf16, int nthreads) {
  const int64_t H = Hq + 2 * Hkv, half = D / 2, rotated = Hq + Hkv;
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 4)
  for (int64_t t = 0; t < T; ++t) {
    const void *c = at(cos, t * D, bf16), *sn = at(sin, t * D, bf16);
    for (int64_t h = 0; h < rotated; ++h) {
      void *x = (void *)at(qkv, (t * H + h) * D, bf16);
      for (int64_t i = 0; i < half; i += 16) {
        const __m512 x1 = load16(at(x, i, bf16), bf16), x2 = load16(at(x, half + i, bf16), bf16);
        const __m512 c1 = load16(at(c, i, bf16), bf16), c2 = load16(at(c, half + i, bf16), bf16);
        const __m512 s1 = load16(at(sn, i, bf16), bf16), s2 = load16(at(sn, half + i, bf16), bf16);
        const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
        const __m512 o1 = _mm512_add_ps(round_dtype(_mm512_mul_ps(x1, c1), bf16), round_dtype(_mm512_mul_ps(neg_x2, s1), bf16));
        const __m512 o2 = _mm512_add_ps(round_dtype(_mm512_mul_ps(x2, c2), bf16), round_dtype(_mm512_mul_ps(x1, s2), bf16));
        store16((void *)at(x, i, bf16), o1, bf16);
        store16((void *)at(x, half + i, bf16), o2, bf16);
      }
    }
    const size_t row = (size_t)(Hkv * D) * (bf16 ? 2 : 4);
    memcpy((void *)at(k_cache, slots[t] * Hkv * D, bf16), at(qkv, (t * H + Hq) * D, bf16), row);
    memcpy((void *)at(v_cache, slots[t] * Hkv * D, bf16), at(qkv, (t * H + Hq + Hkv) * D, bf16), row);
  }
}

/* ---- paged attention for decode tokens -------------------------------------------------------------- */

/* The 16 horizontal sums of v[0..15] as one vector (lane j = sum of v[j]'s lanes): pairs of vectors are
 * folded with unpacks, then 128-bit lanes with shuffles, ~45 instructions instead of 16 reductions. */
static inline __m512 hsum16(const __m512 v[16]) {
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

/* acc[0..D) = sum over l < len of weights[l] * V[slot[l], kvh]; NV = D / 16 constant when inlined. */
static inline __attribute__((always_inline)) void weighted_sum(const float *weights, int64_t len, const void *v_cache,
                                                               const int64_t *slot, int64_t Hkv, int64_t kvh,
                                                               int64_t D, int bf16, float *acc, const int NV) {
  __m512 a[16];
  for (int i = 0; i < NV; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t l = 0; l < len; ++l) {
    const void *vp = at(v_cache, (slot[l] * Hkv + kvh) * D, bf16);
    const __m512 w = _mm512_set1_ps(weights[l]);
    for (int i = 0; i < NV; ++i) a[i] = _mm512_fmadd_ps(w, load16(at(vp, i * 16, bf16), bf16), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + i * 16, a[i]);
}

static void weighted_sum_any(const float *weights, int64_t len, const void *v_cache, const int64_t *slot,
                             int64_t Hkv, int64_t kvh, int64_t D, int bf16, float *acc) {
  for (int64_t i = 0; i < D; i += 16) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t l = 0; l < len; ++l)
      a = _mm512_fmadd_ps(_mm512_set1_ps(weights[l]), load16(at(v_cache, (slot[l] * Hkv + kvh) * D + i, bf16), bf16), a);
    _mm512_storeu_ps(acc + i, a);
  }
}

/* One query token per sequence attends over its context in the paged KV pool.
 * q: [B, Hq, D] with row stride q_stride (elements) between sequences; k_cache/v_cache: [S, Hkv, D];
 * slots: [B, max_len] int64 (slot of each context position); lens: [B]; out: [B, Hq, D] contiguous.
 * Scores, softmax and the weighted sum run in float32, with torch's roundings in bf16 (see below), so
 * greedy tokens stay those of transformers' SDPA path. D % 16 == 0, D <= 256. */
void ps_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                         const int64_t *slots, const int64_t *lens, void *out, int64_t B, int64_t Hq,
                         int64_t Hkv, int64_t D, int64_t max_len, float scale, int bf16, int nthreads) {
  const int64_t group = Hq / Hkv, nv = D / 16;
  #pragma omp parallel num_threads(nthreads)
  {
    float *scores = (float *)malloc(sizeof(float) * (size_t)(group * max_len + 16));
    float *acc = (float *)malloc(sizeof(float) * (size_t)(group * D));
    float *inv_sum = (float *)malloc(sizeof(float) * (size_t)group);
    #pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * Hkv; ++task) {
      const int64_t b = task / Hkv, kvh = task % Hkv, len = lens[b];
      const int64_t *slot = slots + b * max_len;
      __m512 qv[16][1];  /* one query head at a time: up to 16 vectors (D <= 256) */
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kvh * group + g;
        for (int64_t i = 0; i < nv; ++i)
          qv[i][0] = load16(at(q, b * q_stride + h * D + i * 16, bf16), bf16);
        float *s = scores + g * max_len;
        __m512 mxv = _mm512_set1_ps(-INFINITY);
        int64_t l0 = 0;
        for (; l0 + 16 <= len; l0 += 16) {  /* 16 positions: their 16 dot products summed in one go */
          __m512 d[16];
          for (int j = 0; j < 16; ++j) {
            const void *kp = at(k_cache, (slot[l0 + j] * Hkv + kvh) * D, bf16);
            d[j] = _mm512_mul_ps(qv[0][0], load16(kp, bf16));
            for (int64_t i = 1; i < nv; ++i) d[j] = _mm512_fmadd_ps(qv[i][0], load16(at(kp, i * 16, bf16), bf16), d[j]);
          }
          const __m512 block = _mm512_mul_ps(hsum16(d), _mm512_set1_ps(scale));
          _mm512_storeu_ps(s + l0, block);
          mxv = _mm512_max_ps(mxv, block);
        }
        float mx = _mm512_reduce_max_ps(mxv);
        for (int64_t l = l0; l < len; ++l) {
          const void *kp = at(k_cache, (slot[l] * Hkv + kvh) * D, bf16);
          __m512 d = _mm512_setzero_ps();
          for (int64_t i = 0; i < nv; ++i) d = _mm512_fmadd_ps(qv[i][0], load16(at(kp, i * 16, bf16), bf16), d);
          s[l] = _mm512_reduce_add_ps(d) * scale;
          mx = s[l] > mx ? s[l] : mx;
        }
        __m512 sum = _mm512_setzero_ps();
        int64_t l = 0;
        for (; l + 16 <= len; l += 16) {
          __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l), _mm512_set1_ps(mx)));
          _mm512_storeu_ps(s + l, e);
          sum = _mm512_add_ps(sum, e);
        }
        if (l < len) {
          __mmask16 tail = (__mmask16)((1u << (len - l)) - 1);
          __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + l), _mm512_set1_ps(mx)));
          e = _mm512_maskz_mov_ps(tail, e);
          _mm512_mask_storeu_ps(s + l, tail, e);
          sum = _mm512_add_ps(sum, e);
        }
        /* As torch's CPU flash attention: the weights meet V rounded to the activation dtype and still
         * unnormalised; the float32 sum of the unrounded ones divides at the end. */
        inv_sum[g] = 1.0f / _mm512_reduce_add_ps(sum);
        if (bf16) {
          int64_t l2 = 0;
          for (; l2 + 16 <= len; l2 += 16) _mm512_storeu_ps(s + l2, round_dtype(_mm512_loadu_ps(s + l2), 1));
          if (l2 < len) {
            const __mmask16 tail = (__mmask16)((1u << (len - l2)) - 1);
            _mm512_mask_storeu_ps(s + l2, tail, round_dtype(_mm512_maskz_loadu_ps(tail, s + l2), 1));
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float *weights = scores + g * max_len;
        float *a = acc + g * D;
        switch (nv) {  /* the common head sizes keep their accumulators in registers */
          case 4: weighted_sum(weights, len, v_cache, slot, Hkv, kvh, D, bf16, a, 4); break;
          case 8: weighted_sum(weights, len, v_cache, slot, Hkv, kvh, D, bf16, a, 8); break;
          default: weighted_sum_any(weights, len, v_cache, slot, Hkv, kvh, D, bf16, a); break;
        }
        for (int64_t i = 0; i < nv; ++i)
          store16((void *)at(out, (b * Hq + kvh * group + g) * D + i * 16, bf16),
                  _mm512_mul_ps(_mm512_loadu_ps(a + i * 16), _mm512_set1_ps(inv_sum[g])), bf16);
      }
    }
    free(scores);
    free(acc);
    free(inv_sum);
  }
}

/* ---- the whole decoder stack for a decode-only batch ------------------------------------------------ */

/* One decode step of a Llama-style decoder (pre-norm, fused qkv with rotary, paged attention, SiLU MLP)
 * in one call: the same kernels, in the same order and with the same roundings as the per-layer path
 * (models/llama.py), without ~10 Python calls and their tensors per layer.
 * layers: n_layers rows of PS_LAYER_FIELDS int64 (pointers and kinds, laid out as the PS_L_* below; each
 * of the 4 linears is {kind (0 bf16 packed, 1 int8), weight, bias or 0, scales (int8), row sums (int8)}).
 * x: [B, H] embeddings; out: [B, H] = final_norm(last hidden + residual); cos/sin [B, D]; slots [B];
 * ctx_slots [B, max_len] and lens [B] as ps_decode_attention. int8 linears need B <= 32 (the caller checks). */
enum { PS_L_IN_NORM, PS_L_POST_NORM, PS_L_QKV, PS_L_O = PS_L_QKV + 5, PS_L_GATE_UP = PS_L_O + 5,
       PS_L_DOWN = PS_L_GATE_UP + 5, PS_L_K_CACHE = PS_L_DOWN + 5, PS_L_V_CACHE, PS_LAYER_FIELDS };

int ps_layer_fields(void) { return PS_LAYER_FIELDS; }

static void stack_linear(const int64_t *lin, const void *x, void *y, int64_t M, int64_t N, int64_t K, int bf16,
                         int nthreads) {
  if (lin[0] == 1)
    ps_linear_i8(x, (const int8_t *)lin[1], (const float *)lin[3], (const int32_t *)lin[4], (const void *)lin[2],
                 y, M, N, K, bf16, nthreads);
  else
    ps_linear_bf16((const uint16_t *)x, (const uint16_t *)lin[1], (const uint16_t *)lin[2], (uint16_t *)y,
                   M, N, K, nthreads);
}

void ps_decode_stack(const void *x, void *out, const int64_t *layers, int64_t n_layers, const void *final_norm,
                     const void *cos, const void *sin, const int64_t *slots, const int64_t *ctx_slots,
                     const int64_t *lens, int64_t B, int64_t max_len, int64_t H, int64_t Hq, int64_t Hkv,
                     int64_t D, int64_t I, float eps, float scale, int bf16, int nthreads) {
  const size_t es = bf16 ? 2 : 4, qkv_n = (size_t)((Hq + 2 * Hkv) * D);
  const size_t bytes = es * (size_t)B * ((size_t)H * 3 + qkv_n + (size_t)(Hq * D + 3 * I));
  char *residual = (char *)aligned_alloc(64, (bytes + 63) / 64 * 64);
  char *h = residual + es * B * H, *y = h + es * B * H, *qkv = y + es * B * H;
  char *attn = qkv + es * B * qkv_n, *gate_up = attn + es * B * Hq * D, *act = gate_up + es * B * 2 * I;
  memcpy(residual, x, es * B * H);
  for (int64_t l = 0; l < n_layers; ++l) {
    const int64_t *p = layers + l * PS_LAYER_FIELDS;
    if (l == 0)
      ps_rms_norm(x, NULL, NULL, (const void *)p[PS_L_IN_NORM], h, B, H, eps, bf16, nthreads);
    else
      ps_rms_norm(y, residual, residual, (const void *)p[PS_L_IN_NORM], h, B, H, eps, bf16, nthreads);
    stack_linear(p + PS_L_QKV, h, qkv, B, (int64_t)qkv_n, H, bf16, nthreads);
    ps_rope_kv_write(qkv, cos, sin, (void *)p[PS_L_K_CACHE], (void *)p[PS_L_V_CACHE], slots, B, Hq, Hkv, D, bf16,
                     nthreads);
    ps_decode_attention(qkv, (int64_t)qkv_n, (const void *)p[PS_L_K_CACHE], (const void *)p[PS_L_V_CACHE],
                        ctx_slots, lens, attn, B, Hq, Hkv, D, max_len, scale, bf16, nthreads);
    stack_linear(p + PS_L_O, attn, y, B, H, Hq * D, bf16, nthreads);
    ps_rms_norm(y, residual, residual, (const void *)p[PS_L_POST_NORM], h, B, H, eps, bf16, nthreads);
    stack_linear(p + PS_L_GATE_UP, h, gate_up, B, 2 * I, H, bf16, nthreads);
    ps_silu_mul(gate_up, act, B, I, bf16, nthreads);
    stack_linear(p + PS_L_DOWN, act, y, B, H, I, bf16, nthreads);
  }
  ps_rms_norm(y, residual, residual, final_norm, out, B, H, eps, bf16, nthreads);
  free(residual);
}

#else  /* no AVX-512 (F, BW, VNNI) on this machine: report it, and pagedserve keeps the torch path */
int ps_isa(void) { return 0; }
#endif
