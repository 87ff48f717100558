/* lmserve CPU kernels: decode-path operations where PyTorch's CPU ops leave most of the machine unused
 * (measured on the benchmark model, 2 cores, benchmarks/profile_step.py; see docs/performance.md).
 * One file past 500 lines because it is one thing: the one C library lmserve compiles and loads (kernels/__init__.py),
 * its sections (float32, quantized KV, quantized linears, GGUF K-quants, W4A8 int4, the decode stack) sharing helpers.
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
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__AVXVNNI__)
#include <immintrin.h>
#endif

#define MAX_GROUP_HEADS 256 /* query heads one attention work item may hold (caller asserts H <= this) */

#define F32_MAX_ROWS 8 /* rows of x one pass over the weights serves in registers (longer x: in runs of 8) */

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

/* bfloat16 -> float32 is exact: the bf16 bits are the high half of the float32. */
/* Each of nq rows of N scores (row maxima in mx) → its softmax in place; zero the nq output rows of D. */
static inline __attribute__((always_inline)) void softmax_rows_zero_out(float *scores, const float *mx, int64_t nq,
                                                                        int64_t N, float *o0, int64_t D) {
    for (int64_t h = 0; h < nq; h++) {
        float *sh = scores + h * N, m = mx[h], tot = 0.f;
#pragma omp simd reduction(+ : tot)
        for (int64_t t = 0; t < N; t++) {
            float e = exp_f32(sh[t] - m);
            sh[t] = e;
            tot += e;
        }
        float inv = 1.f / tot;
#pragma omp simd
        for (int64_t t = 0; t < N; t++) sh[t] *= inv;
        for (int64_t d = 0; d < D; d++) o0[h * D + d] = 0.f;
    }
}

/* Software prefetch of a decode query's K/V rows: the hardware prefetchers lose the stream at every 4 KiB page and
 * every block (one kv head's 256 bytes of a 768-byte token row are a short stride), so without it the attention of a
 * single-stream step waits on DRAM latency token after token (~100 us a layer of the benchmark model at 230 tokens
 * against ~14 us of bandwidth). While the scores walk token t, K of token t + ATTN_PREFETCH (into L1) and V of
 * token t (into L2, for the weighted sum that follows) are fetched. Prefetches change no arithmetic. */
#define ATTN_PREFETCH 16

/* The bytes [p, p + n) of one token's K or V row (the heads an item reads) into the cache level `hint` (2: L1,
 * 1: L2). */
static inline __attribute__((always_inline)) void prefetch_span(const char *p, int64_t n, int hint) {
    for (int64_t o = 0; o < n; o += 64) {
        if (hint == 2)
            __builtin_prefetch(p + o, 0, 3);
        else
            __builtin_prefetch(p + o, 0, 2);
    }
}

/* Address of the row of token t (< L) of a paged cache: table[t / block_size] * block_size + t % block_size rows
 * of row_bytes from base, plus off. */
static inline __attribute__((always_inline)) const char *token_row(const void *base, const int64_t *table, int64_t t,
                                                                   int64_t block_size, int64_t row_bytes,
                                                                   int64_t off) {
    return (const char *)base + (table[t / block_size] * block_size + t % block_size) * row_bytes + off;
}

#ifdef F32_ROWS_AVX512
/* r[t] lane i -> r[i] lane t: the 16 x 16 transpose (in-lane unpacks and shuffles, then 128-bit block shuffles). */
static inline __attribute__((always_inline)) void transpose16_ps(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* The scores of one query head qr (D floats, D a multiple of 16) against the K rows kr, kr + row, ... of 16
 * consecutive tokens, times scale, into out[0..15]: each the value the scalar loop of decode_attention_heads
 * computes (its `omp simd` reduction, as GCC vectorizes it: one 16-lane accumulator of FMAs over the D / 16
 * chunks, then s = 0 + lane 0 + lane 1 + ... + lane 15 in order, then s * scale), so a token's score does not
 * depend on which path computed it. The 16 serial lane sums of the scalar loop become 15 vector adds of the
 * transposed accumulators, one score a lane. */
static inline __attribute__((always_inline)) void scores16_f32(const float *qr, const float *kr, int64_t row,
                                                               int64_t D, float scale, float *out) {
    __m512 acc[16];
    for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
        const __m512 qc = _mm512_loadu_ps(qr + c);
        for (int t = 0; t < 16; t++) acc[t] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kr + t * row + c), acc[t]);
    }
    transpose16_ps(acc);
    __m512 r = _mm512_add_ps(_mm512_setzero_ps(), acc[0]);
    for (int i = 1; i < 16; i++) r = _mm512_add_ps(r, acc[i]);
    _mm512_storeu_ps(out, _mm512_mul_ps(r, _mm512_set1_ps(scale)));
}

/* One token's score as scores16_f32 computes it (the tokens past the last run of 16), written out so that both
 * paths agree whatever the compiler makes of the scalar loop's reduction. */
static inline __attribute__((always_inline)) float score1_f32(const float *qr, const float *kr, int64_t D,
                                                              float scale) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qr + c), _mm512_loadu_ps(kr + c), acc);
    float lanes[16], s = 0.f;
    _mm512_storeu_ps(lanes, acc);
    for (int i = 0; i < 16; i++) s += lanes[i];
    return s * scale;
}
#endif

/* Attention of query heads [h0, h1) of one sequence over its tokens [t_begin, L) (t_begin > 0: a sliding window;
 * the blocks before it are never read); query head h reads kv head h / G. Token t's K (and V) row holds all kv
 * heads contiguously, so walking the tokens once for a range of heads reads whole cache lines. Each score, each
 * softmax row and each output head is computed the same whatever range [h0, h1) it is computed in. */
static void decode_attention_heads(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                                   int64_t t_begin, int64_t L, float *out, int64_t h0, int64_t h1, int64_t G,
                                   int64_t D, int64_t block_size, int64_t row, float scale, float *scores) {
    int64_t nq = h1 - h0; /* query heads handled here, scores laid out (nq, N) */
    int64_t N = L - t_begin;
    const float *q0 = q + h0 * D;
    float *o0 = out + h0 * D;
    float mx[MAX_GROUP_HEADS];
    for (int64_t h = 0; h < nq; h++) mx[h] = -INFINITY;
    /* the bytes of a token row the heads read: kv heads h0 / G .. (h1 - 1) / G */
    const int64_t pf_off = h0 / G * D * 4, pf_len = ((h1 - 1) / G + 1) * D * 4 - pf_off, row_bytes = row * 4;
    for (int64_t t = t_begin; t < L && t < t_begin + ATTN_PREFETCH; t++)
        prefetch_span(token_row(k_cache, table, t, block_size, row_bytes, pf_off), pf_len, 2);
    /* block by block from the one holding t_begin: contiguous rows, no division */
    for (int64_t t0 = t_begin - t_begin % block_size; t0 < L; t0 += block_size) {
        const float *kb = k_cache + table[t0 / block_size] * block_size * row;
        int64_t j0 = t_begin > t0 ? t_begin - t0 : 0;
        int64_t n = L - t0 < block_size ? L - t0 : block_size;
        int64_t j = j0;
#ifdef F32_ROWS_AVX512
        if (D % 16 == 0) /* runs of 16 tokens: the same scores, the lane sums vectorized (scores16_f32) */
            for (; j + 16 <= n; j += 16) {
                for (int64_t u = j; u < j + 16; u++) {
                    if (t0 + u + ATTN_PREFETCH < L)
                        prefetch_span(token_row(k_cache, table, t0 + u + ATTN_PREFETCH, block_size, row_bytes, pf_off),
                                      pf_len, 2);
                    prefetch_span(token_row(v_cache, table, t0 + u, block_size, row_bytes, pf_off), pf_len, 1);
                }
                for (int64_t h = 0; h < nq; h++) {
                    float *sh = scores + h * N + t0 + j - t_begin;
                    scores16_f32(q0 + h * D, kb + j * row + (h0 + h) / G * D, row, D, scale, sh);
                    for (int u = 0; u < 16; u++) mx[h] = sh[u] > mx[h] ? sh[u] : mx[h];
                }
            }
#endif
        for (; j < n; j++) {
            const float *kr = kb + j * row;
            if (t0 + j + ATTN_PREFETCH < L)
                prefetch_span(token_row(k_cache, table, t0 + j + ATTN_PREFETCH, block_size, row_bytes, pf_off),
                              pf_len, 2);
            prefetch_span(token_row(v_cache, table, t0 + j, block_size, row_bytes, pf_off), pf_len, 1);
            for (int64_t h = 0; h < nq; h++) {
                const float *qr = q0 + h * D, *kh = kr + (h0 + h) / G * D;
                float s = 0.f;
#ifdef F32_ROWS_AVX512
                if (D % 16 == 0) {
                    s = score1_f32(qr, kh, D, scale);
                } else
#endif
                {
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; d++) s += qr[d] * kh[d];
                    s *= scale;
                }
                scores[h * N + t0 + j - t_begin] = s;
                mx[h] = s > mx[h] ? s : mx[h];
            }
        }
    }
    softmax_rows_zero_out(scores, mx, nq, N, o0, D);
#ifdef F32_ROWS_AVX512
    if (D % 16 == 0 && D <= 128) { /* each head's output in registers over all tokens: the same FMAs in order */
        for (int64_t h = 0; h < nq; h++) {
            __m512 acc[8];
            for (int64_t c = 0; c < D / 16; c++) acc[c] = _mm512_loadu_ps(o0 + h * D + 16 * c);
            const float *sh = scores + h * N - t_begin;
            const int64_t off = (h0 + h) / G * D;
            for (int64_t t0 = t_begin - t_begin % block_size; t0 < L; t0 += block_size) {
                const float *vb = v_cache + table[t0 / block_size] * block_size * row + off;
                int64_t j0 = t_begin > t0 ? t_begin - t0 : 0;
                int64_t n = L - t0 < block_size ? L - t0 : block_size;
                for (int64_t j = j0; j < n; j++) {
                    const __m512 pv = _mm512_set1_ps(sh[t0 + j]);
                    for (int64_t c = 0; c < D / 16; c++)
                        acc[c] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vb + j * row + 16 * c), acc[c]);
                }
            }
            for (int64_t c = 0; c < D / 16; c++) _mm512_storeu_ps(o0 + h * D + 16 * c, acc[c]);
        }
        return;
    }
#endif
    for (int64_t t0 = t_begin - t_begin % block_size; t0 < L; t0 += block_size) {
        const float *vb = v_cache + table[t0 / block_size] * block_size * row;
        int64_t j0 = t_begin > t0 ? t_begin - t0 : 0;
        int64_t n = L - t0 < block_size ? L - t0 : block_size;
        for (int64_t j = j0; j < n; j++) {
            const float *vr = vb + j * row;
            for (int64_t h = 0; h < nq; h++) {
                const float *vh = vr + (h0 + h) / G * D;
                float p = scores[h * N + t0 + j - t_begin], *oh = o0 + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) oh[d] += p * vh[d];
            }
        }
    }
}

/* How decode attention splits B sequences of H query heads (KVH kv heads) into work items: *split items a
 * sequence, each of *per query heads. Many sequences: one item each (all heads, whole K/V rows). Fewer than 4 a
 * thread: one a kv head (its group of query heads), so every thread has work; fewer sequences than threads (a
 * single stream): each sequence's query heads in as many near-equal runs as it takes to give every thread one
 * (9 heads over 2 threads: 5 + 4, where 3 kv heads would leave one thread two of the three). */
static inline void attention_items(int64_t B, int64_t H, int64_t KVH, int nthreads, int64_t *split, int64_t *per) {
    if (B >= 4 * nthreads) {
        *split = 1, *per = H;
    } else if (B >= nthreads || KVH % nthreads == 0) {
        *split = KVH, *per = H / KVH;
    } else {
        int64_t s = (nthreads + B - 1) / B;
        s = s < H ? s : H;
        *split = s, *per = (H + s - 1) / s;
    }
}

/* First token a decode query over L tokens reads: L - window with a sliding window (window > 0) shorter than L
 * (the query at position L - 1 sees keys > L - 1 - window, as HF's sliding-window mask), else 0. */
static inline int64_t window_begin(int64_t L, int64_t window) { return window > 0 && L > window ? L - window : 0; }

/* Decode attention over a paged cache.
 * q: (B, H, D); k_cache, v_cache: (num_blocks, block_size, KVH, D); block_tables: (B, max_blocks);
 * context_lens: (B,) tokens each query attends to (its own K/V already written); window: 0, or a sliding window
 * (only the last `window` tokens are read: table entries of earlier blocks may be anything, even freed);
 * out: (B, H, D).
 * Query head h reads kv head h / (H / KVH) (GQA). Work items as attention_items splits them (a sequence, a kv
 * head's group of query heads, or a run of query heads); every output is the same whatever the split. */
void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                            const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                            int64_t block_size, int64_t max_blocks, float scale, int64_t window, int nthreads) {
    int64_t G = H / KVH;
    int64_t row = KVH * D; /* floats between consecutive tokens of a block */
    int64_t split, per;    /* items per sequence, query heads per item (attention_items) */
    attention_items(B, H, KVH, nthreads, &split, &per);
#pragma omp parallel num_threads(nthreads)
    {
        int64_t cap = 0;
        float *scores = NULL; /* (heads, L) per thread, grown as needed */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * split; item++) {
            int64_t bi = item / split, h0 = (item % split) * per, h1 = h0 + per < H ? h0 + per : H;
            int64_t L = context_lens[bi], t_begin = window_begin(L, window), nq = h1 - h0;
            if (nq <= 0) continue;
            if ((L - t_begin) * nq > cap) {
                free(scores);
                cap = (L - t_begin) * nq;
                scores = (float *)malloc(sizeof(float) * cap);
            }
            decode_attention_heads(q + bi * H * D, k_cache, v_cache, block_tables + bi * max_blocks, t_begin, L,
                                   out + bi * H * D, h0, h1, G, D, block_size, row, scale, scores);
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

/* ==================================================================================================== *
 * Quantized KV cache (EngineArgs.kv_cache_dtype): bfloat16, int8 + scale, fp8 e4m3 + scale.
 *
 * Layout as the float32 cache: values (num_blocks, block_size, KVH, D) in the storage type; int8 and fp8
 * add a float32 scale per (slot, KV head), scales (num_blocks * block_size, KVH). A stored row is
 * x ≈ scale * value: int8 value = rint(x / s), s = amax|x| / 127; fp8 value = e4m3(x / s), s = amax|x| / 448
 * (the same operations, in the same order, as lmserve/model/kv_cache.py's quantize, so both write the same
 * bytes). Decode attention converts values to float32 in registers and applies the scale once per row:
 * score = (q . k_raw) * s_k * softmax_scale; out += (p * s_v) * v_raw.
 * ==================================================================================================== */

enum { KV_BF16 = 0, KV_INT8 = 1, KV_FP8_E4M3 = 2 };

static float fp8_e4m3_lut[256]; /* e4m3fn byte -> float32, filled when the library loads */

__attribute__((constructor)) static void init_fp8_e4m3_lut(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float a = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + (float)m / 8.f, e - 7); /* bias 7; e=0 subnormal */
        if (e == 15 && m == 7) a = NAN;                                                   /* e4m3fn: no inf */
        fp8_e4m3_lut[b] = (b & 0x80) ? -a : a;
    }
}

static inline __attribute__((always_inline)) float kv_value(const void *base, int64_t i, int kind) {
    if (kind == KV_BF16) {
        uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    if (kind == KV_INT8) return (float)((const int8_t *)base)[i];
    return fp8_e4m3_lut[((const uint8_t *)base)[i]];
}

/* float32 -> e4m3fn byte, round to nearest even, |x| <= 448 (the caller scaled it so; larger saturates). */
static inline uint8_t f32_to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7fffffffu;
    float a;
    memcpy(&a, &u, sizeof a);
    if (a < 0.015625f) return sign | (uint8_t)rintf(a * 512.f); /* below 2^-6: multiples of 2^-9; 8 -> 0x08 = 2^-6 */
    u += 0x7ffffu + ((u >> 20) & 1u);                            /* keep 3 mantissa bits, ties to even */
    uint32_t r = (((u >> 23) - 120u) << 3) | ((u >> 20) & 7u);  /* exponent bias 127 -> 7 */
    return sign | (uint8_t)(r > 0x7eu ? 0x7eu : r);
}

