/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */
/* ==================================================================================================== *
 * MXFP4 x int8 kernels (issue #49): gpt-oss's experts as the checkpoint holds them (4.25 bits a weight), *
 * activations quantized to int8 per block of 32, integer dot products; the path chosen at run time.      *
 * ==================================================================================================== *
 *
 * Weights (lmserve.model.mxfp4's layout, transformers' own): row o, block b of 32 inputs = 16 bytes
 *   blocks[o, b] (input 2i in the low nibble of byte i, input 2i + 1 in the high one) and one e8m0 byte
 *   scales[o, b]: w = E2M1[code] * 2^(e - 127) = v * 2^(e - 128), v = 2 E2M1[code] in {0, ±1, ±2, ±3, ±4, ±6, ±8,
 *   ±12}: an exact int8 (ggml's kvalues_mxfp4), 2^(e - 128) an exact float32 (subnormal for e < 2).
 * Activations, row m, block b (llama.cpp's Q8_0 rule with a float32 scale, the W4A8 kernels' own): d = max|x| / 127,
 *   q = round-half-even(x * (1 / d)), 0 where d = 0 (lmserve.model.quantization.quantize_activation_blocks' bits).
 *   They are stored de-interleaved, the block's 16 even inputs then its 16 odd ones, so the low nibbles of the
 *   16 weight bytes meet the first 16 q and the high nibbles the last 16: the weights need no shuffle.
 * Block sum: s = sum v q, exact in int32 (|s| <= 32 * 12 * 127). The SIMD paths look the codes up as u = v + 12
 *   (0..24, unsigned: vpshufb on a 16-entry table, the unsigned operand of vpmaddubsw / vpdpbusd) and subtract
 *   12 sum q (once per activation block, shared by every weight row).
 * Output: y[m, o] = sum_b s_b (d_b 2^(e_b - 128)) + bias, as float32 operations in one fixed order: per block one
 *   product of the two scales and one FMA into lane b % 8 of 8 accumulators, then the lanes summed as
 *   ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)). Every path does exactly these (each finds the integer sums
 *   its own way), so all paths give the same bits and a row's result does not depend on the other rows.
 * Paths (mxfp4_isa_supported; LMSERVE_MXFP4_ISA forces one, e.g. in the tests):
 *   MX_VNNI256  vpdpbusd ymm: AVX-VNNI (VEX) where the CPU has it, else AVX512-VNNI/VL's EVEX encoding
 *   MX_AVX2     vpmaddubsw + vpmaddwd (a pair of products <= 2 * 24 * 127: no saturation)
 *   MX_SCALAR   portable C
 * Up to MX_MR rows of x per pass: a weight row's 8 blocks are unpacked once and meet every row (decode, speculative
 * verification); more rows loop over runs of MX_MR. Threads split the output rows.
 */
enum { MX_SCALAR = 0, MX_AVX2 = 1, MX_VNNI256 = 2 };
#define MX_MR 8    /* rows of x one pass over a weight row serves */
#define MX_OFF 12  /* u = v + MX_OFF: the unsigned codes the SIMD paths multiply */
#define MX_LANES 8 /* blocks a step, one float accumulator lane each */

static const int8_t mx_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Whether this CPU (and OS) runs path isa. */
int mxfp4_isa_supported(int isa) {
    switch (isa) {
    case MX_SCALAR: return 1;
    case MX_AVX2: return w4a8_isa_supported(W4A8_AVX2);
    case MX_VNNI256: return w4a8_isa_supported(W4A8_VNNI256);
    default: return 0;
    }
}

/* The fastest path this CPU runs. */
int mxfp4_isa_best(void) {
    for (int isa = MX_VNNI256; isa > MX_SCALAR; isa--)
        if (mxfp4_isa_supported(isa)) return isa;
    return MX_SCALAR;
}

/* 2^(e - 128) (e8m0 e, halved: v is twice the e2m1 value), exactly; ggml's ggml_e8m0_to_fp32_half. */
static inline float mx_scale(uint8_t e) {
    uint32_t bits = e >= 2 ? (uint32_t)(e - 1) << 23 : 0x00200000u << e;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Quantized activations of M rows, NBp = ceil(K / 32 / 8) * 8 blocks a row (the last step's missing blocks: all
 * zero): row m, block b at r = m NBp + b: q (32 bytes, de-interleaved) at q + 32 r, d[r], c[r] = 12 sum q. */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *c;
    int64_t NB, NBp;
} mx_act;

