/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */

/* ======================================= Gated DeltaNet decode ========================================
 * One decode token per sequence of a linear-attention layer (lmserve/model/linear_attention.py), its state read
 * and written in place at the sequence's slot:
 *   conv:  window (S, C, W-1) + x (B, C) -> silu(sum_j w[c, j] * [window, x][j]) (B, C); window shifted by one
 *   delta: q, k (B, Hk, K) L2-normalised (q also by K^-1/2), each key head serving Hv/Hk value heads; per value
 *          head: s *= exp(g); s += k (x) beta (v - s^T k); out = s^T q, s (K, V) at ssm + (slot, h)
 * float32 throughout; the same operations as the torch path, in its order per element. */
void gdn_conv_decode_f32(const float *x, float *conv_state, const int64_t *slots, const float *weight, float *out,
                         int64_t B, int64_t C, int64_t W, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (B * C > 16384)
    for (int64_t b = 0; b < B; b++) {
        float *win = conv_state + slots[b] * C * (W - 1);
        float *o = out + b * C;
        for (int64_t c = 0; c < C; c++) {
            float *w_c = win + c * (W - 1);
            const float *k_c = weight + c * W;
            float acc = 0.f;
            for (int64_t j = 0; j < W - 1; j++) acc += w_c[j] * k_c[j];
            const float xv = x[b * C + c];
            acc += xv * k_c[W - 1];
            for (int64_t j = 0; j + 1 < W - 1; j++) w_c[j] = w_c[j + 1];
            w_c[W - 2] = xv;
            o[c] = acc;
        }
#pragma omp simd
        for (int64_t c = 0; c < C; c++) o[c] = o[c] / (1.f + exp_f32(-o[c])); /* silu, vectorized (exp_f32) */
    }
}

static void gdn_l2norm(const float *x, float *y, int64_t n, float scale) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.f / sqrtf(ss + 1e-6f) * scale;
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * inv;
}

void gdn_recurrent_decode_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                              float *ssm, const int64_t *slots, float *out, int64_t B, int64_t Hk, int64_t Hv,
                              int64_t K, int64_t V, int64_t q_stride, int64_t v_stride, int nthreads) {
    const int64_t group = Hv / Hk;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (B * Hv > 1)
    for (int64_t bh = 0; bh < B * Hv; bh++) {
        const int64_t b = bh / Hv, h = bh % Hv, hk = h / group;
        float qn[K], kn[K], kv[V];
        gdn_l2norm(q + b * q_stride + hk * K, qn, K, 1.f / sqrtf((float)K));
        gdn_l2norm(k + b * q_stride + hk * K, kn, K, 1.f);
        float *s = ssm + (slots[b] * Hv + h) * K * V;
        const float decay = expf(g[b * Hv + h]), bt = beta[b * Hv + h];
        const float *vv = v + b * v_stride + h * V;
        for (int64_t j = 0; j < V; j++) kv[j] = 0.f;
        for (int64_t i = 0; i < K; i++) {
            float *row = s + i * V;
#pragma omp simd
            for (int64_t j = 0; j < V; j++) {
                row[j] *= decay;
                kv[j] += row[j] * kn[i];
            }
        }
        for (int64_t j = 0; j < V; j++) kv[j] = (vv[j] - kv[j]) * bt;  /* the delta */
        float *o = out + (b * Hv + h) * V;
        for (int64_t j = 0; j < V; j++) o[j] = 0.f;
        for (int64_t i = 0; i < K; i++) {
            float *row = s + i * V;
            const float ki = kn[i], qi = qn[i];
#pragma omp simd
            for (int64_t j = 0; j < V; j++) {
                row[j] += ki * kv[j];
                o[j] += row[j] * qi;
            }
        }
    }
}
/* ===================================== end of Gated DeltaNet decode ===================================== */