/* One row of D floats into the cache in the storage type; *scale gets the row's scale (int8 / fp8). */
static void kv_store_row(const float *x, void *dst, float *scale, int64_t D, int kind) {
    if (kind == KV_BF16) {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t d = 0; d < D; d++) {
            uint32_t u;
            memcpy(&u, &x[d], sizeof u);
            u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch's float -> bfloat16 */
            o[d] = (uint16_t)(u >> 16);
        }
        return;
    }
    float amax = 0.f;
    for (int64_t d = 0; d < D; d++) {
        float a = fabsf(x[d]);
        amax = a > amax ? a : amax;
    }
    float qmax = kind == KV_INT8 ? 127.f : 448.f;
    float s = amax / qmax;
    if (!(s > 0.f)) s = 1.f;
    *scale = s;
    if (kind == KV_INT8) {
        int8_t *o = (int8_t *)dst;
        for (int64_t d = 0; d < D; d++) {
            float r = rintf(x[d] / s);
            o[d] = (int8_t)(r > 127.f ? 127.f : (r < -127.f ? -127.f : r));
        }
    } else {
        uint8_t *o = (uint8_t *)dst;
        for (int64_t d = 0; d < D; d++) {
            float y = x[d] / s;
            o[d] = f32_to_e4m3(y > 448.f ? 448.f : (y < -448.f ? -448.f : y));
        }
    }
}

/* rope_write_kv_f32 writing the cache in the storage type `kind` (element size 2 for bf16, else 1). */
void rope_write_kv_q(float *q, int64_t q_stride, float *k, int64_t k_stride, const float *v, int64_t v_stride,
                     const float *cos, const float *sin, void *k_cache, void *v_cache, float *k_scale,
                     float *v_scale, const int64_t *slots, int64_t T, int64_t H, int64_t KVH, int64_t D, int kind,
                     int nthreads) {
    int64_t half = D / 2, esize = kind == KV_BF16 ? 2 : 1;
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
        for (int64_t h = 0; h < KVH; h++) {
            int64_t row = slots[t] * KVH + h; /* (slot, head) row of D elements; scales are indexed by it */
            kv_store_row(k + t * k_stride + h * D, (char *)k_cache + row * D * esize, k_scale ? k_scale + row : NULL,
                         D, kind);
            kv_store_row(v + t * v_stride + h * D, (char *)v_cache + row * D * esize, v_scale ? v_scale + row : NULL,
                         D, kind);
        }
    }
}

/* decode_attention_heads over a cache stored as `kind` (a literal at every call site, so each variant is
 * compiled separately with the conversion inlined); query heads [h0, h1), the same prefetches. Scales: NULL for
 * bf16. */
static inline __attribute__((always_inline)) void decode_attention_heads_q(
    const float *q, const void *k_cache, const void *v_cache, const float *k_scale, const float *v_scale,
    const int64_t *table, int64_t t_begin, int64_t L, float *out, int64_t h0, int64_t h1, int64_t G, int64_t KVH,
    int64_t D, int64_t block_size, float scale, float *scores, int kind) {
    int64_t nq = h1 - h0, row = KVH * D, N = L - t_begin;
    const float *q0 = q + h0 * D;
    float *o0 = out + h0 * D;
    float mx[MAX_GROUP_HEADS];
    for (int64_t h = 0; h < nq; h++) mx[h] = -INFINITY;
    const int64_t esize = kind == KV_BF16 ? 2 : 1, row_bytes = row * esize;
    const int64_t pf_off = h0 / G * D * esize, pf_len = ((h1 - 1) / G + 1) * D * esize - pf_off;
    for (int64_t t = t_begin; t < L && t < t_begin + ATTN_PREFETCH; t++)
        prefetch_span(token_row(k_cache, table, t, block_size, row_bytes, pf_off), pf_len, 2);
    for (int64_t t0 = t_begin - t_begin % block_size; t0 < L; t0 += block_size) {
        int64_t slot0 = table[t0 / block_size] * block_size;
        int64_t j0 = t_begin > t0 ? t_begin - t0 : 0;
        int64_t n = L - t0 < block_size ? L - t0 : block_size;
        for (int64_t j = j0; j < n; j++) {
            int64_t slot = slot0 + j;
            if (t0 + j + ATTN_PREFETCH < L)
                prefetch_span(token_row(k_cache, table, t0 + j + ATTN_PREFETCH, block_size, row_bytes, pf_off),
                              pf_len, 2);
            prefetch_span(token_row(v_cache, table, t0 + j, block_size, row_bytes, pf_off), pf_len, 1);
            for (int64_t h = 0; h < nq; h++) {
                int64_t kh = (h0 + h) / G, base = slot * row + kh * D;
                const float *qr = q0 + h * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; d++) s += qr[d] * kv_value(k_cache, base + d, kind);
                s *= (k_scale ? k_scale[slot * KVH + kh] : 1.f) * scale;
                scores[h * N + t0 + j - t_begin] = s;
                mx[h] = s > mx[h] ? s : mx[h];
            }
        }
    }
    softmax_rows_zero_out(scores, mx, nq, N, o0, D);
    for (int64_t t0 = t_begin - t_begin % block_size; t0 < L; t0 += block_size) {
        int64_t slot0 = table[t0 / block_size] * block_size;
        int64_t j0 = t_begin > t0 ? t_begin - t0 : 0;
        int64_t n = L - t0 < block_size ? L - t0 : block_size;
        for (int64_t j = j0; j < n; j++) {
            int64_t slot = slot0 + j;
            for (int64_t h = 0; h < nq; h++) {
                int64_t kh = (h0 + h) / G, base = slot * row + kh * D;
                float p = scores[h * N + t0 + j - t_begin] * (v_scale ? v_scale[slot * KVH + kh] : 1.f);
                float *oh = o0 + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) oh[d] += p * kv_value(v_cache, base + d, kind);
            }
        }
    }
}

/* paged_decode_attention over a bf16 / int8 / fp8 cache (kind), dequantizing in registers: the same work
 * split and the same arguments (the sliding window included), plus the scale tensors (NULL for bf16). */
void paged_decode_attention_q(const float *q, const void *k_cache, const void *v_cache, const float *k_scale,
                              const float *v_scale, const int64_t *block_tables, const int64_t *context_lens,
                              float *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                              int64_t max_blocks, float scale, int64_t window, int kind, int nthreads) {
    int64_t G = H / KVH;
    int64_t split, per;
    attention_items(B, H, KVH, nthreads, &split, &per);
#pragma omp parallel num_threads(nthreads)
    {
        int64_t cap = 0;
        float *scores = NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * split; item++) {
            int64_t bi = item / split, h0 = (item % split) * per, h1 = h0 + per < H ? h0 + per : H;
            int64_t L = context_lens[bi], t0 = window_begin(L, window), nq = h1 - h0;
            if (nq <= 0) continue;
            if ((L - t0) * nq > cap) {
                free(scores);
                cap = (L - t0) * nq;
                scores = (float *)malloc(sizeof(float) * cap);
            }
            const float *qb = q + bi * H * D;
            const int64_t *table = block_tables + bi * max_blocks;
            float *ob = out + bi * H * D;
            if (kind == KV_BF16)
                decode_attention_heads_q(qb, k_cache, v_cache, NULL, NULL, table, t0, L, ob, h0, h1, G, KVH, D,
                                         block_size, scale, scores, KV_BF16);
            else if (kind == KV_INT8)
                decode_attention_heads_q(qb, k_cache, v_cache, k_scale, v_scale, table, t0, L, ob, h0, h1, G, KVH,
                                         D, block_size, scale, scores, KV_INT8);
            else
                decode_attention_heads_q(qb, k_cache, v_cache, k_scale, v_scale, table, t0, L, ob, h0, h1, G, KVH,
                                         D, block_size, scale, scores, KV_FP8_E4M3);
        }
        free(scores);
    }
}
/* ========================================= end quantized KV cache ========================================= */

/* ==================================================================================================== *
 * Quantized linear kernels (issue #12): int8 W8A8 and int4 weight-only, for 1-2 rows (decode).          *
 * Section owned by the quantization work; other sections append below their own delimiter.             *
 * ==================================================================================================== *
 *
 *   quantize_rows_i8   per-row symmetric int8 of float32 activations: s = max|x| / 127 (1 when the row
 *                      is all zero), q = round-half-even(x / s) clamped to [-127, 127]; the same
 *                      operations, in the same order, as lmserve.model.quantization.quantize_activations,
 *                      so both give identical bits.
 *   linear_i8_f32      y = (x_q . w_q) * (s_x * s_w[o]) + b: the int32 dot product is exact, only the
 *                      final scale rounds. AVX512-VNNI (vpdpbusd, 64 products an instruction) or AVX-VNNI
 *                      (256-bit) when compiled for a CPU that has them, else a portable int32 loop.
 *                      vpdpbusd multiplies unsigned by signed bytes: x is shifted to x + 128 (unsigned)
 *                      and 128 * sum(w row) (precomputed, w_sum) is subtracted afterwards.
 *   linear_i4_f32      y = x W^T (+ b) with W stored as 4-bit codes and one float16 scale per group of G
 *                      inputs along a row: w = (code - 8) * scale (symmetric, no zero point). Within a row
 *                      each run of 32 inputs is 16 bytes: byte i holds input i (low nibble) and input
 *                      i + 16 (high nibble), so one load and two masks unpack it.
 *                      With mins (O, K / G) float16 (GGUF Q4_1's per-block minimum; NULL otherwise) the
 *                      codes are not offset: w = code * scale + min, and each group adds min * sum(x) of
 *                      its inputs to its scaled code sum.
 *   dequant_i4_f32     the same codes to a float32 (O, K) matrix (larger batches: dequantize, then GEMM).
 *   linear_i8w_f32     weight-only int8 with one float16 scale per group of G inputs (GGUF Q8_0 blocks as
 *                      they are in the file): w = q * scale, x float32; per group the float sum of q * x,
 *                      then one multiply by its scale. dequant_i8w_f32: the float32 matrix.
 */
/* Which int8 dot-product instruction linear_i8_f32 was compiled with: 2 AVX512-VNNI, 1 AVX-VNNI, 0 none. */
int i8_kernel_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVXVNNI__)
    return 1;
#else
    return 0;
#endif
}

/* 1 when linear_i4_f32 was compiled with its AVX-512 path. */
int i4_kernel_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

static void quantize_row_i8(const float *x, int8_t *q, float *scale, int64_t K) {
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < K; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float s = amax / 127.f;
    if (s == 0.f) s = 1.f;
    *scale = s;
#pragma omp simd
    for (int64_t i = 0; i < K; i++) {
        float r = nearbyintf(x[i] / s);
        r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
        q[i] = (int8_t)r;
    }
}

void quantize_rows_i8(const float *x, int8_t *q, float *scales, int64_t M, int64_t K, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++) quantize_row_i8(x + m * K, q + m * K, scales + m, K);
}

#define I8_MAX_ROWS 8 /* rows of x one pass over an int8 weight row serves in registers (more: in runs of 8) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* The 8 lane sums of a[0..7] (a[m]'s 16 lanes summed into lane m): the unpack / shuffle tree of a transposed
 * reduction, 7 + 7 + 2 adds instead of 8 separate horizontal sums. */
static inline __m256i i8_sum8(const __m512i *a) {
    __m512i c[4], d[2];
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(c[2 * i], c[2 * i + 1]),
                                _mm512_unpackhi_epi64(c[2 * i], c[2 * i + 1]));
    /* d[0]'s 128-bit lanes: partial sums of rows 0-3, d[1]'s of rows 4-7 */
    const __m512i e = _mm512_add_epi32(_mm512_shuffle_i32x4(d[0], d[1], 0x88), _mm512_shuffle_i32x4(d[0], d[1], 0xDD));
    const __m512i f = _mm512_add_epi32(e, _mm512_shuffle_i32x4(e, e, 0xB1)); /* lane 0: rows 0-3, lane 2: 4-7 */
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_castsi512_si128(f)), _mm512_extracti32x4_epi32(f, 2),
                                   1);
}
#endif

/* s[m] = sum_i xu[m K + i] * w[i] with xu = x_q + 128 as unsigned bytes (VNNI paths), or sum_i x_q * w
 * (portable), for the N (constant after inlining) rows of x against one weight row: each load of the weight row
 * meets every row of x (in L1), one accumulator a row. xt (AVX512-VNNI, N > 1): the same rows' whole 64-byte
 * chunks interleaved, chunk c of row m at xt + (c N + m) 64, so one pointer walks them. Exact in int32, so a row's
 * sum is the same whatever N is: a row computes bit-identically alone or in a batch, and as torch._int_mm does. */
static inline __attribute__((always_inline)) void dot_i8_rows(const uint8_t *xu, const int8_t *xq, const uint8_t *xt,
                                                              const int8_t *w, int64_t K, int N, int32_t *s) {
    int64_t i = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i acc[I8_MAX_ROWS];
    for (int m = 0; m < I8_MAX_ROWS; m++) acc[m] = _mm512_setzero_si512();
    if (N == 1) {
        for (; i + 64 <= K; i += 64)
            acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_loadu_si512((const void *)(xu + i)),
                                         _mm512_loadu_si512((const void *)(w + i)));
        s[0] = _mm512_reduce_add_epi32(acc[0]);
    } else {
        for (const uint8_t *xp = xt; i + 64 <= K; i += 64, xp += N * 64) {
            const __m512i wv = _mm512_loadu_si512((const void *)(w + i));
            for (int m = 0; m < N; m++)
                acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512((const void *)(xp + m * 64)), wv);
        }
        _mm256_storeu_si256((__m256i *)s, i8_sum8(acc)); /* (s holds I8_MAX_ROWS) */
    }
    (void)xq;
#elif defined(__AVXVNNI__)
    (void)xt;
    __m256i acc[I8_MAX_ROWS];
    for (int m = 0; m < N; m++) acc[m] = _mm256_setzero_si256();
    for (; i + 32 <= K; i += 32) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + i));
        for (int m = 0; m < N; m++)
            acc[m] = _mm256_dpbusd_avx_epi32(acc[m], _mm256_loadu_si256((const __m256i *)(xu + m * K + i)), wv);
    }
    for (int m = 0; m < N; m++) {
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc[m]), _mm256_extracti128_si256(acc[m], 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
        s[m] = _mm_cvtsi128_si32(h);
    }
    (void)xq;
#else
    (void)xu;
    (void)xt;
    for (int m = 0; m < N; m++) {
        int32_t a = 0;
        const int8_t *xm = xq + m * K;
#pragma omp simd reduction(+ : a)
        for (int64_t j = 0; j < K; j++) a += (int32_t)xm[j] * (int32_t)w[j];
        s[m] = a;
    }
    i = K;
#endif
    for (; i < K; i++) /* the tail past the last whole vector */
        for (int m = 0; m < N; m++) s[m] += (int32_t)xu[m * K + i] * (int32_t)w[i];
}

/* x (M, K) float32 -> quantized per row here; w (O, K) int8; w_scale (O,); w_sum (O,) = sum of each w row;
 * b (O,) or NULL; y (M, O). Threads split the output features, each streaming its weight rows once, every row
 * of x meeting a weight row while it is in L1 (I8_MAX_ROWS at a time). */