static void mx_quantize_row(const float *x, const mx_act *a, int64_t m) {
    for (int64_t b = 0; b < a->NBp; b++) {
        const int64_t r = m * a->NBp + b;
        int8_t *q = a->q + 32 * r;
        if (b >= a->NB) {
            memset(q, 0, 32);
            a->d[r] = 0.f;
            a->c[r] = 0;
            continue;
        }
        const float *xb = x + 32 * b;
        float id;
        const float db = q8_block_scale(xb, &id); /* (w4a8.c's grid: the same codes as W4A8's activations) */
        int32_t s = 0;
        for (int i = 0; i < 32; i++) {
            const int8_t v = q8_code(xb[i], id);
            q[(i & 1) * 16 + i / 2] = v;
            s += (int32_t)v;
        }
        a->d[r] = db;
        a->c[r] = MX_OFF * s;
    }
}

/* The activation scratch for M rows of K inputs in one allocation (free(a->q) releases it); 0, or -1. */
static int mx_act_alloc(mx_act *a, int64_t M, int64_t K) {
    a->NB = K / 32;
    a->NBp = (a->NB + MX_LANES - 1) / MX_LANES * MX_LANES;
    const int64_t n = M * a->NBp;
    char *buf = (char *)aligned_alloc(64, (size_t)((n * 40 + 63) / 64 * 64));
    if (!buf) return -1;
    a->q = (int8_t *)buf;
    a->d = (float *)(buf + 32 * n);
    a->c = (int32_t *)(buf + 36 * n);
    return 0;
}

static void mx_quantize(const float *x, const mx_act *a, int64_t M, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * a->NB > 2048)
    for (int64_t m = 0; m < M; m++) mx_quantize_row(x + m * a->NB * 32, a, m);
}

/* The 8 accumulators summed in the fixed order above, plus the bias. */
static inline float mx_lanes_sum(const float *acc, float bias) {
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + bias;
}

/* ---- portable C: rows m0 .. m0 + MR of x against weight row o ------------------------------------------------ */
static void mx_row_scalar(const mx_act *a, int64_t m0, int64_t MR, const uint8_t *wr, const uint8_t *er,
                          const float *b, float *y, int64_t O, int64_t o) {
    for (int64_t m = m0; m < m0 + MR; m++) {
        float acc[MX_LANES] = {0};
        for (int64_t bl = 0; bl < a->NBp; bl++) {
            const int64_t r = m * a->NBp + bl;
            const int8_t *q = a->q + 32 * r;
            int32_t s = 0;
            if (bl < a->NB)
                for (int i = 0; i < 16; i++) {
                    const uint8_t c = wr[16 * bl + i];
                    s += mx_values[c & 15] * q[i] + mx_values[c >> 4] * q[16 + i];
                }
            const float sc = a->d[r] * mx_scale(bl < a->NB ? er[bl] : 0);
            acc[bl % MX_LANES] = fmaf((float)s, sc, acc[bl % MX_LANES]);
        }
        y[m * O + o] = mx_lanes_sum(acc, b ? b[o] : 0.f);
    }
}

#ifdef W4A8_X86
/* The 8 lane sums of p[0..7] (lane j of the result: p[j]'s 8 lanes summed); integer, so any order is exact. */
#define MX_SUM8(p, out)                                                                                         \
    do {                                                                                                        \
        const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);                 \
        const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);                 \
        const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);                       \
        out = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31)); \
    } while (0)

/* One body, two instruction sets: MX_DEFINE(name, target, DOT) defines mx_row_<name>, where DOT(u, q) is the 8
 * int32 lanes of sums of 4 products of the unsigned codes u and the signed activations q. */
