/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */
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
/* Which int8 dot-product instructions linear_i8_f32 was compiled with: 2 AVX512-VNNI, 1 AVX-VNNI, -1 AVX2's
 * vpmaddubsw (no VNNI), 0 none (the portable loop). */
int i8_kernel_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVXVNNI__)
    return 1;
#elif defined(__AVX2__)
    return -1;
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
#elif defined(__AVX2__)
    /* no VNNI: |w| (unsigned) times x carrying w's sign, pairs summed to int16 by vpmaddubsw (at most
     * 2 * 128 * 127 < 2^15: x is within +-127, so never saturating), then to int32 by vpmaddwd: exact */
    (void)xu;
    (void)xt;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[I8_MAX_ROWS];
    for (int m = 0; m < N; m++) acc[m] = _mm256_setzero_si256();
    for (; i + 32 <= K; i += 32) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + i));
        const __m256i wa = _mm256_abs_epi8(wv);
        for (int m = 0; m < N; m++) {
            const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + m * K + i)), wv);
            acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xv), ones));
        }
    }
    for (int m = 0; m < N; m++) {
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc[m]), _mm256_extracti128_si256(acc[m], 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
        s[m] = _mm_cvtsi128_si32(h);
        for (int64_t j = i; j < K; j++) s[m] += (int32_t)xq[m * K + j] * (int32_t)w[j];
    }
    i = K;
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