void linear_i8_f32(const float *x, const int8_t *w, const float *w_scale, const int32_t *w_sum, const float *b,
                   float *y, int64_t M, int64_t O, int64_t K, int nthreads) {
    const int64_t KC = K / 64 * 64; /* bytes of a row in whole 64-byte chunks (the interleaved copy's) */
    /* 64-byte aligned: a row's vector loads never straddle two cache lines, whatever the heap handed out before */
    const size_t xbytes = (size_t)((M * K + 63) / 64 * 64);
    int8_t *xq = (int8_t *)aligned_alloc(64, xbytes);
    uint8_t *xu = (uint8_t *)aligned_alloc(64, xbytes);
    uint8_t *xt = M > 1 ? (uint8_t *)aligned_alloc(64, (size_t)(M * KC) + 64) : NULL;
    float *xs = (float *)malloc(sizeof(float) * (size_t)M);
    for (int64_t m = 0; m < M; m++) {
        quantize_row_i8(x + m * K, xq + m * K, xs + m, K);
        for (int64_t i = 0; i < K; i++) xu[m * K + i] = (uint8_t)((int32_t)xq[m * K + i] + 128);
    }
    for (int64_t m0 = 0; xt && m0 < M; m0 += I8_MAX_ROWS) { /* each run of rows: chunk c of row m at (c n + m) 64 */
        const int64_t n = M - m0 < I8_MAX_ROWS ? M - m0 : I8_MAX_ROWS;
        for (int64_t m = 0; m < n; m++)
            for (int64_t c = 0; c < KC / 64; c++)
                memcpy(xt + m0 * KC + (c * n + m) * 64, xu + (m0 + m) * K + c * 64, 64);
    }
    int shifted = i8_kernel_isa() > 0;
    if (M == 1) { /* single-stream decode: one row of x, one accumulator a weight row */
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t o = 0; o < O; o++) {
            int32_t acc;
            dot_i8_rows(xu, xq, NULL, w + o * K, K, 1, &acc);
            y[o] = (float)(acc - (shifted ? 128 * w_sum[o] : 0)) * (xs[0] * w_scale[o]) + (b ? b[o] : 0.f);
        }
    } else { /* (the run loop below, with M = 1, measured ~1.6x slower than the loop above) */
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t o = 0; o < O; o++) {
            const int8_t *wr = w + o * K;
            float bias = b ? b[o] : 0.f;
            int32_t corr = shifted ? 128 * w_sum[o] : 0, acc[I8_MAX_ROWS];
            for (int64_t m0 = 0; m0 < M; m0 += I8_MAX_ROWS) {
                const int64_t n = M - m0 < I8_MAX_ROWS ? M - m0 : I8_MAX_ROWS;
                const uint8_t *xum = xu + m0 * K, *xtm = xt + m0 * KC;
                const int8_t *xqm = xq + m0 * K;
                switch (n) {
                case 1: dot_i8_rows(xum, xqm, xtm, wr, K, 1, acc); break;
                case 2: dot_i8_rows(xum, xqm, xtm, wr, K, 2, acc); break;
                case 3: dot_i8_rows(xum, xqm, xtm, wr, K, 3, acc); break;
                case 4: dot_i8_rows(xum, xqm, xtm, wr, K, 4, acc); break;
                case 5: dot_i8_rows(xum, xqm, xtm, wr, K, 5, acc); break;
                case 6: dot_i8_rows(xum, xqm, xtm, wr, K, 6, acc); break;
                case 7: dot_i8_rows(xum, xqm, xtm, wr, K, 7, acc); break;
                default: dot_i8_rows(xum, xqm, xtm, wr, K, 8, acc);
                }
                for (int64_t m = 0; m < n; m++)
                    y[(m0 + m) * O + o] = (float)(acc[m] - corr) * (xs[m0 + m] * w_scale[o]) + bias;
            }
        }
    }
    free(xq);
    free(xu);
    free(xt);
    free(xs);
}

/* The most rows linear_i8_f32 serves in one pass over its weights (longer x: a pass per I8_MAX_ROWS rows). */
int i8_kernel_max_rows(void) { return I8_MAX_ROWS; }

/* float16 bits -> float32 (exact): the F16C instruction where the CPU has it, else the bit manipulation. */
#if defined(__F16C__) && (defined(__AVX512F__) || defined(__AVX2__) || defined(__AVXVNNI__)) /* immintrin.h */
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

/* Dequantized row o of an int4 matrix: out[i] = (code_i - 8) * scale[i / G], or with mins
 * code_i * scale[i / G] + min[i / G] (code * scale is exact in float32, so one rounding, as gguf's). */
static void dequant_i4_row(const uint8_t *wr, const uint16_t *sr, const uint16_t *mr, float *out, int64_t K,
                           int64_t G) {
    const int32_t off = mr ? 0 : 8;
    for (int64_t j = 0; j < K; j += 32) {
        const uint8_t *blk = wr + j / 2;
        float d = f16_to_f32(sr[j / G]);
        for (int64_t i = 0; i < 16; i++) {
            out[j + i] = (float)((int32_t)(blk[i] & 0x0f) - off) * d;
            out[j + 16 + i] = (float)((int32_t)(blk[i] >> 4) - off) * d;
        }
        if (mr) {
            float mn = f16_to_f32(mr[j / G]);
            for (int64_t i = 0; i < 32; i++) out[j + i] += mn;
        }
    }
}

void dequant_i4_f32(const uint8_t *w, const uint16_t *scales, const uint16_t *mins, float *out, int64_t O, int64_t K,
                    int64_t G, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < O; o++)
        dequant_i4_row(w + o * (K / 2), scales + o * (K / G), mins ? mins + o * (K / G) : NULL, out + o * K, K, G);
}

#define I4_MAX_ROWS 8 /* rows of x one pass over the weights serves (the caller asserts M <= this) */

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* The 16 values code 0..15 of one group dequantizes to: (code - 8) * scale, or code * scale + min. */
static inline __m512 i4_group_table(uint16_t scale, const uint16_t *min) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 d = _mm512_set1_ps(f16_to_f32(scale));
    return min ? _mm512_fmadd_ps(codes, d, _mm512_set1_ps(f16_to_f32(*min)))
               : _mm512_mul_ps(_mm512_sub_ps(codes, _mm512_set1_ps(8.f)), d);
}

/* The 32 dequantized weights of one block of 16 code bytes: low nibbles (w0), high nibbles (w1). */
static inline void i4_block_lookup(const uint8_t *blk, __m512 tab, __m512 *w0, __m512 *w1) {
    __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blk));
    *w0 = _mm512_permutexvar_ps(i0, tab);
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), tab);
}

/* One row of x against weight rows o and o + next (single-stream decode): the two rows' lookups interleave (twice
 * the independent work per x load), two accumulators each, all in registers; each row's sum is the same
 * operations in the same order as a row done alone. next = 0: a lone last row (computed twice, stored once). */
static inline void i4_two_rows(const float *x, const uint8_t *wa, const uint16_t *sa, const uint16_t *ma,
                               int64_t next, int64_t K, int64_t G, float *ya, float *yb) {
    const uint8_t *wb = wa + next * (K / 2);
    const uint16_t *sb = sa + next * (K / G), *mb = ma ? ma + next * (K / G) : NULL;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    for (int64_t g = 0; g < K; g += G) {
        __m512 ta = i4_group_table(sa[g / G], ma ? ma + g / G : NULL);
        __m512 tb = i4_group_table(sb[g / G], mb ? mb + g / G : NULL), wa0, wa1, wb0, wb1;
        for (int64_t j = g; j < g + G; j += 32) {
            __m512 x0 = _mm512_loadu_ps(x + j), x1 = _mm512_loadu_ps(x + j + 16);
            i4_block_lookup(wa + j / 2, ta, &wa0, &wa1);
            i4_block_lookup(wb + j / 2, tb, &wb0, &wb1);
            a0 = _mm512_fmadd_ps(wa0, x0, a0);
            a1 = _mm512_fmadd_ps(wa1, x1, a1);
            b0 = _mm512_fmadd_ps(wb0, x0, b0);
            b1 = _mm512_fmadd_ps(wb1, x1, b1);
        }
    }
    *ya = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    *yb = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
}
#endif

/* x (M, K) float32, M <= I4_MAX_ROWS; w (O, K / 2) codes; scales (O, K / G) float16 bits; mins (O, K / G)
 * float16 bits or NULL; y (M, O). Each weight is dequantized exactly as dequant_i4_row does (code * scale,
 * or code * scale + min with one rounding) and multiplied in float32: weight-only, x is not quantized.
 * AVX-512: per group a 16-entry table of the group's 16 dequantized values, indexed by the codes
 * (vpermps reads the low 4 bits of each lane, so the low nibble needs no mask). */
void linear_i4_f32(const float *x, const uint8_t *w, const uint16_t *scales, const uint16_t *mins, const float *b,
                   float *y, int64_t M, int64_t O, int64_t K, int64_t G, int nthreads) {
    const int64_t NG = K / G;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (M == 1) { /* single-stream decode: weight rows in pairs */
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t p = 0; p < (O + 1) / 2; p++) {
            int64_t o = 2 * p, next = o + 1 < O;
            float ya, yb;
            i4_two_rows(x, w + o * (K / 2), scales + o * NG, mins ? mins + o * NG : NULL, next, K, G, &ya, &yb);
            y[o] = ya + (b ? b[o] : 0.f);
            if (next) y[o + 1] = yb + (b ? b[o + 1] : 0.f);
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < O; o++) {
        const uint8_t *wr = w + o * (K / 2);
        const uint16_t *sr = scales + o * NG;
        const uint16_t *mr = mins ? mins + o * NG : NULL;
        float bias = b ? b[o] : 0.f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512 tot[I4_MAX_ROWS];
        for (int64_t m = 0; m < M; m++) tot[m] = _mm512_setzero_ps();
        for (int64_t g = 0; g < K; g += G) {
            __m512 tab = i4_group_table(sr[g / G], mr ? mr + g / G : NULL), w0, w1;
            for (int64_t j = g; j < g + G; j += 32) {
                i4_block_lookup(wr + j / 2, tab, &w0, &w1);
                for (int64_t m = 0; m < M; m++) {
                    const float *xm = x + m * K + j;
                    tot[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), tot[m]);
                    tot[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), tot[m]);
                }
            }
        }
        for (int64_t m = 0; m < M; m++) y[m * O + o] = _mm512_reduce_add_ps(tot[m]) + bias;
#else
        const int32_t off = mr ? 0 : 8;
        float tot[I4_MAX_ROWS] = {0};
        for (int64_t g = 0; g < K; g += G) {
            float d = f16_to_f32(sr[g / G]), mn = mr ? f16_to_f32(mr[g / G]) : 0.f;
            for (int64_t j = g; j < g + G; j += 32) {
                const uint8_t *blk = wr + j / 2;
                float w0[16], w1[16];
                for (int64_t i = 0; i < 16; i++) {
                    w0[i] = (float)((int32_t)(blk[i] & 0x0f) - off) * d + mn;
                    w1[i] = (float)((int32_t)(blk[i] >> 4) - off) * d + mn;
                }
                for (int64_t m = 0; m < M; m++) {
                    const float *xm = x + m * K + j;
                    float a = 0.f;
#pragma omp simd reduction(+ : a)
                    for (int64_t i = 0; i < 16; i++) a += w0[i] * xm[i] + w1[i] * xm[16 + i];
                    tot[m] += a;
                }
            }
        }
        for (int64_t m = 0; m < M; m++) y[m * O + o] = tot[m] + bias;
#endif
    }
}

/* Dequantized row o of a group-scaled int8 matrix: out[i] = q_i * scale[i / G] (exact in float32). */
static void dequant_i8w_row(const int8_t *wr, const uint16_t *sr, float *out, int64_t K, int64_t G) {
    for (int64_t g = 0; g < K; g += G) {
        float d = f16_to_f32(sr[g / G]);
        for (int64_t i = g; i < g + G; i++) out[i] = (float)wr[i] * d;
    }
}

void dequant_i8w_f32(const int8_t *w, const uint16_t *scales, float *out, int64_t O, int64_t K, int64_t G,
                     int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < O; o++) dequant_i8w_row(w + o * K, scales + o * (K / G), out + o * K, K, G);
}

/* x (M, K) float32, M <= I4_MAX_ROWS; w (O, K) int8; scales (O, K / G) float16 bits (G a multiple of 32);
 * y (M, O). Per group: the float sum of q * x, then one multiply by the group's scale. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Weight rows wa and wa + next * K against one row of x (as i4_two_rows): per row two accumulators, each weight
 * times its group's scale, then times x; the same operations in the same order as a row done alone. */
static inline void i8w_two_rows(const float *x, const int8_t *wa, const uint16_t *sa, int64_t next, int64_t K,
                                int64_t G, float *ya, float *yb) {
    const int8_t *wb = wa + next * K;
    const uint16_t *sb = sa + next * (K / G);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    for (int64_t g = 0; g < K; g += G) {
        __m512 da = _mm512_set1_ps(f16_to_f32(sa[g / G])), db = _mm512_set1_ps(f16_to_f32(sb[g / G]));
        for (int64_t j = g; j < g + G; j += 32) {
            __m512 x0 = _mm512_loadu_ps(x + j), x1 = _mm512_loadu_ps(x + j + 16);
            __m512 wa0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wa + j))));
            __m512 wa1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wa + j + 16))));
            __m512 wb0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + j))));
            __m512 wb1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + j + 16))));
            a0 = _mm512_fmadd_ps(_mm512_mul_ps(wa0, da), x0, a0);
            a1 = _mm512_fmadd_ps(_mm512_mul_ps(wa1, da), x1, a1);
            b0 = _mm512_fmadd_ps(_mm512_mul_ps(wb0, db), x0, b0);
            b1 = _mm512_fmadd_ps(_mm512_mul_ps(wb1, db), x1, b1);
        }
    }
    *ya = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    *yb = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
}
#endif

void linear_i8w_f32(const float *x, const int8_t *w, const uint16_t *scales, const float *b, float *y, int64_t M,
                    int64_t O, int64_t K, int64_t G, int nthreads) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (M == 1) { /* single-stream decode: weight rows in pairs, the scale folded into the weights */
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t p = 0; p < (O + 1) / 2; p++) {
            int64_t o = 2 * p, next = o + 1 < O;
            float ya, yb;
            i8w_two_rows(x, w + o * K, scales + o * (K / G), next, K, G, &ya, &yb);
            y[o] = ya + (b ? b[o] : 0.f);
            if (next) y[o + 1] = yb + (b ? b[o + 1] : 0.f);
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < O; o++) {
        const int8_t *wr = w + o * K;
        const uint16_t *sr = scales + o * (K / G);
        float bias = b ? b[o] : 0.f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512 tot[I4_MAX_ROWS];
        for (int64_t m = 0; m < M; m++) tot[m] = _mm512_setzero_ps();
        for (int64_t g = 0; g < K; g += G) {
            __m512 acc[I4_MAX_ROWS];
            for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
            for (int64_t j = g; j < g + G; j += 32) {
                __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + j))));
                __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + j + 16))));
                for (int64_t m = 0; m < M; m++) {
                    const float *xm = x + m * K + j;
                    acc[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), acc[m]);
                    acc[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), acc[m]);
                }
            }
            __m512 d = _mm512_set1_ps(f16_to_f32(sr[g / G]));
            for (int64_t m = 0; m < M; m++) tot[m] = _mm512_fmadd_ps(acc[m], d, tot[m]);
        }
        for (int64_t m = 0; m < M; m++) y[m * O + o] = _mm512_reduce_add_ps(tot[m]) + bias;
#else
        float tot[I4_MAX_ROWS] = {0};
        for (int64_t g = 0; g < K; g += G) {
            float acc[I4_MAX_ROWS] = {0};
            for (int64_t m = 0; m < M; m++) {
                const float *xm = x + m * K;
                float a = 0.f;
#pragma omp simd reduction(+ : a)
                for (int64_t i = g; i < g + G; i++) a += (float)wr[i] * xm[i];
                acc[m] = a;
            }
            float d = f16_to_f32(sr[g / G]);
            for (int64_t m = 0; m < M; m++) tot[m] += acc[m] * d;
        }
        for (int64_t m = 0; m < M; m++) y[m * O + o] = tot[m] + bias;
