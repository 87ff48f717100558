/* lmserve CPU kernels: decode-path operations where PyTorch's CPU ops leave most of the machine unused
 * (measured on the benchmark model, 2 cores, bench/profile_step.py; see docs/performance.md):
 *
 *   linear_f32               y = x W^T (+ b) for 1-2 rows of x. MKL's sgemv runs the (1 x 576) @
 *                            (576 x 49152) LM head at ~9 GB/s; streaming W once with all threads
 *                            reaches ~30 GB/s (the machine's read bandwidth). linear_bf16w_f32: the same
 *                            with bfloat16 weights (EngineArgs.weight_dtype="bfloat16").
 *   paged_decode_attention   one query token per sequence against its paged K/V history, read in
 *                            place through the block table: no gather copy, no padding mask.
 *   rmsnorm_f32, silu_mul_f32, rope_write_kv_f32
 *                            fused element-wise steps of a decoder layer (each replaced 3-10 small
 *                            PyTorch ops costing a few microseconds of dispatch apiece).
 *
 * Plain C with OpenMP, loaded with ctypes (lmserve/kernels/__init__.py compiles it on first use).
 * libgomp is the same shared object torch uses, so both share one thread pool; the caller passes
 * the thread count (torch.get_num_threads()) because OpenMP's default is per calling thread.
 * All tensors are contiguous float32 (int64 for indices); the Python side asserts it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP_HEADS 256 /* query heads one attention work item may hold (caller asserts H <= this) */

static inline float dot_f32(const float *x, const float *w, int64_t I) {
    float a = 0.f;
#pragma omp simd reduction(+ : a)
    for (int64_t i = 0; i < I; i++) a += x[i] * w[i];
    return a;
}

/* y[m, o] = sum_i x[m, i] * w[o, i] + (b ? b[o] : 0); x (M, I), w (O, I), y (M, O).
 * Threads split the output features; each weight row is read once, front to back, and meets every row
 * of x while in L1. One sequential stream per thread is what the hardware prefetcher follows best:
 * interleaving 4 rows (to share loads of x) measured 20 GB/s against 31 GB/s for this loop. */
void linear_f32(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t O, int64_t I,
                int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < O; o++) {
        const float *wr = w + o * I;
        float bias = b ? b[o] : 0.f;
        for (int64_t m = 0; m < M; m++) y[m * O + o] = dot_f32(x + m * I, wr, I) + bias;
    }
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

/* bfloat16 -> float32 is exact: the bf16 bits are the high half of the float32. */
static inline float dot_bf16(const float *x, const uint16_t *w, int64_t I) {
    float a = 0.f;
#pragma omp simd reduction(+ : a)
    for (int64_t i = 0; i < I; i++) {
        uint32_t u = (uint32_t)w[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        a += x[i] * f;
    }
    return a;
}

/* linear_f32 with the weight stored in bfloat16 (float32 input, accumulation and output): half the bytes
 * per decode step on the bandwidth-bound path (27.5 GB/s of bf16 = 55 GB/s of float32 equivalent). */
void linear_bf16w_f32(const float *x, const uint16_t *w, const float *b, float *y, int64_t M, int64_t O, int64_t I,
                      int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < O; o++) {
        const uint16_t *wr = w + o * I;
        float bias = b ? b[o] : 0.f;
        for (int64_t m = 0; m < M; m++) y[m * O + o] = dot_bf16(x + m * I, wr, I) + bias;
    }
}

/* Attention of the query heads of kv heads [kh0, kh1) of one sequence. Token t's K (and V) row holds all
 * kv heads contiguously, so walking the tokens once for a range of heads reads whole cache lines. */
static void decode_attention_heads(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                                   int64_t L, float *out, int64_t kh0, int64_t kh1, int64_t G, int64_t D,
                                   int64_t block_size, int64_t row, float scale, float *scores) {
    int64_t nq = (kh1 - kh0) * G; /* query heads handled here, scores laid out (nq, L) */
    const float *q0 = q + kh0 * G * D;
    float *o0 = out + kh0 * G * D;
    float mx[MAX_GROUP_HEADS];
    for (int64_t h = 0; h < nq; h++) mx[h] = -INFINITY;
    for (int64_t t0 = 0; t0 < L; t0 += block_size) { /* block by block: contiguous rows, no division */
        const float *kb = k_cache + table[t0 / block_size] * block_size * row;
        int64_t n = L - t0 < block_size ? L - t0 : block_size;
        for (int64_t j = 0; j < n; j++) {
            const float *kr = kb + j * row;
            for (int64_t h = 0; h < nq; h++) {
                const float *qr = q0 + h * D, *kh = kr + (kh0 + h / G) * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; d++) s += qr[d] * kh[d];
                s *= scale;
                scores[h * L + t0 + j] = s;
                mx[h] = s > mx[h] ? s : mx[h];
            }
        }
    }
    for (int64_t h = 0; h < nq; h++) {
        float *sh = scores + h * L, m = mx[h], tot = 0.f;
#pragma omp simd reduction(+ : tot)
        for (int64_t t = 0; t < L; t++) {
            float e = exp_f32(sh[t] - m);
            sh[t] = e;
            tot += e;
        }
        float inv = 1.f / tot;
#pragma omp simd
        for (int64_t t = 0; t < L; t++) sh[t] *= inv;
        for (int64_t d = 0; d < D; d++) o0[h * D + d] = 0.f;
    }
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const float *vb = v_cache + table[t0 / block_size] * block_size * row;
        int64_t n = L - t0 < block_size ? L - t0 : block_size;
        for (int64_t j = 0; j < n; j++) {
            const float *vr = vb + j * row;
            for (int64_t h = 0; h < nq; h++) {
                const float *vh = vr + (kh0 + h / G) * D;
                float p = scores[h * L + t0 + j], *oh = o0 + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) oh[d] += p * vh[d];
            }
        }
    }
}

/* Decode attention over a paged cache.
 * q: (B, H, D); k_cache, v_cache: (num_blocks, block_size, KVH, D); block_tables: (B, max_blocks);
 * context_lens: (B,) tokens each query attends to (its own K/V already written); out: (B, H, D).
 * Query head h reads kv head h / (H / KVH) (GQA). With many sequences a work item is one sequence (all
 * heads, whole K/V rows); with few, one (sequence, kv head) pair so every thread has work. */
void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                            const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                            int64_t block_size, int64_t max_blocks, float scale, int nthreads) {
    int64_t G = H / KVH;
    int64_t row = KVH * D; /* floats between consecutive tokens of a block */
    int64_t split = B < 4 * nthreads ? KVH : 1; /* items per sequence */
    int64_t heads_per_item = KVH / split;
#pragma omp parallel num_threads(nthreads)
    {
        int64_t cap = 0;
        float *scores = NULL; /* (heads, L) per thread, grown as needed */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * split; item++) {
            int64_t bi = item / split, kh0 = (item % split) * heads_per_item;
            int64_t L = context_lens[bi], nq = heads_per_item * G;
            if (L * nq > cap) {
                free(scores);
                cap = L * nq;
                scores = (float *)malloc(sizeof(float) * cap);
            }
            decode_attention_heads(q + bi * H * D, k_cache, v_cache, block_tables + bi * max_blocks, L,
                                   out + bi * H * D, kh0, kh0 + heads_per_item, G, D, block_size, row, scale,
                                   scores);
        }
        free(scores);
    }
}

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