#define MX_DEFINE(NAME, TARGET, DOT)                                                                             \
    __attribute__((target(TARGET))) static inline __attribute__((always_inline)) void mx_body_##NAME(           \
        const int MR, const mx_act *a, int64_t m0, const uint8_t *wr, const uint8_t *er, const float *b, float *y, \
        int64_t O, int64_t o) {                                                                                  \
        const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13,  \
                                             14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);                  \
        const __m256i lo4 = _mm256_set1_epi8(0x0f), shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);          \
        const __m256i one = _mm256_set1_epi32(1);                                                                \
        __m256 acc[MX_MR];                                                                                       \
        for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();                                               \
        for (int64_t b0 = 0; b0 < a->NBp; b0 += MX_LANES) {                                                      \
            const int64_t n = a->NB - b0 < MX_LANES ? a->NB - b0 : MX_LANES;                                     \
            __m256i u[MX_LANES];                                                                                 \
            for (int j = 0; j < MX_LANES; j++) { /* low nibbles to bytes 0-15, high ones to 16-31, looked up */ \
                if (j < n) {                                                                                     \
                    const __m128i raw = _mm_loadu_si128((const __m128i *)(wr + 16 * (b0 + j)));               \
                    const __m256i v = _mm256_broadcastsi128_si256(raw);                                          \
                    u[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srlv_epi32(v, shift), lo4));         \
                } else {                                                                                         \
                    u[j] = _mm256_setzero_si256();                                                               \
                }                                                                                                \
            }                                                                                                    \
            uint8_t e8[MX_LANES] = {0};                                                                          \
            memcpy(e8, er + b0, (size_t)n);                                                                      \
            const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e8));                        \
            const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, one), 23);                              \
            const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);                             \
            const __m256 ws = _mm256_castsi256_ps(_mm256_blendv_epi8(sub, normal, _mm256_cmpgt_epi32(e, one))); \
            for (int m = 0; m < MR; m++) {                                                                       \
                const int64_t r = (m0 + m) * a->NBp + b0;                                                        \
                const int8_t *q = a->q + 32 * r;                                                                 \
                __m256i p[MX_LANES], s;                                                                          \
                for (int j = 0; j < MX_LANES; j++)                                                               \
                    p[j] = DOT(u[j], _mm256_loadu_si256((const __m256i *)(q + 32 * j)));                         \
                MX_SUM8(p, s);                                                                                   \
                s = _mm256_sub_epi32(s, _mm256_loadu_si256((const __m256i *)(a->c + r)));                        \
                const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(a->d + r), ws);                                  \
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, acc[m]);                                     \
            }                                                                                                    \
        }                                                                                                        \
        for (int m = 0; m < MR; m++) {                                                                           \
            float lanes[MX_LANES];                                                                               \
            _mm256_storeu_ps(lanes, acc[m]);                                                                     \
            y[(m0 + m) * O + o] = mx_lanes_sum(lanes, b ? b[o] : 0.f);                                           \
        }                                                                                                        \
    }                                                                                                            \
    __attribute__((target(TARGET))) static void mx_row_##NAME(const mx_act *a, int64_t m0, int64_t MR,          \
                                                             const uint8_t *wr, const uint8_t *er, const float *b, \
                                                             float *y, int64_t O, int64_t o) {                  \
        W4A8_ROWS_SWITCH(MR, mx_body_##NAME, a, m0, wr, er, b, y, O, o)                                          \
    }

#define MX_DOT_AVX2(u, q) _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1))
#define MX_DOT_VEX(u, q) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, q)
#define MX_DOT_EVEX(u, q) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q)
MX_DEFINE(avx2, "avx2,fma,f16c", MX_DOT_AVX2)
MX_DEFINE(vex, "avxvnni,avx2,fma,f16c", MX_DOT_VEX)
MX_DEFINE(evex, "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c", MX_DOT_EVEX)
#endif /* W4A8_X86 */

typedef void (*mx_row_fn)(const mx_act *, int64_t, int64_t, const uint8_t *, const uint8_t *, const float *, float *,
                          int64_t, int64_t);

static mx_row_fn mx_row_for(int isa) {
#ifdef W4A8_X86
    if (isa == MX_VNNI256) return w4a8_vnni256_vex() ? mx_row_vex : mx_row_evex;
    if (isa == MX_AVX2) return mx_row_avx2;
#endif
    (void)isa;
    return mx_row_scalar;
}

/* y (M, O) = x (M, K) (quantized into `a` already) times the MXFP4 weight, b (O,) or NULL: output rows split over
 * the threads, each meeting every run of MX_MR rows of x. (The decode stack's MoE block calls it with its own
 * scratch.) */
static void mx_linear_act(const mx_act *a, int64_t M, const uint8_t *blocks, const uint8_t *scales, const float *b,
                          float *y, int64_t O, int isa, int nthreads) {
    const mx_row_fn fn = mx_row_for(isa);
    const int64_t NB = a->NB;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < O; o++)
        for (int64_t m0 = 0; m0 < M; m0 += MX_MR)
            fn(a, m0, M - m0 < MX_MR ? M - m0 : MX_MR, blocks + o * NB * 16, scales + o * NB, b, y, O, o);
}

/* y (M, O) = x (M, K) float32 times the MXFP4 weight blocks (O, K / 32, 16) / scales (O, K / 32), plus b (O,) or
 * NULL; K a multiple of 32, any M; isa a path mxfp4_isa_supported accepts. Returns 0, or -1 (y untouched) when
 * isa is not runnable or the activation scratch could not be allocated. */
int linear_mxfp4_f32(const float *x, const uint8_t *blocks, const uint8_t *scales, const float *b, float *y,
                     int64_t M, int64_t O, int64_t K, int isa, int nthreads) {
    mx_act a;
    if (!mxfp4_isa_supported(isa) || K % 32 || mx_act_alloc(&a, M, K)) return -1;
    mx_quantize(x, &a, M, nthreads);
    mx_linear_act(&a, M, blocks, scales, b, y, O, isa, nthreads);
    free(a.q);
    return 0;
}
/* ======================================== end of MXFP4 x int8 kernels ====================================== */