#endif
    }
}
/* ==================================== end of quantized linear kernels ================================ */

/* ==================================================================================================== *
 * GGUF K-quant linear kernels (issue #31): Q4_K, Q5_K, Q6_K super-blocks as they are in the file.       *
 * ==================================================================================================== *
 *
 * ggml's layouts (ggml-common.h), 256 weights (QK_K) a super-block, a row of K / 256 super-blocks:
 *   Q4_K  144 bytes: d f16, dmin f16, scales[12], qs[128]. 8 sub-blocks of 32, each with a 6-bit scale sc and a
 *         6-bit min m packed in scales[] (kq_scale_min); w = d * sc * q - dmin * m, q 4 bits. Sub-blocks 2j and
 *         2j + 1 share qs[32j .. 32j + 31]: 2j in the low nibbles, 2j + 1 in the high ones.
 *   Q5_K  176 bytes: d, dmin, scales[12] as Q4_K, qh[32], qs[128] as Q4_K; the 5th bit of weight l of sub-block
 *         s is bit s of qh[l].
 *   Q6_K  210 bytes: ql[128], qh[64], scales[16] int8, d f16. 16 sub-blocks of 16, w = d * sc * (q - 32), q 6
 *         bits: in half n (128 weights: ql + 64n, qh + 32n, scales + 8n) weight 32g + l (g 0..3, l 0..31) has its
 *         low 4 bits in ql[l + 32 (g & 1)] >> 4 (g >> 1), its high 2 in qh[l] >> 2g, its scale scales[2g + l / 16].
 * Every product above is exact in float32 (d's 11 significant bits times sc's 6-8 times q's 4-6 fit in 24), so a
 * weight has one rounding at most (Q4_K / Q5_K: subtracting the min), fused into an FMA or not: dequant_kq_f32 is
 * bit-identical to gguf's dequantizer, and the linear kernel multiplies x by exactly those weights in float32
 * (weight-only: x is not quantized); only the order of the sums differs from a float32 matmul (and for a Q4_K /
 * Q5_K row against one row of x, the arrangement: sum_s d_s sum_l q_l x_l - sum_s m_s sum_l x_l, as ggml's).
 *
 *   linear_kq_f32    y = x W^T (+ b) for up to KQ_MAX_ROWS rows of x (decode, speculative verification), W a
 *                    stack of row segments, each of one K-quant type: a fused qkv whose v is Q6_K and q / k
 *                    Q4_K (llama-quantize's Q4_K_M writes them so) is one call of two segments.
 *   dequant_kq_f32   rows of one type to float32 (more rows: a tile of them, then the float32 GEMM; the token
 *                    embedding's lookup).
 *
 * The AVX-512 path is chosen at run time by the CPU's features (__builtin_cpu_supports, whatever -march the file
 * was compiled for; kq_force_portable(1) takes the portable C path, for tests). For 2-8 rows of x it builds per
 * sub-block a table of the 16 (Q5_K: 32) values its codes dequantize to and looks the codes up with vpermps
 * (vpermt2ps), as the int4 kernel does, each weight vector meeting every row in registers; one row looks the codes'
 * own values up instead, sums q * x per sub-block and applies d and the mins' sum_l x_l once per sub-block (no
 * tables to build: 10-20% faster). Q6_K converts its 6-bit codes and scales them with one exact FMA (q * s - 32 *
 * s). One row spreads its sums over four accumulators (independent FMA chains). The portable path dequantizes
 * each super-block into 1 KiB on the stack and takes the dot products from there. Measured on a 2-core Zen 4
 * share (busy): Q4_K ~14 G weights/s a core with the weights in cache, ~9 from DRAM (float32: ~4); the kernel is
 * bound by its instructions, not by memory (integer dot products on quantized activations, as llama.cpp's Q8_K,
 * would be the next step, at the cost of weight-only accuracy).
 */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KQ_X86 1
#define KQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define KQ_INLINE static inline __attribute__((always_inline)) KQ_TARGET
#endif

#define QK_K 256
#define KQ_MAX_ROWS 8 /* rows of x one pass over the weights serves */
#define KQ_ACC 4      /* accumulators a row of x may spread its sums over */
#ifndef KQ_PREFETCH
#define KQ_PREFETCH 8192 /* x */
#endif
enum { KQ_Q4_K = 0, KQ_Q5_K = 1, KQ_Q6_K = 2 };

static inline int64_t kq_block_bytes(int type) { return type == KQ_Q4_K ? 144 : type == KQ_Q5_K ? 176 : 210; }

static int kq_portable = 0;

/* on != 0: every K-quant kernel takes the portable C path, whatever the CPU has (the tests compare both). */
void kq_force_portable(int on) { kq_portable = on; }

/* 1 when the K-quant kernels run their AVX-512 path on this CPU now, 0 for the portable C path. */
int kq_kernel_isa(void) {
#ifdef KQ_X86
    if (kq_portable) return 0;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static inline float kq_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return f16_to_f32(h);
}

/* The 8 six-bit scales and mins of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4 for j = 0..7): bytes 0-3
 * hold scales 0-3, bytes 4-7 mins 0-3 (low 6 bits each); scales / mins 4-7 are the nibbles of bytes 8-11 with
 * the top two bits of bytes 0-3 / 4-7 above them. */
static inline void kq_scale_min(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0f) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* One super-block of `type` to its 256 float32 weights (the reference the AVX-512 path matches bit for bit). The
 * loops run over 16 or 32 weights of one scale, so that the compiler vectorizes them (the portable path). */
static void kq_dequant_block(int type, const uint8_t *b, float *out) {
    if (type == KQ_Q6_K) {
        const float d = kq_f16(b + 208);
        const int8_t *scales = (const int8_t *)(b + 192);
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
            float *y = out + 128 * n;
            for (int half = 0; half < 2; half++) { /* weights l = 16 half .. 16 half + 15 of each group of 32 */
                float s0 = d * scales[8 * n + half], s1 = d * scales[8 * n + half + 2];
                float s2 = d * scales[8 * n + half + 4], s3 = d * scales[8 * n + half + 6];
#pragma omp simd
                for (int l = 16 * half; l < 16 * half + 16; l++) {
                    y[l] = s0 * (float)(((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32);
                    y[l + 32] = s1 * (float)(((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    y[l + 64] = s2 * (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    y[l + 96] = s3 * (float)(((ql[l + 32] >> 4) | ((qh[l] >> 6) << 4)) - 32);
                }
            }
        }
        return;
    }
    const float d = kq_f16(b), dmin = kq_f16(b + 2);
    uint8_t sc[8], mn[8];
    kq_scale_min(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *ql = type == KQ_Q5_K ? b + 48 : b + 16;
    for (int j = 0; j < 4; j++) {
        float d1 = d * sc[2 * j], m1 = dmin * mn[2 * j], d2 = d * sc[2 * j + 1], m2 = dmin * mn[2 * j + 1];
        const uint8_t *q = ql + 32 * j;
        float *y = out + 64 * j;
        if (type == KQ_Q5_K) {
#pragma omp simd
            for (int l = 0; l < 32; l++) {
                y[l] = d1 * (float)((q[l] & 0x0f) | (((qh[l] >> (2 * j)) & 1) << 4)) - m1;
                y[l + 32] = d2 * (float)((q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) - m2;
            }
        } else {
#pragma omp simd
            for (int l = 0; l < 32; l++) {
                y[l] = d1 * (float)(q[l] & 0x0f) - m1;
                y[l + 32] = d2 * (float)(q[l] >> 4) - m2;
            }
        }
    }
}

static void kq_linear_portable(int type, const float *x, const uint8_t *w, const float *b, float *y, int64_t M,
                               int64_t O, int64_t K, int64_t ldy, int nthreads) {
    const int64_t nb = K / QK_K, bb = kq_block_bytes(type);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < O; o++) {
        for (int64_t m0 = 0; m0 < M; m0 += KQ_MAX_ROWS) {
            int64_t n = M - m0 < KQ_MAX_ROWS ? M - m0 : KQ_MAX_ROWS;
            float tot[KQ_MAX_ROWS] = {0}, wb[QK_K];
            for (int64_t j = 0; j < nb; j++) {
                kq_dequant_block(type, w + (o * nb + j) * bb, wb);
                for (int64_t m = 0; m < n; m++) {
                    const float *xm = x + (m0 + m) * K + j * QK_K;
                    float a = 0.f;
#pragma omp simd reduction(+ : a)
                    for (int i = 0; i < QK_K; i++) a += wb[i] * xm[i];
                    tot[m] += a;
                }
            }
            for (int64_t m = 0; m < n; m++) y[(m0 + m) * ldy + o] = tot[m] + (b ? b[o] : 0.f);
        }
    }
}

#ifdef KQ_X86
/* A float16 field of a super-block (unaligned) to float32, by the F16C instruction. */
KQ_INLINE float kq_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* Weight vector w (16 weights from element e of the super-block) into N rows' sums, or with N = 0 (dequantizing)
 * stored at out + e. x: the super-block's first input of row 0 (rows K apart); v: the vector's index in the
 * super-block, which picks the accumulator (v % A, A chains a row: 4 for one row, 2 for two, 1 from three up). */
KQ_INLINE void kq_put(__m512 w, const float *x, int64_t K, int e, int N, int v, __m512 (*acc)[KQ_ACC], float *out) {
    if (N == 0) {
        _mm512_storeu_ps(out + e, w);
        return;
    }
    const int A = N == 1 ? 4 : N == 2 ? 2 : 1;
#pragma GCC unroll 8
    for (int m = 0; m < N; m++) acc[m][v % A] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * K + e), acc[m][v % A]);
}

/* Q4_K / Q5_K: the table of sub-block values code 0..15 (plus `base`: 16 for Q5_K's upper half) dequantizes to,
 * d1 * code - m1 in one rounding (d1 * code is exact), as kq_dequant_block computes them. */
KQ_INLINE __m512 kq_table(float d1, float m1, float base) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(_mm512_add_ps(codes, _mm512_set1_ps(base)), _mm512_set1_ps(d1), _mm512_set1_ps(-m1));
}

/* A super-block's scales as floats, sd[0..31]: Q4_K / Q5_K d * sc[8], then dmin * m[8] (the 8 six-bit scales and
 * mins unpacked four at a time in 32-bit words: kq_scale_min's bits, llama.cpp's trick); Q6_K d * sc[16], then
 * -32 times those (all exact). kq_rows decodes a run of super-blocks' scales before their weights: broadcasting
 * them from memory right after storing them (or from registers) cost as much as the lookups themselves. */
KQ_INLINE void kq_scales(int type, const uint8_t *b, float *sd) {
    if (type == KQ_Q6_K) {
        __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        __m512 ds = _mm512_mul_ps(_mm512_set1_ps(kq_f16c(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        _mm512_storeu_ps(sd, ds);
        _mm512_storeu_ps(sd + 16, _mm512_mul_ps(ds, _mm512_set1_ps(-32.f)));
        return;
    }
    uint32_t u[3], sc[2], mn[2];
    memcpy(u, b + 4, sizeof u);
    sc[0] = u[0] & 0x3f3f3f3fu;
    mn[0] = u[1] & 0x3f3f3f3fu;
    sc[1] = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u);
    mn[1] = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u);
    uint64_t sc8, mn8;
    memcpy(&sc8, sc, sizeof sc8);
    memcpy(&mn8, mn, sizeof mn8);
    __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8)));
    __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn8)));
    _mm256_storeu_ps(sd, _mm256_mul_ps(_mm256_set1_ps(kq_f16c(b)), scf));
    _mm256_storeu_ps(sd + 8, _mm256_mul_ps(_mm256_set1_ps(kq_f16c(b + 2)), mnf));
}

/* Q4_K / Q5_K super-block b (scales sd from kq_scales) into N rows' sums, or dequantized (N = 0). Q5_K: the 5th bit
 * of each weight (bit s of qh[l] for sub-block s) shifted to bit 4 of its code's lane, and the 32-entry table
 * (codes 0..15, 16..31) looked up with one vpermt2ps (it reads the low 5 bits of each lane). */
KQ_INLINE void kq_block_q4k_q5k(int type, const uint8_t *b, const float *sd, const float *x, int64_t K, int N,
                                __m512 (*acc)[KQ_ACC], float *out) {
    const float *d1 = sd, *m1 = sd + 8;
    const uint8_t *ql = type == KQ_Q5_K ? b + 48 : b + 16;
    __m512i qh[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}; /* Q5_K: qh[16h + i] in lane i */
    if (type == KQ_Q5_K) {
        qh[0] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16)));
        qh[1] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 32)));
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m512 ta = kq_table(d1[2 * j], m1[2 * j], 0.f), tb = kq_table(d1[2 * j + 1], m1[2 * j + 1], 0.f);
        __m512 ta16 = ta, tb16 = tb;
        if (type == KQ_Q5_K) {
            ta16 = kq_table(d1[2 * j], m1[2 * j], 16.f);
            tb16 = kq_table(d1[2 * j + 1], m1[2 * j + 1], 16.f);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m512i ia = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 32 * j + 16 * h)));
            __m512i ib = _mm512_srli_epi32(ia, 4); /* (vpermps reads the low 4 bits: the low nibble needs no mask) */
            __m512 wa, wb;
            if (type == KQ_Q5_K) { /* bits 0-3 the nibble, bit 4 the qh bit (bits above: ignored) */
                const __m512i nib = _mm512_set1_epi32(0x0f);
                __m512i ha = 2 * j <= 4 ? _mm512_slli_epi32(qh[h], 4 - 2 * j) : _mm512_srli_epi32(qh[h], 2 * j - 4);
                __m512i hb = 2 * j + 1 <= 4 ? _mm512_slli_epi32(qh[h], 3 - 2 * j) : _mm512_srli_epi32(qh[h], 2 * j - 3);
                wa = _mm512_permutex2var_ps(ta, _mm512_ternarylogic_epi32(ia, ha, nib, 0xe4), ta16);
                wb = _mm512_permutex2var_ps(tb, _mm512_ternarylogic_epi32(ib, hb, nib, 0xe4), tb16);
            } else {
                wa = _mm512_permutexvar_ps(ia, ta);
                wb = _mm512_permutexvar_ps(ib, tb);
            }
            kq_put(wa, x, K, 64 * j + 16 * h, N, 4 * j + h, acc, out);
            kq_put(wb, x, K, 64 * j + 32 + 16 * h, N, 4 * j + 2 + h, acc, out);
        }
    }
}

/* Q4_K / Q5_K super-block b against one row of x, as ggml arranges the sum: y = sum_s d_s (sum_l q_l x_l) -
 * sum_s m_s (sum_l x_l) over its sub-blocks s, the codes looked up in a table of their own values (no table to
 * build per sub-block: a third fewer operations than the weights' tables, which pay off once several rows share
 * them); sumx: the 8 sub-block sums of x, macc the sum of m_s times them. */
