/* Quantised matrix products for the stage engine (workers/node/engine/native.py builds this).
 *
 * y[t, n] = sum_k x[t, k] * w[n, k] (+ add[t, n]) where every weight is affine in an
 * unsigned integer code, w = scale * code + min, per group of SUB consecutive k (16 or 32).
 * Scales and mins are float16: the GGUF values themselves for Q4_0/Q4_1/Q5_0/Q8_0 (whose
 * min is -zero * scale for a fixed zero code: then no mins are stored), d * sc rounded to
 * float16 (2^-12) for the K formats. The activations are
 * quantised per block of 32 to int8 (q = round(x / dx), dx = max|x| / 127, as llama.cpp's
 * Q8 blocks do), so each group's product is an integer dot product:
 *   sum_k x w  ~=  scale * dx * sum(code * q)  +  min * dx * sum(q).
 * Codes are stored one per byte ("byte" format: up to 8 bits) or two per byte ("nibble":
 * 4 bits; a 64-byte chunk holds groups 4c, 4c+1 in its low nibbles, 4c+2, 4c+3 in its high
 * ones, so both halves line up with the int8 activations in their natural order).
 * K is padded to a multiple of 128 (nibble) or 64 (byte) with zero codes and scales.
 *
 * The AVX-512 VNNI path (vpdpbusd: 64 u8 x s8 products per instruction) is built where the
 * compiler targets it (-march=native); a plain C path elsewhere computes the same sums.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    !defined(MVK_GENERIC)
#include <immintrin.h>
#define MVK_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && !defined(MVK_GENERIC)
/* The build without AVX-512 on a CPU with AVX2: the Q4_0/Q4_1/Q5_0/Q8_0 products
 * (rows_avx2_q0) and the Q4_K/Q6_K products (rows8_avx2_k) in AVX2, the same integer sums
 * and the same float operations as the plain C (so the same bits); the rest in plain C. */
#include <immintrin.h>
#define MVK_AVX2 1
#endif

/* 1: the AVX-512 VNNI build; 2: the AVX2 build (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K products
 * in AVX2, the rest in plain C); 0: plain C. */
int mvk_simd(void) {
#if defined(MVK_AVX512)
    return 1;
#elif defined(MVK_AVX2)
    return 2;
#else
    return 0;
#endif
}

/* ---- activations ---------------------------------------------------------------------
 * x: T rows of k_in floats (row stride ldx), quantised the way llama.cpp's CPU backend
 * quantises them for the weight format at hand (its vec_dot_type), so that the products
 * are the ones it computes:
 *   MVK_Q8_0 (Q4_0, Q5_0, Q8_0 weights): blocks of 32, d = max|x| / 127 stored as float16,
 *            q = round-to-even(x * 127 / max|x|).
 *   MVK_Q8_1 (Q4_1): as Q8_0, and the block sum s = d * sum(q) is also a float16.
 *   MVK_Q8_K (K formats): blocks of 256, iscale = -127 / x_max (x_max: the element of
 *            largest magnitude, signed), q = round(iscale * x) <= 127, d = 1 / iscale
 *            (float32).
 * Outputs, per row t (kp = padded K):
 *   qx[t*kp + k]       int8 codes (0 past k_in)
 *   dxe[t*kp/4 + j]    d of element 4j (one per 32-bit lane of a vpdpbusd)
 *   s16[t*kp/16 + j]   d * sum(q) over elements 16j..16j+15
 *   s32[t*kp/32 + j]   d * sum(q) over elements 32j..32j+31 (Q8_1: its float16 s)
 */
enum { MVK_Q8_0 = 0, MVK_Q8_1 = 1, MVK_Q8_K = 2 };

static inline float f16r(float x) { return (float)(_Float16)x; }

/* mvk_attention's scratch, in floats: a decode step's buffers or a prompt's transposed v */
#define MVK_ATTN_SCRATCH(npad, hd, kv_heads) \
    (2 * (npad) + (hd) + 64 * (hd) + (kv_heads) * (hd) * (npad))

#ifdef MVK_AVX512
/* mvk_quantize, 16 elements at a time: the same products x * id, rounded to nearest even
 * (vcvtps2dq under the default rounding mode is nearbyintf), the same clamps and sums. */
static void quantize_row_simd(const float *xr, int64_t k_in, int64_t kp, int mode, int8_t *q,
                              float *dxe, float *s16, float *s32) {
    const int64_t bs = mode == MVK_Q8_K ? 256 : 32;
    const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
    for (int64_t b = 0; b < kp; b += bs) {
        __m512 vmax = _mm512_setzero_ps();
        for (int64_t k = b; k < b + bs; k += 16) {
            const int64_t left = k_in - k;
            const __mmask16 m = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u);
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, xr + k)));
        }
        const float amax = _mm512_reduce_max_ps(vmax);
        float xmax = 0.0f;
        if (mode == MVK_Q8_K && amax > 0.0f) { /* the first element of largest magnitude */
            for (int64_t k = b; k < b + bs && k < k_in; k++)
                if (fabsf(xr[k]) == amax) {
                    xmax = xr[k];
                    break;
                }
        }
        float id, d, dq;
        if (mode == MVK_Q8_K) {
            id = amax > 0.0f ? -127.0f / xmax : 0.0f;
            d = amax > 0.0f ? 1.0f / id : 0.0f;
            dq = d;
        } else {
            d = amax / 127.0f;
            id = amax > 0.0f ? 127.0f / amax : 0.0f;
            dq = f16r(d);
        }
        const __m512 vid = _mm512_set1_ps(id);
        int32_t sum32 = 0;
        for (int64_t k = b; k < b + bs; k += 16) {
            const int64_t left = k_in - k;
            const __mmask16 m = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u);
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + k), vid));
            v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
            _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(v));
            const int32_t sum = _mm512_reduce_add_epi32(v);
            s16[k / 16] = dq * (float)sum;
            sum32 += sum;
            if ((k - b) % 32 == 16) {
                s32[k / 32] = mode == MVK_Q8_1 ? f16r(d * (float)sum32) : dq * (float)sum32;
                sum32 = 0;
            }
        }
        for (int64_t i = b / 4; i < (b + bs) / 4; i++) dxe[i] = dq;
    }
}
#endif

void mvk_quantize(const float *x, int64_t t_rows, int64_t k_in, int64_t ldx, int64_t kp,
                  int mode, int8_t *qx, float *dxe, float *s16, float *s32) {
    const int64_t bs = mode == MVK_Q8_K ? 256 : 32;
    for (int64_t t = 0; t < t_rows; t++) {
        const float *xr = x + t * ldx;
        int8_t *q = qx + t * kp;
#ifdef MVK_AVX512
        quantize_row_simd(xr, k_in, kp, mode, q, dxe + t * kp / 4, s16 + t * kp / 16,
                          s32 + t * kp / 32);
        continue;
#endif
        for (int64_t b = 0; b < kp; b += bs) {
            float amax = 0.0f, xmax = 0.0f;
            for (int64_t k = b; k < b + bs && k < k_in; k++) {
                float a = fabsf(xr[k]);
                if (a > amax) {
                    amax = a;
                    xmax = xr[k];
                }
            }
            float id, d, dq;
            if (mode == MVK_Q8_K) {
                id = amax > 0.0f ? -127.0f / xmax : 0.0f;
                d = amax > 0.0f ? 1.0f / id : 0.0f;
                dq = d;
            } else {
                d = amax / 127.0f;
                id = amax > 0.0f ? 127.0f / amax : 0.0f;
                dq = f16r(d);
            }
            for (int64_t k0 = b; k0 < b + bs; k0 += 16) {
                int32_t sum = 0;
                for (int64_t k = k0; k < k0 + 16; k++) {
                    int32_t v = 0;
                    if (k < k_in) {
                        v = (int32_t)nearbyintf(xr[k] * id);
                        v = v > 127 ? 127 : (v < -128 ? -128 : v);
                    }
                    q[k] = (int8_t)v;
                    sum += v;
                }
                s16[t * kp / 16 + k0 / 16] = dq * (float)sum;
            }
            for (int64_t k0 = b; k0 < b + bs; k0 += 32) {
                int32_t sum = 0;
                for (int64_t k = k0; k < k0 + 32; k++) sum += q[k];
                s32[t * kp / 32 + k0 / 32] = mode == MVK_Q8_1 ? f16r(d * (float)sum)
                                                              : dq * (float)sum;
            }
            for (int64_t j = b / 4; j < (b + bs) / 4; j++) dxe[t * kp / 4 + j] = dq;
        }
    }
}

/* ---- products ------------------------------------------------------------------------ */
typedef struct {
    const int8_t *qx;
    const float *dxe, *s16, *s32;
    int64_t t_rows, kp;
    const uint8_t *codes;
    const void *scale, *min; /* [n][kp / sub] float16 (or float32: f32); min NULL: -zero * scale */
    int64_t n;
    int nibble, sub, zero, f32;
    float *y;
    int64_t ldy;
    const float *add;
    int64_t ldadd;
    /* MVK_ARITH_Q0: -q (int8, as qx) and each row's zero code (NULL: Q4_1's mins) */
    const int8_t *nq;
    const uint8_t *zrow;
    int arith;
    /* MVK_ARITH_Q4K / Q6K: the format's own integer sub-scales (and Q4_K's mins) per
     * group, d (and dmin) per 256-block as float32, the activations' sums per 16 */
    const void *ksc;
    const uint8_t *kmin;
    const float *kd, *kdmin;
    const int32_t *qs16;
    /* MVK_ARITH_Q0 with zero codes: per group of 16 rows the index of its (uniform) zero
     * code in corr, or -1 (mixed: the -q product); corr [zero][t][kp / 4] = -zero times
     * each 4 activation codes' sum, the zero code's term as the product's start value */
    const int8_t *zg;
    const int32_t *corr;
    /* per activation row, which of llama.cpp's row-count-dependent sums it gets
     * (MVK_ROW_*; NULL: as a product of t_rows rows, row_kind) */
    const uint8_t *rowk;
    /* interleaved codes of at most 5 bits (Q5_0, Q5_1, Q5_K) in 5 bits: per piece of 16
     * rows x 32, the low nibbles as the nibble layout, then a bit plane (unpack5) */
    int bits5;
} mvk_job;

/* llama.cpp picks some sums by the number of rows in a product (see MVK_ARITH_Q4K and
 * Q6K below): a row of a product of T rows gets MVK_ROW_PER64 where it lies in its whole
 * fours (row < T / 4 * 4), MVK_ROW_TILED where T >= 8. A batch of several sequences passes
 * each row's kind as its own sequence's product would give it (mvk_layers_batch), so that
 * a row's result depends on its own sequence alone, never on the rows beside it; every
 * other sum here is the same for a row whatever the number of rows and its place. */
enum { MVK_ROW_PER64 = 1, MVK_ROW_TILED = 2 };
static inline int row_kind(const mvk_job *j, int64_t r) {
    if (j->rowk) return j->rowk[r];
    return (r < j->t_rows / 4 * 4 ? MVK_ROW_PER64 : 0) | (j->t_rows >= 8 ? MVK_ROW_TILED : 0);
}
static inline uint8_t seg_kind(int64_t i, int64_t t) {
    return (uint8_t)((i < t / 4 * 4 ? MVK_ROW_PER64 : 0) | (t >= 8 ? MVK_ROW_TILED : 0));
}

/* How a row's float sum is formed from its integer products:
 *   MVK_ARITH_GROUPS  every group's scale times its dot product, mins apart (any format);
 *   MVK_ARITH_Q0      llama.cpp's x86 vec_dot for Q4_0/Q4_1/Q5_0/Q8_0 x Q8_0/Q8_1, to
 *                     the bit: 8 lanes of 4-element integer sums, one fused multiply-add
 *                     per block and lane (block by block), lanes summed as hsum_float_8
 *                     does, then Q4_1's min terms summed block by block;
 *   MVK_ARITH_Q4K     llama.cpp's repacked Q4_K x Q8_K (q4_K_8x8 gemv and gemm, which it
 *                     uses for every Q4_K matrix whose rows come in eights): per 256-block
 *                     the whole integer sum with the 6-bit sub-scales, one fused
 *                     multiply-add by d * dx, the mins' the same way by dmin * dx, then
 *                     their difference;
 *                     Rows in whole fours of a product of 4 or more rows: its gemm,
 *                     which adds per 64 elements (two sub-blocks) instead;
 *   MVK_ARITH_Q6K     llama.cpp's x86 vec_dot for Q6_K x Q8_K: per 256-block 8 lanes of
 *                     integer sums (lane l: elements 4l..4l+3 of each 32, times their
 *                     int8 sub-scales, less 32 x the sub-scaled sums of sub-blocks 2l,
 *                     2l+1), one fused multiply-add each, then hsum_float_8. A product of
 *                     8 rows or more: its tiled K-quant GEMM instead, which adds
 *                     fma(d * isum, dx, acc) per 256-block (ggml-cpu/tiled).
 *   MVK_ARITH_Q0R     llama.cpp's repacked Q4_0 x Q8_0 (q4_0_8x8 gemv and gemm, which it
 *                     uses for every Q4_0 matrix of a product whose rows come in eights,
 *                     a tied head's copy of the embedding too): per
 *                     block of 32 the whole integer sum, one fused multiply-add by
 *                     d * dx, block by block; the same for any number of rows.
 *   MVK_ARITH_Q5K     llama.cpp's x86 vec_dot for Q5_K x Q8_K: per 256-block 8 lanes of
 *                     integer sums (lane l: elements 4l..4l+3 of each sub-block of 32,
 *                     times its 6-bit scale), one fused multiply-add each by d * dx, the
 *                     mins' term block by block (fused: summs - dmin * dx * isum), then
 *                     hsum_float_8 + summs. A product of 8 rows or more: the tiled GEMM,
 *                     per 256-block fma(-dmin, isum_mins, isum * d) times dx, added fused.
 *                     The codes are stored a byte each (the Q8_0 layout). */
enum { MVK_ARITH_GROUPS = 0, MVK_ARITH_Q0 = 1, MVK_ARITH_Q4K = 2, MVK_ARITH_Q6K = 3,
       MVK_ARITH_Q0R = 4, MVK_ARITH_Q5K = 5 };
static inline int arith_k(int arith) {
    return arith == MVK_ARITH_Q4K || arith == MVK_ARITH_Q5K || arith == MVK_ARITH_Q6K;
}
static inline int arith_q0(int arith) { return arith == MVK_ARITH_Q0 || arith == MVK_ARITH_Q0R; }

#define TILE 4
#ifndef MVK_SUMMS
#define MVK_SUMMS(acc, a, b) fmaf((a), (b), (acc))
#endif

#ifdef MVK_AVX512
/* Four scales from element i of a float16 (or float32) array. */
static inline __m128 scales4(const void *p, int64_t i, int f32) {
    if (f32) return _mm_loadu_ps((const float *)p + i);
    return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)p + i)));
}

static inline __m512 scales16(const void *p, int64_t i, __mmask16 m, int f32) {
    if (f32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
}

/* sum_g min[g] * sums[g] (or -zero * sum_g scale[g] * sums[g]) over ns groups */
static inline float min_term(const mvk_job *j, const void *sc, const void *mn,
                             int64_t off, const float *sm, int64_t ns) {
    const void *v = mn ? mn : sc;
    __m512 macc = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= ns; g += 16)
        macc = _mm512_fmadd_ps(scales16(v, off + g, 0xffff, j->f32), _mm512_loadu_ps(sm + g),
                               macc);
    if (g < ns) {
        __mmask16 m = (__mmask16)((1u << (ns - g)) - 1u);
        macc = _mm512_fmadd_ps(scales16(v, off + g, m, j->f32), _mm512_maskz_loadu_ps(m, sm + g),
                               macc);
    }
    float r = _mm512_reduce_add_ps(macc);
    return mn ? r : -(float)j->zero * r;
}

