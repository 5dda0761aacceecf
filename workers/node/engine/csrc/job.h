/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). What every product's rows are computed from: mvk_job, the row kinds and
 * the forms of a row's sum. */

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
    /* MVK_ARITH_Q4K: per activation row and 64 elements, its two sums per 32 as 16-bit
     * halves (|sum| <= 32 * 128), the mins' vpdpwssd operand (NULL: none) */
    const int32_t *qp64;
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