KQ_INLINE void kq_block_q4k_q5k_one(int type, const uint8_t *b, const float *sd, const float *x, const float *sumx,
                                    __m512 *tot, __m256 *macc) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 codes16 = _mm512_add_ps(codes, _mm512_set1_ps(16.f));
    const __m512i nib = _mm512_set1_epi32(0x0f);
    *macc = _mm256_fmadd_ps(_mm256_loadu_ps(sd + 8), _mm256_loadu_ps(sumx), *macc);
    const uint8_t *ql = type == KQ_Q5_K ? b + 48 : b + 16;
    __m512i qh[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    if (type == KQ_Q5_K) {
        qh[0] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16)));
        qh[1] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 32)));
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m512 qa[2], qb[2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m512i ia = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 32 * j + 16 * h)));
            __m512i ib = _mm512_srli_epi32(ia, 4);
            if (type == KQ_Q5_K) { /* as kq_block_q4k_q5k: the qh bit to bit 4 of the code's lane */
                __m512i ha = 2 * j <= 4 ? _mm512_slli_epi32(qh[h], 4 - 2 * j) : _mm512_srli_epi32(qh[h], 2 * j - 4);
                __m512i hb = 2 * j + 1 <= 4 ? _mm512_slli_epi32(qh[h], 3 - 2 * j) : _mm512_srli_epi32(qh[h], 2 * j - 3);
                qa[h] = _mm512_permutex2var_ps(codes, _mm512_ternarylogic_epi32(ia, ha, nib, 0xe4), codes16);
                qb[h] = _mm512_permutex2var_ps(codes, _mm512_ternarylogic_epi32(ib, hb, nib, 0xe4), codes16);
            } else {
                qa[h] = _mm512_permutexvar_ps(ia, codes);
                qb[h] = _mm512_permutexvar_ps(ib, codes);
            }
        }
        const float *xj = x + 64 * j;
        __m512 sa = _mm512_fmadd_ps(qa[1], _mm512_loadu_ps(xj + 16), _mm512_mul_ps(qa[0], _mm512_loadu_ps(xj)));
        __m512 sb = _mm512_fmadd_ps(qb[1], _mm512_loadu_ps(xj + 48), _mm512_mul_ps(qb[0], _mm512_loadu_ps(xj + 32)));
        tot[2 * (j & 1)] = _mm512_fmadd_ps(sa, _mm512_set1_ps(sd[2 * j]), tot[2 * (j & 1)]);
        tot[2 * (j & 1) + 1] = _mm512_fmadd_ps(sb, _mm512_set1_ps(sd[2 * j + 1]), tot[2 * (j & 1) + 1]);
    }
}

/* Q6_K super-block b (scales sd from kq_scales) into N rows' sums, or dequantized (N = 0). */
KQ_INLINE void kq_block_q6k(const uint8_t *b, const float *sd, const float *x, int64_t K, int N,
                            __m512 (*acc)[KQ_ACC], float *out) {
    const __m512i m4 = _mm512_set1_epi32(0x0f), m2 = _mm512_set1_epi32(3);
#pragma GCC unroll 2
    for (int n = 0; n < 2; n++) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * n + 16 * h, *qh = b + 128 + 32 * n + 16 * h;
            __m512i l0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)ql));
            __m512i l1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 32)));
            __m512i hb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qh));
            __m512i q[4];
            q[0] = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_slli_epi32(_mm512_and_si512(hb, m2), 4));
            q[1] = _mm512_or_si512(_mm512_and_si512(l1, m4),
                                   _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 2), m2), 4));
            q[2] = _mm512_or_si512(_mm512_srli_epi32(l0, 4),
                                   _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 4), m2), 4));
            q[3] = _mm512_or_si512(_mm512_srli_epi32(l1, 4), _mm512_slli_epi32(_mm512_srli_epi32(hb, 6), 4));
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                int i = 8 * n + 2 * g + h; /* (q - 32) * s exactly: q * s and 32 * s are exact */
                __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[g]), _mm512_set1_ps(sd[i]), _mm512_set1_ps(sd[16 + i]));
                kq_put(w, x, K, 128 * n + 32 * g + 16 * h, N, 8 * n + 2 * g + h, acc, out);
            }
        }
    }
}

#define KQ_RUN 16 /* super-blocks whose scales kq_walk decodes ahead of their weights (2 KiB of stack) */

/* The N rows' sums of weight row wr (N = 0: its float32 weights into out), a run of KQ_RUN super-blocks at a time:
 * their scales first, then their weights, KQ_PREFETCH bytes of the stream ahead into L2 (the hardware prefetcher
 * alone left the lookups waiting on DRAM: 4 GB/s a core). */
KQ_INLINE void kq_walk(int type, const uint8_t *wr, const float *x, const float *sumx, int64_t K, int N,
                       __m512 (*acc)[KQ_ACC], __m256 *macc, float *out) {
    const int64_t bb = kq_block_bytes(type), nb = K / QK_K;
    float sd[KQ_RUN][32];
    for (int64_t j0 = 0; j0 < nb; j0 += KQ_RUN) {
        int64_t n = nb - j0 < KQ_RUN ? nb - j0 : KQ_RUN;
        for (int64_t j = 0; j < n; j++) kq_scales(type, wr + (j0 + j) * bb, sd[j]);
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *b = wr + (j0 + j) * bb;
            const char *pf = (const char *)b + KQ_PREFETCH;
            _mm_prefetch(pf, _MM_HINT_T1);
            _mm_prefetch(pf + 64, _MM_HINT_T1);
            _mm_prefetch(pf + 128, _MM_HINT_T1);
            if (type == KQ_Q6_K) _mm_prefetch(pf + 192, _MM_HINT_T1);
            const float *xb = N ? x + (j0 + j) * QK_K : NULL;
            float *ob = N ? NULL : out + (j0 + j) * QK_K;
            if (type == KQ_Q6_K)
                kq_block_q6k(b, sd[j], xb, K, N, acc, ob);
            else if (N == 1)
                kq_block_q4k_q5k_one(type, b, sd[j], xb, sumx + (j0 + j) * 8, acc[0], macc);
            else
                kq_block_q4k_q5k(type, b, sd[j], xb, K, N, acc, ob);
        }
    }
}

/* y[m * ldy] = x[m] . (weight row wr) for the N (a constant after inlining) rows of x; sumx (one row, Q4_K /
 * Q5_K): x's sums over each sub-block of 32. */
KQ_INLINE void kq_rows(int type, const uint8_t *wr, const float *x, const float *sumx, int64_t K, int N, float *y,
                       int64_t ldy) {
    const int A = N == 1 ? 4 : N == 2 ? 2 : 1;
    __m512 acc[KQ_MAX_ROWS][KQ_ACC];
    __m256 macc = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < N; m++)
        for (int a = 0; a < KQ_ACC; a++) acc[m][a] = _mm512_setzero_ps();
    kq_walk(type, wr, x, sumx, K, N, acc, &macc, NULL);
#pragma GCC unroll 8
    for (int m = 0; m < N; m++) {
        __m512 s = acc[m][0];
        for (int a = 1; a < A; a++) s = _mm512_add_ps(s, acc[m][a]);
        y[m * ldy] = _mm512_reduce_add_ps(s);
    }
    if (N == 1 && type != KQ_Q6_K) { /* the mins' part, sum_s m_s sum_l x_l */
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(macc), _mm256_extractf128_ps(macc, 1));
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        y[0] -= _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
    }
}

/* One weight row against M <= KQ_MAX_ROWS rows of x: the type and the row count made constants. */
static KQ_TARGET void kq_row_avx512(int type, const uint8_t *wr, const float *x, const float *sumx, int64_t K,
                                    int64_t M, float *y, int64_t ldy) {
#define KQ_ROWS_CASES(T)                                                                                              \
    switch (M) {                                                                                                      \
    case 1: kq_rows(T, wr, x, sumx, K, 1, y, ldy); break;                                                             \
    case 2: kq_rows(T, wr, x, sumx, K, 2, y, ldy); break;                                                             \
    case 3: kq_rows(T, wr, x, sumx, K, 3, y, ldy); break;                                                             \
    case 4: kq_rows(T, wr, x, sumx, K, 4, y, ldy); break;                                                             \
    case 5: kq_rows(T, wr, x, sumx, K, 5, y, ldy); break;                                                             \
    case 6: kq_rows(T, wr, x, sumx, K, 6, y, ldy); break;                                                             \
    case 7: kq_rows(T, wr, x, sumx, K, 7, y, ldy); break;                                                             \
    default: kq_rows(T, wr, x, sumx, K, 8, y, ldy);                                                                   \
    }
    if (type == KQ_Q4_K) {
        KQ_ROWS_CASES(KQ_Q4_K)
    } else if (type == KQ_Q5_K) {
        KQ_ROWS_CASES(KQ_Q5_K)
    } else {
        KQ_ROWS_CASES(KQ_Q6_K)
    }
#undef KQ_ROWS_CASES
}

static KQ_TARGET void kq_linear_avx512(int type, const float *x, const uint8_t *w, const float *b, float *y,
                                       int64_t M, int64_t O, int64_t K, int64_t ldy, int nthreads) {
    const int64_t rb = K / QK_K * kq_block_bytes(type);
    float *sumx = NULL; /* Q4_K / Q5_K, a row run alone (the last when M % KQ_MAX_ROWS == 1): its sub-block sums */
    if (type != KQ_Q6_K && M % KQ_MAX_ROWS == 1) {
        sumx = (float *)malloc(sizeof(float) * (size_t)(K / 32));
        if (!sumx) return; /* (K / 8 bytes) */
        const float *xl = x + (M - 1) * K;
        for (int64_t s = 0; s < K / 32; s++) {
            float a = 0.f;
#pragma omp simd reduction(+ : a)
            for (int i = 0; i < 32; i++) a += xl[32 * s + i];
            sumx[s] = a;
        }
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < O; o++) {
        for (int64_t m0 = 0; m0 < M; m0 += KQ_MAX_ROWS) /* (longer x: in runs of KQ_MAX_ROWS) */
            kq_row_avx512(type, w + o * rb, x + m0 * K, sumx, K, M - m0 < KQ_MAX_ROWS ? M - m0 : KQ_MAX_ROWS,
                          y + m0 * ldy + o, ldy);
        if (b)
            for (int64_t m = 0; m < M; m++) y[m * ldy + o] += b[o];
    }
    free(sumx);
}

static KQ_TARGET void kq_dequant_row_avx512(int type, const uint8_t *wr, float *out, int64_t K) {
    if (type == KQ_Q4_K)
        kq_walk(KQ_Q4_K, wr, NULL, NULL, K, 0, NULL, NULL, out);
    else if (type == KQ_Q5_K)
        kq_walk(KQ_Q5_K, wr, NULL, NULL, K, 0, NULL, NULL, out);
    else
        kq_walk(KQ_Q6_K, wr, NULL, NULL, K, 0, NULL, NULL, out);
}
#endif

/* x (M, K) float32; w: the weight's bytes, a stack of nseg row segments, segment s being segs[3s .. 3s + 2] =
 * (type, rows, byte offset of its first row in w), K / 256 super-blocks a row; b (O,) or NULL; y (M, O).
 * Threads split each segment's rows; each weight row is read once per KQ_MAX_ROWS rows of x, which meet it in
 * registers (more rows are served, in runs of KQ_MAX_ROWS, but the caller dequantizes tiles for a GEMM then). */
void linear_kq_f32(const float *x, const uint8_t *w, const int64_t *segs, int64_t nseg, const float *b, float *y,
                   int64_t M, int64_t O, int64_t K, int nthreads) {
    const int avx512 = kq_kernel_isa();
    (void)avx512;
    for (int64_t s = 0, row = 0; s < nseg; row += segs[3 * s + 1], s++) {
        int type = (int)segs[3 * s];
        const uint8_t *ws = w + segs[3 * s + 2];
        const float *bs = b ? b + row : NULL;
#ifdef KQ_X86
        if (avx512) {
            kq_linear_avx512(type, x, ws, bs, y + row, M, segs[3 * s + 1], K, O, nthreads);
            continue;
        }
#endif
        kq_linear_portable(type, x, ws, bs, y + row, M, segs[3 * s + 1], K, O, nthreads);
    }
}

/* w (O, K / 256 super-blocks of `type`) -> out (O, K) float32, exactly gguf's dequantized values. */
void dequant_kq_f32(int type, const uint8_t *w, float *out, int64_t O, int64_t K, int nthreads) {
    const int64_t rb = K / QK_K * kq_block_bytes(type);
    const int avx512 = kq_kernel_isa();
    (void)avx512;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (O * K > 65536)
    for (int64_t o = 0; o < O; o++) {
#ifdef KQ_X86
        if (avx512) {
            kq_dequant_row_avx512(type, w + o * rb, out + o * K, K);
            continue;
        }
#endif
        for (int64_t j = 0; j < K / QK_K; j++)
            kq_dequant_block(type, w + o * rb + j * kq_block_bytes(type), out + o * K + j * QK_K);
    }
}
/* ======================================= end of K-quant linear kernels ======================================= */

/* ==================================================================================================== *
 * W4A8 int4 kernels (issue #31): 4-bit weights repacked at load into 16-row panels, activations        *
 * quantized to int8 per row per block of 32 on the fly, integer dot products; the instruction set is    *
 * chosen at run time from the CPU's features (cpuid), never from the build's.                           *
 * ==================================================================================================== *
 *
 * The math (lmserve.model.quantization.w4a8_reference is the PyTorch reference the tests compare with):
 *   activations, row m, block b of 32 inputs (llama.cpp's Q8_0 activation blocks, float32 scale here):
 *     d = max|x| / 127, q = round-half-even(x * (1 / d)) (all zero where d = 0), s = sum of the block's q.
 *   weights, code c in 0..15 with a scale w_d per group of G inputs (G a multiple of 32) and optionally a min w_m:
 *     symmetric (lmserve int4, GGUF Q4_0)  w = (c - 8) w_d  -> block dot = w_d d (sum c q - 8 s)
 *     with mins (GGUF Q4_1)                w = c w_d + w_m  -> block dot = w_d d (sum c q) + w_m (d s)
 *   sum c q - 8 s is exact in int32 (|.| <= 32 * 15 * 127 + 8 * 32 * 127); only the float products per block
 *   and their sum round. vpdpbusd multiplies unsigned by signed bytes: the codes are the unsigned operand as
 *   they are (0..15) and the activations the signed one, so the offset 8 costs no per-weight work: each
 *   block's integer accumulator starts at -8 s (a per-activation-block constant shared by every output row).
 *
 * Packed layout (lmserve.model.quantization.pack_w4a8; P = ceil(O / 16) panels of 16 output rows, rows past O
 * zero codes and zero scales):
 *   codes  (P, K / 32, 4, 64) bytes: panel p, block b, vector t = 0..3, byte 4j + i (lane j = 0..15, i = 0..3):
 *          low nibble code(row 16p + j, input 32b + 4t + i), high nibble code(row 16p + j, input 32b + 16 + 4t + i).
 *          Masked to its low nibbles a 64-byte vector holds, in 32-bit lane j, row j's 4 codes that meet the
 *          activation bytes 32b + 4t .. 32b + 4t + 3: one vpdpbusd against that 32-bit word broadcast adds
 *          4 products into each of 16 rows' lanes (no horizontal sums, one x word feeds 16 rows).
 *          The 256-bit paths read each vector's two halves (lanes 0-7, 8-15) as two 8-row panels.
 *   scales (P, K / G, 16) float16 bits, row j of the panel in lane j; mins the same, or NULL.
 *   W8A8 blocks (bits = 8: the int4 method's 8-bit LM head, llama.cpp's Q8_0 rule): codes (P, K / 32, 8, 64),
 *          byte 4j + i of vector t = q(row 16p + j, input 32b + 4t + i) + 128 (unsigned), no mins; the offset 128
 *          is corrected like the nibbles' 8 (block dot = w_d d (sum c q - 128 s)).
 *   5-bit blocks (bits = 5: GGUF Q5_0 / Q5_1, codes c in 0..31, w = (c - 16) w_d or c w_d + w_m): codes
 *          (P, K / 32, 5, 64), vectors 0..3 the low nibbles as for bits 4, vector 4 the fifth bits: byte 4j + i
 *          holds in bit t (t = 0..3) the high bit of code(row 16p + j, input 32b + 4t + i) and in bit 4 + t that of
 *          input 32b + 16 + 4t + i, so vector t's codes are its nibbles or'ed with (v4 << (4 - t)) & 0x10 (low) and
 *          (v4 >> t) & 0x10 (high); the offset 16 is corrected like the nibbles' 8 (llama.cpp's q5_0 x q8_0).
 *
 * Paths (w4a8_isa_supported says which this CPU runs; LMSERVE_W4A8_ISA forces one, e.g. in the tests):
 *   W4A8_VNNI512  AVX512-VNNI vpdpbusd zmm, 16 rows a step
 *   W4A8_VNNI256  vpdpbusd ymm, 8 rows a step: AVX-VNNI (VEX) where the CPU has it, else the AVX512-VNNI/VL
 *                 (EVEX) encoding of the same instruction (so the 256-bit code runs on AVX-512 machines too)
 *   W4A8_AVX2     vpmaddubsw + vpmaddwd (no VNNI): the 8 products of a block summed in int16 (|.| <= 8 * 2 *
 *                 15 * 127 = 30480, no saturation), widened once a block
 *   W4A8_SCALAR   portable C over the same layout
 * Every path computes each output with the same float operations in the same order (per block one FMA of the
 * exact integer sum into the row's accumulator, with mins a second one; the bias added last), and a row's result
 * does not depend on the other rows: all paths and row counts give the same bits (tests/test_w4a8.py checks).
 * Rows of x: up to 8 at a time against one panel, all accumulators in registers (the row count is a literal
 * after inlining); more rows (prefill, batches) loop over runs of 8 with the panel outermost, so a panel
 * (16 rows x K / 2 bytes) stays in L1 / L2 while every run of x meets it: a blocked GEMM on the packed codes,
 * no float copy of any weight. Threads split the panels.
 */