/* Rows [n0, n1) of the job for activation rows [t0, t0 + TT). */
static inline __attribute__((always_inline)) void rows_simd(const mvk_job *j, int64_t n0,
                                                            int64_t n1, int64_t t0,
                                                            const int TT) {
    const int64_t kp = j->kp, ns = kp / j->sub;
    const int64_t row_bytes = j->nibble ? kp / 2 : kp;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    /* lane -> scale index within a chunk */
    const __m512i idx_a = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i idx_b = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i idx_q = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const float *sums = j->sub == 16 ? j->s16 : j->s32;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = j->codes + n * row_bytes;
        const void *sc = j->scale, *mn = j->min;
        const int64_t off = n * ns;
        const int f32 = j->f32;
        __m512 acc[TILE];
        for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
        /* Two accumulators per activation row (the fmadd chain's latency bounds one). */
        __m512 acc2[TILE];
        for (int t = 0; t < TT; t++) acc2[t] = _mm512_setzero_ps();
        if (j->nibble) { /* sub 32; 128 elements per chunk */
            for (int64_t c = 0; c < kp / 128; c++) {
                __m512i v = _mm512_loadu_si512(w + 64 * c);
                __m512i lo = _mm512_and_si512(v, low4);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                __m512 s4 = _mm512_castps128_ps512(scales4(sc, off + 4 * c, f32));
                __m512 sa = _mm512_permutexvar_ps(idx_a, s4);
                __m512 sb = _mm512_permutexvar_ps(idx_b, s4);
                for (int t = 0; t < TT; t++) {
                    const int8_t *q = j->qx + (t0 + t) * kp + 128 * c;
                    const float *de = j->dxe + (t0 + t) * kp / 4 + 32 * c;
                    __m512i ia = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                                     _mm512_loadu_si512(q));
                    __m512i ib = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi,
                                                     _mm512_loadu_si512(q + 64));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia),
                                             _mm512_mul_ps(sa, _mm512_loadu_ps(de)), acc[t]);
                    acc2[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib),
                                              _mm512_mul_ps(sb, _mm512_loadu_ps(de + 16)), acc2[t]);
                }
            }
        } else { /* 64 elements per chunk: 2 groups of 32 or 4 of 16 */
            const __m512i idx = j->sub == 16 ? idx_q : idx_a;
            const int per = j->sub == 16 ? 4 : 2;
            const int64_t chunks = kp / 64;
            int64_t c = 0;
            for (; c + 2 <= chunks; c += 2) {
                __m512i v0 = _mm512_loadu_si512(w + 64 * c);
                __m512i v1 = _mm512_loadu_si512(w + 64 * c + 64);
                __m512 s0 = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(scales4(sc, off + per * c, f32)));
                __m512 s1 = _mm512_permutexvar_ps(
                    idx, _mm512_castps128_ps512(scales4(sc, off + per * (c + 1), f32)));
                for (int t = 0; t < TT; t++) {
                    const int8_t *q = j->qx + (t0 + t) * kp + 64 * c;
                    const float *de = j->dxe + (t0 + t) * kp / 4 + 16 * c;
                    __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v0,
                                                     _mm512_loadu_si512(q));
                    __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v1,
                                                     _mm512_loadu_si512(q + 64));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0),
                                             _mm512_mul_ps(s0, _mm512_loadu_ps(de)), acc[t]);
                    acc2[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1),
                                              _mm512_mul_ps(s1, _mm512_loadu_ps(de + 16)), acc2[t]);
                }
            }
            for (; c < chunks; c++) {
                __m512i v = _mm512_loadu_si512(w + 64 * c);
                __m512 s = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(scales4(sc, off + per * c, f32)));
                for (int t = 0; t < TT; t++) {
                    const int8_t *q = j->qx + (t0 + t) * kp + 64 * c;
                    const float *de = j->dxe + (t0 + t) * kp / 4 + 16 * c;
                    __m512i ia = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v,
                                                     _mm512_loadu_si512(q));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia),
                                             _mm512_mul_ps(s, _mm512_loadu_ps(de)), acc[t]);
                }
            }
        }
        for (int t = 0; t < TT; t++) acc[t] = _mm512_add_ps(acc[t], acc2[t]);
        for (int t = 0; t < TT; t++) {
            int64_t tr = t0 + t;
            float r = _mm512_reduce_add_ps(acc[t]) + min_term(j, sc, mn, off, sums + tr * ns, ns);
            if (j->add) r += j->add[tr * j->ldadd + n];
            j->y[tr * j->ldy + n] = r;
        }
    }
}


static inline float hsum8(__m256 x) { /* ggml's hsum_float_8, in its order */
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* MVK_ARITH_Q0 on the 16-row interleaved layout (kernels.native_layout): one vpdpbusd
 * gives a 4-element lane sum for 16 rows at once (the activation's 4 codes broadcast), so
 * a row's 8 lanes are 8 vectors over rows, and each block's fused multiply-adds, the lanes'
 * reduction (hsum_float_8's tree) and Q4_1's min terms run 16 rows wide: the float order
 * of every row is llama.cpp's, with no horizontal sums and no per-row scalar work.
 * Codes of group G (rows 16G..16G+15), block b: nibble, 4 x 64 bytes, vector c holding
 * lanes 2c (low nibbles) and 2c+1 (high), byte 4r+e = element 4l+e of row r; byte,
 * 8 x 64 bytes, one per lane. Scales (and mins) [G][block][16]; zrow padded to 16. */
static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* A piece (16 rows x 32) of codes of at most 5 bits (Q5_PIECE bytes): the low nibbles as
 * the nibble layout (vector c: lanes 2c, 2c + 1), then 64 bytes whose bit l is lane l's
 * fifth bit. Lanes first..first+count-1 as bytes (rows_q0's byte layout). */
#define Q5_PIECE 320
static inline void unpack5(const uint8_t *p, __m512i *w, const int first, const int count) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(1);
    const __m512i hv = _mm512_loadu_si512(p + 256);
    for (int i = 0; i < count; i++) {
        const int l = first + i;
        const __m512i v = _mm512_loadu_si512(p + 64 * (l / 2));
        const __m512i lo = (l & 1) ? _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)
                                   : _mm512_and_si512(v, low4);
        const __m512i hb = _mm512_and_si512(_mm512_srli_epi16(hv, l), one);
        w[i] = _mm512_or_si512(lo, _mm512_slli_epi16(hb, 4));
    }
}

#define Q0_MAXT 4
static inline __attribute__((always_inline)) void q0_tile(const mvk_job *j, int64_t G,
                                                          int64_t t0, const int T) {
    const int64_t kp = j->kp, ns = kp / 32;
    const int nib = j->nibble, f32 = j->f32, zeroed = j->zrow != NULL;
    const int b5 = j->bits5;
    const int64_t piece = nib ? 256 : b5 ? Q5_PIECE : 512;
    const uint8_t *wg = j->codes + G * ns * piece;
    const int64_t sbase = G * ns * 16;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512i zb = _mm512_setzero_si512();
    if (zeroed)
        zb = _mm512_mullo_epi32(
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(j->zrow + 16 * G))),
            _mm512_set1_epi32(0x01010101));
    const int zi = zeroed && j->zg ? j->zg[G] : -1;
    const int32_t *corr = zi >= 0 ? j->corr + (zi * j->t_rows + t0) * (kp / 4) : NULL;
    const int LP = T <= 2 ? 8 : 4; /* lanes per pass: T * LP accumulators in registers */
    __m512 lanes[Q0_MAXT][8], summs[Q0_MAXT];
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) summs[t] = _mm512_setzero_ps();
    _Pragma("GCC unroll 8") for (int p = 0; p < 8; p += LP) {
        __m512 acc[Q0_MAXT][8];
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++)
            _Pragma("GCC unroll 8") for (int l = 0; l < LP; l++) acc[t][l] = _mm512_setzero_ps();
        for (int64_t b = 0; b < ns; b++) {
            const __m512 sc = scales16(j->scale, sbase + 16 * b, 0xffff, f32);
            __m512 dd[Q0_MAXT];
            _Pragma("GCC unroll 8") for (int t = 0; t < T; t++)
                dd[t] = _mm512_mul_ps(sc, _mm512_set1_ps(j->dxe[(t0 + t) * kp / 4 + 8 * b]));
            __m512i w[8];
            if (nib) {
                _Pragma("GCC unroll 8") for (int c = p / 2; c < (p + LP) / 2; c++) {
                    const __m512i v = _mm512_loadu_si512(wg + b * 256 + 64 * c);
                    w[2 * c - p] = _mm512_and_si512(v, low4);
                    w[2 * c + 1 - p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                }
            } else if (b5) {
                unpack5(wg + b * Q5_PIECE, w, p, LP);
            } else {
                _Pragma("GCC unroll 8") for (int l = 0; l < LP; l++) w[l] = _mm512_loadu_si512(wg + b * 512 + 64 * (p + l));
            }
            _Pragma("GCC unroll 8") for (int l = 0; l < LP; l++)
                _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
                    const int64_t e = (t0 + t) * kp + 32 * b + 4 * (p + l);
                    __m512i i;
                    if (corr) {
                        i = _mm512_set1_epi32(corr[t * (kp / 4) + 8 * b + p + l]);
                        i = _mm512_dpbusd_epi32(i, w[l], bcast4(j->qx + e));
                    } else {
                        i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[l], bcast4(j->qx + e));
                        if (zeroed) i = _mm512_dpbusd_epi32(i, zb, bcast4(j->nq + e));
                    }
                    acc[t][l] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), dd[t], acc[t][l]);
                }
            if (p == 0 && !zeroed) { /* Q4_1: summs += m * s, block by block */
                const __m512 mn = scales16(j->min, sbase + 16 * b, 0xffff, f32);
                _Pragma("GCC unroll 8") for (int t = 0; t < T; t++)
                    summs[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(j->s32[(t0 + t) * ns + b]), summs[t]);
            }
        }
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++)
            _Pragma("GCC unroll 8") for (int l = 0; l < LP; l++) lanes[t][p + l] = acc[t][l];
    }
    const int64_t r0 = 16 * G, left = j->n - r0;
    const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
        const __m512 *L = lanes[t];
        __m512 r = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(L[0], L[4]), _mm512_add_ps(L[2], L[6])),
                                 _mm512_add_ps(_mm512_add_ps(L[1], L[5]), _mm512_add_ps(L[3], L[7])));
        if (!zeroed) r = _mm512_add_ps(r, summs[t]);
        const int64_t tr = t0 + t;
        if (j->add) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, j->add + tr * j->ldadd + r0));
        _mm512_mask_storeu_ps(j->y + tr * j->ldy + r0, m, r);
    }
}

/* MVK_ARITH_Q0R on q0_tile's layout: each block's 8 lane sums added as integers (exact),
 * then one fused multiply-add per block. */
static inline __attribute__((always_inline)) void q0r_tile(const mvk_job *j, int64_t G,
                                                           int64_t t0, const int T) {
    const int64_t kp = j->kp, ns = kp / 32;
    const int nib = j->nibble, f32 = j->f32, zeroed = j->zrow != NULL;
    const uint8_t *wg = j->codes + G * ns * (nib ? 256 : 512);
    const int64_t sbase = G * ns * 16;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512i zb = _mm512_setzero_si512();
    if (zeroed)
        zb = _mm512_mullo_epi32(
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(j->zrow + 16 * G))),
            _mm512_set1_epi32(0x01010101));
    const int zi = zeroed && j->zg ? j->zg[G] : -1;
    const int32_t *corr = zi >= 0 ? j->corr + (zi * j->t_rows + t0) * (kp / 4) : NULL;
    __m512 acc[Q0_MAXT];
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < ns; b++) {
        const __m512 sc = scales16(j->scale, sbase + 16 * b, 0xffff, f32);
        __m512i w[8];
        if (nib) {
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(wg + b * 256 + 64 * c);
                w[2 * c] = _mm512_and_si512(v, low4);
                w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
        } else {
            _Pragma("GCC unroll 8") for (int l = 0; l < 8; l++) w[l] = _mm512_loadu_si512(wg + b * 512 + 64 * l);
        }
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
            const int64_t e0 = (t0 + t) * kp + 32 * b;
            __m512i i = _mm512_setzero_si512();
            if (corr) {
                int32_t c0 = 0;
                for (int l = 0; l < 8; l++) c0 += corr[t * (kp / 4) + 8 * b + l];
                i = _mm512_set1_epi32(c0);
            }
            _Pragma("GCC unroll 8") for (int l = 0; l < 8; l++) {
                i = _mm512_dpbusd_epi32(i, w[l], bcast4(j->qx + e0 + 4 * l));
                if (zeroed && !corr) i = _mm512_dpbusd_epi32(i, zb, bcast4(j->nq + e0 + 4 * l));
            }
            const __m512 dd = _mm512_mul_ps(sc, _mm512_set1_ps(j->dxe[(t0 + t) * kp / 4 + 8 * b]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), dd, acc[t]);
        }
    }
    const int64_t r0 = 16 * G, left = j->n - r0;
    const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
        __m512 r = acc[t];
        const int64_t tr = t0 + t;
        if (j->add) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, j->add + tr * j->ldadd + r0));
        _mm512_mask_storeu_ps(j->y + tr * j->ldy + r0, m, r);
    }
}

/* MVK_ARITH_Q4K on the interleaved layout (rows_q0's, codes per sub-block of 32; ksc and
 * kmin [G][sub-block][16] uint8, kd and kdmin [G][256-block][16] float32): per sub-block
 * the 16 rows' integer dot products, times their 6-bit scales; the mins' terms from the
 * activations' sums per 32; then llama.cpp's repacked gemv (one fused multiply-add per
 * 256-block) or, for activation rows in whole fours, its gemm (one per 64 elements). */
static inline __attribute__((always_inline)) void q4k_tile(const mvk_job *j, int64_t G,
                                                           int64_t t0, const int T,
                                                           const int per64) {
    const int64_t kp = j->kp, ns = kp / 32, nsb = kp / 256;
    const uint8_t *wg = j->codes + G * ns * 256;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 acc[Q0_MAXT], accm[Q0_MAXT];
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) acc[t] = accm[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const __m512 d = _mm512_loadu_ps(j->kd + (G * nsb + b) * 16);
        const __m512 dmin = _mm512_loadu_ps(j->kdmin + (G * nsb + b) * 16);
        __m512 dd[Q0_MAXT], ddm[Q0_MAXT];
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
            const __m512 dx = _mm512_set1_ps(j->dxe[(t0 + t) * kp / 4 + 64 * b]);
            dd[t] = _mm512_mul_ps(d, dx);
            ddm[t] = _mm512_mul_ps(dmin, dx);
        }
        __m512i isum[Q0_MAXT], imin[Q0_MAXT];
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) isum[t] = imin[t] = _mm512_setzero_si512();
        for (int g = 0; g < 8; g++) {
            const int64_t sb = 8 * b + g;
            const __m512i sc = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)((const uint8_t *)j->ksc + (G * ns + sb) * 16)));
            const __m512i mn = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(j->kmin + (G * ns + sb) * 16)));
            __m512i w[8];
            _Pragma("GCC unroll 8") for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(wg + sb * 256 + 64 * c);
                w[2 * c] = _mm512_and_si512(v, low4);
                w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
            _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
                const int8_t *q = j->qx + (t0 + t) * kp + 32 * sb;
                __m512i e0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(q));
                __m512i e1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], bcast4(q + 4));
                _Pragma("GCC unroll 8") for (int l = 2; l < 8; l += 2) {
                    e0 = _mm512_dpbusd_epi32(e0, w[l], bcast4(q + 4 * l));
                    e1 = _mm512_dpbusd_epi32(e1, w[l + 1], bcast4(q + 4 * l + 4));
                }
                isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(_mm512_add_epi32(e0, e1), sc));
                const int32_t *qs = j->qs16 + (t0 + t) * (kp / 16) + 2 * sb;
                imin[t] = _mm512_add_epi32(imin[t], _mm512_mullo_epi32(mn, _mm512_set1_epi32(qs[0] + qs[1])));
            }
            if (per64 ? (g & 1) : g == 7)
                _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), dd[t], acc[t]);
                    accm[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin[t]), ddm[t], accm[t]);
                    isum[t] = imin[t] = _mm512_setzero_si512();
                }
        }
    }
    const int64_t r0 = 16 * G, left = j->n - r0;
    const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
        const int64_t tr = t0 + t;
        __m512 r = _mm512_sub_ps(acc[t], accm[t]);
        if (j->add) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, j->add + tr * j->ldadd + r0));
        _mm512_mask_storeu_ps(j->y + tr * j->ldy + r0, m, r);
    }
}

