/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). Attention (mvk_attention). */

/* mvk_attention's scratch, in floats: a decode step's buffers or a prompt's transposed v */
#define MVK_ATTN_SCRATCH(npad, hd, kv_heads) \
    (2 * (npad) + (hd) + 64 * (hd) + (kv_heads) * (hd) * (npad))

/* ---- attention, as ggml's CPU backend computes it without flash attention -------------
 * kq = k . q with q rounded to float16 (the cache holds float16 values), softmax over the
 * row with masked entries at -inf, the weights rounded to float16, kqv = v . weights.
 * A decode step's dots are ggml_vec_dot_f16's (4 x 16 lanes, stride 64, then its
 * reduction); a prompt's (several query rows) are llamafile's tinyBLAS f16 GEMM's (one
 * 16-lane accumulator per output). exp is the same polynomial as ggml_v_expf (AVX-512),
 * written out here; the softmax sums 16-element partial sums in double as ggml does. */
static inline float dot64(const h16 *x, const float *y, int64_t n) {
    const int64_t np = n & ~(int64_t)63; /* ggml_vec_dot_f16: whole steps of 64 in SIMD */
    v16 s[4] = {v_zero(), v_zero(), v_zero(), v_zero()};
    for (int64_t i = 0; i < np; i += 64)
        for (int j = 0; j < 4; j++)
            s[j] = v_fmadd(v_load_h(x + i + 16 * j), v_load(y + i + 16 * j), s[j]);
    s[0] = v_add(s[0], s[2]);
    s[1] = v_add(s[1], s[3]);
    s[0] = v_add(s[0], s[1]);
    const float r = v_sum(s[0]);
    if (np == n) return r;
    double acc = r; /* the leftovers (a head dim of 96: 32), float products summed in double */
    for (int64_t i = np; i < n; i++) acc += (double)((float)x[i] * y[i]);
    return (float)acc;
}

static inline float dot16(const float *x, const float *y, int64_t n) {
    v16 s = v_zero();
    for (int64_t i = 0; i < n; i += 16) s = v_fmadd(v_load(x + i), v_load(y + i), s);
    return v_sum(s);
}

static inline float dot16h(const h16 *x, const float *y, int64_t n) { /* dot16, x cached */
    v16 s = v_zero();
    for (int64_t i = 0; i < n; i += 16) s = v_fmadd(v_load_h(x + i), v_load(y + i), s);
    return v_sum(s);
}

/* o[d] = dot64(v[.][d], w) for every d at once: v rows [n][hd] as the cache holds them,
 * the 64 partial sums per d (position s into slot s % 64, in order) kept as vectors over
 * d, then reduced in dot64's tree (its 4 accumulators, then _mm512_reduce_add_ps's
 * pairing of 16 lanes). part: 64 * hd floats. hd a multiple of 16. */
static void kqv_dot64(const h16 *v, const float *w, int64_t n, int64_t hd, float *part,
                      float *o) {
    const int64_t used = n < 64 ? n : 64; /* slots past n stay zero: not stored */
    memset(part, 0, sizeof(float) * (size_t)(used * hd));
    for (int64_t s = 0; s < n; s++) {
        const v16 ws = v_set1(w[s]);
        float *p = part + (s % 64) * hd;
        const h16 *vr = v + s * hd;
        for (int64_t d = 0; d < hd; d += 16)
            v_store(p + d, v_fmadd(v_load_h(vr + d), ws, v_load(p + d)));
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
 * float16 values (h16), positions pos..pos+t-1 (each query sees keys 0..its position, and with
 * window > 0 only the last `window` of them); scale multiplies kq (ggml's kq_scale).
 * out [t][nh * hd]. scratch: (3 * npad + hd * npad + hd) floats, npad = (pos+t) rounded
 * up to 64. Returns -1 without a scratch buffer. */
typedef struct {
    const float *q;
    const h16 *kc, *vc;
    const float *vt;
    int64_t t, nh, hd, kv_heads, max_seq, pos, window, npad, group;
    float scale;
    float *out;
} attn_ctx;

/* Query row r's heads of kv head g. row, w: npad floats; qh: hd; part: 64 * hd (a decode
 * step) or vt, the group's v transposed [hd][npad] (a prompt). */
static void attn_rows(const attn_ctx *c, int64_t g, int64_t r, float *row, float *w, float *qh,
                      float *part) {
    const int64_t t = c->t, hd = c->hd, npad = c->npad, n = c->pos + t, qp = c->pos + r;
    const h16 *kg = c->kc + g * c->max_seq * hd, *vg = c->vc + g * c->max_seq * hd;
    for (int64_t h = g * c->group; h < (g + 1) * c->group; h++) {
        const float *qr = c->q + (r * c->nh + h) * hd;
        for (int64_t i = 0; i < hd; i++) qh[i] = (float)(_Float16)qr[i];
        for (int64_t s = 0; s < npad; s++) {
            int hidden = s > qp || (c->window > 0 && qp - s >= c->window);
            if (hidden) {
                row[s] = -INFINITY;
                continue;
            }
            float v = t == 1 ? dot64(kg + s * hd, qh, hd) : dot16h(kg + s * hd, qh, hd);
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
 * float16 values (h16), positions pos..pos+t-1 (each query sees keys 0..its position, and with
 * window > 0 only the last `window` of them); scale multiplies kq (ggml's kq_scale).
 * out [t][nh * hd]. scratch: MVK_ATTN_SCRATCH floats. A prompt's rows are shared out
 * over the pool. */
int mvk_attention(const float *q, int64_t t, int64_t nh, int64_t hd, const h16 *kc,
                  const h16 *vc, int64_t kv_heads, int64_t max_seq, int64_t pos,
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
        const h16 *vg = vc + g * max_seq * hd;
        for (int64_t d = 0; d < hd; d++) {
            float *o = vt + (g * hd + d) * npad;
            for (int64_t s = 0; s < n; s++) o[s] = (float)vg[s * hd + d];
            for (int64_t s = n; s < npad; s++) o[s] = 0.0f;
        }
    }
    c.vt = vt;
    dispatch_task(attn_task, &c, kv_heads * t);
    return 0;
}