enum { W4A8_SCALAR = 0, W4A8_AVX2 = 1, W4A8_VNNI256 = 2, W4A8_VNNI512 = 3 };
#define W4A8_PANEL 16 /* output rows per panel */
#define W4A8_MR 8     /* rows of x one pass over a panel serves */

#if defined(__x86_64__) || defined(__i386__)
#define W4A8_X86 1
#include <immintrin.h>
#endif

/* Whether this CPU (and OS: libgcc's cpuid checks also read XCR0) runs path isa. */
int w4a8_isa_supported(int isa) {
#ifdef W4A8_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    int v512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vnni");
    switch (isa) {
    case W4A8_SCALAR: return 1;
    case W4A8_AVX2: return avx2;
    case W4A8_VNNI256:
        return avx2 && (__builtin_cpu_supports("avxvnni") || (v512 && __builtin_cpu_supports("avx512vl")));
    case W4A8_VNNI512: return avx2 && v512;
    default: return 0;
    }
#else
    return isa == W4A8_SCALAR;
#endif
}

/* The fastest path this CPU runs. */
int w4a8_isa_best(void) {
    for (int isa = W4A8_VNNI512; isa > W4A8_SCALAR; isa--)
        if (w4a8_isa_supported(isa)) return isa;
    return W4A8_SCALAR;
}

/* 1 where W4A8_VNNI256 uses the VEX (AVX-VNNI) encoding, 0 where the EVEX (AVX512-VNNI/VL) one. */
int w4a8_vnni256_vex(void) {
#ifdef W4A8_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avxvnni") ? 1 : 0;
#else
    return 0;
#endif
}

/* The quantized activations of M rows, per block of 32 inputs (NB = K / 32 a row): q int8 (32 a block), d float32
 * scales, corr int32 = -off * s (the integer accumulator's start: off 8 for symmetric codes, 0 with mins), ds
 * float32 = d * s (what a block's min multiplies). Same operations as the PyTorch reference, so the same bits.
 * Index space: rows in chunks of R (the W4A8_MR rows one pass over a panel serves; M itself when fewer), and
 * (row m, block b) at w4a8_ai = ((m / R) * NB + b) * R + m % R: a block's R rows are adjacent, so a kernel
 * addresses all of them from one base (per-row pointers ran the x86 registers out). R = 1 is the row-major
 * (M, NB) layout (what w4a8_quantize_rows gives the tests). */
typedef struct {
    int8_t *q; /* q of (m, b) at 32 * w4a8_ai(m, b) */
    float *d, *ds;
    int32_t *corr;
    int64_t R, NB;
    int64_t bits; /* of the weight codes: 4 (nibbles), 5 (nibbles + a bit plane) or 8 (W8A8 blocks, see below) */
} w4a8_act;

static inline int64_t w4a8_ai(const w4a8_act *a, int64_t m, int64_t b) {
    return ((m / a->R) * a->NB + b) * a->R + m % a->R;
}

static void w4a8_quantize_row(const float *x, const w4a8_act *a, int64_t m, int32_t off) {
    for (int64_t b = 0; b < a->NB; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) {
            float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        float db = amax / 127.f, id = db != 0.f ? 1.f / db : 0.f;
        const int64_t ai = w4a8_ai(a, m, b);
        int8_t *q = a->q + 32 * ai;
        int32_t s = 0;
        for (int i = 0; i < 32; i++) {
            float r = nearbyintf(xb[i] * id);
            r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
            q[i] = (int8_t)r;
            s += (int32_t)r;
        }
        a->d[ai] = db;
        a->corr[ai] = -off * s;
        a->ds[ai] = db * (float)s;
    }
}

static void w4a8_quantize(const float *x, const w4a8_act *a, int64_t M, int32_t off, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * a->NB > 2048)
    for (int64_t m = 0; m < M; m++) w4a8_quantize_row(x + m * a->NB * 32, a, m, off);
}

/* Exposed for the tests: the activation blocks the kernels compute with, row-major: q (M, K), d, corr, ds
 * (M, K / 32). */
void w4a8_quantize_rows(const float *x, int8_t *q, float *d, int32_t *corr, float *ds, int64_t M, int64_t K,
                        int32_t off, int nthreads) {
    const w4a8_act a = {q, d, ds, corr, 1, K / 32, 4};
    w4a8_quantize(x, &a, M, off, nthreads);
}

/* y[m * O + o0 + j] = acc lane j (+ bias), for the first n (< 16 at the last panel) lanes. */
static inline void w4a8_store(const float *acc, const float *b, float *y, int64_t o0, int64_t n) {
    for (int64_t j = 0; j < n; j++) y[o0 + j] = acc[j] + (b ? b[o0 + j] : 0.f);
}

/* ---- portable C: rows m0 .. m0 + MR of x against nrows (<= 16) rows of panel pc -------------------------- */
static void w4a8_panel_scalar(const w4a8_act *a, int64_t m0, int64_t MR, const uint8_t *pc, const uint16_t *ps,
                              const uint16_t *pm, const float *b, float *y, int64_t O, int64_t o0, int64_t K,
                              int64_t G) {
    const int64_t NB = K / 32, BPG = G / 32, bits = a->bits;
    for (int64_t m = m0; m < m0 + MR; m++) {
        float acc[W4A8_PANEL];
        for (int j = 0; j < W4A8_PANEL; j++) {
            float f = 0.f;
            for (int64_t bl = 0; bl < NB; bl++) {
                const uint8_t *blk = pc + bl * 64 * bits;
                const int64_t ai = w4a8_ai(a, m, bl);
                const int8_t *xq = a->q + 32 * ai;
                int32_t s = a->corr[ai];
                if (bits == 8) /* vector t: inputs 4t .. 4t + 3 */
                    for (int t = 0; t < 8; t++)
                        for (int i = 0; i < 4; i++) s += (int32_t)blk[64 * t + 4 * j + i] * xq[4 * t + i];
                else if (bits == 5)
                    for (int t = 0; t < 4; t++)
                        for (int i = 0; i < 4; i++) {
                            const uint8_t c = blk[64 * t + 4 * j + i], h5 = blk[256 + 4 * j + i];
                            const int32_t lo = (c & 0x0f) | ((h5 >> t) & 1) << 4;
                            const int32_t hi = (c >> 4) | ((h5 >> (4 + t)) & 1) << 4;
                            s += lo * xq[4 * t + i] + hi * xq[16 + 4 * t + i];
                        }
                else
                    for (int t = 0; t < 4; t++)
                        for (int i = 0; i < 4; i++) {
                            uint8_t c = blk[64 * t + 4 * j + i];
                            s += (int32_t)(c & 0x0f) * xq[4 * t + i] + (int32_t)(c >> 4) * xq[16 + 4 * t + i];
                        }
                const int64_t g = bl / BPG;
                /* fmaf: the vector paths' per-lane operations, so every path gives the same bits */
                f = fmaf((float)s, f16_to_f32(ps[g * W4A8_PANEL + j]) * a->d[ai], f);
                if (pm) f = fmaf(f16_to_f32(pm[g * W4A8_PANEL + j]), a->ds[ai], f);
            }
            acc[j] = f;
        }
        w4a8_store(acc, b, y + m * O, o0, O - o0 < W4A8_PANEL ? O - o0 : W4A8_PANEL);
    }
}

#ifdef W4A8_X86
/* ---- AVX512-VNNI: 16 rows a step ------------------------------------------------------------------------- */
#define W4A8_T512 "avx512f,avx512bw,avx512vnni,avx2,fma,f16c"
/* The body for a literal MR (1..8): per block, per row of x an int32 accumulator of 16 lanes (rows of the panel)
 * from -8 s, 8 vpdpbusd (4 vectors x low / high nibbles) each against one broadcast word of x, then one convert
 * and one FMA into the float accumulator with (w_d lanes) * d. Up to 4 rows of x keep two integer chains each
 * (the low- and high-nibble products), so a block's 8 dependent vpdpbusd become two chains of 4. */
__attribute__((target(W4A8_T512))) static inline __attribute__((always_inline)) void
w4a8_body512(const int MR, const int BITS, const w4a8_act *a, int64_t m0, const uint8_t *pc, const uint16_t *ps,
             const uint16_t *pm, const float *b, float *y, int64_t O, int64_t o0, int64_t K, int64_t G) {
    const int64_t NB = K / 32, BPG = G / 32;
    const int split = MR <= 4;
    const __m512i lo4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    __m512 f[W4A8_MR];
    for (int m = 0; m < MR; m++) f[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < NB / BPG; g++) {
        const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ps + g * W4A8_PANEL)));
        const __m512 wm = pm ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pm + g * W4A8_PANEL)))
                             : _mm512_setzero_ps();
        for (int64_t bl = g * BPG; bl < (g + 1) * BPG; bl++) {
            const uint8_t *blk = pc + bl * 64 * BITS;
            for (int t = 0; t < BITS; t++) _mm_prefetch((const char *)blk + 2048 + 64 * t, _MM_HINT_T0);
            const int64_t ab = w4a8_ai(a, m0, bl); /* row m0 + m of this block: ab + m */
            const int8_t *xb = a->q + 32 * ab;
            __m512i ia[W4A8_MR], ib[W4A8_MR];
            const __m512i h5 = BITS == 5 ? _mm512_loadu_si512((const void *)(blk + 256)) : _mm512_setzero_si512();
            for (int m = 0; m < MR; m++) {
                ia[m] = _mm512_set1_epi32(a->corr[ab + m]);
                ib[m] = _mm512_setzero_si512();
            }
            for (int t = 0; t < 4; t++) {
                __m512i lo, hi; /* the codes meeting x words 4t and 16 + 4t */
                if (BITS == 8) {
                    lo = _mm512_loadu_si512((const void *)(blk + 64 * t));
                    hi = _mm512_loadu_si512((const void *)(blk + 64 * (t + 4)));
                } else {
                    const __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * t));
                    lo = _mm512_and_si512(v, lo4);
                    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                    if (BITS == 5) { /* the fifth bits (16-bit shifts: bit 4 of each byte comes from its own byte) */
                        lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(h5, 4 - t), bit4));
                        hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(h5, t), bit4));
                    }
                }
                for (int m = 0; m < MR; m++) {
                    const int8_t *xq = xb + 32 * m + 4 * t;
                    int32_t w0, w1;
                    memcpy(&w0, xq, 4);
                    memcpy(&w1, xq + 16, 4);
                    ia[m] = _mm512_dpbusd_epi32(ia[m], lo, _mm512_set1_epi32(w0));
                    if (split)
                        ib[m] = _mm512_dpbusd_epi32(ib[m], hi, _mm512_set1_epi32(w1));
                    else
                        ia[m] = _mm512_dpbusd_epi32(ia[m], hi, _mm512_set1_epi32(w1));
                }
            }
            for (int m = 0; m < MR; m++) {
                const __m512i s = split ? _mm512_add_epi32(ia[m], ib[m]) : ia[m];
                f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(wd, _mm512_set1_ps(a->d[ab + m])), f[m]);
                if (pm) f[m] = _mm512_fmadd_ps(wm, _mm512_set1_ps(a->ds[ab + m]), f[m]);
            }
        }
    }
    const int64_t n = O - o0 < W4A8_PANEL ? O - o0 : W4A8_PANEL;
    const __mmask16 k = (__mmask16)((1u << n) - 1);
    const __m512 bias = b ? _mm512_maskz_loadu_ps(k, b + o0) : _mm512_setzero_ps();
    for (int m = 0; m < MR; m++) _mm512_mask_storeu_ps(y + (m0 + m) * O + o0, k, _mm512_add_ps(f[m], bias));
}

/* BODY(MR, args...) for a literal MR = the run's row count: the compiler keeps every accumulator in a register. */
#define W4A8_ROWS_SWITCH(MR, BODY, ...)                                                                          \
    switch (MR) {                                                                                                \
    case 1: BODY(1, __VA_ARGS__); break;                                                                         \
    case 2: BODY(2, __VA_ARGS__); break;                                                                         \
    case 3: BODY(3, __VA_ARGS__); break;                                                                         \
    case 4: BODY(4, __VA_ARGS__); break;                                                                         \
    case 5: BODY(5, __VA_ARGS__); break;                                                                         \
    case 6: BODY(6, __VA_ARGS__); break;                                                                         \
    case 7: BODY(7, __VA_ARGS__); break;                                                                         \
    default: BODY(8, __VA_ARGS__); break;                                                                        \
    }

__attribute__((target(W4A8_T512))) static void w4a8_panel512(const w4a8_act *a, int64_t m0, int64_t MR,
                                                              const uint8_t *pc, const uint16_t *ps,
                                                              const uint16_t *pm, const float *b, float *y, int64_t O,
                                                              int64_t o0, int64_t K, int64_t G) {
    if (a->bits == 8) {
        W4A8_ROWS_SWITCH(MR, w4a8_body512, 8, a, m0, pc, ps, pm, b, y, O, o0, K, G)
    } else if (a->bits == 5) {
        W4A8_ROWS_SWITCH(MR, w4a8_body512, 5, a, m0, pc, ps, pm, b, y, O, o0, K, G)
    } else {
        W4A8_ROWS_SWITCH(MR, w4a8_body512, 4, a, m0, pc, ps, pm, b, y, O, o0, K, G)
    }
}

/* ---- 256-bit paths: 8 rows a step (half h of a panel: bytes 32h .. 32h + 31 of each 64-byte vector) ------- *
 * One body, three instruction sets: W4A8_DEFINE_256(name, target, DOT) defines w4a8_panel256_<name>, where
 * DOT(acc, lo[4], hi[4], xq, bits) returns acc plus the block's 32 products per 32-bit lane. */