/* Q6_K's codes are stored in 6 bits (Q6K_PIECE bytes per 32-element piece of 16 rows):
 * the low 4 bits as the nibble layout (256 bytes: vector c holds lanes 2c and 2c + 1), then
 * the high 2 bits (128 bytes: vector h holds lanes 4h..4h+3, lane 4h + i in bits 2i, 2i+1
 * of each byte). This unpacks a piece's 8 lanes to a byte per code (rows_q0's byte layout):
 * the bytes a decode step reads are 3/4 of one a code. */
#define Q6K_PIECE 384
static inline void unpack6(const uint8_t *p, __m512i w[8]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), three = _mm512_set1_epi8(3);
    const __m512i h0 = _mm512_loadu_si512(p + 256), h1 = _mm512_loadu_si512(p + 320);
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512(p + 64 * c);
        w[2 * c] = _mm512_and_si512(v, low4);
        w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        const __m512i a = _mm512_and_si512(_mm512_srli_epi16(h0, 2 * i), three);
        const __m512i b = _mm512_and_si512(_mm512_srli_epi16(h1, 2 * i), three);
        w[i] = _mm512_or_si512(w[i], _mm512_slli_epi16(a, 4));
        w[4 + i] = _mm512_or_si512(w[4 + i], _mm512_slli_epi16(b, 4));
    }
}

/* MVK_ARITH_Q6K on the interleaved layout (rows_q0's byte layout, 32-element pieces; ksc
 * [G][sub-block of 16][16] int8, kd [G][256-block][16]): lane l of a 256-block is, per
 * row, the sum over its 8 pieces p of sc[2p + l/4] times lane l's 4-code dot product, less
 * 32 (qs[2l] sc[2l] + qs[2l+1] sc[2l+1]) (qs: the activations' sums per 16), the integer
 * lanes of rows_q6k. A prompt of 8 rows or more needs only their total (the tiled GEMM),
 * per sub-block sc times its dot product started from -32 qs. */
static inline __attribute__((always_inline)) void q6k_tile(const mvk_job *j, int64_t G,
                                                           int64_t t0, const int T,
                                                           const int tiled) {
    const int64_t kp = j->kp, ns16 = kp / 16, nsb = kp / 256;
    const uint8_t *wg = j->codes + G * (kp / 32) * Q6K_PIECE;
    const int8_t *ksc = (const int8_t *)j->ksc;
    __m512 acc8[8], tacc[Q0_MAXT];
    for (int l = 0; l < 8; l++) acc8[l] = _mm512_setzero_ps();
    for (int t = 0; t < T; t++) tacc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const __m512 d = _mm512_loadu_ps(j->kd + (G * nsb + b) * 16);
        const int8_t *scb = ksc + (G * ns16 + 16 * b) * 16; /* [16 sub-blocks][16 rows] */
        if (tiled) {
            __m512i isum[Q0_MAXT];
            for (int t = 0; t < T; t++) isum[t] = _mm512_setzero_si512();
            for (int p = 0; p < 8; p++) {
                __m512i w[8];
                unpack6(wg + (8 * b + p) * Q6K_PIECE, w);
                for (int h = 0; h < 2; h++) {
                    const __m512i sc = _mm512_cvtepi8_epi32(
                        _mm_loadu_si128((const __m128i *)(scb + (2 * p + h) * 16)));
                    for (int t = 0; t < T; t++) {
                        const int64_t tr = t0 + t;
                        const int8_t *q = j->qx + tr * kp + 256 * b + 32 * p + 16 * h;
                        __m512i e = _mm512_set1_epi32(-32 * j->qs16[tr * ns16 + 16 * b + 2 * p + h]);
                        for (int l = 0; l < 4; l++) e = _mm512_dpbusd_epi32(e, w[4 * h + l], bcast4(q + 4 * l));
                        isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(e, sc));
                    }
                }
            }
            for (int t = 0; t < T; t++) {
                const __m512 dx = _mm512_set1_ps(j->dxe[(t0 + t) * kp / 4 + 64 * b]);
                tacc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(isum[t])), dx, tacc[t]);
            }
            continue;
        }
        /* T == 1: lanes by maddubs (codes <= 63, |q| <= 127: no saturation) and vpdpwssd
         * with the sub-scale in both 16-bit halves */
        __m512i lane[8];
        for (int l = 0; l < 8; l++) lane[l] = _mm512_setzero_si512();
        const int8_t *q = j->qx + t0 * kp + 256 * b;
        for (int p = 0; p < 8; p++) {
            __m512i s2[2];
            for (int h = 0; h < 2; h++) {
                const __m512i s = _mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(scb + (2 * p + h) * 16)));
                s2[h] = _mm512_or_si512(_mm512_and_si512(s, _mm512_set1_epi32(0xffff)),
                                        _mm512_slli_epi32(s, 16));
            }
            __m512i w8[8];
            unpack6(wg + (8 * b + p) * Q6K_PIECE, w8);
            for (int l = 0; l < 8; l++) {
                const __m512i pr = _mm512_maddubs_epi16(w8[l], bcast4(q + 32 * p + 4 * l));
                lane[l] = _mm512_dpwssd_epi32(lane[l], pr, s2[l / 4]);
            }
        }
        const int32_t *qs = j->qs16 + t0 * ns16 + 16 * b;
        const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(j->dxe[t0 * kp / 4 + 64 * b]));
        for (int l = 0; l < 8; l++) {
            const __m512i sa = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(scb + 2 * l * 16)));
            const __m512i sb = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(scb + (2 * l + 1) * 16)));
            const __m512i sub = _mm512_add_epi32(_mm512_mullo_epi32(sa, _mm512_set1_epi32(32 * qs[2 * l])),
                                                 _mm512_mullo_epi32(sb, _mm512_set1_epi32(32 * qs[2 * l + 1])));
            acc8[l] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(_mm512_sub_epi32(lane[l], sub)), acc8[l]);
        }
    }
    const int64_t r0 = 16 * G, left = j->n - r0;
    const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    for (int t = 0; t < T; t++) {
        const int64_t tr = t0 + t;
        __m512 r = tacc[t];
        if (!tiled) {
            const __m512 *L = acc8;
            r = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(L[0], L[4]), _mm512_add_ps(L[2], L[6])),
                              _mm512_add_ps(_mm512_add_ps(L[1], L[5]), _mm512_add_ps(L[3], L[7])));
        }
        if (j->add) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, j->add + tr * j->ldadd + r0));
        _mm512_mask_storeu_ps(j->y + tr * j->ldy + r0, m, r);
    }
}

/* Sub-block sb of a Q5_K group G: the 16 rows' 6-bit scales and mins, and its codes as
 * the 8 lanes' bytes (5 bits a code or a byte each). */
static inline void q5k_piece(const mvk_job *j, int64_t G, int64_t sb, const uint8_t *wg,
                             __m512i *sc, __m512i *mn, __m512i w[8]) {
    const int64_t at = (G * (j->kp / 32) + sb) * 16;
    *sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)j->ksc + at)));
    *mn = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(j->kmin + at)));
    if (j->bits5)
        unpack5(wg + sb * Q5_PIECE, w, 0, 8);
    else
        for (int l = 0; l < 8; l++) w[l] = _mm512_loadu_si512(wg + sb * 512 + 64 * l);
}

/* MVK_ARITH_Q5K on the interleaved byte layout (codes per sub-block of 32 as q0_tile's
 * Q8_0; ksc and kmin [G][sub-block][16] uint8, kd and kdmin [G][256-block][16]). */
static inline __attribute__((always_inline)) void q5k_tile(const mvk_job *j, int64_t G,
                                                           int64_t t0, const int T,
                                                           const int tiled) {
    const int64_t kp = j->kp, ns = kp / 32, nsb = kp / 256, ns16 = kp / 16;
    const int64_t piece = j->bits5 ? Q5_PIECE : 512;
    const uint8_t *wg = j->codes + G * ns * piece;
    __m512 acc8[8], tacc[Q0_MAXT], summs = _mm512_setzero_ps();
    for (int l = 0; l < 8; l++) acc8[l] = _mm512_setzero_ps();
    for (int t = 0; t < T; t++) tacc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const __m512 d = _mm512_loadu_ps(j->kd + (G * nsb + b) * 16);
        const __m512 dmin = _mm512_loadu_ps(j->kdmin + (G * nsb + b) * 16);
        if (tiled) {
            __m512i s1[Q0_MAXT], s2[Q0_MAXT];
            for (int t = 0; t < T; t++) s1[t] = s2[t] = _mm512_setzero_si512();
            for (int g = 0; g < 8; g++) {
                const int64_t sb = 8 * b + g;
                __m512i sc, mn, w[8];
                q5k_piece(j, G, sb, wg, &sc, &mn, w);
                for (int t = 0; t < T; t++) {
                    const int8_t *q = j->qx + (t0 + t) * kp + 32 * sb;
                    __m512i e = _mm512_setzero_si512();
                    for (int l = 0; l < 8; l++) e = _mm512_dpbusd_epi32(e, w[l], bcast4(q + 4 * l));
                    s1[t] = _mm512_add_epi32(s1[t], _mm512_mullo_epi32(e, sc));
                    const int32_t *qs = j->qs16 + (t0 + t) * ns16 + 2 * sb;
                    s2[t] = _mm512_add_epi32(s2[t], _mm512_mullo_epi32(mn, _mm512_set1_epi32(qs[0] + qs[1])));
                }
            }
            for (int t = 0; t < T; t++) {
                const __m512 dx = _mm512_set1_ps(j->dxe[(t0 + t) * kp / 4 + 64 * b]);
                const __m512 res = _mm512_fnmadd_ps(dmin, _mm512_cvtepi32_ps(s2[t]),
                                                    _mm512_mul_ps(_mm512_cvtepi32_ps(s1[t]), d));
                tacc[t] = _mm512_fmadd_ps(res, dx, tacc[t]);
            }
            continue;
        }
        /* T == 1: the 8 lanes */
        __m512i lane[8], imin = _mm512_setzero_si512();
        for (int l = 0; l < 8; l++) lane[l] = _mm512_setzero_si512();
        const int8_t *q = j->qx + t0 * kp;
        for (int g = 0; g < 8; g++) {
            const int64_t sb = 8 * b + g;
            __m512i sc, mn, w8[8];
            q5k_piece(j, G, sb, wg, &sc, &mn, w8);
            for (int l = 0; l < 8; l++) {
                const __m512i w = w8[l];
                const __m512i e = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, bcast4(q + 32 * sb + 4 * l));
                lane[l] = _mm512_add_epi32(lane[l], _mm512_mullo_epi32(e, sc));
            }
            const int32_t *qs = j->qs16 + t0 * ns16 + 2 * sb;
            imin = _mm512_add_epi32(imin, _mm512_mullo_epi32(mn, _mm512_set1_epi32(qs[0] + qs[1])));
        }
        const __m512 dx = _mm512_set1_ps(j->dxe[t0 * kp / 4 + 64 * b]);
        const __m512 dd = _mm512_mul_ps(d, dx), ddm = _mm512_mul_ps(dmin, dx);
        for (int l = 0; l < 8; l++) acc8[l] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(lane[l]), acc8[l]);
        summs = _mm512_fnmadd_ps(ddm, _mm512_cvtepi32_ps(imin), summs);
    }
    const int64_t r0 = 16 * G, left = j->n - r0;
    const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    for (int t = 0; t < T; t++) {
        const int64_t tr = t0 + t;
        __m512 r = tacc[t];
        if (!tiled) {
            const __m512 *L = acc8;
            r = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(L[0], L[4]), _mm512_add_ps(L[2], L[6])),
                              _mm512_add_ps(_mm512_add_ps(L[1], L[5]), _mm512_add_ps(L[3], L[7])));
            r = _mm512_add_ps(r, summs);
        }
        if (j->add) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, j->add + tr * j->ldadd + r0));
        _mm512_mask_storeu_ps(j->y + tr * j->ldy + r0, m, r);
    }
}

/* Rows [n0, n1) (n0 a multiple of 16) of the interleaved formats: group by group, every
 * activation row against the group while its codes are in L1, up to Q0_MAXT at a time
 * (one for Q6_K's 8 lanes below 8 activation rows: their registers). */
#define MVK_BY_T(fn, t)                          \
    switch (t) {                                 \
    case 1: fn(j, G, t0, 1); break;              \
    case 2: fn(j, G, t0, 2); break;              \
    case 3: fn(j, G, t0, 3); break;              \
    default: fn(j, G, t0, 4); break;             \
    }

#define MVK_BY_TK(fn, t, k)                      \
    switch (t) {                                 \
    case 1: fn(j, G, t0, 1, k); break;           \
    case 2: fn(j, G, t0, 2, k); break;           \
    case 3: fn(j, G, t0, 3, k); break;           \
    default: fn(j, G, t0, 4, k); break;          \
    }

/* Tiles are runs of rows of one kind (row_kind): up to Q0_MAXT rows, one for Q6_K's
 * untiled rows (their 8 lanes' registers). */
static void rows_q0(const mvk_job *j, int64_t n0, int64_t n1) {
    const int bit = j->arith == MVK_ARITH_Q4K                                 ? MVK_ROW_PER64
                    : j->arith == MVK_ARITH_Q6K || j->arith == MVK_ARITH_Q5K ? MVK_ROW_TILED
                                                                              : 0;
    for (int64_t G = n0 / 16; 16 * G < n1; G++)
        for (int64_t t0 = 0; t0 < j->t_rows;) {
            const int kind = bit ? row_kind(j, t0) & bit : 0;
            const int lanes8 = j->arith == MVK_ARITH_Q6K || j->arith == MVK_ARITH_Q5K;
            const int64_t step = lanes8 && !kind ? 1 : Q0_MAXT;
            int64_t tt = 1;
            while (tt < step && t0 + tt < j->t_rows && (!bit || (row_kind(j, t0 + tt) & bit) == kind))
                tt++;
            if (j->arith == MVK_ARITH_Q4K) {
                MVK_BY_TK(q4k_tile, tt, kind != 0)
            } else if (j->arith == MVK_ARITH_Q6K) {
                MVK_BY_TK(q6k_tile, tt, kind != 0)
            } else if (j->arith == MVK_ARITH_Q5K) {
                MVK_BY_TK(q5k_tile, tt, kind != 0)
            } else if (j->arith == MVK_ARITH_Q0R) {
                MVK_BY_T(q0r_tile, tt)
            } else {
                MVK_BY_T(q0_tile, tt)
            }
            t0 += tt;
        }
}

static void rows_simd_n(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
    switch (tt) {
    case 1: rows_simd(j, n0, n1, t0, 1); break;
    case 2: rows_simd(j, n0, n1, t0, 2); break;
    case 3: rows_simd(j, n0, n1, t0, 3); break;
    default: rows_simd(j, n0, n1, t0, 4); break;
    }
}
#endif

