/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). Whole decoder layers in one foreign call (mvk_layers, mvk_layers_batch). */

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
    h16 *kc, *vc; /* float16, as ggml's default cache */
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
    const int64_t l0 = PROF_START();
    for (int64_t i = 0; i < n_layers; i++) {
        const mvk_layer *L = layers + i;
        if (L->round_scale > 0.0f) {
            const float inv = 1.0f / L->round_scale;
            for (int64_t e = 0; e < t * hid; e++) h[e] = f16r(h[e] * L->round_scale) * inv;
        }
        int64_t p0 = PROF_START();
        if (mvk_linear_rows(L->qkv, h, t, hid, hid, qkv, L->qkv_bias, 0, rowk) != 0) return -1;
        PROF_ADD(PROF_QKV, p0);
        p0 = PROF_START();
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
            h16 *kci = S->kc + i * nkv * ms * hd, *vci = S->vc + i * nkv * ms * hd;
            (L->neox ? mvk_rope_neox : mvk_rope_norm)(qk + S->row0 * (qd + kvd), S->t, nh + nkv, hd,
                                                       L->cos + pos * (hd / 2),
                                                       L->sin + pos * (hd / 2));
            for (int64_t r = S->row0; r < S->row0 + S->t; r++) {
                const float *kr = qk + r * (qd + kvd) + qd, *vr = qkv + r * ld + qd + kvd;
                const int64_t p = pos + r - S->row0;
                for (int64_t g = 0; g < nkv; g++)
                    for (int64_t e = 0; e < hd; e++) {
                        kci[(g * ms + p) * hd + e] = (h16)kr[g * hd + e];
                        vci[(g * ms + p) * hd + e] = (h16)vr[g * hd + e];
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
        PROF_ADD(PROF_ATTN, p0);
        p0 = PROF_START();
        if (L->post_attn) {
            if (mvk_linear_rows(L->wo, att, t, qd, qd, y, NULL, 0, rowk) != 0) return -1;
            rms_norm(y, t, hid, hid, L->post_attn, d->eps, y);
            for (int64_t e = 0; e < t * hid; e++) h[e] = h[e] + y[e];
        } else if (mvk_linear_rows(L->wo, att, t, qd, qd, h, h, hid, rowk) != 0) {
            return -1;
        }
        PROF_ADD(PROF_WO, p0);
        if (L->out_last)
            for (int64_t s = 0; s < n_segs; s++) rowk[segs[s].row0 + segs[s].t - 1] = 0;
        p0 = PROF_START();
        if (mvk_linear_rows(L->gate_up, h, t, hid, hid, gu, NULL, 0, rowk) != 0) return -1;
        PROF_ADD(PROF_GATE_UP, p0);
        p0 = PROF_START();
        if (L->geglu)
            mvk_geglu(gu, t, ffn, 2 * ffn, act);
        else if (mvk_swiglu(gu, t, ffn, 2 * ffn, act) != 0)
            return -2;
        PROF_ADD(PROF_ACT, p0);
        p0 = PROF_START();
        if (L->post_ffn) {
            if (mvk_linear_rows(L->down, act, t, ffn, ffn, y, NULL, 0, rowk) != 0) return -1;
            rms_norm(y, t, hid, hid, L->post_ffn, d->eps, y);
            for (int64_t e = 0; e < t * hid; e++) h[e] = h[e] + y[e];
        } else if (mvk_linear_rows(L->down, act, t, ffn, ffn, h, h, hid, rowk) != 0) {
            return -1;
        }
        PROF_ADD(PROF_DOWN, p0);
    }
    PROF_ADD(PROF_LAYERS, l0);
    return 0;
}

/* One sequence: mvk_layers_batch with a single segment. */
int mvk_layers(const mvk_dims *d, const mvk_layer *layers, int64_t n_layers, float *h,
               int64_t t, int64_t pos, h16 *kc, h16 *vc, int64_t max_seq) {
    const mvk_seg seg = {0, t, pos, kc, vc, max_seq};
    return mvk_layers_batch(d, layers, n_layers, h, t, &seg, 1);
}