#define W4A8_DEFINE_256(NAME, TARGET, DOT)                                                                       \
    __attribute__((target(TARGET))) static inline __attribute__((always_inline)) void w4a8_body256_##NAME(      \
        const int MR, const int BITS, const w4a8_act *a, int64_t m0, const uint8_t *pc, const uint16_t *ps,     \
        const uint16_t *pm, const float *b, float *y, int64_t O, int64_t o0, int64_t K, int64_t G, int h) {    \
        const int64_t NB = K / 32, BPG = G / 32;                                                                 \
        const __m256i lo4 = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);                               \
        __m256 f[W4A8_MR];                                                                                       \
        for (int m = 0; m < MR; m++) f[m] = _mm256_setzero_ps();                                                 \
        for (int64_t g = 0; g < NB / BPG; g++) {                                                                 \
            const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ps + g * W4A8_PANEL + 8 * h))); \
            const __m256 wm = pm ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pm + g * W4A8_PANEL + 8 * h))) \
                                 : _mm256_setzero_ps();                                                          \
            for (int64_t bl = g * BPG; bl < (g + 1) * BPG; bl++) {                                               \
                const uint8_t *blk = pc + bl * 64 * BITS + 32 * h;                                               \
                __m256i lo[4], hi[4];                                                                            \
                const __m256i h5 = BITS == 5 ? _mm256_loadu_si256((const __m256i *)(blk + 256))                  \
                                             : _mm256_setzero_si256();                                           \
                for (int t = 0; t < 4; t++) {                                                                    \
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * t));                       \
                    lo[t] = BITS == 8 ? v : _mm256_and_si256(v, lo4);                                            \
                    hi[t] = BITS == 8 ? _mm256_loadu_si256((const __m256i *)(blk + 64 * (t + 4)))                \
                                      : _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);                          \
                    if (BITS == 5) {                                                                             \
                        lo[t] = _mm256_or_si256(lo[t], _mm256_and_si256(_mm256_slli_epi16(h5, 4 - t), bit4));    \
                        hi[t] = _mm256_or_si256(hi[t], _mm256_and_si256(_mm256_srli_epi16(h5, t), bit4));        \
                    }                                                                                            \
                }                                                                                                \
                const int64_t ab = w4a8_ai(a, m0, bl);                                                           \
                for (int m = 0; m < MR; m++) {                                                                   \
                    const __m256i s = DOT(_mm256_set1_epi32(a->corr[ab + m]), lo, hi, a->q + 32 * (ab + m), BITS); \
                    const __m256 sc = _mm256_mul_ps(wd, _mm256_set1_ps(a->d[ab + m]));                           \
                    f[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, f[m]);                                     \
                    if (pm) f[m] = _mm256_fmadd_ps(wm, _mm256_set1_ps(a->ds[ab + m]), f[m]);                     \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        float out[8];                                                                                            \
        const int64_t n0 = o0 + 8 * h, n = O - n0 < 8 ? O - n0 : 8;                                              \
        for (int m = 0; m < MR; m++) {                                                                           \
            _mm256_storeu_ps(out, f[m]);                                                                         \
            if (n > 0) w4a8_store(out, b, y + (m0 + m) * O, n0, n);                                               \
        }                                                                                                        \
    }                                                                                                            \
    __attribute__((target(TARGET))) static void w4a8_panel256_##NAME(                                           \
        const w4a8_act *a, int64_t m0, int64_t MR, const uint8_t *pc, const uint16_t *ps, const uint16_t *pm,   \
        const float *b, float *y, int64_t O, int64_t o0, int64_t K, int64_t G) {                               \
        for (int h = 0; h < 2 && o0 + 8 * h < O; h++) {                                                         \
            if (a->bits == 8) {                                                                                  \
                W4A8_ROWS_SWITCH(MR, w4a8_body256_##NAME, 8, a, m0, pc, ps, pm, b, y, O, o0, K, G, h)            \
            } else if (a->bits == 5) {                                                                           \
                W4A8_ROWS_SWITCH(MR, w4a8_body256_##NAME, 5, a, m0, pc, ps, pm, b, y, O, o0, K, G, h)            \
            } else {                                                                                             \
                W4A8_ROWS_SWITCH(MR, w4a8_body256_##NAME, 4, a, m0, pc, ps, pm, b, y, O, o0, K, G, h)            \
            }                                                                                                    \
        }                                                                                                        \
    }

/* One block's 32 products per lane: two independent vpdpbusd chains (low and high nibbles) of 4. */
#define W4A8_DOT_VNNI(FN)                                                                                       \
    {                                                                                                           \
        (void)bits;                                                                                             \
        __m256i s0 = acc, s1 = _mm256_setzero_si256();                                                          \
        for (int t = 0; t < 4; t++) {                                                                           \
            int32_t w0, w1;                                                                                     \
            memcpy(&w0, xq + 4 * t, 4);                                                                         \
            memcpy(&w1, xq + 16 + 4 * t, 4);                                                                    \
            s0 = FN(s0, lo[t], _mm256_set1_epi32(w0));                                                          \
            s1 = FN(s1, hi[t], _mm256_set1_epi32(w1));                                                          \
        }                                                                                                       \
        return _mm256_add_epi32(s0, s1);                                                                        \
    }
__attribute__((target("avxvnni,avx2,fma,f16c"))) static inline __attribute__((always_inline)) __m256i
w4a8_dot_vex(__m256i acc, const __m256i *lo, const __m256i *hi, const int8_t *xq, int bits)
    W4A8_DOT_VNNI(_mm256_dpbusd_avx_epi32)
#define W4A8_T256E "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
__attribute__((target(W4A8_T256E))) static inline __attribute__((always_inline)) __m256i
w4a8_dot_evex(__m256i acc, const __m256i *lo, const __m256i *hi, const int8_t *xq, int bits)
    W4A8_DOT_VNNI(_mm256_dpbusd_epi32)
/* AVX2: vpmaddubsw gives pairs of products in int16; with 4-bit codes the block's 8 of them per int16 lane stay
 * below 30480, so they add in int16 and vpmaddwd against ones widens once a block. 8-bit codes (c = q + 128) would
 * saturate a pair (2 * 255 * 127): that path multiplies |q| by x * sign(q) instead (a pair <= 2 * 128 * 127), widening
 * each pair, and its activations come with corr = 0 (linear_w4a8_f32 quantizes them with offset 0). */
__attribute__((target("avx2,fma,f16c"))) static inline __attribute__((always_inline)) __m256i
w4a8_dot_avx2(__m256i acc, const __m256i *lo, const __m256i *hi, const int8_t *xq, int bits) {
    if (bits == 8) {
        const __m256i sign = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
        for (int t = 0; t < 8; t++) {
            int32_t w;
            memcpy(&w, xq + 4 * t, 4);
            const __m256i q = _mm256_xor_si256(t < 4 ? lo[t] : hi[t - 4], sign); /* the signed weights */
            const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(_mm256_set1_epi32(w), q));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
        }
        return acc;
    }
    if (bits == 5) { /* 5-bit codes: a pair of products <= 2 * 31 * 127, so each t's 4 of them widen at once */
        for (int t = 0; t < 4; t++) {
            int32_t w0, w1;
            memcpy(&w0, xq + 4 * t, 4);
            memcpy(&w1, xq + 16 + 4 * t, 4);
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[t], _mm256_set1_epi32(w0)),
                                               _mm256_maddubs_epi16(hi[t], _mm256_set1_epi32(w1)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
        }
        return acc;
    }
    __m256i s = _mm256_setzero_si256();
    for (int t = 0; t < 4; t++) {
        int32_t w0, w1;
        memcpy(&w0, xq + 4 * t, 4);
        memcpy(&w1, xq + 16 + 4 * t, 4);
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[t], _mm256_set1_epi32(w0)));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[t], _mm256_set1_epi32(w1)));
    }
    return _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
}
W4A8_DEFINE_256(vex, "avxvnni,avx2,fma,f16c", w4a8_dot_vex)
W4A8_DEFINE_256(evex, W4A8_T256E, w4a8_dot_evex)
W4A8_DEFINE_256(avx2, "avx2,fma,f16c", w4a8_dot_avx2)
#endif /* W4A8_X86 */

typedef void (*w4a8_panel_fn)(const w4a8_act *, int64_t, int64_t, const uint8_t *, const uint16_t *, const uint16_t *,
                              const float *, float *, int64_t, int64_t, int64_t, int64_t);

static w4a8_panel_fn w4a8_panel_for(int isa) {
#ifdef W4A8_X86
    if (isa == W4A8_VNNI512) return w4a8_panel512;
    if (isa == W4A8_VNNI256) return w4a8_vnni256_vex() ? w4a8_panel256_vex : w4a8_panel256_evex;
    if (isa == W4A8_AVX2) return w4a8_panel256_avx2;
#endif
    (void)isa;
    return w4a8_panel_scalar;
}

/* y (M, O) = x (M, K) float32 times the packed weight (layout above: bits 4, 5, or 8 for the W8A8 blocks; K a
 * multiple of G, G of 32), with x quantized here per row per block of 32; b (O,) or NULL; isa a path
 * w4a8_isa_supported accepts (the caller checks). Any M: rows in runs of W4A8_MR per panel, panels split over the
 * threads. Returns 0, or -1 when the activation scratch could not be allocated, isa is not runnable or bits is
 * neither 4 nor 8 (y untouched). */
int linear_w4a8_f32(const float *x, const uint8_t *pc, const uint16_t *ps, const uint16_t *pm, const float *b,
                    float *y, int64_t M, int64_t O, int64_t K, int64_t G, int bits, int isa, int nthreads) {
    if (!w4a8_isa_supported(isa) || (bits != 4 && bits != 5 && bits != 8) || (bits == 8 && pm)) return -1;
    const int64_t NB = K / 32, P = (O + W4A8_PANEL - 1) / W4A8_PANEL, NG = K / G;
    const int64_t R = M < W4A8_MR ? M : W4A8_MR, Mp = (M + R - 1) / R * R; /* rows padded to whole chunks */
    char *buf = (char *)malloc((size_t)(Mp * K + Mp * NB * 12));
    if (!buf) return -1;
    const w4a8_act a = {(int8_t *)buf, (float *)(buf + Mp * K), (float *)(buf + Mp * K + 4 * Mp * NB),
                        (int32_t *)(buf + Mp * K + 8 * Mp * NB), R, NB, bits};
    /* the codes' offset the block sums correct: 8 (symmetric nibbles), 16 (symmetric 5-bit codes), 0 (with mins),
     * 128 (8-bit; 0 on AVX2, whose sign trick multiplies the signed weights themselves) */
    const int32_t off = bits == 8 ? (isa == W4A8_AVX2 ? 0 : 128) : pm ? 0 : bits == 5 ? 16 : 8;
    w4a8_quantize(x, &a, M, off, nthreads);
    const w4a8_panel_fn fn = w4a8_panel_for(isa);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t p = 0; p < P; p++) {
        const uint8_t *pcp = pc + p * NB * 64 * bits;
        const uint16_t *psp = ps + p * NG * W4A8_PANEL, *pmp = pm ? pm + p * NG * W4A8_PANEL : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += W4A8_MR)
            fn(&a, m0, M - m0 < W4A8_MR ? M - m0 : W4A8_MR, pcp, psp, pmp, b, y, O, p * W4A8_PANEL, K, G);
    }
    free(buf);
    return 0;
}
/* ========================================= end of W4A8 int4 kernels ======================================== */

/* ==================================================================================================== *
 * The decoder stack of a decode step in one call (decode_stack).                                        *
 * ==================================================================================================== *
 *
 * A pure decode step of a few rows spends as long in Python between the kernels above (module calls,
 * argument checks, ctypes, ~9 calls a layer) as in some of the kernels themselves: ~270 us a layer on the
 * benchmark model. decode_stack runs every layer of a plain pre-norm Llama-family decoder (RMSNorm,
 * fused qkv, RoPE, paged attention, o, RMSNorm, gate_up, SiLU*up, down) and the final norm by calling the
 * same kernels in the same order with the same arguments as lmserve/model/llama.py does, so its output is
 * bit-identical to the module path. The Python side (lmserve/model/decode_stack.py) fills the layer
 * descriptions once and checks which models and steps qualify.
 */
enum { LS_F32 = 0, LS_BF16W = 1, LS_I8 = 2, LS_I4 = 3, LS_I8W = 4, LS_KQ = 5, LS_W4A8 = 6, LS_W5A8 = 7, LS_W8A8 = 8 };

/* one projection; every field 8 bytes (the ctypes Structure mirrors it). LS_KQ (GGUF K-quants): scales points at
 * the (G, 3) int64 segment table linear_kq_f32 reads, G its row count. */
typedef struct {
    int64_t kind, O, K, G;
    const void *w, *scales, *mins, *row_sums;
    const float *bias;
    int64_t isa; /* LS_W4A8: the W4A8_* path (the Python side resolved it once) */
} ls_linear;

typedef struct {
    const float *in_norm, *post_norm;
    void *k_cache, *v_cache;
    float *k_scale, *v_scale; /* int8 / fp8 caches only */
    int64_t window;           /* 0: full attention */
    ls_linear qkv, o, gate_up, down;
} ls_layer;

struct ls_lora;      /* the LoRA section at the end of the file */
struct ls_allreduce; /* the shared-memory all-reduce section after decode_stack */

/* x (n floats) summed over the ranks in place (a tensor-parallel decode stack, after o and after down).
 * Returns 0, LS_AR_ABORTED or LS_AR_TIMEOUT. */
static int ls_all_reduce(const struct ls_allreduce *a, float *x, int64_t n);

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, block_size, kv_kind; /* kv_kind -1: float32 */
    double eps, scale;
    const ls_layer *layers;
    const float *final_norm;
    const struct ls_lora *lora;           /* NULL: no LoRA row in the step */
    const struct ls_allreduce *allreduce; /* NULL: one rank; else the sum after o and down (tensor parallel) */
    const ls_linear *head;                /* NULL: none; else the LM head, run on the final norm when asked */
} ls_model;

/* y (B, O) += the LoRA delta of projection p (0 qkv, 1 o, 2 gate_up, 3 down) of layer l for x (B, K); -1: no memory */
static int ls_lora_add(const struct ls_lora *lora, int64_t l, int p, const float *x, float *y, int nthreads);

/* Returns 0, or -1 when a kernel could not allocate its scratch. */
static int ls_linear_run(const ls_linear *l, const float *x, float *y, int64_t M, int nthreads) {
    switch (l->kind) {
    case LS_F32: linear_f32(x, (const float *)l->w, l->bias, y, M, l->O, l->K, nthreads); break;
    case LS_BF16W: linear_bf16w_f32(x, (const uint16_t *)l->w, l->bias, y, M, l->O, l->K, nthreads); break;
    case LS_I8:
        linear_i8_f32(x, (const int8_t *)l->w, (const float *)l->scales, (const int32_t *)l->row_sums, l->bias, y, M,
                      l->O, l->K, nthreads);
        break;
    case LS_I4:
        linear_i4_f32(x, (const uint8_t *)l->w, (const uint16_t *)l->scales, (const uint16_t *)l->mins, l->bias, y,
                      M, l->O, l->K, l->G, nthreads);
        break;
    case LS_KQ:
        linear_kq_f32(x, (const uint8_t *)l->w, (const int64_t *)l->scales, l->G, l->bias, y, M, l->O, l->K,
                      nthreads);
        break;
    case LS_W4A8: /* the W4A8 panels of 4-, 5- and 8-bit codes (GGUF Q5_0 / Q5_1, Q8_0 and the int4 head) */
    case LS_W5A8:
    case LS_W8A8:
        return linear_w4a8_f32(x, (const uint8_t *)l->w, (const uint16_t *)l->scales, (const uint16_t *)l->mins,
                               l->bias, y, M, l->O, l->K, l->G, l->kind == LS_W4A8 ? 4 : l->kind == LS_W5A8 ? 5 : 8,
                               (int)l->isa, nthreads);
    default:
        linear_i8w_f32(x, (const int8_t *)l->w, (const uint16_t *)l->scales, l->bias, y, M, l->O, l->K, l->G,
                       nthreads);
    }
    return 0;
}

/* h (B, hidden): the embeddings of the step's B decode tokens; out (B, hidden): the final norm of the last
 * residual stream. cos, sin (B, head_dim); slots (B,); tables (B, max_blocks); lens (B,): as the kernels
 * above take them. With m->allreduce (a rank of a tensor-parallel group: o and down are row-parallel), the
 * outputs of o and down are summed over the ranks where the module path's hooks all-reduce them.
 * With logits (B, head's O) and m->head, the LM head's kernel then runs on out into logits, as the module path's
 * Linear runs it.
 * Returns 0, -1 when the scratch memory could not be allocated (out may be partly written), or the all-reduce's
 * LS_AR_ABORTED / LS_AR_TIMEOUT. */