static inline float h2f(uint16_t h) {
#if defined(__F16C__) && (defined(MVK_AVX512) || defined(MVK_AVX2))
    return _cvtsh_ss(h); /* exact, as the bit manipulation below */
#endif
    uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 0) {
        if (m == 0) {
            bits = sign;
        } else { /* subnormal */
            float f = ldexpf((float)m, -24);
            return sign ? -f : f;
        }
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline int32_t code_at(const mvk_job *j, const uint8_t *w, int64_t k) {
    if (!j->nibble) return w[k];
    int64_t c = k / 128, r = k % 128;
    uint8_t b = w[64 * c + (r % 64)];
    return r < 64 ? (b & 15) : (b >> 4);
}

/* MVK_ARITH_Q0's interleaved layout (see rows_q0): code k of row n, a scale or min of
 * row n's block g. */
static inline int32_t code_q0(const mvk_job *j, int64_t n, int64_t k) {
    const int64_t ns = j->kp / 32, at = (n / 16) * ns + k / 32, l = (k % 32) / 4;
    const int64_t byte = 4 * (n % 16) + k % 4;
    if (j->arith == MVK_ARITH_Q6K) { /* 6 bits a code (see unpack6) */
        const uint8_t *p = j->codes + at * 384;
        const uint8_t lo = p[64 * (l / 2) + byte], hi = p[256 + 64 * (l / 4) + byte];
        return ((l & 1) ? lo >> 4 : lo & 15) | (((hi >> (2 * (l % 4))) & 3) << 4);
    }
    if (j->bits5) { /* 5 bits a code (see unpack5) */
        const uint8_t *p = j->codes + at * 320;
        const uint8_t lo = p[64 * (l / 2) + byte];
        return ((l & 1) ? lo >> 4 : lo & 15) | (((p[256 + byte] >> l) & 1) << 4);
    }
    if (!j->nibble) return j->codes[at * 512 + 64 * l + byte];
    const uint8_t v = j->codes[at * 256 + 64 * (l / 2) + byte];
    return (l & 1) ? v >> 4 : v & 15;
}

static inline float param_q0(const mvk_job *j, const void *p, int64_t n, int64_t g) {
    const int64_t i = ((n / 16) * (j->kp / 32) + g) * 16 + n % 16;
    return j->f32 ? ((const float *)p)[i] : h2f(((const uint16_t *)p)[i]);
}

#ifndef MVK_AVX512 /* the build without AVX-512: every row in plain C */
/* Row n of activation row tr of a Q0 product from its 8 lane sums: their pairing tree,
 * Q4_1's mins (no zero codes), the added term. */
static inline void store_row_q0(const mvk_job *j, int64_t n, int64_t tr, const float acc[8]) {
    const int64_t ns = j->kp / 32;
    float r = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    if (!j->zrow) {
        float summs = 0.0f;
        for (int64_t g = 0; g < ns; g++)
            summs = MVK_SUMMS(summs, param_q0(j, j->min, n, g), j->s32[tr * ns + g]);
        r += summs;
    }
    if (j->add) r += j->add[tr * j->ldadd + n];
    j->y[tr * j->ldy + n] = r;
}

/* MVK_ARITH_Q0R in plain C (the AVX2 build's too): q0r_tile's sums and chain. */
static void rows_generic_q0r(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
    const int64_t kp = j->kp, ns = kp / 32;
    for (int64_t n = n0; n < n1; n++) {
        const int32_t zero = j->zrow ? j->zrow[n] : 0;
        for (int t = 0; t < tt; t++) {
            const int64_t tr = t0 + t;
            const int8_t *q = j->qx + tr * kp;
            const float *de = j->dxe + tr * kp / 4;
            float acc = 0.0f;
            for (int64_t g = 0; g < ns; g++) {
                const float d = param_q0(j, j->scale, n, g) * de[g * 8];
                int32_t isum = 0;
                for (int64_t k = g * 32; k < g * 32 + 32; k++)
                    isum += (code_q0(j, n, k) - zero) * (int32_t)q[k];
                acc = fmaf((float)isum, d, acc);
            }
            if (j->add) acc += j->add[tr * j->ldadd + n];
            j->y[tr * j->ldy + n] = acc;
        }
    }
}

#ifndef MVK_AVX2
/* MVK_ARITH_Q0 in plain C: the same lanes, chain and sums as rows_q0. */
static void rows_generic_q0(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
    const int64_t kp = j->kp, ns = kp / 32;
    for (int64_t n = n0; n < n1; n++) {
        const int32_t zero = j->zrow ? j->zrow[n] : 0;
        for (int t = 0; t < tt; t++) {
            int64_t tr = t0 + t;
            const int8_t *q = j->qx + tr * kp;
            const float *de = j->dxe + tr * kp / 4;
            float acc[8] = {0};
            for (int64_t g = 0; g < ns; g++) {
                float d = param_q0(j, j->scale, n, g) * de[g * 8];
                for (int l = 0; l < 8; l++) {
                    int32_t isum = 0;
                    for (int64_t k = g * 32 + 4 * l; k < g * 32 + 4 * l + 4; k++)
                        isum += (code_q0(j, n, k) - zero) * (int32_t)q[k];
                    acc[l] = fmaf((float)isum, d, acc[l]);
                }
            }
            store_row_q0(j, n, tr, acc);
        }
    }
}

#endif

#ifdef MVK_AVX2
/* rows_generic_q0 in AVX2. Lane l of group g sums the 4 products of elements 4l..4l+3
 * (integers: any order gives the same sum); the 8 lanes are one __m256, each lane's
 * chain the same fused multiply-adds as the plain C, and the same final sum. */
static inline __m256i codes32_q0(const mvk_job *j, int64_t at, int64_t r) {
    if (j->nibble) { /* lanes 2p (low nibbles) and 2p+1 (high) in bytes 64p + 4r.. */
        const uint8_t *b = j->codes + at * 256 + 4 * r;
        uint32_t w0, w1, w2, w3;
        memcpy(&w0, b, 4);
        memcpy(&w1, b + 64, 4);
        memcpy(&w2, b + 128, 4);
        memcpy(&w3, b + 192, 4);
        const __m128i v = _mm_set_epi32((int)w3, (int)w2, (int)w1, (int)w0);
        const __m128i m = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
        return _mm256_set_m128i(_mm_unpackhi_epi32(lo, hi), _mm_unpacklo_epi32(lo, hi));
    }
    uint32_t w[8];
    if (j->bits5) { /* 5 bits a code (see unpack5) */
        const uint8_t *b = j->codes + at * 320 + 4 * r;
        uint32_t hb;
        memcpy(&hb, b + 256, 4);
        for (int l = 0; l < 8; l++) {
            uint32_t v;
            memcpy(&v, b + 64 * (l / 2), 4);
            v = (l & 1) ? (v >> 4) & 0x0f0f0f0fu : v & 0x0f0f0f0fu;
            w[l] = v | (((hb >> l) & 0x01010101u) << 4);
        }
        return _mm256_set_epi32((int)w[7], (int)w[6], (int)w[5], (int)w[4], (int)w[3], (int)w[2],
                                (int)w[1], (int)w[0]);
    }
    const uint8_t *b = j->codes + at * 512 + 4 * r; /* lane l in bytes 64l + 4r.. */
    for (int l = 0; l < 8; l++) memcpy(&w[l], b + 64 * l, 4);
    return _mm256_set_epi32((int)w[7], (int)w[6], (int)w[5], (int)w[4], (int)w[3], (int)w[2],
                            (int)w[1], (int)w[0]);
}

/* 8 rows' float16 (or float32) parameters of one group, from element i on. */
static inline __m256 params8_avx2(const mvk_job *j, const void *p, int64_t i) {
    if (j->f32) return _mm256_loadu_ps((const float *)p + i);
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
#else
    float v[8];
    for (int r = 0; r < 8; r++) v[r] = h2f(((const uint16_t *)p)[i + r]);
    return _mm256_loadu_ps(v);
#endif
}

/* rows n..n+7 (n % 8 == 0) of a Q0 product, one row per float lane. 4-bit codes: the
 * group's 16-row block holds, for lanes 2p and 2p+1, each row's 4 codes in 4 bytes at
 * 64p + 4r, so 8 rows' codes for two lanes are one 32-byte load. Byte codes (with a zero
 * code per row): lane l's at 64l + 4r, taken less the row's zero as int8 (Q8_0's
 * code - 128 and Q5_0's code - 16 fit) and multiplied by maddubs on their magnitude
 * and the activations' sign flipped by theirs (|w| <= 128, |q| <= 127: no saturation).
 * Each row's lane sums, chains and final sum are rows_generic_q0's, lane for lane (vector
 * adds are the same IEEE adds). */
static void rows8_avx2_q0(const mvk_job *j, int64_t n, int64_t t0, int tt) {
    const int64_t kp = j->kp, ns = kp / 32, base = (n / 16) * ns, h = (n % 16) / 8;
    const __m256i m4 = _mm256_set1_epi8(15), ones16 = _mm256_set1_epi16(1);
    const __m256i ones8 = _mm256_set1_epi8(1);
    __m256i zv = _mm256_setzero_si256();
    if (j->zrow) {
        int64_t z8;
        memcpy(&z8, j->zrow + n, 8);
        zv = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(z8));
    }
    const __m256i zb = _mm256_mullo_epi32(zv, _mm256_set1_epi32(0x01010101)); /* per byte */
    for (int t = 0; t < tt; t++) {
        const int64_t tr = t0 + t;
        const int8_t *q = j->qx + tr * kp;
        const float *de = j->dxe + tr * kp / 4;
        __m256 acc[8];
        for (int l = 0; l < 8; l++) acc[l] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ns; g++) {
            const int64_t at = base + g;
            const __m256 d = _mm256_mul_ps(params8_avx2(j, j->scale, at * 16 + 8 * h),
                                           _mm256_set1_ps(de[g * 8]));
            if (!j->nibble) {
                const uint8_t *b = j->codes + at * (j->bits5 ? 320 : 512) + 32 * h;
                for (int l = 0; l < 8; l++) {
                    __m256i c;
                    if (j->bits5) { /* 5 bits a code (see unpack5) */
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 64 * (l / 2)));
                        const __m256i hv = _mm256_loadu_si256((const __m256i *)(b + 256));
                        const __m256i lo = (l & 1) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)
                                                   : _mm256_and_si256(v, m4);
                        c = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, l), ones8), 4));
                    } else {
                        c = _mm256_loadu_si256((const __m256i *)(b + 64 * l));
                    }
                    const __m256i w = _mm256_sub_epi8(c, zb);
                    int32_t a;
                    memcpy(&a, q + g * 32 + 4 * l, 4);
                    const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(a), w);
                    const __m256i i = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), x), ones16);
                    acc[l] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), d, acc[l]);
                }
                continue;
            }
            const uint8_t *b = j->codes + at * 256 + 32 * h;
            for (int p = 0; p < 4; p++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 64 * p));
                const __m256i lo = _mm256_and_si256(w, m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                int32_t a0, a1;
                memcpy(&a0, q + g * 32 + 8 * p, 4);
                memcpy(&a1, q + g * 32 + 8 * p + 4, 4);
                const __m256i x0 = _mm256_set1_epi32(a0), x1 = _mm256_set1_epi32(a1);
                __m256i i0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), ones16);
                __m256i i1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), ones16);
                if (j->zrow) {
                    const __m256i s0 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, x0), ones16);
                    const __m256i s1 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, x1), ones16);
                    i0 = _mm256_sub_epi32(i0, _mm256_mullo_epi32(zv, s0));
                    i1 = _mm256_sub_epi32(i1, _mm256_mullo_epi32(zv, s1));
                }
                acc[2 * p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), d, acc[2 * p]);
                acc[2 * p + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), d, acc[2 * p + 1]);
            }
        }
        __m256 r = _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
            _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])));
        if (!j->zrow) {
            __m256 summs = _mm256_setzero_ps();
            for (int64_t g = 0; g < ns; g++)
                summs = _mm256_fmadd_ps(params8_avx2(j, j->min, (base + g) * 16 + 8 * h),
                                        _mm256_set1_ps(j->s32[tr * ns + g]), summs);
            r = _mm256_add_ps(r, summs);
        }
        if (j->add) r = _mm256_add_ps(r, _mm256_loadu_ps(j->add + tr * j->ldadd + n));
        _mm256_storeu_ps(j->y + tr * j->ldy + n, r);
    }
}

/* MVK_ARITH_Q0R (4-bit codes with a zero code: Q4_0) for rows n..n+7, one row per float
 * lane: rows8_avx2_q0's lane sums added as integers per block, then one fused
 * multiply-add per block (rows_generic_q0r's chain). */
static void rows8_avx2_q0r(const mvk_job *j, int64_t n, int64_t t0, int tt) {
    const int64_t kp = j->kp, ns = kp / 32, base = (n / 16) * ns, h = (n % 16) / 8;
    const __m256i m4 = _mm256_set1_epi8(15), ones16 = _mm256_set1_epi16(1);
    const __m256i ones8 = _mm256_set1_epi8(1);
    int64_t z8;
    memcpy(&z8, j->zrow + n, 8);
    const __m256i zv = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(z8));
    for (int t = 0; t < tt; t++) {
        const int64_t tr = t0 + t;
        const int8_t *q = j->qx + tr * kp;
        const float *de = j->dxe + tr * kp / 4;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t g = 0; g < ns; g++) {
            const int64_t at = base + g;
            const __m256 d = _mm256_mul_ps(params8_avx2(j, j->scale, at * 16 + 8 * h),
                                           _mm256_set1_ps(de[g * 8]));
            const uint8_t *b = j->codes + at * 256 + 32 * h;
            __m256i isum = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 64 * p));
                const __m256i lo = _mm256_and_si256(w, m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                int32_t a0, a1;
                memcpy(&a0, q + g * 32 + 8 * p, 4);
                memcpy(&a1, q + g * 32 + 8 * p + 4, 4);
                const __m256i x0 = _mm256_set1_epi32(a0), x1 = _mm256_set1_epi32(a1);
                const __m256i i0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), ones16);
                const __m256i i1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), ones16);
                const __m256i s0 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, x0), ones16);
                const __m256i s1 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, x1), ones16);
                isum = _mm256_add_epi32(isum, _mm256_add_epi32(i0, i1));
                isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(zv, _mm256_add_epi32(s0, s1)));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, acc);
        }
        if (j->add) acc = _mm256_add_ps(acc, _mm256_loadu_ps(j->add + tr * j->ldadd + n));
        _mm256_storeu_ps(j->y + tr * j->ldy + n, acc);
    }
}

static void rows_avx2_q0(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
    const int64_t kp = j->kp, ns = kp / 32;
    const __m256i ones16 = _mm256_set1_epi16(1);
    const __m256i ones8 = _mm256_set1_epi8(1);
    /* 4-bit codes times int8 activations (|q| <= 127) cannot saturate maddubs' int16
     * pair sums (2 x 15 x 127); wider codes go through int16 products (madd). */
    const int narrow = j->nibble;
    for (int64_t n = n0; n < n1; n++) {
        if ((narrow || j->zrow) && n % 8 == 0 && n + 8 <= n1) { /* 8 rows, one per lane */
            rows8_avx2_q0(j, n, t0, tt);
            n += 7;
            continue;
        }
        const int32_t zero = j->zrow ? j->zrow[n] : 0;
        const __m256i vzero = _mm256_set1_epi32(zero);
        const int64_t base = (n / 16) * ns, r = n % 16;
        __m256 acc[TILE];
        for (int t = 0; t < tt; t++) acc[t] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ns; g++) { /* a group's codes once, for every row t */
            const __m256i c = codes32_q0(j, base + g, r);
            const __m256i ca = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(c));
            const __m256i cb = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(c, 1));
            const float scale = param_q0(j, j->scale, n, g);
            for (int t = 0; t < tt; t++) {
                const int64_t tr = t0 + t;
                const __m256i x = _mm256_loadu_si256((const __m256i *)(j->qx + tr * kp + g * 32));
                __m256i isum; /* lane l: the sum over elements 4l..4l+3, lanes in order */
                if (narrow) {
                    isum = _mm256_madd_epi16(_mm256_maddubs_epi16(c, x), ones16);
                    if (zero) {
                        const __m256i xs = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, x), ones16);
                        isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(vzero, xs));
                    }
                } else {
                    const __m256i xa = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x));
                    const __m256i xb = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(x, 1));
                    isum = _mm256_hadd_epi32(_mm256_madd_epi16(ca, xa), _mm256_madd_epi16(cb, xb));
                    if (zero) {
                        const __m256i xs = _mm256_hadd_epi32(_mm256_madd_epi16(xa, ones16),
                                                             _mm256_madd_epi16(xb, ones16));
                        isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(vzero, xs));
                    }
                    isum = _mm256_permute4x64_epi64(isum, 0xD8); /* 0,1,4,5,2,3,6,7 -> 0..7 */
                }
                const float d = scale * j->dxe[tr * kp / 4 + g * 8];
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d), acc[t]);
            }
        }
        for (int t = 0; t < tt; t++) {
            const int64_t tr = t0 + t;
            float a[8];
            _mm256_storeu_ps(a, acc[t]);
            store_row_q0(j, n, tr, a);
        }
    }
}
#endif

