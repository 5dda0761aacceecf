/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). The activations' quantisation (mvk_quantize). */

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

/* One block's scales from its largest magnitude amax (and, for Q8_K, the signed element
 * x_max that has it): id multiplies x into codes, d is the block's scale as the format
 * writes it, dq is d as the products use it (float16-rounded for Q8_0 and Q8_1). */
static inline void block_scales(int mode, float amax, float xmax, float *id, float *d,
                                float *dq) {
    if (mode == MVK_Q8_K) {
        *id = amax > 0.0f ? -127.0f / xmax : 0.0f;
        *d = amax > 0.0f ? 1.0f / *id : 0.0f;
        *dq = *d;
    } else {
        *d = amax / 127.0f;
        *id = amax > 0.0f ? 127.0f / amax : 0.0f;
        *dq = f16r(*d);
    }
}

#ifdef MVK_AVX512
/* The lanes of 16 that hold elements when `left` of them remain (none past the row). */
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u);
}

/* mvk_quantize, 16 elements at a time: the same products x * id, rounded to nearest even
 * (vcvtps2dq under the default rounding mode is nearbyintf), the same clamps and sums. */
static void quantize_row_simd(const float *xr, int64_t k_in, int64_t kp, int mode, int8_t *q,
                              float *dxe, float *s16, float *s32) {
    const int64_t bs = mode == MVK_Q8_K ? 256 : 32;
    const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
    for (int64_t b = 0; b < kp; b += bs) {
        __m512 vmax = _mm512_setzero_ps();
        for (int64_t k = b; k < b + bs; k += 16) {
            const __mmask16 m = tail_mask(k_in - k);
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
        block_scales(mode, amax, xmax, &id, &d, &dq);
        const __m512 vid = _mm512_set1_ps(id);
        int32_t sum32 = 0;
        for (int64_t k = b; k < b + bs; k += 16) {
            const __mmask16 m = tail_mask(k_in - k);
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
            block_scales(mode, amax, xmax, &id, &d, &dq);
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
