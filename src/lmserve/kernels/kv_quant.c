/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */
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
    int64_t D, int64_t block_size, float scale, const float *sinks, float *scores, int kind) {
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
    softmax_rows_zero_out(scores, mx, nq, N, o0, D, sinks ? sinks + h0 : NULL);
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
 * split and the same arguments (the sliding window and sinks included), plus the scale tensors (NULL for bf16). */
void paged_decode_attention_q(const float *q, const void *k_cache, const void *v_cache, const float *k_scale,
                              const float *v_scale, const int64_t *block_tables, const int64_t *context_lens,
                              float *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                              int64_t max_blocks, float scale, int64_t window, const float *sinks, int kind,
                              int nthreads) {
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
                                         block_size, scale, sinks, scores, KV_BF16);
            else if (kind == KV_INT8)
                decode_attention_heads_q(qb, k_cache, v_cache, k_scale, v_scale, table, t0, L, ob, h0, h1, G, KVH,
                                         D, block_size, scale, sinks, scores, KV_INT8);
            else
                decode_attention_heads_q(qb, k_cache, v_cache, k_scale, v_scale, table, t0, L, ob, h0, h1, G, KVH,
                                         D, block_size, scale, sinks, scores, KV_FP8_E4M3);
        }
        free(scores);
    }
}
/* ========================================= end quantized KV cache ========================================= */