/* MVK_ARITH_Q4K and Q6K in plain C: the same integer sums, chains and lanes. */
static void rows_generic_k(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
    const int64_t kp = j->kp, nsb = kp / 256;
    const int q4 = j->arith == MVK_ARITH_Q4K, q5 = j->arith == MVK_ARITH_Q5K;
    for (int64_t n = n0; n < n1; n++) {
        for (int t = 0; t < tt; t++) {
            const int64_t tr = t0 + t;
            const int8_t *q = j->qx + tr * kp;
            const int32_t *qs = j->qs16 + tr * (kp / 16);
            float acc = 0.0f, accm = 0.0f, lacc[8] = {0};
            for (int64_t b = 0; b < nsb; b++) {
                const float dx = j->dxe[tr * kp / 4 + 64 * b];
                if (q4) { /* the interleaved layout (q4k_tile) */
                    const int64_t G = n / 16, r = n % 16, ns = kp / 32;
                    const uint8_t *sc = (const uint8_t *)j->ksc, *m = j->kmin;
                    const float kd = j->kd[(G * nsb + b) * 16 + r];
                    const float kdmin = j->kdmin[(G * nsb + b) * 16 + r];
                    const int per64 = row_kind(j, tr) & MVK_ROW_PER64; /* see q4k_tile */
                    int32_t isum = 0, imin = 0;
                    for (int g = 0; g < 8; g++) {
                        const int64_t at = (G * ns + 8 * b + g) * 16 + r;
                        int32_t gs = 0;
                        for (int64_t k = 256 * b + 32 * g; k < 256 * b + 32 * g + 32; k++)
                            gs += code_q0(j, n, k) * (int32_t)q[k];
                        isum += sc[at] * gs;
                        imin += (int32_t)m[at] * (qs[16 * b + 2 * g] + qs[16 * b + 2 * g + 1]);
                        if (per64 && (g & 1)) {
                            acc = fmaf((float)isum, kd * dx, acc);
                            accm = fmaf((float)imin, kdmin * dx, accm);
                            isum = imin = 0;
                        }
                    }
                    if (!per64) {
                        acc = fmaf((float)isum, kd * dx, acc);
                        accm = fmaf((float)imin, kdmin * dx, accm);
                    }
                } else if (q5) { /* the interleaved byte layout (q5k_tile) */
                    const int64_t G = n / 16, r = n % 16, ns = kp / 32;
                    const uint8_t *sc = (const uint8_t *)j->ksc, *m = j->kmin;
                    const float kd = j->kd[(G * nsb + b) * 16 + r];
                    const float kdmin = j->kdmin[(G * nsb + b) * 16 + r];
                    int32_t s1 = 0, s2 = 0, lane[8] = {0};
                    for (int g = 0; g < 8; g++) {
                        const int64_t at = (G * ns + 8 * b + g) * 16 + r;
                        for (int l = 0; l < 8; l++) {
                            int32_t ls = 0;
                            for (int64_t k = 256 * b + 32 * g + 4 * l; k < 256 * b + 32 * g + 4 * l + 4; k++)
                                ls += code_q0(j, n, k) * (int32_t)q[k];
                            lane[l] += sc[at] * ls;
                            s1 += sc[at] * ls;
                        }
                        s2 += (int32_t)m[at] * (qs[16 * b + 2 * g] + qs[16 * b + 2 * g + 1]);
                    }
                    /* 8 rows or more: llama.cpp's tiled K-quant GEMM (see q5k_tile) */
                    acc = fmaf(fmaf(-kdmin, (float)s2, (float)s1 * kd), dx, acc);
                    for (int l = 0; l < 8; l++) lacc[l] = fmaf(kd * dx, (float)lane[l], lacc[l]);
                    accm = fmaf(-(kdmin * dx), (float)s2, accm);
                } else { /* the interleaved layout (q6k_tile) */
                    const int64_t G = n / 16, r = n % 16;
                    const int8_t *scg = (const int8_t *)j->ksc + (G * (kp / 16) + 16 * b) * 16 + r;
#define SC(i) ((int32_t)scg[16 * (i)])
                    const float kd = j->kd[(G * nsb + b) * 16 + r];
                    const float dd = kd * dx;
                    int32_t total = 0;
                    for (int l = 0; l < 8; l++) {
                        int32_t lane = 0;
                        for (int g = 0; g < 8; g++) {
                            int32_t ls = 0;
                            for (int64_t k = 256 * b + 32 * g + 4 * l; k < 256 * b + 32 * g + 4 * l + 4; k++)
                                ls += code_q0(j, n, k) * (int32_t)q[k];
                            lane += SC(2 * g + (l >= 4)) * ls;
                        }
                        lane -= 32 * (qs[16 * b + 2 * l] * SC(2 * l) + qs[16 * b + 2 * l + 1] * SC(2 * l + 1));
                        lacc[l] = fmaf(dd, (float)lane, lacc[l]);
                        total += lane;
                    }
#undef SC
                    /* 8 rows or more: llama.cpp's tiled K-quant GEMM (see q6k_tile) */
                    acc = fmaf(kd * (float)total, dx, acc);
                }
            }
            float r = q4                                ? acc - accm
                      : row_kind(j, tr) & MVK_ROW_TILED ? acc
                                       : ((lacc[0] + lacc[4]) + (lacc[2] + lacc[6])) +
                                             ((lacc[1] + lacc[5]) + (lacc[3] + lacc[7]));
            if (q5 && !(row_kind(j, tr) & MVK_ROW_TILED)) r += accm;
            if (j->add) r += j->add[tr * j->ldadd + n];
            j->y[tr * j->ldy + n] = r;
        }
    }
}

#ifdef MVK_AVX2
static inline __m256i bcast4_avx2(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* rows_generic_k's rows n..n+7 (n % 8 == 0) in AVX2, one row per int32 lane: the
 * interleaved layout's 32 bytes at 64c + 32h hold rows 8h..8h+7's 4 codes of lanes 2c
 * and 2c+1 (Q4_K's nibbles) or of lane c (Q6_K's bytes), so maddubs (codes <= 63,
 * |q| <= 127: no saturation) and madd give 8 rows' 4-element sums at once. Every integer
 * sum is rows_generic_k's (integers: any order), and every float operation its own, in
 * its order, lane for lane. */
static void rows8_avx2_k(const mvk_job *j, int64_t n, int64_t t0, int tt) {
    const int64_t kp = j->kp, nsb = kp / 256, ns = kp / 32, ns16 = kp / 16;
    const int64_t G = n / 16, h = (n % 16) / 8;
    const __m256i m4 = _mm256_set1_epi8(15), ones16 = _mm256_set1_epi16(1);
    for (int t = 0; t < tt; t++) {
        const int64_t tr = t0 + t;
        const int8_t *qx = j->qx + tr * kp;
        const int32_t *qs = j->qs16 + tr * ns16;
        const int kind = row_kind(j, tr);
        __m256 r;
        if (j->arith == MVK_ARITH_Q4K) {
            const uint8_t *wg = j->codes + G * ns * 256 + 32 * h;
            const int per64 = kind & MVK_ROW_PER64;
            __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
            for (int64_t b = 0; b < nsb; b++) {
                const __m256 dx = _mm256_set1_ps(j->dxe[tr * kp / 4 + 64 * b]);
                const __m256 dd = _mm256_mul_ps(_mm256_loadu_ps(j->kd + (G * nsb + b) * 16 + 8 * h), dx);
                const __m256 ddm = _mm256_mul_ps(_mm256_loadu_ps(j->kdmin + (G * nsb + b) * 16 + 8 * h), dx);
                __m256i isum = _mm256_setzero_si256(), imin = _mm256_setzero_si256();
                for (int g = 0; g < 8; g++) {
                    const int64_t sb = 8 * b + g, at = (G * ns + sb) * 16 + 8 * h;
                    int64_t s8, m8;
                    memcpy(&s8, (const uint8_t *)j->ksc + at, 8);
                    memcpy(&m8, j->kmin + at, 8);
                    const __m256i sc = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(s8));
                    const __m256i mn = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(m8));
                    const int8_t *q = qx + 32 * sb;
                    __m256i e = _mm256_setzero_si256();
                    for (int c = 0; c < 4; c++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + sb * 256 + 64 * c));
                        const __m256i lo = _mm256_and_si256(v, m4);
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4_avx2(q + 8 * c)),
                                                           _mm256_maddubs_epi16(hi, bcast4_avx2(q + 8 * c + 4)));
                        e = _mm256_add_epi32(e, _mm256_madd_epi16(p, ones16));
                    }
                    isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(e, sc));
                    imin = _mm256_add_epi32(imin, _mm256_mullo_epi32(mn, _mm256_set1_epi32(qs[2 * sb] + qs[2 * sb + 1])));
                    if (per64 ? (g & 1) : g == 7) {
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dd, acc);
                        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), ddm, accm);
                        isum = imin = _mm256_setzero_si256();
                    }
                }
            }
            r = _mm256_sub_ps(acc, accm);
        } else { /* MVK_ARITH_Q6K */
            const uint8_t *wg = j->codes + G * ns * 384 + 32 * h; /* 6 bits a code */
            const int8_t *ksc = (const int8_t *)j->ksc + G * ns16 * 16 + 8 * h;
            const int tiled = kind & MVK_ROW_TILED;
            __m256 lacc[8], acc = _mm256_setzero_ps();
            for (int l = 0; l < 8; l++) lacc[l] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nsb; b++) {
                const float dx = j->dxe[tr * kp / 4 + 64 * b];
                const __m256 kd = _mm256_loadu_ps(j->kd + (G * nsb + b) * 16 + 8 * h);
                __m256i sc[16];
                for (int s = 0; s < 16; s++) {
                    int64_t s8;
                    memcpy(&s8, ksc + (16 * b + s) * 16, 8);
                    sc[s] = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(s8));
                }
                __m256i lane[8];
                for (int l = 0; l < 8; l++) lane[l] = _mm256_setzero_si256();
                for (int p = 0; p < 8; p++) {
                    const uint8_t *w = wg + (8 * b + p) * 384;
                    const int8_t *q = qx + 256 * b + 32 * p;
                    for (int l = 0; l < 8; l++) {
                        const __m256i lo4 = _mm256_loadu_si256((const __m256i *)(w + 64 * (l / 2)));
                        const __m256i hi2 = _mm256_loadu_si256((const __m256i *)(w + 256 + 64 * (l / 4)));
                        const __m256i lo = (l & 1) ? _mm256_and_si256(_mm256_srli_epi16(lo4, 4), m4)
                                                   : _mm256_and_si256(lo4, m4);
                        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hi2, 2 * (l % 4)),
                                                            _mm256_set1_epi8(3));
                        const __m256i v = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
                        const __m256i ls = _mm256_madd_epi16(_mm256_maddubs_epi16(v, bcast4_avx2(q + 4 * l)), ones16);
                        lane[l] = _mm256_add_epi32(lane[l], _mm256_mullo_epi32(sc[2 * p + (l >= 4)], ls));
                    }
                }
                __m256i total = _mm256_setzero_si256();
                for (int l = 0; l < 8; l++) {
                    const __m256i sub = _mm256_add_epi32(
                        _mm256_mullo_epi32(_mm256_set1_epi32(qs[16 * b + 2 * l]), sc[2 * l]),
                        _mm256_mullo_epi32(_mm256_set1_epi32(qs[16 * b + 2 * l + 1]), sc[2 * l + 1]));
                    lane[l] = _mm256_sub_epi32(lane[l], _mm256_slli_epi32(sub, 5));
                    total = _mm256_add_epi32(total, lane[l]);
                }
                if (tiled) {
                    acc = _mm256_fmadd_ps(_mm256_mul_ps(kd, _mm256_cvtepi32_ps(total)), _mm256_set1_ps(dx), acc);
                } else {
                    const __m256 dd = _mm256_mul_ps(kd, _mm256_set1_ps(dx));
                    for (int l = 0; l < 8; l++)
                        lacc[l] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(lane[l]), lacc[l]);
                }
            }
            r = tiled ? acc
                      : _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(lacc[0], lacc[4]), _mm256_add_ps(lacc[2], lacc[6])),
                                      _mm256_add_ps(_mm256_add_ps(lacc[1], lacc[5]), _mm256_add_ps(lacc[3], lacc[7])));
        }
        if (j->add) r = _mm256_add_ps(r, _mm256_loadu_ps(j->add + tr * j->ldadd + n));
        _mm256_storeu_ps(j->y + tr * j->ldy + n, r);
    }
}
#endif

static void rows_generic(const mvk_job *j, int64_t n0, int64_t n1, int64_t t0, int tt) {
    if (j->arith == MVK_ARITH_Q0R) {
#ifdef MVK_AVX2
        for (int64_t n = n0; n < n1; n++) {
            if (j->nibble && j->zrow && n % 8 == 0 && n + 8 <= n1) { /* 8 rows at once */
                rows8_avx2_q0r(j, n, t0, tt);
                n += 7;
            } else {
                rows_generic_q0r(j, n, n + 1, t0, tt);
            }
        }
#else
        rows_generic_q0r(j, n0, n1, t0, tt);
#endif
        return;
    }
    if (j->arith == MVK_ARITH_Q0) {
#ifdef MVK_AVX2
        rows_avx2_q0(j, n0, n1, t0, tt);
#else
        rows_generic_q0(j, n0, n1, t0, tt);
#endif
        return;
    }
    if (j->arith == MVK_ARITH_Q5K) { /* plain C in every build without AVX-512 */
        rows_generic_k(j, n0, n1, t0, tt);
        return;
    }
    if (j->arith == MVK_ARITH_Q4K || j->arith == MVK_ARITH_Q6K) {
#ifdef MVK_AVX2
        for (int64_t n = n0; n < n1; n++) {
            if (n % 8 == 0 && n + 8 <= n1) { /* 8 rows at once, one per lane */
                rows8_avx2_k(j, n, t0, tt);
                n += 7;
            } else {
                rows_generic_k(j, n, n + 1, t0, tt);
            }
        }
#else
        rows_generic_k(j, n0, n1, t0, tt);
#endif
        return;
    }
    const int64_t kp = j->kp, sub = j->sub, ns = kp / sub;
    const int64_t row_bytes = j->nibble ? kp / 2 : kp;
    const float *sums = sub == 16 ? j->s16 : j->s32;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = j->codes + n * row_bytes;
        for (int t = 0; t < tt; t++) {
            int64_t tr = t0 + t;
            const int8_t *q = j->qx + tr * kp;
            const float *de = j->dxe + tr * kp / 4;
            float acc = 0.0f, macc = 0.0f;
            for (int64_t g = 0; g < ns; g++) {
                int32_t isum = 0;
                for (int64_t k = g * sub; k < (g + 1) * sub; k++) {
                    int32_t code;
                    if (j->nibble) {
                        int64_t c = k / 128, r = k % 128;
                        uint8_t b = w[64 * c + (r % 64)];
                        code = r < 64 ? (b & 15) : (b >> 4);
                    } else {
                        code = w[k];
                    }
                    isum += code * (int32_t)q[k];
                }
                int64_t i = n * ns + g;
                float scale = j->f32 ? ((const float *)j->scale)[i]
                                     : h2f(((const uint16_t *)j->scale)[i]);
                float mn = !j->min ? -(float)j->zero * scale
                           : j->f32 ? ((const float *)j->min)[i]
                                    : h2f(((const uint16_t *)j->min)[i]);
                acc += (float)isum * (scale * de[g * sub / 4]);
                macc += mn * sums[tr * ns + g];
            }
            float r = acc + macc;
            if (j->add) r += j->add[tr * j->ldadd + n];
            j->y[tr * j->ldy + n] = r;
        }
    }
}
#endif

