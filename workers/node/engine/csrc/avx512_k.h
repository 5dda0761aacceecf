/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). AVX-512: the Q4_K / Q6_K / Q5_K tiles on the interleaved layout. */

#ifdef MVK_AVX512
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
            prefetch_ahead(wg + sb * 256, 256);
            if ((sb & 3) == 0 && g_pf_dist) {
                _mm_prefetch((const char *)j->ksc + (G * ns + sb) * 16 + g_pf_dist / 16, _MM_HINT_T0);
                _mm_prefetch((const char *)j->kmin + (G * ns + sb) * 16 + g_pf_dist / 16, _MM_HINT_T0);
            }
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
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++)
        store_group(j, G, t0 + t, _mm512_sub_ps(acc[t], accm[t]));
}

/* MVK_ARITH_Q4K for activation rows of MVK_ROW_PER64 (a prompt's whole fours), up to
 * Q4K_ROWS at a time: q4k_tile's per64 sums (the same integers, the same two fused
 * multiply-adds per 64 elements) in another loop order. Each 64 elements' two sub-blocks
 * are unpacked once, to 16 registers, and every row's 64 finished against them (its
 * integer sums, both fused multiply-adds into its acc and accm) before the next 64: one
 * unpacking serves up to 64 rows, not 4, and no row's sums stay in registers across 64s.
 * The activations' 4 bytes are vpdpbusd's broadcast operand (dpbusd_b); the two
 * sub-blocks' mins terms are one vpdpwssd against j->qp64 (16-bit pairs: mins <= 63,
 * |sum per 32| <= 4096), the integers of q4k_tile's two 32-bit multiplies. Not inlined:
 * the rows' float state (16 KiB) stays out of rows_q0's frame. */
#define Q4K_ROWS 64
static __attribute__((noinline)) void q4k_tile64(const mvk_job *j, int64_t G, int64_t t0, int T) {
    const int64_t kp = j->kp, ns = kp / 32, nsb = kp / 256;
    const uint8_t *wg = j->codes + G * ns * 256;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    /* per row acc, accm, d dx, dmin dx side by side (four arrays would lie 4 KiB apart,
     * their loads and stores aliasing in the L1's address bits) */
    __m512 st[Q4K_ROWS][4];
    for (int t = 0; t < T; t++) st[t][0] = st[t][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const __m512 d = _mm512_loadu_ps(j->kd + (G * nsb + b) * 16);
        const __m512 dmin = _mm512_loadu_ps(j->kdmin + (G * nsb + b) * 16);
        for (int t = 0; t < T; t++) {
            const __m512 dx = _mm512_set1_ps(j->dxe[(t0 + t) * kp / 4 + 64 * b]);
            st[t][2] = _mm512_mul_ps(d, dx);
            st[t][3] = _mm512_mul_ps(dmin, dx);
        }
        for (int64_t sb = 8 * b; sb < 8 * b + 8; sb += 2) {
            const uint8_t *ksc = (const uint8_t *)j->ksc + (G * ns + sb) * 16;
            const uint8_t *kmin = j->kmin + (G * ns + sb) * 16;
            const __m512i sc0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)ksc));
            const __m512i sc1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ksc + 16)));
            const __m512i mn = _mm512_or_si512(
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)kmin)),
                _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(kmin + 16))), 16));
            prefetch_ahead(wg + sb * 256, 512);
            if ((sb & 3) == 0 && g_pf_dist) {
                _mm_prefetch((const char *)ksc + g_pf_dist / 16, _MM_HINT_T0);
                _mm_prefetch((const char *)kmin + g_pf_dist / 16, _MM_HINT_T0);
            }
            __m512i w[16]; /* sub-block sb's 8 lanes, then sb + 1's */
            _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {
                const __m512i v = _mm512_loadu_si512(wg + sb * 256 + 64 * c);
                w[2 * c] = _mm512_and_si512(v, low4);
                w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
            for (int t = 0; t < T; t++) {
                const int8_t *q = j->qx + (t0 + t) * kp + 32 * sb;
                __m512i e0 = _mm512_setzero_si512(), e1 = e0, f0 = e0, f1 = e0, imin = e0;
                _Pragma("GCC unroll 8") for (int l = 0; l < 8; l += 2) {
                    e0 = dpbusd_b(e0, w[l], q + 4 * l);
                    e1 = dpbusd_b(e1, w[l + 1], q + 4 * l + 4);
                    f0 = dpbusd_b(f0, w[8 + l], q + 32 + 4 * l);
                    f1 = dpbusd_b(f1, w[9 + l], q + 36 + 4 * l);
                }
                const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_add_epi32(e0, e1), sc0),
                                                      _mm512_mullo_epi32(_mm512_add_epi32(f0, f1), sc1));
                __asm__("vpdpwssd %2%{1to16%}, %1, %0"
                        : "+v"(imin)
                        : "v"(mn), "m"(j->qp64[(t0 + t) * (kp / 64) + sb / 2]));
                st[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), st[t][2], st[t][0]);
                st[t][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), st[t][3], st[t][1]);
            }
        }
    }
    for (int t = 0; t < T; t++) store_group(j, G, t0 + t, _mm512_sub_ps(st[t][0], st[t][1]));
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
 * lanes of rows_q6k, for one activation row of a product of fewer than 8 (a prompt of 8
 * or more needs only their total, the tiled GEMM: q6k_tile64). */
