/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define F32_ROWS_AVX512 1
#ifndef F32_PREFETCH
#define F32_PREFETCH 8192
#endif
/* 16 weights from i on, float32 or bfloat16 (widened exactly), lanes outside mask zero. */
static inline __attribute__((always_inline)) __m512 w16(const void *w, int64_t i, int bf16, __mmask16 k) {
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)w + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(k, (const float *)w + i);
}

/* y[m * ys] = x[m] . wr for the N (constant after inlining) rows of x against one weight row: two accumulators a
 * row over 32-input steps, a masked last step, then (a0 + a1) summed across lanes. A row's arithmetic is the same
 * whatever N is, so a row computes bit-identically alone, in a pair, or in a verification run of 8: a
 * speculative step scores each position exactly as a plain decode step would. All 2N accumulators stay in
 * registers and each weight load meets every row of x (in L1), so 1-8 rows cost about one pass over the weights. */
static inline __attribute__((always_inline)) void rows_dot(const float *x, const void *wr, int bf16, int64_t K,
                                                           int N, float *y, int64_t ys) {
    __m512 a0[F32_MAX_ROWS], a1[F32_MAX_ROWS];
    for (int m = 0; m < N; m++) a0[m] = a1[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 w0 = w16(wr, k, bf16, 0xffff), w1 = w16(wr, k + 16, bf16, 0xffff);
        /* the weight stream a few rows ahead, into L2: the rows' FMAs would otherwise idle the next loads */
        const char *pf = (const char *)wr + (k << (2 - bf16)) + F32_PREFETCH;
        _mm_prefetch(pf, _MM_HINT_T1);
        if (!bf16) _mm_prefetch(pf + 64, _MM_HINT_T1);
        for (int m = 0; m < N; m++) {
            a0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), a0[m]);
            a1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + k + 16), a1[m]);
        }
    }
    if (k < K) {
        int64_t r = K - k;
        __mmask16 k0 = r >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << r) - 1);
        __mmask16 k1 = r > 16 ? (__mmask16)((1u << (r - 16)) - 1) : (__mmask16)0;
        __m512 w0 = w16(wr, k, bf16, k0), w1 = w16(wr, k + 16, bf16, k1);
        for (int m = 0; m < N; m++) {
            a0[m] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(k0, x + m * K + k), a0[m]);
            a1[m] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(k1, x + m * K + k + 16), a1[m]);
        }
    }
    for (int m = 0; m < N; m++) y[m * ys] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
}

static inline __attribute__((always_inline)) void linear_rows(const float *x, const void *w, int bf16, const float *b,
                                                              float *y, int64_t M, int64_t O, int64_t I, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < O; o++) {
        const void *wr = bf16 ? (const void *)((const uint16_t *)w + o * I) : (const void *)((const float *)w + o * I);
        for (int64_t m0 = 0; m0 < M; m0 += F32_MAX_ROWS) {
            const float *xm = x + m0 * I;
            float *ym = y + m0 * O + o;
            switch (M - m0 < F32_MAX_ROWS ? M - m0 : F32_MAX_ROWS) {
            case 1: rows_dot(xm, wr, bf16, I, 1, ym, O); break;
            case 2: rows_dot(xm, wr, bf16, I, 2, ym, O); break;
            case 3: rows_dot(xm, wr, bf16, I, 3, ym, O); break;
            case 4: rows_dot(xm, wr, bf16, I, 4, ym, O); break;
            case 5: rows_dot(xm, wr, bf16, I, 5, ym, O); break;
            case 6: rows_dot(xm, wr, bf16, I, 6, ym, O); break;
            case 7: rows_dot(xm, wr, bf16, I, 7, ym, O); break;
            default: rows_dot(xm, wr, bf16, I, 8, ym, O);
            }
        }
        if (b)
            for (int64_t m = 0; m < M; m++) y[m * O + o] += b[o];
    }
}
#else
static inline float dot_w(const float *x, const void *w, int bf16, int64_t I) {
    float a = 0.f;
    if (bf16) {
        const uint16_t *wb = (const uint16_t *)w;
#pragma omp simd reduction(+ : a)
        for (int64_t i = 0; i < I; i++) {
            uint32_t u = (uint32_t)wb[i] << 16;
            float f;
            memcpy(&f, &u, sizeof f);
            a += x[i] * f;
        }
    } else {
        const float *wf = (const float *)w;
#pragma omp simd reduction(+ : a)
        for (int64_t i = 0; i < I; i++) a += x[i] * wf[i];
    }
    return a;
}

static void linear_rows(const float *x, const void *w, int bf16, const float *b, float *y, int64_t M, int64_t O,
                        int64_t I, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < O; o++) {
        const void *wr = bf16 ? (const void *)((const uint16_t *)w + o * I) : (const void *)((const float *)w + o * I);
        float bias = b ? b[o] : 0.f;
        for (int64_t m = 0; m < M; m++) y[m * O + o] = dot_w(x + m * I, wr, bf16, I) + bias;
    }
}
#endif

/* The most rows linear_f32 / linear_bf16w_f32 serve in one pass over the weights at about the cost of one:
 * F32_MAX_ROWS with the AVX-512 path, else 2 (the portable loop's dot products are latency-bound). */
int f32_kernel_max_rows(void) {
#ifdef F32_ROWS_AVX512
    return F32_MAX_ROWS;
#else
    return 2;
#endif
}

/* y[m, o] = sum_i x[m, i] * w[o, i] + (b ? b[o] : 0); x (M, I), w (O, I), y (M, O).
 * Threads split the output features; each weight row is read once, front to back, and meets every row
 * of x while in L1. One sequential stream per thread is what the hardware prefetcher follows best:
 * interleaving 4 weight rows (to share loads of x) measured 20 GB/s against 31 GB/s for this loop. */
void linear_f32(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t O, int64_t I,
                int nthreads) {
    linear_rows(x, w, 0, b, y, M, O, I, nthreads);
}

/* linear_f32 with the weight stored in bfloat16 (float32 input, accumulation and output): half the bytes
 * per decode step on the bandwidth-bound path (27.5 GB/s of bf16 = 55 GB/s of float32 equivalent). */
void linear_bf16w_f32(const float *x, const uint16_t *w, const float *b, float *y, int64_t M, int64_t O, int64_t I,
                      int nthreads) {
    linear_rows(x, w, 1, b, y, M, O, I, nthreads);
}

/* e^x in float32 (Cephes' expf: Cody-Waite reduction, degree-6 polynomial, ~1 ulp), inline and branch-free so
 * that loops calling it vectorize (glibc's vector expf is only declared to the compiler under -ffast-math). */
static inline float exp_f32(float x) {
    x = x < -87.33654f ? -87.33654f : x; /* ternaries, not fminf/fmaxf: those block vectorization */
    x = x > 88.72283f ? 88.72283f : x;
    float k = rintf(x * 1.44269504088896341f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23; /* 2^k */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
