/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). One foreign call per product: mvk_weights, the activations' preparation,
 * mvk_linear and mvk_linear_rows. */

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
    int32_t *corr, *qs16, *qp64;
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
    if (c->qp64) /* Q4_K: per 64, the two sums per 32 as 16-bit halves (q4k_tile64) */
        for (int64_t i = 0; i < t * kp / 64; i++) {
            const int32_t *s = c->qs16 + r0 * kp / 16 + 4 * i;
            const uint32_t lo = (uint16_t)(s[0] + s[1]), hi = (uint16_t)(s[2] + s[3]);
            c->qp64[r0 * kp / 64 + i] = (int32_t)(lo | hi << 16);
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
    const int qp = w->arith == MVK_ARITH_Q4K;
    if (qp) need += (size_t)t_rows * (size_t)(kp / 64) * 4 + 64;
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
    prep_ctx c = {w, x, ldx, k_in, kp, t_rows, NULL, qx, dxe, s16, s32, NULL, NULL, NULL, NULL, nz};
    if (w->norm) c.xn = (float *)(((uintptr_t)(qx + t_rows * kp) + 63) & ~(uintptr_t)63);
    if (q0) c.nq = (int8_t *)((past + 63) & ~(uintptr_t)63);
    if (nz) c.corr = (int32_t *)(((uintptr_t)(c.nq + t_rows * kp) + 63) & ~(uintptr_t)63);
    if (kq) c.qs16 = (int32_t *)((past + 63) & ~(uintptr_t)63);
    if (qp) c.qp64 = (int32_t *)(((uintptr_t)(c.qs16 + t_rows * kp / 16) + 63) & ~(uintptr_t)63);
    const int64_t p0 = PROF_START();
    if (t_rows >= 16) /* a prompt's rows over the pool, 8 at a time */
        dispatch_task(prep_task, &c, (t_rows + 7) / 8);
    else
        prep_rows(&c, 0, t_rows);
    PROF_ADD(PROF_PREP, p0);
    int8_t *nq = c.nq;
    int32_t *corr = c.corr, *qs16 = c.qs16;
    mvk_job j = {qx, dxe, s16, s32, t_rows, kp, w->codes, w->scale, w->min, w->n, w->nibble,
                 w->sub, w->zero, w->f32, y, ldy, add, ldadd, nq, w->zrow, w->arith,
                 w->ksc, w->kmin, w->kd, w->kdmin, qs16, nz ? w->zg : NULL, corr, rowk,
                 w->pad == 5, c.qp64};
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
