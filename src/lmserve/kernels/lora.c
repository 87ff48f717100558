/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */
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
