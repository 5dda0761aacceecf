/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). AVX-512: the Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 tiles (MVK_ARITH_Q0,
 * MVK_ARITH_Q0R) on the 16-row interleaved layout. */

#ifdef MVK_AVX512
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

/* acc plus vpdpbusd of w against the 4 bytes at p in every lane, the broadcast as the
 * instruction's own operand ({1to16}): gcc keeps bcast4 a separate vpbroadcastd, one
 * more instruction per vpdpbusd (10% of the Q4_K prefill tile's time on a Zen 4). */
static inline __attribute__((always_inline)) __m512i dpbusd_b(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(const void *)p));
    return acc;
}

/* A group with a fixed zero code per row (j->zrow): its 16 rows' zero codes, each in the
 * 4 bytes of its lane, for a vpdpbusd against the activations' negated codes. */
static inline __m512i zero_codes(const mvk_job *j, int64_t G) {
    return _mm512_mullo_epi32(
        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(j->zrow + 16 * G))),
        _mm512_set1_epi32(0x01010101));
}

/* Where group G's zero codes have precomputed corrections (j->zg), those of activation
 * rows t0.. (kp / 4 a row, one per lane sum); NULL where it has none. */
static inline const int32_t *zero_corrections(const mvk_job *j, int64_t G, int64_t t0) {
    const int zi = j->zrow != NULL && j->zg ? j->zg[G] : -1;
    return zi >= 0 ? j->corr + (zi * j->t_rows + t0) * (j->kp / 4) : NULL;
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
    const __m512i zb = zeroed ? zero_codes(j, G) : _mm512_setzero_si512();
    const int32_t *corr = zero_corrections(j, G, t0);
    const int LP = T <= 2 ? 8 : 4; /* lanes per pass: T * LP accumulators in registers */
    __m512 lanes[Q0_MAXT][8], summs[Q0_MAXT];
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) summs[t] = _mm512_setzero_ps();
    _Pragma("GCC unroll 8") for (int p = 0; p < 8; p += LP) {
        __m512 acc[Q0_MAXT][8];
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++)
            _Pragma("GCC unroll 8") for (int l = 0; l < LP; l++) acc[t][l] = _mm512_setzero_ps();
        for (int64_t b = 0; b < ns; b++) {
            if (p == 0) prefetch_ahead(wg + b * piece, (int)piece);
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
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
        __m512 r = sum8(lanes[t]);
        if (!zeroed) r = _mm512_add_ps(r, summs[t]);
        store_group(j, G, t0 + t, r);
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
    const __m512i zb = zeroed ? zero_codes(j, G) : _mm512_setzero_si512();
    const int32_t *corr = zero_corrections(j, G, t0);
    __m512 acc[Q0_MAXT];
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < ns; b++) {
        prefetch_ahead(wg + b * (nib ? 256 : 512), nib ? 256 : 512);
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
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) store_group(j, G, t0 + t, acc[t]);
}
#endif