static inline __attribute__((always_inline)) void q6k_tile(const mvk_job *j, int64_t G,
                                                           int64_t t0) {
    const int64_t kp = j->kp, ns16 = kp / 16, nsb = kp / 256;
    const uint8_t *wg = j->codes + G * (kp / 32) * Q6K_PIECE;
    const int8_t *ksc = (const int8_t *)j->ksc;
    __m512 acc8[8];
    for (int l = 0; l < 8; l++) acc8[l] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const __m512 d = _mm512_loadu_ps(j->kd + (G * nsb + b) * 16);
        const int8_t *scb = ksc + (G * ns16 + 16 * b) * 16; /* [16 sub-blocks][16 rows] */
        /* lanes by maddubs (codes <= 63, |q| <= 127: no saturation) and vpdpwssd
         * with the sub-scale in both 16-bit halves */
        __m512i lane[8];
        for (int l = 0; l < 8; l++) lane[l] = _mm512_setzero_si512();
        const int8_t *q = j->qx + t0 * kp + 256 * b;
        for (int p = 0; p < 8; p++) {
            prefetch_ahead(wg + (8 * b + p) * Q6K_PIECE, Q6K_PIECE);
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
    store_group(j, G, t0, sum8(acc8));
}

/* MVK_ARITH_Q6K's tiled rows (a prompt of 8 rows or more: llama.cpp's tiled GEMM, whose
 * only sum is a row's total), up to Q4K_ROWS at a time: per 256-block and row, over its
 * sub-blocks of 16, sc times the dot product started from -32 qs, then one float step
 * (d times the sum, times dx, added). Each 32-element piece is unpacked once for all the
 * rows (it was once per 4), each row's integer sum kept in memory until the block's end;
 * the activations' 4 bytes are vpdpbusd's broadcast operand (dpbusd_b). */
static __attribute__((noinline)) void q6k_tile64(const mvk_job *j, int64_t G, int64_t t0, int T) {
    const int64_t kp = j->kp, ns16 = kp / 16, nsb = kp / 256;
    const uint8_t *wg = j->codes + G * (kp / 32) * Q6K_PIECE;
    const int8_t *ksc = (const int8_t *)j->ksc;
    struct {
        __m512 acc;
        __m512i isum;
    } r[Q4K_ROWS];
    for (int t = 0; t < T; t++) r[t].acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const __m512 d = _mm512_loadu_ps(j->kd + (G * nsb + b) * 16);
        const int8_t *scb = ksc + (G * ns16 + 16 * b) * 16; /* [16 sub-blocks][16 rows] */
        for (int t = 0; t < T; t++) r[t].isum = _mm512_setzero_si512();
        for (int p = 0; p < 8; p++) {
            __m512i w[8];
            unpack6(wg + (8 * b + p) * Q6K_PIECE, w);
            const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(scb + 2 * p * 16)));
            const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(scb + (2 * p + 1) * 16)));
            for (int t = 0; t < T; t++) {
                const int64_t tr = t0 + t;
                const int8_t *q = j->qx + tr * kp + 256 * b + 32 * p;
                const int32_t *qs = j->qs16 + tr * ns16 + 16 * b + 2 * p;
                __m512i e0 = _mm512_set1_epi32(-32 * qs[0]), e1 = _mm512_set1_epi32(-32 * qs[1]);
                _Pragma("GCC unroll 4") for (int l = 0; l < 4; l++) {
                    e0 = dpbusd_b(e0, w[l], q + 4 * l);
                    e1 = dpbusd_b(e1, w[4 + l], q + 16 + 4 * l);
                }
                r[t].isum = _mm512_add_epi32(_mm512_add_epi32(r[t].isum, _mm512_mullo_epi32(e0, sc0)),
                                             _mm512_mullo_epi32(e1, sc1));
            }
        }
        for (int t = 0; t < T; t++) {
            const __m512 dx = _mm512_set1_ps(j->dxe[(t0 + t) * kp / 4 + 64 * b]);
            r[t].acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(r[t].isum)), dx, r[t].acc);
        }
    }
    for (int t = 0; t < T; t++) store_group(j, G, t0 + t, r[t].acc);
}

/* Sub-block sb of a Q5_K group G: the 16 rows' 6-bit scales and mins, and its codes as
 * the 8 lanes' bytes (5 bits a code or a byte each). */
static inline void q5k_piece(const mvk_job *j, int64_t G, int64_t sb, const uint8_t *wg,
                             __m512i *sc, __m512i *mn, __m512i w[8]) {
    const int64_t at = (G * (j->kp / 32) + sb) * 16;
    *sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)j->ksc + at)));
    *mn = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(j->kmin + at)));
    prefetch_ahead(wg + sb * (j->bits5 ? Q5_PIECE : 512), j->bits5 ? Q5_PIECE : 512);
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
    for (int t = 0; t < T; t++)
        store_group(j, G, t0 + t, tiled ? tacc[t] : _mm512_add_ps(sum8(acc8), summs));
}
#endif