static void run_rows(const mvk_job *j, int64_t n0, int64_t n1) {
#ifdef MVK_AVX512
    if (arith_q0(j->arith) || arith_k(j->arith)) {
        rows_q0(j, n0, n1);
        return;
    }
#endif
    for (int64_t t0 = 0; t0 < j->t_rows; t0 += TILE) {
        int tt = (int)(j->t_rows - t0 < TILE ? j->t_rows - t0 : TILE);
#ifdef MVK_AVX512
        rows_simd_n(j, n0, n1, t0, tt);
#else
        rows_generic(j, n0, n1, t0, tt);
#endif
    }
}

/* ---- threads -------------------------------------------------------------------------
 * A small pool shares each product's rows, in chunks claimed from one atomic ticket
 * (generation | chunk count | next chunk), so the calling thread never waits for a worker
 * that is not running: on a busy machine (several node processes on a few cores) it
 * simply does more chunks itself. Workers spin briefly for the next product (decode
 * calls come tens of microseconds apart), then sleep on a condition variable.
 */
#define MAX_THREADS 64
#define GEN_SHIFT 40
#define COUNT_SHIFT 20
#define FIELD ((1ull << COUNT_SHIFT) - 1)
static int g_threads = 1;
static mvk_job g_job;            /* written by the caller only while no chunk is out */
/* or, where set, chunk i of a generation is g_task(g_ctx, i) (dispatch_task) */
static void (*g_task)(const void *ctx, int64_t i);
static const void *g_ctx;
static int64_t g_chunk_rows = 16;
static atomic_ullong g_ticket;   /* gen << 40 | chunks << 20 | next */
static atomic_llong g_done;
static atomic_int g_sleepers;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t g_call = PTHREAD_MUTEX_INITIALIZER; /* one product at a time */

static inline void relax(void) {
#ifdef MVK_AVX512
    _mm_pause();
#endif
}

