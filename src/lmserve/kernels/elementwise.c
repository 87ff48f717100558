/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */
/* RMSNorm of M rows of N, optionally after a residual add (the decoder's h = h + sublayer(h)):
 *   if res: res[m] = x[m] + res[m] (written back), r = res[m]; else r = x[m]
 *   out[m] = w * (r * 1/sqrt(mean(r^2) + eps))          -- HF LlamaRMSNorm's order of operations */
void rmsnorm_f32(const float *x, float *res, const float *w, float *out, int64_t M, int64_t N, float eps,
                 int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * N;
        const float *r = xm;
        if (res) {
            float *rm = res + m * N;
#pragma omp simd
            for (int64_t i = 0; i < N; i++) rm[i] = xm[i] + rm[i];
            r = rm;
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < N; i++) ss += r[i] * r[i];
        float inv = 1.f / sqrtf(ss / (float)N + eps);
        float *om = out + m * N;
#pragma omp simd
        for (int64_t i = 0; i < N; i++) om[i] = w[i] * (r[i] * inv);
    }
}

static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.f + exp_f32(-g[i])) * u[i];
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i] for gu (M, 2I): the SwiGLU gate after the fused gate/up product. */
void silu_mul_f32(const float *gu, float *out, int64_t M, int64_t I, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * I > 32768)
    for (int64_t m = 0; m < M; m++) silu_mul_row(gu + m * 2 * I, gu + m * 2 * I + I, out + m * I, I);
}

static void swiglu_clamped_row(const float *restrict g, const float *restrict u, float *restrict o, int64_t n,
                               float alpha, float limit) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float a = g[i] > limit ? limit : g[i]; /* (NaN stays NaN, as torch's clamp) */
        const float b = u[i] > limit ? limit : u[i] < -limit ? -limit : u[i];
        o[i] = (b + 1.f) * (a / (1.f + exp_f32(-(a * alpha))));
    }
}

/* out[m, i] = (clamp(up, -limit, limit) + 1) * gate * sigmoid(alpha * gate), gate = min(gu[m, i], limit), up =
 * gu[m, I + i]: gpt-oss's clamped SwiGLU after the fused gate/up product (its experts' rows: gate first). */
void swiglu_clamped_f32(const float *gu, float *out, int64_t M, int64_t I, float alpha, float limit, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * I > 32768)
    for (int64_t m = 0; m < M; m++)
        swiglu_clamped_row(gu + m * 2 * I, gu + m * 2 * I + I, out + m * I, I, alpha, limit);
}

/* Rotary embedding (rotate-half convention, as HF Llama) applied in place to the T tokens' query and key
 * heads, then each token's K and V rows copied into the paged caches at slots[t] (flat row = block *
 * block_size + offset). q/k/v rows of token t start at q + t * q_stride (etc.); heads are D apart.
 * cos, sin: (T, D) rows for the tokens' positions. */
void rope_write_kv_f32(float *q, int64_t q_stride, float *k, int64_t k_stride, const float *v, int64_t v_stride,
                       const float *cos, const float *sin, float *k_cache, float *v_cache, const int64_t *slots,
                       int64_t T, int64_t H, int64_t KVH, int64_t D, int nthreads) {
    int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < H + KVH; h++) {
            float *x = h < H ? q + t * q_stride + h * D : k + t * k_stride + (h - H) * D;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] + (-x2) * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
        float *kd = k_cache + slots[t] * KVH * D, *vd = v_cache + slots[t] * KVH * D;
        const float *ks = k + t * k_stride, *vs = v + t * v_stride;
        for (int64_t i = 0; i < KVH * D; i++) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
    }
}
