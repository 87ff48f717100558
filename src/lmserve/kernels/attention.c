/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */
/* bfloat16 -> float32 is exact: the bf16 bits are the high half of the float32. */
/* Each of nq rows of N scores (row maxima in mx) → its softmax in place; zero the nq output rows of D. sinks (nq,)
 * or NULL: a logit per row that joins its softmax's maximum and denominator and reads no value (gpt-oss's attention
 * sinks: softmax over [scores, sink], the sink's column dropped). */
static inline __attribute__((always_inline)) void softmax_rows_zero_out(float *scores, const float *mx, int64_t nq,
                                                                        int64_t N, float *o0, int64_t D,
                                                                        const float *sinks) {
    for (int64_t h = 0; h < nq; h++) {
        float *sh = scores + h * N, m = mx[h], tot = 0.f;
        if (sinks) m = sinks[h] > m ? sinks[h] : m;
#pragma omp simd reduction(+ : tot)
        for (int64_t t = 0; t < N; t++) {
            float e = exp_f32(sh[t] - m);
            sh[t] = e;
            tot += e;
        }
        if (sinks) tot += exp_f32(sinks[h] - m);
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
                                   int64_t D, int64_t block_size, int64_t row, float scale, const float *sinks,
                                   float *scores) {
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
    softmax_rows_zero_out(scores, mx, nq, N, o0, D, sinks ? sinks + h0 : NULL);
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
 * sinks: (H,) or NULL, softmax_rows_zero_out's; out: (B, H, D).
 * Query head h reads kv head h / (H / KVH) (GQA). Work items as attention_items splits them (a sequence, a kv
 * head's group of query heads, or a run of query heads); every output is the same whatever the split. */
void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                            const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                            int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                            const float *sinks, int nthreads) {
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
                                   out + bi * H * D, h0, h1, G, D, block_size, row, scale, sinks, scores);
        }
        free(scores);
    }
}