/* Claim and run chunks of generation gen until none is left; returns chunks run. */
static int64_t work(unsigned long long gen) {
    int64_t ran = 0;
    for (;;) {
        unsigned long long t = atomic_load(&g_ticket);
        if ((t >> GEN_SHIFT) != gen) break;
        unsigned long long chunks = (t >> COUNT_SHIFT) & FIELD, next = t & FIELD;
        if (next >= chunks) break;
        if (!atomic_compare_exchange_weak(&g_ticket, &t, t + 1)) continue;
        if (g_task) {
            g_task(g_ctx, (int64_t)next);
        } else {
            int64_t n0 = (int64_t)next * g_chunk_rows;
            int64_t n1 = n0 + g_chunk_rows < g_job.n ? n0 + g_chunk_rows : g_job.n;
            run_rows(&g_job, n0, n1);
        }
        atomic_fetch_add(&g_done, 1);
        ran++;
    }
    return ran;
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* How long an idle worker spins before it sleeps: longer than the gap between a decode
 * step's products (the torch ops between them), short enough to give a busy machine its
 * core back as soon as decoding pauses. */
#define SPIN_NS 300000

static void *worker(void *arg) {
    (void)arg;
    unsigned long long seen = atomic_load(&g_ticket) >> GEN_SHIFT;
    for (;;) {
        unsigned long long gen;
        int64_t since = now_ns();
        int spins = 0;
        while ((gen = atomic_load(&g_ticket) >> GEN_SHIFT) == seen) {
            if ((++spins & 63) != 0 || now_ns() - since < SPIN_NS) {
                relax();
                continue;
            }
            pthread_mutex_lock(&g_mu);
            atomic_fetch_add(&g_sleepers, 1);
            while ((gen = atomic_load(&g_ticket) >> GEN_SHIFT) == seen)
                pthread_cond_wait(&g_cv, &g_mu);
            atomic_fetch_sub(&g_sleepers, 1);
            pthread_mutex_unlock(&g_mu);
            break;
        }
        seen = gen;
        work(gen);
    }
    return NULL;
}

/* Grow the pool to n threads in all (the caller counts as one). Returns the number. */
int mvk_set_threads(int n) {
    pthread_mutex_lock(&g_call);
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    while (g_threads < n) {
        pthread_t th;
        if (pthread_create(&th, NULL, worker, NULL) != 0) break;
        pthread_detach(th);
        g_threads++;
    }
    int r = g_threads;
    pthread_mutex_unlock(&g_call);
    return r;
}

static void dispatch(mvk_job j, int threads);

void mvk_matmul(const int8_t *qx, const float *dxe, const float *s16, const float *s32,
                int64_t t_rows, int64_t kp, const uint8_t *codes, const void *scale,
                const void *min, int64_t n, int nibble, int sub, int zero, int f32, float *y,
                int64_t ldy, const float *add, int64_t ldadd, int threads) {
    mvk_job j = {qx, dxe, s16, s32, t_rows, kp, codes, scale, min, n, nibble, sub, zero, f32,
                 y, ldy, add, ldadd, NULL, NULL, MVK_ARITH_GROUPS, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0};
    dispatch(j, threads);
}

/* A new generation of `chunks` chunks (g_job's rows, or g_task's tasks, set before):
 * workers woken where they sleep, the caller taking part, back when all are done.
 * Called with g_call held. */
static void run_generation(int64_t chunks) {
    atomic_store(&g_done, 0);
    unsigned long long gen = (atomic_load(&g_ticket) >> GEN_SHIFT) + 1;
    atomic_store(&g_ticket, (gen << GEN_SHIFT) | ((unsigned long long)chunks << COUNT_SHIFT));
    if (atomic_load(&g_sleepers) > 0) {
        pthread_mutex_lock(&g_mu);
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
    }
    work(gen);
    while (atomic_load(&g_done) < chunks) relax();
}

static void dispatch(mvk_job j, int threads) {
    const int64_t n = j.n;
    pthread_mutex_lock(&g_call);
    int parts = threads < g_threads ? threads : g_threads;
    if (parts <= 1 || n < 64) {
        run_rows(&j, 0, n);
        pthread_mutex_unlock(&g_call);
        return;
    }
    /* About 8 chunks per thread, multiples of 16 rows. */
    int64_t rows = (n / (8 * parts) + 15) / 16 * 16;
    if (rows < 16) rows = 16;
    int64_t chunks = (n + rows - 1) / rows;
    g_job = j;
    g_task = NULL;
    g_chunk_rows = rows;
    run_generation(chunks);
    pthread_mutex_unlock(&g_call);
}

/* Tasks 0..count-1 of fn over the pool, the caller taking part (as dispatch). */
static void dispatch_task(void (*fn)(const void *, int64_t), const void *ctx, int64_t count) {
    pthread_mutex_lock(&g_call);
    if (g_threads <= 1 || count <= 1) {
        for (int64_t i = 0; i < count; i++) fn(ctx, i);
        pthread_mutex_unlock(&g_call);
        return;
    }
    g_task = fn;
    g_ctx = ctx;
    run_generation(count);
    g_task = NULL;
    pthread_mutex_unlock(&g_call);
}

/* ---- one call per product ------------------------------------------------------------
 * The weights' description is built once per matrix (native.py); the activations are
 * quantised into a per-thread scratch buffer, so a decode product is one foreign call. */
typedef struct {
    const uint8_t *codes;
    const void *scale, *min;
    int64_t n, kp;
    int32_t nibble, sub, zero, mode, f32, pad; /* pad 5: interleaved codes in 5 bits */
    const float *norm; /* RMS norm weights applied to x first (NULL: none) */
    float eps;
    int32_t arith;     /* MVK_ARITH_* */
    const uint8_t *zrow; /* MVK_ARITH_Q0: each row's zero code (NULL: mins) */
    const void *ksc;     /* MVK_ARITH_Q4K / Q6K: see mvk_job */
    const uint8_t *kmin;
    const float *kd, *kdmin;
    const int8_t *zg;    /* MVK_ARITH_Q0: see mvk_job (NULL: every group the -q product) */
    int32_t zlist[4];    /* the zero codes zg indexes */
    int32_t nz;
    /* the product's next rows, in another format (a fused q/k/v of Q4_K and Q6_K rows:
     * each format's rows summed in its own llama.cpp order); NULL: none */
    const void *next;
} mvk_weights;

/* RMS norm as ggml computes it: the mean of squares summed in double, x * (1/sqrt(mean +
 * eps)) in float, then times the weight. */
static void rms_norm(const float *x, int64_t t_rows, int64_t k, int64_t ldx, const float *w,
                     float eps, float *out) {
    /* Each row's sum in order, eight rows' chains side by side (one is latency-bound). */
    for (int64_t t0 = 0; t0 < t_rows; t0 += 8) {
        const int nr = t_rows - t0 < 8 ? (int)(t_rows - t0) : 8;
        double sum[8] = {0};
        for (int64_t i = 0; i < k; i++)
            for (int r = 0; r < nr; r++) {
                const float v = x[(t0 + r) * ldx + i];
                sum[r] += (double)(v * v);
            }
        for (int r = 0; r < nr; r++) {
            const float *xr = x + (t0 + r) * ldx;
            const float scale = 1.0f / sqrtf((float)(sum[r] / (double)k) + eps);
            float *o = out + (t0 + r) * k;
            for (int64_t i = 0; i < k; i++) o[i] = (xr[i] * scale) * w[i];
        }
    }
}

static __thread int8_t *t_buf;
static __thread size_t t_cap;

/* A product's activations, rows r0..r1-1: the fused norm, the quantisation, and what the
 * formats need besides (-q, the zero codes' terms, integer sums per 16). */
typedef struct {
    const mvk_weights *w;
    const float *x;
    int64_t ldx, k_in, kp, t_rows;
    float *xn; /* the normed rows (NULL: no norm) */
    int8_t *qx;
    float *dxe, *s16, *s32;
    int8_t *nq;
    int32_t *corr, *qs16;
    int nz;
} prep_ctx;

static void prep_rows(const prep_ctx *c, int64_t r0, int64_t r1) {
    const mvk_weights *w = c->w;
    const int64_t kp = c->kp, t = r1 - r0;
    const float *x = c->x + r0 * c->ldx;
    int64_t ldx = c->ldx;
    if (c->xn) {
        rms_norm(x, t, c->k_in, ldx, w->norm, w->eps, c->xn + r0 * c->k_in);
        x = c->xn + r0 * c->k_in;
        ldx = c->k_in;
    }
    int8_t *qx = c->qx + r0 * kp;
    mvk_quantize(x, t, c->k_in, ldx, kp, w->mode, qx, c->dxe + r0 * kp / 4, c->s16 + r0 * kp / 16,
                 c->s32 + r0 * kp / 32);
    if (c->nq) /* -q, for a mixed group's zero codes as one more u8 x s8 product */
        for (int64_t i = 0; i < t * kp; i++) c->nq[r0 * kp + i] = (int8_t)-qx[i];
    if (c->corr)
        for (int64_t i = 0; i < t * kp / 4; i++) {
            const int32_t sum = qx[4 * i] + qx[4 * i + 1] + qx[4 * i + 2] + qx[4 * i + 3];
            for (int z = 0; z < c->nz; z++)
                c->corr[z * c->t_rows * kp / 4 + r0 * kp / 4 + i] = -w->zlist[z] * sum;
        }
    if (c->qs16) /* the activations' integer sums per 16 */
        for (int64_t i = 0; i < t * kp / 16; i++) {
            int32_t sum = 0;
            for (int k = 0; k < 16; k++) sum += qx[16 * i + k];
            c->qs16[r0 * kp / 16 + i] = sum;
        }
}

static void prep_task(const void *ctx, int64_t i) {
    const prep_ctx *c = ctx;
    prep_rows(c, 8 * i, 8 * i + 8 < c->t_rows ? 8 * i + 8 : c->t_rows);
}

/* One part of a product (mvk_linear_rows): its rows into y's columns, row stride ldy. */
static int linear_part(const mvk_weights *w, const float *x, int64_t t_rows, int64_t k_in,
                       int64_t ldx, float *y, int64_t ldy, const float *add, int64_t ldadd,
                       const uint8_t *rowk) {
    const int64_t kp = w->kp;
    const int q0 = arith_q0(w->arith) && w->zrow != NULL;
    size_t need = (size_t)t_rows * (size_t)(kp + (kp / 4 + kp / 16 + kp / 32) * 4) + 64;
    if (q0) need += (size_t)t_rows * (size_t)kp + 64;
    const int nz = q0 && w->zg ? w->nz : 0;
    if (nz) need += (size_t)nz * (size_t)t_rows * (size_t)kp + 64;
    const int kq = arith_k(w->arith);
    if (kq) need += (size_t)t_rows * (size_t)(kp / 16) * 4 + 64;
    if (w->norm) need += (size_t)t_rows * (size_t)k_in * 4 + 64;
    if (need > t_cap) {
        free(t_buf);
        t_buf = aligned_alloc(64, (need + 63) / 64 * 64);
        t_cap = t_buf ? need : 0;
        if (!t_buf) return -1;
    }
    float *dxe = (float *)t_buf;
    float *s16 = dxe + t_rows * kp / 4;
    float *s32 = s16 + t_rows * kp / 16;
    int8_t *qx = (int8_t *)(s32 + t_rows * kp / 32);
    const uintptr_t past = (uintptr_t)(qx + t_rows * kp) + (w->norm ? t_rows * k_in * 4 + 64 : 0);
    prep_ctx c = {w, x, ldx, k_in, kp, t_rows, NULL, qx, dxe, s16, s32, NULL, NULL, NULL, nz};
    if (w->norm) c.xn = (float *)(((uintptr_t)(qx + t_rows * kp) + 63) & ~(uintptr_t)63);
    if (q0) c.nq = (int8_t *)((past + 63) & ~(uintptr_t)63);
    if (nz) c.corr = (int32_t *)(((uintptr_t)(c.nq + t_rows * kp) + 63) & ~(uintptr_t)63);
    if (kq) c.qs16 = (int32_t *)((past + 63) & ~(uintptr_t)63);
    if (t_rows >= 16) /* a prompt's rows over the pool, 8 at a time */
        dispatch_task(prep_task, &c, (t_rows + 7) / 8);
    else
        prep_rows(&c, 0, t_rows);
    int8_t *nq = c.nq;
    int32_t *corr = c.corr, *qs16 = c.qs16;
    mvk_job j = {qx, dxe, s16, s32, t_rows, kp, w->codes, w->scale, w->min, w->n, w->nibble,
                 w->sub, w->zero, w->f32, y, ldy, add, ldadd, nq, w->zrow, w->arith,
                 w->ksc, w->kmin, w->kd, w->kdmin, qs16, nz ? w->zg : NULL, corr, rowk,
                 w->pad == 5};
    dispatch(j, MAX_THREADS);
    return 0;
}

/* As mvk_linear, row r's sums of kind rowk[r] (MVK_ROW_*; NULL: a product of t_rows);
 * a chain of parts (mvk_weights.next) fills consecutive columns of y. */
int mvk_linear_rows(const mvk_weights *w, const float *x, int64_t t_rows, int64_t k_in,
                    int64_t ldx, float *y, const float *add, int64_t ldadd, const uint8_t *rowk) {
    int64_t total = 0, off = 0;
    for (const mvk_weights *p = w; p; p = (const mvk_weights *)p->next) total += p->n;
    for (const mvk_weights *p = w; p; p = (const mvk_weights *)p->next) {
        const int rc = linear_part(p, x, t_rows, k_in, ldx, y + off, total,
                                   add ? add + off : NULL, ldadd, rowk);
        if (rc != 0) return rc;
        off += p->n;
    }
    return 0;
}

int mvk_linear(const mvk_weights *w, const float *x, int64_t t_rows, int64_t k_in,
               int64_t ldx, float *y, const float *add, int64_t ldadd) {
    return mvk_linear_rows(w, x, t_rows, k_in, ldx, y, add, ldadd, NULL);
}

/* ---- rope, as ggml's CPU backend computes it -------------------------------------------
 * Angles: theta_i = pos * base^(-2i/n_dims), formed in float32 by repeated multiplication
 * (theta *= powf(base, -2/n_dims)), then cosf/sinf of freq_scale * theta; the rotation of
 * a pair (x0, x1) is fma(x0, c, -(x1 * s)), fma(x0, s, x1 * c), the contraction ggml's
 * compiled x0*c - x1*s and x0*s + x1*c come to (checked against its outputs). */
void mvk_rope_cache(float base, float freq_scale, const float *ff, int64_t n_dims, int64_t pos0,
                    int64_t npos, float *cs, float *sn) {
    /* ff: Llama 3's rope_freqs factors [n_dims / 2], each pair's angle divided by its own
     * (NULL: none), as ggml_rope_cache_init divides theta */
    const float theta_scale = powf(base, -2.0f / (float)n_dims);
    const int64_t h = n_dims / 2;
    for (int64_t p = 0; p < npos; p++) {
        float theta = (float)(pos0 + p);
        for (int64_t i = 0; i < h; i++) {
            const float t = freq_scale * (ff ? theta / ff[i] : theta);
            cs[p * h + i] = cosf(t);
            sn[p * h + i] = sinf(t);
            theta *= theta_scale;
        }
    }
}

/* In place on x [t][heads][hd], half-split pairs (i, i + hd/2); cs, sn [t][hd/2]. */
void mvk_rope_neox(float *x, int64_t t, int64_t heads, int64_t hd, const float *cs,
                   const float *sn) {
    const int64_t h = hd / 2;
    for (int64_t r = 0; r < t; r++) {
        const float *c = cs + r * h, *s = sn + r * h;
        for (int64_t k = 0; k < heads; k++) {
            float *v = x + (r * heads + k) * hd;
            for (int64_t i = 0; i < h; i++) {
                const float x0 = v[i], x1 = v[i + h];
                const float s1 = x1 * s[i], c1 = x1 * c[i];
                v[i] = fmaf(x0, c[i], -s1);
                v[i + h] = fmaf(x0, s[i], c1);
            }
        }
    }
}

/* ---- 16 float lanes for attention and SwiGLU: __m512 in the AVX-512 build, an array
 * in plain C doing the same IEEE operation lane by lane (fmaf where the vector code
 * fuses, _mm512_reduce_add_ps's pairing tree, scalef as ldexpf), so both builds give the
 * same bits and the plain build runs the default path on any x86-64 CPU. */
#ifdef MVK_AVX512
typedef __m512 v16;
static inline v16 v_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 v_fmadd(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v_fnmadd(v16 a, v16 b, v16 c) { return _mm512_fnmadd_ps(a, b, c); }
static inline v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
static inline float v_sum(v16 a) { return _mm512_reduce_add_ps(a); }
/* p * 2^n for n integral; where |n| > 192, +inf (n > 0) or 0 (as ggml_v_expf) */
static inline v16 v_scale2(v16 p, v16 n) {
    v16 r = _mm512_scalef_ps(p, n);
    const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
    if (big) {
        const __mmask16 neg = _mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ);
        const __m512 alt = _mm512_mask_blend_ps(neg, _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
        r = _mm512_mask_blend_ps(big, r, alt);
    }
    return r;
}
#else
typedef struct {
    float f[16];
} v16;
#define V_EACH(expr)                              \
    v16 r;                                        \
    for (int l = 0; l < 16; l++) r.f[l] = (expr); \
    return r
static inline v16 v_zero(void) { V_EACH(0.0f); }
static inline v16 v_set1(float x) { V_EACH(x); }
static inline v16 v_load(const float *p) { V_EACH(p[l]); }
static inline void v_store(float *p, v16 v) { memcpy(p, v.f, sizeof v.f); }
static inline v16 v_fmadd(v16 a, v16 b, v16 c) { V_EACH(fmaf(a.f[l], b.f[l], c.f[l])); }
static inline v16 v_fnmadd(v16 a, v16 b, v16 c) { V_EACH(fmaf(-a.f[l], b.f[l], c.f[l])); }
static inline v16 v_add(v16 a, v16 b) { V_EACH(a.f[l] + b.f[l]); }
static inline v16 v_sub(v16 a, v16 b) { V_EACH(a.f[l] - b.f[l]); }
static inline v16 v_mul(v16 a, v16 b) { V_EACH(a.f[l] * b.f[l]); }
static inline v16 v_div(v16 a, v16 b) { V_EACH(a.f[l] / b.f[l]); }
static inline v16 v_scale2(v16 p, v16 n) {
    V_EACH(fabsf(n.f[l]) > 192.0f ? (n.f[l] <= 0.0f ? 0.0f : INFINITY)
                                  : ldexpf(p.f[l], (int)n.f[l]));
}
#undef V_EACH
static inline float v_sum(v16 a) { /* _mm512_reduce_add_ps: halves, quarters, pairs */
    float t3[8], t6[4];
    for (int i = 0; i < 8; i++) t3[i] = a.f[8 + i] + a.f[i];
    for (int i = 0; i < 4; i++) t6[i] = t3[4 + i] + t3[i];
    return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}
#endif

/* ---- attention, as ggml's CPU backend computes it without flash attention -------------
 * kq = k . q with q rounded to float16 (the cache holds float16 values), softmax over the
 * row with masked entries at -inf, the weights rounded to float16, kqv = v . weights.
 * A decode step's dots are ggml_vec_dot_f16's (4 x 16 lanes, stride 64, then its
 * reduction); a prompt's (several query rows) are llamafile's tinyBLAS f16 GEMM's (one
 * 16-lane accumulator per output). exp is the same polynomial as ggml_v_expf (AVX-512),
 * written out here; the softmax sums 16-element partial sums in double as ggml does. */
static inline float dot64(const float *x, const float *y, int64_t n) {
    const int64_t np = n & ~(int64_t)63; /* ggml_vec_dot_f16: whole steps of 64 in SIMD */
    v16 s[4] = {v_zero(), v_zero(), v_zero(), v_zero()};
    for (int64_t i = 0; i < np; i += 64)
        for (int j = 0; j < 4; j++)
            s[j] = v_fmadd(v_load(x + i + 16 * j), v_load(y + i + 16 * j), s[j]);
    s[0] = v_add(s[0], s[2]);
    s[1] = v_add(s[1], s[3]);
    s[0] = v_add(s[0], s[1]);
    const float r = v_sum(s[0]);
    if (np == n) return r;
    double acc = r; /* the leftovers (a head dim of 96: 32), float products summed in double */
    for (int64_t i = np; i < n; i++) acc += (double)(x[i] * y[i]);
    return (float)acc;
}

static inline float dot16(const float *x, const float *y, int64_t n) {
    v16 s = v_zero();
    for (int64_t i = 0; i < n; i += 16) s = v_fmadd(v_load(x + i), v_load(y + i), s);
    return v_sum(s);
}

/* o[d] = dot64(v[.][d], w) for every d at once: v rows [n][hd] as the cache holds them,
 * the 64 partial sums per d (position s into slot s % 64, in order) kept as vectors over
 * d, then reduced in dot64's tree (its 4 accumulators, then _mm512_reduce_add_ps's
 * pairing of 16 lanes). part: 64 * hd floats. hd a multiple of 16. */
static void kqv_dot64(const float *v, const float *w, int64_t n, int64_t hd, float *part,
                      float *o) {
    const int64_t used = n < 64 ? n : 64; /* slots past n stay zero: not stored */
    memset(part, 0, sizeof(float) * (size_t)(used * hd));
    for (int64_t s = 0; s < n; s++) {
        const v16 ws = v_set1(w[s]);
        float *p = part + (s % 64) * hd;
        const float *vr = v + s * hd;
        for (int64_t d = 0; d < hd; d += 16)
            v_store(p + d, v_fmadd(v_load(vr + d), ws, v_load(p + d)));
    }
#define P(slot) ((slot) < used ? v_load(part + (slot) * hd + d) : v_zero())
    for (int64_t d = 0; d < hd; d += 16) {
        v16 x[16];
        for (int l = 0; l < 16; l++) /* accumulators j = 0..3 hold slots 16j + l */
            x[l] = v_add(v_add(P(l), P(32 + l)), v_add(P(16 + l), P(48 + l)));
        v16 t3[8], t6[4];
        for (int i = 0; i < 8; i++) t3[i] = v_add(x[8 + i], x[i]);
        for (int i = 0; i < 4; i++) t6[i] = v_add(t3[4 + i], t3[i]);
        v_store(o + d, v_add(v_add(t6[0], t6[2]), v_add(t6[1], t6[3])));
    }
#undef P
}

/* exp(x): x = n ln2 + b (n rounded, ln2 in two parts), 2^n * p(b), p of degree 5. */
static inline v16 exp16(v16 x) {
    const v16 shift = v_set1(0x1.8p23f);
    const v16 z = v_fmadd(x, v_set1(0x1.715476p+0f), shift);
    const v16 n = v_sub(z, shift);
    const v16 b = v_fnmadd(n, v_set1(0x1.7f7d1cp-20f), v_fnmadd(n, v_set1(0x1.62e4p-1f), x));
    const v16 b2 = v_mul(b, b);
    const v16 hi = v_fmadd(v_set1(0x1.0e4020p-7f), b, v_set1(0x1.573e2ep-5f));
    const v16 mid = v_fmadd(v_set1(0x1.555e66p-3f), b, v_set1(0x1.fffdb6p-2f));
    const v16 lo = v_fmadd(v_set1(0x1.ffffecp-1f), b, v_set1(1.0f));
    const v16 p = v_fmadd(v_fmadd(hi, b2, mid), b2, lo);
    return v_scale2(p, n);
}

/* q [t][nh][hd] (rounded to float16 here), k/v caches [kv_heads][max_seq][hd] holding
 * float16 values, positions pos..pos+t-1 (each query sees keys 0..its position, and with
 * window > 0 only the last `window` of them); scale multiplies kq (ggml's kq_scale).
 * out [t][nh * hd]. scratch: (3 * npad + hd * npad + hd) floats, npad = (pos+t) rounded
 * up to 64. Returns -1 without a scratch buffer. */
typedef struct {
    const float *q, *kc, *vc, *vt;
    int64_t t, nh, hd, kv_heads, max_seq, pos, window, npad, group;
    float scale;
    float *out;
} attn_ctx;

/* Query row r's heads of kv head g. row, w: npad floats; qh: hd; part: 64 * hd (a decode
 * step) or vt, the group's v transposed [hd][npad] (a prompt). */
static void attn_rows(const attn_ctx *c, int64_t g, int64_t r, float *row, float *w, float *qh,
                      float *part) {
    const int64_t t = c->t, hd = c->hd, npad = c->npad, n = c->pos + t, qp = c->pos + r;
    const float *kg = c->kc + g * c->max_seq * hd, *vg = c->vc + g * c->max_seq * hd;
    for (int64_t h = g * c->group; h < (g + 1) * c->group; h++) {
        const float *qr = c->q + (r * c->nh + h) * hd;
        for (int64_t i = 0; i < hd; i++) qh[i] = (float)(_Float16)qr[i];
        for (int64_t s = 0; s < npad; s++) {
            int hidden = s > qp || (c->window > 0 && qp - s >= c->window);
            if (hidden) {
                row[s] = -INFINITY;
                continue;
            }
            float v = t == 1 ? dot64(kg + s * hd, qh, hd) : dot16(kg + s * hd, qh, hd);
            row[s] = v * c->scale;
        }
        float mx = -INFINITY;
        for (int64_t s = 0; s < npad; s++) mx = row[s] > mx ? row[s] : mx;
        double sum = 0.0;
        for (int64_t s = 0; s < npad; s += 16) {
            v16 e = exp16(v_sub(v_load(row + s), v_set1(mx)));
            v_store(w + s, e);
            sum += (double)v_sum(e);
        }
        const float inv = (float)(1.0 / sum);
        for (int64_t s = 0; s < npad; s++) w[s] = (float)(_Float16)(w[s] * inv);
        float *o = c->out + (r * c->nh + h) * hd;
        if (t == 1) {
            kqv_dot64(vg, w, n, hd, part, o);
            continue;
        }
        for (int64_t d = 0; d < hd; d++) o[d] = dot16(part + d * npad, w, npad);
    }
}

static __thread float *t_abuf;
static __thread size_t t_acap;

/* Task i of a prompt's attention: query row i % t of kv head i / t, on the thread's own
 * buffers (the order of every sum is the one-thread order). */
static void attn_task(const void *ctx, int64_t i) {
    const attn_ctx *c = ctx;
    const size_t need = (size_t)(2 * c->npad + c->hd);
    if (need > t_acap) {
        free(t_abuf);
        t_abuf = aligned_alloc(64, (need * 4 + 63) / 64 * 64);
        t_acap = t_abuf ? need : 0;
        if (!t_abuf) abort(); /* 8 KB per thousand positions; nothing to return it to */
    }
    const int64_t g = i / c->t, r = i % c->t;
    attn_rows(c, g, r, t_abuf, t_abuf + c->npad, t_abuf + 2 * c->npad,
              (float *)c->vt + g * c->hd * c->npad);
}

/* q [t][nh][hd] (rounded to float16 here), k/v caches [kv_heads][max_seq][hd] holding
 * float16 values, positions pos..pos+t-1 (each query sees keys 0..its position, and with
 * window > 0 only the last `window` of them); scale multiplies kq (ggml's kq_scale).
 * out [t][nh * hd]. scratch: MVK_ATTN_SCRATCH floats. A prompt's rows are shared out
 * over the pool. */
int mvk_attention(const float *q, int64_t t, int64_t nh, int64_t hd, const float *kc,
                  const float *vc, int64_t kv_heads, int64_t max_seq, int64_t pos,
                  int64_t window, float scale, float *out, float *scratch) {
    const int64_t n = pos + t, npad = (n + 63) / 64 * 64;
    attn_ctx c = {q, kc, vc, NULL, t, nh, hd, kv_heads, max_seq, pos, window, npad,
                  nh / kv_heads, scale, out};
    if (t == 1) {
        float *row = scratch, *w = row + npad, *qh = w + npad, *part = qh + hd;
        for (int64_t g = 0; g < kv_heads; g++) attn_rows(&c, g, 0, row, w, qh, part);
        return 0;
    }
    float *vt = scratch; /* v transposed, zero past n (as ggml's cache) */
    for (int64_t g = 0; g < kv_heads; g++) {
        const float *vg = vc + g * max_seq * hd;
        for (int64_t d = 0; d < hd; d++) {
            float *o = vt + (g * hd + d) * npad;
            for (int64_t s = 0; s < n; s++) o[s] = vg[s * hd + d];
            for (int64_t s = n; s < npad; s++) o[s] = 0.0f;
        }
    }
    c.vt = vt;
    dispatch_task(attn_task, &c, kv_heads * t);
    return 0;
}
/* SwiGLU as ggml computes it: silu(x) = x / (1 + exp(-x)) with exp16, times g, 16 at a
 * time (n a multiple of 16; rows of gate | up, each `ld` wide, the halves n wide). */
int mvk_swiglu(const float *gu, int64_t t, int64_t n, int64_t ld, float *out) {
    if (n % 16) return -1;
    const v16 one = v_set1(1.0f);
    for (int64_t r = 0; r < t; r++) {
        const float *x = gu + r * ld, *g = x + n;
        for (int64_t i = 0; i < n; i += 16) {
            v16 v = v_load(x + i);
            v16 e = exp16(v_sub(v_zero(), v));
            v16 silu = v_div(v, v_add(one, e));
            v_store(out + r * n + i, v_mul(silu, v_load(g + i)));
        }
    }
    return 0;
}
/* As mvk_rope_neox, for adjacent pairs (2i, 2i + 1): ggml's "normal" rope (llama). */
void mvk_rope_norm(float *x, int64_t t, int64_t heads, int64_t hd, const float *cs,
                   const float *sn) {
    const int64_t h = hd / 2;
    for (int64_t r = 0; r < t; r++) {
        const float *c = cs + r * h, *s = sn + r * h;
        for (int64_t k = 0; k < heads; k++) {
            float *v = x + (r * heads + k) * hd;
            for (int64_t i = 0; i < h; i++) {
                const float x0 = v[2 * i], x1 = v[2 * i + 1];
                const float s1 = x1 * s[i], c1 = x1 * c[i];
                v[2 * i] = fmaf(x0, c[i], -s1);
                v[2 * i + 1] = fmaf(x0, s[i], c1);
            }
        }
    }
}

/* rms_norm (above) for callers outside a product: Gemma's q/k and post norms. */
void mvk_rms_norm(const float *x, int64_t t_rows, int64_t k, int64_t ldx, const float *w,
                  float eps, float *out) {
    rms_norm(x, t_rows, k, ldx, w, eps, out);
}

/* GeGLU as ggml's CPU backend computes it: gelu (tanh form) looked up in a table of every
 * float16 input, its values float16, built with the float arithmetic ggml compiles it to
 * (0.5x (1 + tanhf(sqrt(2/pi) x fma(0.044715x, x, 1))), checked against ggml's table:
 * torch's tanh-gelu differs on 26 of the 65536 entries); 0 below -10, x above 10. */
static uint16_t g_gelu[(1 << 16) + 2]; /* +2: a 32-bit gather of the last entry */
static pthread_once_t g_gelu_once = PTHREAD_ONCE_INIT;

static void gelu_table(void) {
    for (uint32_t i = 0; i < (1u << 16); i++) {
        uint16_t h = (uint16_t)i;
        _Float16 hf;
        memcpy(&hf, &h, 2);
        const float x = (float)hf;
        const float inner = fmaf(0.044715f * x, x, 1.0f);
        const float y = (0.5f * x) * (1.0f + tanhf((0.79788456080286535587989211986876f * x) * inner));
        _Float16 r = (_Float16)y;
        memcpy(&g_gelu[i], &r, 2);
    }
}

/* gu: rows of gate | up (each `ld` wide, halves n wide); out [t][n]. */
void mvk_geglu(const float *gu, int64_t t, int64_t n, int64_t ld, float *out) {
    pthread_once(&g_gelu_once, gelu_table);
    for (int64_t r = 0; r < t; r++) {
        const float *x = gu + r * ld, *g = x + n;
        float *o = out + r * n;
        int64_t i = 0;
#ifdef MVK_AVX512
        /* 16 at a time: the same float16 rounding of x, table entry and products */
        for (; i + 16 <= n; i += 16) {
            const __m512 xv = _mm512_loadu_ps(x + i), gv = _mm512_loadu_ps(g + i);
            const __m512i idx = _mm512_cvtepu16_epi32(
                _mm512_cvtps_ph(xv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m512i raw = _mm512_i32gather_epi32(idx, (const void *)g_gelu, 2);
            const __m512 y = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw));
            __m512 res = _mm512_mul_ps(y, gv);
            res = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(xv, _mm512_set1_ps(10.0f), _CMP_GE_OQ),
                                       res, _mm512_mul_ps(xv, gv));
            res = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(xv, _mm512_set1_ps(-10.0f), _CMP_NLE_UQ),
                                      res);
            _mm512_storeu_ps(o + i, res);
        }
#endif
        for (; i < n; i++) {
            if (x[i] <= -10.0f) {
                o[i] = 0.0f;
            } else if (x[i] >= 10.0f) {
                o[i] = x[i] * g[i];
            } else {
                _Float16 hx = (_Float16)x[i], hy;
                uint16_t k;
                memcpy(&k, &hx, 2);
                memcpy(&hy, &g_gelu[k], 2);
                o[i] = (float)hy * g[i];
            }
        }
    }
}

