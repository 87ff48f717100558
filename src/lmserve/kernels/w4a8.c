/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */
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

/* A block of 32 activations' int8 step (max|x| / 127) and its inverse in *inv (0 for an all-zero block). */
static inline float q8_block_scale(const float *xb, float *inv) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) {
        float v = fabsf(xb[i]);
        amax = v > amax ? v : amax;
    }
    float db = amax / 127.f;
    *inv = db != 0.f ? 1.f / db : 0.f;
    return db;
}

/* x's int8 code on a block's grid (inv: q8_block_scale's), rounded to nearest even and clamped to +-127. */
static inline int8_t q8_code(float x, float inv) {
    float r = nearbyintf(x * inv);
    return (int8_t)(r > 127.f ? 127.f : (r < -127.f ? -127.f : r));
}

static void w4a8_quantize_row(const float *x, const w4a8_act *a, int64_t m, int32_t off) {
    for (int64_t b = 0; b < a->NB; b++) {
        const float *xb = x + 32 * b;
        float id;
        const float db = q8_block_scale(xb, &id);
        const int64_t ai = w4a8_ai(a, m, b);
        int8_t *q = a->q + 32 * ai;
        int32_t s = 0;
        for (int i = 0; i < 32; i++) {
            q[i] = q8_code(xb[i], id);
            s += (int32_t)q[i];
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

/* One product of linear_w4a8_multi_f32: y (M, O) = x (M, K) times a packed weight (linear_w4a8_f32's arguments). */
typedef struct {
    const float *x;
    const uint8_t *pc;
    const uint16_t *ps, *pm;
    const float *b;
    float *y;
    int64_t M, O, G;
} w4a8_job;

/* n linear_w4a8_f32 products of one K, bits and isa (all with mins or none) in one parallel region: each job's x
 * quantized (a job with the previous job's x and M shares its activations), then every job's panels split over
 * the threads together, so a few small products (a layer's input projections, a token's chosen experts) cost
 * one fork and one join and balance over the threads as one. The same bits as n linear_w4a8_f32 calls. Returns
 * 0, or -1 as linear_w4a8_f32 (no y written). */
int linear_w4a8_multi_f32(const w4a8_job *jobs, int64_t n, int64_t K, int bits, int isa, int nthreads) {
    if (!w4a8_isa_supported(isa) || (bits != 4 && bits != 5 && bits != 8) || n < 1) return -1;
    const int has_mins = jobs[0].pm != NULL;
    for (int64_t j = 0; j < n; j++)
        if ((jobs[j].pm != NULL) != has_mins || (bits == 8 && jobs[j].pm)) return -1;
    const int64_t NB = K / 32;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * n + 1)); /* panel prefix; act index; offset */
    w4a8_act *acts = (w4a8_act *)malloc(sizeof(w4a8_act) * (size_t)n);
    if (!first || !acts) {
        free(first);
        free(acts);
        return -1;
    }
    int64_t *act_of = first + n + 1, *act_at = act_of + n, bytes = 0, na = 0;
    first[0] = 0;
    for (int64_t j = 0; j < n; j++) {
        first[j + 1] = first[j] + (jobs[j].O + W4A8_PANEL - 1) / W4A8_PANEL;
        if (j > 0 && jobs[j].x == jobs[j - 1].x && jobs[j].M == jobs[j - 1].M) {
            act_of[j] = act_of[j - 1];
            continue;
        }
        const int64_t M = jobs[j].M, R = M < W4A8_MR ? (M ? M : 1) : W4A8_MR, Mp = (M + R - 1) / R * R;
        act_of[j] = na;
        act_at[na] = bytes;
        acts[na++] = (w4a8_act){NULL, NULL, NULL, NULL, R, NB, bits};
        bytes += Mp * K + Mp * NB * 12;
    }
    char *buf = (char *)malloc((size_t)(bytes ? bytes : 1));
    if (!buf) {
        free(first);
        free(acts);
        return -1;
    }
    /* the codes' offset the block sums correct: 8 (symmetric nibbles), 16 (symmetric 5-bit codes), 0 (with mins),
     * 128 (8-bit; 0 on AVX2, whose sign trick multiplies the signed weights themselves) */
    const int32_t off = bits == 8 ? (isa == W4A8_AVX2 ? 0 : 128) : has_mins ? 0 : bits == 5 ? 16 : 8;
    for (int64_t j = 0, a = 0; j < n; j++) {
        if (act_of[j] != a) continue; /* (a job sharing the previous one's activations) */
        const int64_t M = jobs[j].M, R = acts[a].R, Mp = (M + R - 1) / R * R;
        char *p = buf + act_at[a];
        acts[a].q = (int8_t *)p;
        acts[a].d = (float *)(p + Mp * K);
        acts[a].ds = (float *)(p + Mp * K + 4 * Mp * NB);
        acts[a].corr = (int32_t *)(p + Mp * K + 8 * Mp * NB);
        w4a8_quantize(jobs[j].x, acts + a, M, off, nthreads);
        a++;
    }
    const w4a8_panel_fn fn = w4a8_panel_for(isa);
    const int64_t P = first[n];
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t p = 0; p < P; p++) {
        int64_t j = 0;
        while (first[j + 1] <= p) j++;
        const w4a8_job *J = jobs + j;
        const int64_t lp = p - first[j], NG = K / J->G, M = J->M;
        const uint8_t *pcp = J->pc + lp * NB * 64 * bits;
        const uint16_t *psp = J->ps + lp * NG * W4A8_PANEL, *pmp = J->pm ? J->pm + lp * NG * W4A8_PANEL : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += W4A8_MR)
            fn(acts + act_of[j], m0, M - m0 < W4A8_MR ? M - m0 : W4A8_MR, pcp, psp, pmp, J->b, J->y, J->O,
               lp * W4A8_PANEL, K, J->G);
    }
    free(buf);
    free(first);
    free(acts);
    return 0;
}
/* y (M, O) = x (M, K) float32 times the packed weight (layout above: bits 4, 5, or 8 for the W8A8 blocks; K a
 * multiple of G, G of 32), with x quantized here per row per block of 32; b (O,) or NULL; isa a path
 * w4a8_isa_supported accepts (the caller checks). Any M: rows in runs of W4A8_MR per panel, panels split over the
 * threads. Returns 0, or -1 when the activation scratch could not be allocated, isa is not runnable or bits is
 * neither 4 nor 8 (y untouched). One job of linear_w4a8_multi_f32. */
int linear_w4a8_f32(const float *x, const uint8_t *pc, const uint16_t *ps, const uint16_t *pm, const float *b,
                    float *y, int64_t M, int64_t O, int64_t K, int64_t G, int bits, int isa, int nthreads) {
    const w4a8_job job = {x, pc, ps, pm, b, y, M, O, G};
    return linear_w4a8_multi_f32(&job, 1, K, bits, isa, nthreads);
}
/* ========================================= end of W4A8 int4 kernels ======================================== */
