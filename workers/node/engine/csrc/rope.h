/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). Rope: tables (mvk_rope_cache) and rotations (mvk_rope_neox, mvk_rope_norm). */

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
