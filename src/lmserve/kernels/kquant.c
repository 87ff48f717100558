/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */
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
