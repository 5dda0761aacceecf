/* Part of qmm.c, its one translation unit: included there once, in its order (see
 * there). RMS norm (rms_norm; mvk_rms_norm for the callers outside a product). */

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

/* rms_norm (above) for callers outside a product: Gemma's q/k and post norms. */
void mvk_rms_norm(const float *x, int64_t t_rows, int64_t k, int64_t ldx, const float *w,
                  float eps, float *out) {
    rms_norm(x, t_rows, k, ldx, w, eps, out);
}
