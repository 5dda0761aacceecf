/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). AVX-512: which tile runs which activation rows (rows_q0), and
 * rows_simd by tile height. */

#ifdef MVK_AVX512
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
 * untiled rows (their 8 lanes' registers), up to Q4K_ROWS for Q4_K's per64 rows and
 * Q6_K's tiled ones (q4k_tile64, q6k_tile64). */
static void rows_q0(const mvk_job *j, int64_t n0, int64_t n1) {
    const int bit = j->arith == MVK_ARITH_Q4K                                 ? MVK_ROW_PER64
                    : j->arith == MVK_ARITH_Q6K || j->arith == MVK_ARITH_Q5K ? MVK_ROW_TILED
                                                                              : 0;
    for (int64_t G = n0 / 16; 16 * G < n1; G++)
        for (int64_t t0 = 0; t0 < j->t_rows;) {
            const int kind = bit ? row_kind(j, t0) & bit : 0;
            const int lanes8 = j->arith == MVK_ARITH_Q6K || j->arith == MVK_ARITH_Q5K;
            const int64_t step = lanes8 && !kind                   ? 1
                                 : j->arith == MVK_ARITH_Q4K && kind ? Q4K_ROWS
                                 : j->arith == MVK_ARITH_Q6K         ? Q4K_ROWS
                                                                     : Q0_MAXT;
            int64_t tt = 1;
            while (tt < step && t0 + tt < j->t_rows && (!bit || (row_kind(j, t0 + tt) & bit) == kind))
                tt++;
            if (j->arith == MVK_ARITH_Q4K && kind) {
                q4k_tile64(j, G, t0, (int)tt);
            } else if (j->arith == MVK_ARITH_Q4K) {
                MVK_BY_TK(q4k_tile, tt, kind != 0)
            } else if (j->arith == MVK_ARITH_Q6K && kind) {
                q6k_tile64(j, G, t0, (int)tt);
            } else if (j->arith == MVK_ARITH_Q6K) {
                q6k_tile(j, G, t0);
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