int decode_stack(const ls_model *m, const float *h, float *out, const float *cos, const float *sin,
                 const int64_t *slots, const int64_t *tables, const int64_t *lens, int64_t B, int64_t max_blocks,
                 float *logits, int nthreads) {
    const int64_t Hd = m->hidden, NH = m->heads, KVH = m->kv_heads, D = m->head_dim, I = m->inter;
    const int64_t qs = NH * D, kvs = KVH * D, qkvw = qs + 2 * kvs;
    const float eps = (float)m->eps, scale = (float)m->scale;
    const int64_t n = B * (4 * Hd + qkvw + 2 * qs + 3 * I);
    float *buf = (float *)malloc(sizeof(float) * (size_t)n);
    if (!buf) return -1;
    int rc = -1;
    float *res = buf, *x = res + B * Hd, *hb = x + B * Hd, *ob = hb + B * Hd, *qkv = ob + B * Hd;
    float *q = qkv + B * qkvw, *attn = q + B * qs, *gu = attn + B * qs, *act = gu + 2 * B * I;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const ls_layer *L = m->layers + l;
        if (l == 0) { /* the residual stream starts as the embeddings */
            memcpy(res, h, sizeof(float) * (size_t)(B * Hd));
            rmsnorm_f32(h, NULL, L->in_norm, x, B, Hd, eps, nthreads);
        } else {
            rmsnorm_f32(hb, res, L->in_norm, x, B, Hd, eps, nthreads);
        }
        if (ls_linear_run(&L->qkv, x, qkv, B, nthreads)) goto fail;
        if (m->lora && ls_lora_add(m->lora, l, 0, x, qkv, nthreads)) goto fail;
        if (m->kv_kind < 0)
            rope_write_kv_f32(qkv, qkvw, qkv + qs, qkvw, qkv + qs + kvs, qkvw, cos, sin, (float *)L->k_cache,
                              (float *)L->v_cache, slots, B, NH, KVH, D, nthreads);
        else
            rope_write_kv_q(qkv, qkvw, qkv + qs, qkvw, qkv + qs + kvs, qkvw, cos, sin, L->k_cache, L->v_cache,
                            L->k_scale, L->v_scale, slots, B, NH, KVH, D, (int)m->kv_kind, nthreads);
        for (int64_t b = 0; b < B; b++) memcpy(q + b * qs, qkv + b * qkvw, sizeof(float) * (size_t)qs);
        if (m->kv_kind < 0)
            paged_decode_attention(q, (const float *)L->k_cache, (const float *)L->v_cache, tables, lens, attn, B, NH,
                                   KVH, D, m->block_size, max_blocks, scale, L->window, nthreads);
        else
            paged_decode_attention_q(q, L->k_cache, L->v_cache, L->k_scale, L->v_scale, tables, lens, attn, B, NH,
                                     KVH, D, m->block_size, max_blocks, scale, L->window, (int)m->kv_kind, nthreads);
        if (ls_linear_run(&L->o, attn, ob, B, nthreads)) goto fail;
        if (m->lora && ls_lora_add(m->lora, l, 1, attn, ob, nthreads)) goto fail;
        if (m->allreduce && (rc = ls_all_reduce(m->allreduce, ob, B * Hd))) goto fail;
        rmsnorm_f32(ob, res, L->post_norm, x, B, Hd, eps, nthreads);
        if (ls_linear_run(&L->gate_up, x, gu, B, nthreads)) goto fail;
        if (m->lora && ls_lora_add(m->lora, l, 2, x, gu, nthreads)) goto fail;
        silu_mul_f32(gu, act, B, I, nthreads);
        if (ls_linear_run(&L->down, act, hb, B, nthreads)) goto fail;
        if (m->lora && ls_lora_add(m->lora, l, 3, act, hb, nthreads)) goto fail;
        if (m->allreduce && (rc = ls_all_reduce(m->allreduce, hb, B * Hd))) goto fail;
    }
    rmsnorm_f32(hb, res, m->final_norm, out, B, Hd, eps, nthreads);
    free(buf);
    if (logits && m->head && ls_linear_run(m->head, out, logits, B, nthreads)) return -1;
    return 0;
fail:
    free(buf);
    return rc;
}
/* ========================================= end of decode_stack ========================================= */

/* ==================================================================================================== *
 * The shared-memory all-reduce in C (shm_all_reduce_f32; the decode stack's ls_all_reduce).              *
 * ==================================================================================================== *
 *
 * The protocol of lmserve/worker/shm_allreduce.py, on the same mapped file, so calls from Python and from C
 * interleave on one sequence: a rank's next call is its own posted flag + 1 (the flag is the rank's call
 * counter, shared by both sides). Call k: wait until every peer posted k - 1, copy x into this rank's slot of
 * buffer k % 2, post k (release), wait until every peer posted k (acquire), then x = slot 0 + slot 1 (+ slot 2
 * ...), left to right, elementwise: the same float additions in the same order as the Python side's torch.add
 * and add_, so both give the same bits. Longer inputs go in slot-sized chunks, one call each (as Python's).
 *
 * Waiting: a rank whose peer is late spins (pause) for spin_us microseconds, then sleeps on a futex on the
 * peer's flag (its low 32 bits, which every post changes) until the peer posts: on a machine where another busy
 * process (the API server) shares the ranks' CPUs, a spinning rank would hold a CPU the late peer or that process
 * needs. A sleeper first raises the peer's `waiters` word (the int64 after its flag, same cache line); a poster
 * that finds it raised clears it and wakes the flag's sleepers (no system call while nobody sleeps). Both sides
 * use sequentially consistent accesses (store, then load the other word): either the sleeper sees the new flag, or
 * the poster sees the raised word; a sleeper whose flag changed in between returns from FUTEX_WAIT at once.
 * Python's posts (worker/shm_allreduce.py) go through shm_post when the kernels are loaded, so they wake too.
 * Sleeps last at most LS_AR_NAP_NS; between them the abort word (set by the owning process's Python watcher
 * thread when its peer is gone: ShmAllReduce.alive) and the deadline (timeout_s from the first sleep) are
 * checked. A rank whose peer died returns LS_AR_ABORTED, one whose peer never came LS_AR_TIMEOUT; the caller
 * raises. */
#define LS_AR_FLAG_STRIDE 8     /* int64s between two ranks' flags (FLAG_STRIDE in shm_allreduce.py) */
#define LS_AR_NAP_NS 5000000LL  /* the longest futex sleep between abort / deadline checks: 5 ms */
enum { LS_AR_ABORTED = -2, LS_AR_TIMEOUT = -3 };

/* Every field 8 bytes (the ctypes Structure in shm_allreduce.py mirrors it). */
struct ls_allreduce {
    int64_t *flags; /* per rank: its flag, then its waiters word; LS_AR_FLAG_STRIDE int64s apart */
    char *data;     /* 2 parities x size ranks x slot_bytes */
    int64_t rank, size, slot_bytes;
    const int64_t *abort; /* nonzero: stop waiting (this process's own word, not shared) */
    double timeout_s;
    int64_t spin_us; /* how long a wait spins before it sleeps (0: sleep at once) */
};

static double ls_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
/* the low half of an int64 flag: the word FUTEX_WAIT compares (little-endian x86-64 only uses this file's
 * shared-memory path: worker/distributed.py) */
static int32_t *ls_low_word(int64_t *flag) { return (int32_t *)flag; }
static void ls_futex_wait(int64_t *flag, int64_t seen) {
    struct timespec t = {0, LS_AR_NAP_NS};
    syscall(SYS_futex, ls_low_word(flag), FUTEX_WAIT, (int32_t)seen, &t, NULL, 0);
}
static void ls_futex_wake(int64_t *flag) {
    syscall(SYS_futex, ls_low_word(flag), FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}
#else
static void ls_futex_wait(int64_t *flag, int64_t seen) {
    (void)flag, (void)seen;
    sched_yield();
}
static void ls_futex_wake(int64_t *flag) { (void)flag; }
#endif

/* Wait until every peer has posted call seq. Returns 0, LS_AR_ABORTED or LS_AR_TIMEOUT. */
static int ls_ar_wait(const struct ls_allreduce *a, int64_t seq) {
    double spin_end = 0.0, deadline = 0.0;
    for (int64_t r = 0; r < a->size; r++) {
        if (r == a->rank) continue;
        int64_t *flag = a->flags + r * LS_AR_FLAG_STRIDE, *waiters = flag + 1;
        for (int64_t checks = 1;; checks++) {
            const int64_t seen = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
            if (seen >= seq) break;
            if (checks % 64) { /* spin: a clock read every 64 pauses */
#if defined(__x86_64__)
                __builtin_ia32_pause();
#endif
                continue;
            }
            const double now = ls_now();
            if (spin_end == 0.0) spin_end = now + 1e-6 * (double)a->spin_us;
            if (now < spin_end) continue;
            if (__atomic_load_n(a->abort, __ATOMIC_RELAXED)) return LS_AR_ABORTED;
            if (deadline == 0.0) deadline = now + a->timeout_s;
            else if (now > deadline) return LS_AR_TIMEOUT;
            __atomic_store_n(waiters, 1, __ATOMIC_SEQ_CST);
            const int64_t again = __atomic_load_n(flag, __ATOMIC_SEQ_CST);
            if (again >= seq) break;
            ls_futex_wait(flag, again);
        }
    }
    return 0;
}

/* Post call seq: the data written before is visible to a peer that sees the flag (release, TSO); sleepers woken. */
static void ls_ar_post(const struct ls_allreduce *a, int64_t seq) {
    int64_t *mine = a->flags + a->rank * LS_AR_FLAG_STRIDE, *waiters = mine + 1;
    __atomic_store_n(mine, seq, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(waiters, __ATOMIC_SEQ_CST)) {
        __atomic_store_n(waiters, 0, __ATOMIC_SEQ_CST);
        ls_futex_wake(mine);
    }
}

static int ls_all_reduce(const struct ls_allreduce *a, float *x, int64_t n) {
    const int64_t per = a->slot_bytes / (int64_t)sizeof(float);
    int64_t *mine = a->flags + a->rank * LS_AR_FLAG_STRIDE;
    for (int64_t start = 0; start < n; start += per) {
        const int64_t len = n - start < per ? n - start : per;
        float *xs = x + start;
        const int64_t seq = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;
        int rc = ls_ar_wait(a, seq - 1); /* every peer is done with this parity's buffer (its call seq - 2) */
        if (rc) return rc;
        char *buf = a->data + (seq % 2) * a->size * a->slot_bytes;
        memcpy(buf + a->rank * a->slot_bytes, xs, sizeof(float) * (size_t)len);
        ls_ar_post(a, seq);
        if ((rc = ls_ar_wait(a, seq))) return rc;
        const float *s0 = (const float *)buf, *s1 = (const float *)(buf + a->slot_bytes);
        for (int64_t i = 0; i < len; i++) xs[i] = s0[i] + s1[i];
        for (int64_t r = 2; r < a->size; r++) {
            const float *sr = (const float *)(buf + r * a->slot_bytes);
            for (int64_t i = 0; i < len; i++) xs[i] += sr[i];
        }
    }
    return 0;
}

/* x (n float32s) summed over the group in place: ShmAllReduce.all_reduce's C path. Returns 0, LS_AR_ABORTED or
 * LS_AR_TIMEOUT. */
int shm_all_reduce_f32(const struct ls_allreduce *a, float *x, int64_t n) { return ls_all_reduce(a, x, n); }

/* The Python side's waits and posts (its gather, other dtypes), so they sleep and wake as the C calls do. */
int shm_wait(const struct ls_allreduce *a, int64_t seq) { return ls_ar_wait(a, seq); }
void shm_post(const struct ls_allreduce *a, int64_t seq) { ls_ar_post(a, seq); }
/* ========================================= end of the shared-memory all-reduce ======================== */

/* ==================================================================================================== *
 * LoRA deltas (lora_delta_f32) and the decode stack's LoRA rows (ls_lora_add).                           *
 * ==================================================================================================== *
 *
 * One adapter's delta for a run of M rows of one projection, as lmserve/lora/layers.py lays the slots out:
 * y (M, O) += (x (M, K) . A[:cols]^T) . B[:, :cols]^T, A (cols, K) rows contiguous, B (O, b_stride) (the slot's
 * block-diagonal B, its first cols columns used). The LoRA hooks call it for runs of a few rows (decodes) and the
 * decode stack calls it for the same runs with the same arguments, so the two paths add the same bits. Every
 * value of xa and y is one thread's fixed-order sum (16 partial sums, then the tail, then the partials in order),
 * whatever the thread count, the row count or the pointers' alignment.
 */
#define LORA_LANES 16

static inline float lora_dot(const float *a, const float *b, int64_t n) {
    float acc[LORA_LANES] = {0};
    int64_t i = 0;
    for (; i + LORA_LANES <= n; i += LORA_LANES)
        for (int j = 0; j < LORA_LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < LORA_LANES; j++) s += acc[j];
    return s;
}

/* Returns 0, or -1 when the (M, cols) scratch could not be allocated. */
int lora_delta_f32(const float *x, const float *A, const float *B, float *y, int64_t M, int64_t K, int64_t O,
                   int64_t cols, int64_t b_stride, int nthreads) {
    if (M <= 0 || cols <= 0) return 0;
    float *xa = (float *)malloc(sizeof(float) * (size_t)(M * cols));
    if (!xa) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * cols * K > 65536)
    for (int64_t c = 0; c < cols; c++)
        for (int64_t m = 0; m < M; m++) xa[m * cols + c] = lora_dot(x + m * K, A + c * K, K);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * cols * O > 65536)
    for (int64_t o = 0; o < O; o++)
        for (int64_t m = 0; m < M; m++) y[m * O + o] += lora_dot(xa + m * cols, B + o * b_stride, cols);
    free(xa);
    return 0;
}

/* One LoRA'd projection of the decode stack: the slot-stacked A (max_loras, PR, K) and B (max_loras, O, PR) of
 * lmserve/lora/layers.LoRALinear, and its per-slot columns in use (0: the slot's adapter skips it). */
typedef struct {
    const float *A, *B;
    const int64_t *cols;
    int64_t O, K, PR;
} ls_lora_linear;

/* The step's LoRA rows: linears[4 l + p] for layer l's projection p; groups (num_groups, 3) int64 rows of
 * (slot, first row, end row), as LoRAHooks.groups. Every field 8 bytes (the ctypes Structure mirrors it). */
struct ls_lora {
    const ls_lora_linear *linears;
    const int64_t *groups;
    int64_t num_groups;
};

static int ls_lora_add(const struct ls_lora *lora, int64_t l, int p, const float *x, float *y, int nthreads) {
    const ls_lora_linear *d = lora->linears + 4 * l + p;
    for (int64_t g = 0; g < lora->num_groups; g++) {
        const int64_t slot = lora->groups[3 * g], r0 = lora->groups[3 * g + 1], r1 = lora->groups[3 * g + 2];
        const int64_t cols = d->cols[slot];
        if (!cols) continue;
        if (lora_delta_f32(x + r0 * d->K, d->A + slot * d->PR * d->K, d->B + slot * d->O * d->PR, y + r0 * d->O,
                           r1 - r0, d->K, d->O, cols, d->PR, nthreads))
            return -1;
    }
    return 0;
}
/* ========================================= end of LoRA deltas ========================================= */

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
        for (int64_t c = 0; c < C; c++) {
            float *w_c = win + c * (W - 1);
            const float *k_c = weight + c * W;
            float acc = 0.f;
            for (int64_t j = 0; j < W - 1; j++) acc += w_c[j] * k_c[j];
            const float xv = x[b * C + c];
            acc += xv * k_c[W - 1];
            for (int64_t j = 0; j + 1 < W - 1; j++) w_c[j] = w_c[j + 1];
            w_c[W - 2] = xv;
            out[b * C + c] = acc / (1.f + expf(-acc));
        }
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