/* ---- whole layers -------------------------------------------------------------------
 * A stage's decoder layers in one foreign call (model.py / gemma3.py forward() compute
 * the same ops, one torch or foreign call each): a decode step is otherwise dispatch-
 * bound. Per layer, as ggml computes it:
 *   qkv = W_qkv(rms_norm(h)) [+ qkv_bias]        (the norm fused in the product; Qwen 2)
 *   q, k = rms_norm per head (q_norm, k_norm; Gemma, Qwen 3), then rope (the layer's
 *   tables); q_scale != 0: q *= q_scale after the rope (Phi-3's ggml_scale)
 *   the cache gets k and v rounded to float16; attn = mvk_attention(q, window, kq_scale)
 *   h += W_o(attn)           or, with post_attn: h += rms_norm(W_o(attn), post_attn)
 *   gu = W_gate_up(rms_norm(h)); act = swiglu(gu) or geglu(gu)
 *   h += W_down(act)         or, with post_ffn:  h += rms_norm(W_down(act), post_ffn)
 * round_scale > 0: h = f16(h * round_scale) / round_scale first (a pipeline split's
 * float16 hand-over, emulated in one stage). */
typedef struct {
    const mvk_weights *qkv, *wo, *gate_up, *down;
    const float *q_norm, *k_norm, *post_attn, *post_ffn; /* NULL: none */
    const float *cos, *sin;                             /* [positions][hd / 2] */
    int32_t neox, geglu;
    int64_t window;
    float kq_scale, round_scale;
    const float *qkv_bias; /* NULL: none */
    float q_scale;         /* 0: none */
    /* the model's last layer: llama.cpp keeps only the output row (the last of each
     * sequence) after the attention (ggml_get_rows), so its feed-forward products are
     * one-row products there (row kind 0) */
    int32_t out_last;
} mvk_layer;

typedef struct {
    int64_t hidden, nh, nkv, hd, ffn;
    float eps;
} mvk_dims;

/* One sequence's rows in a batch for mvk_layers_batch: rows row0..row0+t-1 of h, at
 * positions pos..pos+t-1, with its own caches [layers][nkv][max_seq][hd]. */
typedef struct {
    int64_t row0, t, pos;
    float *kc, *vc;
    int64_t max_seq;
} mvk_seg;

static __thread float *t_lbuf;
static __thread size_t t_lcap;

/* A batch's decode attention: task i is kv head i % nkv of one-row sequence i / nkv, on
 * the thread's own buffers (the one-row order of mvk_attention, whatever the thread). */
typedef struct {
    const attn_ctx *cs;
    int64_t nkv, npad_max;
} attn_batch_ctx;

static __thread float *t_dbuf;
static __thread size_t t_dcap;

static void attn_decode_task(const void *ctx, int64_t i) {
    const attn_batch_ctx *b = ctx;
    const attn_ctx *c = b->cs + i / b->nkv;
    const size_t need = (size_t)(2 * b->npad_max + c->hd + 64 * c->hd);
    if (need > t_dcap) {
        free(t_dbuf);
        t_dbuf = aligned_alloc(64, (need * 4 + 63) / 64 * 64);
        t_dcap = t_dbuf ? need : 0;
        if (!t_dbuf) abort(); /* as attn_task */
    }
    float *row = t_dbuf, *w = row + b->npad_max, *qh = w + b->npad_max, *part = qh + c->hd;
    attn_rows(c, i % b->nkv, 0, row, w, qh, part);
}

/* The layers over a batch of sequences' rows (segs, in row order, covering h's t rows):
 * every product over all rows at once, each row with its own sequence's row kind
 * (seg_kind: as if its sequence's rows were the product), rope at each row's position,
 * the cache writes and attention per sequence in its own caches (one-row sequences'
 * attention shared over the pool, kv head by kv head). A row's result is the one its
 * sequence gets alone (mvk_layers), bit for bit. Returns 0, -1 (no memory) or -2 (not
 * built for this CPU). */
int mvk_layers_batch(const mvk_dims *d, const mvk_layer *layers, int64_t n_layers, float *h,
                     int64_t t, const mvk_seg *segs, int64_t n_segs) {
    const int64_t hd = d->hd, nh = d->nh, nkv = d->nkv, hid = d->hidden, ffn = d->ffn;
    const int64_t qd = nh * hd, kvd = nkv * hd, ld = qd + 2 * kvd;
    int64_t npad_max = 64, n_dec = 0;
    for (int64_t s = 0; s < n_segs; s++) {
        const int64_t n = segs[s].pos + segs[s].t, np = (n + 63) / 64 * 64;
        npad_max = np > npad_max ? np : npad_max;
        n_dec += segs[s].t == 1;
    }
    const size_t f = (size_t)t * (size_t)(ld + (qd + kvd) + 2 * qd + hid + 3 * ffn) +
                     (size_t)(MVK_ATTN_SCRATCH(npad_max, hd, nkv)) + 16 * 8 +
                     (size_t)t / 4 + 16 + (size_t)n_segs * (sizeof(attn_ctx) / 4 + 1);
    if (f > t_lcap) {
        free(t_lbuf);
        t_lbuf = aligned_alloc(64, (f * 4 + 63) / 64 * 64);
        t_lcap = t_lbuf ? f : 0;
        if (!t_lbuf) return -1;
    }
    float *qkv = t_lbuf, *qk = qkv + t * ld, *q = qk + t * (qd + kvd), *att = q + t * qd;
    float *y = att + t * qd, *gu = y + t * hid, *act = gu + t * 2 * ffn, *scr = act + t * ffn;
    attn_ctx *dec = (attn_ctx *)(((uintptr_t)(scr + MVK_ATTN_SCRATCH(npad_max, hd, nkv)) + 63) &
                                 ~(uintptr_t)63);
    uint8_t *rowk = (uint8_t *)(dec + n_segs);
    for (int64_t s = 0; s < n_segs; s++)
        for (int64_t r = 0; r < segs[s].t; r++) rowk[segs[s].row0 + r] = seg_kind(r, segs[s].t);
    for (int64_t i = 0; i < n_layers; i++) {
        const mvk_layer *L = layers + i;
        if (L->round_scale > 0.0f) {
            const float inv = 1.0f / L->round_scale;
            for (int64_t e = 0; e < t * hid; e++) h[e] = f16r(h[e] * L->round_scale) * inv;
        }
        if (mvk_linear_rows(L->qkv, h, t, hid, hid, qkv, L->qkv_bias, 0, rowk) != 0) return -1;
        for (int64_t r = 0; r < t; r++) {
            const float *src = qkv + r * ld;
            float *dst = qk + r * (qd + kvd);
            if (L->q_norm) {
                rms_norm(src, nh, hd, hd, L->q_norm, d->eps, dst);
                rms_norm(src + qd, nkv, hd, hd, L->k_norm, d->eps, dst + qd);
            } else {
                memcpy(dst, src, sizeof(float) * (size_t)(qd + kvd));
            }
        }
        int64_t nd = 0;
        for (int64_t s = 0; s < n_segs; s++) {
            const mvk_seg *S = segs + s;
            const int64_t pos = S->pos, ms = S->max_seq;
            float *kci = S->kc + i * nkv * ms * hd, *vci = S->vc + i * nkv * ms * hd;
            (L->neox ? mvk_rope_neox : mvk_rope_norm)(qk + S->row0 * (qd + kvd), S->t, nh + nkv, hd,
                                                       L->cos + pos * (hd / 2),
                                                       L->sin + pos * (hd / 2));
            for (int64_t r = S->row0; r < S->row0 + S->t; r++) {
                const float *kr = qk + r * (qd + kvd) + qd, *vr = qkv + r * ld + qd + kvd;
                const int64_t p = pos + r - S->row0;
                for (int64_t g = 0; g < nkv; g++)
                    for (int64_t e = 0; e < hd; e++) {
                        kci[(g * ms + p) * hd + e] = f16r(kr[g * hd + e]);
                        vci[(g * ms + p) * hd + e] = f16r(vr[g * hd + e]);
                    }
                memcpy(q + r * qd, qk + r * (qd + kvd), sizeof(float) * (size_t)qd);
                if (L->q_scale != 0.0f)
                    for (int64_t e = 0; e < qd; e++) q[r * qd + e] *= L->q_scale;
            }
            if (S->t == 1) {
                const int64_t np = (pos + 1 + 63) / 64 * 64;
                attn_ctx c = {q + S->row0 * qd, kci, vci, NULL, 1, nh, hd, nkv, ms, pos,
                              L->window, np, nh / nkv, L->kq_scale, att + S->row0 * qd};
                dec[nd++] = c;
            } else {
                mvk_attention(q + S->row0 * qd, S->t, nh, hd, kci, vci, nkv, ms, pos, L->window,
                              L->kq_scale, att + S->row0 * qd, scr);
            }
        }
        if (nd > 1) {
            attn_batch_ctx b = {dec, nkv, npad_max};
            dispatch_task(attn_decode_task, &b, nd * nkv);
        } else if (nd == 1) { /* one sequence's step: on this thread, as mvk_attention */
            mvk_attention(dec[0].q, 1, nh, hd, dec[0].kc, dec[0].vc, nkv, dec[0].max_seq,
                          dec[0].pos, L->window, L->kq_scale, dec[0].out, scr);
        }
        if (L->post_attn) {
            if (mvk_linear_rows(L->wo, att, t, qd, qd, y, NULL, 0, rowk) != 0) return -1;
            rms_norm(y, t, hid, hid, L->post_attn, d->eps, y);
            for (int64_t e = 0; e < t * hid; e++) h[e] = h[e] + y[e];
        } else if (mvk_linear_rows(L->wo, att, t, qd, qd, h, h, hid, rowk) != 0) {
            return -1;
        }
        if (L->out_last)
            for (int64_t s = 0; s < n_segs; s++) rowk[segs[s].row0 + segs[s].t - 1] = 0;
        if (mvk_linear_rows(L->gate_up, h, t, hid, hid, gu, NULL, 0, rowk) != 0) return -1;
        if (L->geglu)
            mvk_geglu(gu, t, ffn, 2 * ffn, act);
        else if (mvk_swiglu(gu, t, ffn, 2 * ffn, act) != 0)
            return -2;
        if (L->post_ffn) {
            if (mvk_linear_rows(L->down, act, t, ffn, ffn, y, NULL, 0, rowk) != 0) return -1;
            rms_norm(y, t, hid, hid, L->post_ffn, d->eps, y);
            for (int64_t e = 0; e < t * hid; e++) h[e] = h[e] + y[e];
        } else if (mvk_linear_rows(L->down, act, t, ffn, ffn, h, h, hid, rowk) != 0) {
            return -1;
        }
    }
    return 0;
}

/* One sequence: mvk_layers_batch with a single segment. */
int mvk_layers(const mvk_dims *d, const mvk_layer *layers, int64_t n_layers, float *h,
               int64_t t, int64_t pos, float *kc, float *vc, int64_t max_seq) {
    const mvk_seg seg = {0, t, pos, kc, vc, max_seq};
    return mvk_layers_batch(d, layers, n_layers, h, t, &seg, 1);
}
