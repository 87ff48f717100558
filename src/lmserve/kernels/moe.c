/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */
/* ==================================================================================================== *
 * The mixture-of-experts router of a few rows (moe_route_f32), shared by SparseMoE's few-row path and   *
 * the decode stack's MoE block, so both route with the same bits.                                     *
 * ==================================================================================================== *
 *
 * Softmax in float32 (max, exp, sum, times 1/sum, as torch's CPU softmax orders it), then the top k chosen
 * exactly as torch.topk's CPU kernel chooses them: (value, index) pairs through libstdc++'s nth_element
 * (or partial_sort when k * 64 <= E) with torch's comparator, the first k - 1 then insertion-sorted: so ties
 * pick the same experts as torch (and HF) pick. Each row's k experts come out in ascending id.
 */
typedef struct {
    float v;
    int64_t i;
} moe_pair;

/* torch's topk comparator (largest): NaN first, then greater values */
static inline int moe_before(const moe_pair *a, const moe_pair *b) {
    return (isnan(a->v) && !isnan(b->v)) || a->v > b->v;
}

static inline void moe_swap(moe_pair *a, moe_pair *b) {
    moe_pair t = *a;
    *a = *b;
    *b = t;
}

/* libstdc++'s heap primitives (std::__push_heap, __adjust_heap, __make_heap, __pop_heap) */
static void moe_push_heap(moe_pair *f, int64_t hole, int64_t top, moe_pair val) {
    int64_t parent = (hole - 1) / 2;
    while (hole > top && moe_before(f + parent, &val)) {
        f[hole] = f[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    f[hole] = val;
}

static void moe_adjust_heap(moe_pair *f, int64_t hole, int64_t len, moe_pair val) {
    const int64_t top = hole;
    int64_t child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (moe_before(f + child, f + child - 1)) child--;
        f[hole] = f[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        f[hole] = f[child - 1];
        hole = child - 1;
    }
    moe_push_heap(f, hole, top, val);
}

static void moe_make_heap(moe_pair *f, int64_t len) {
    if (len < 2) return;
    for (int64_t parent = (len - 2) / 2;; parent--) {
        moe_adjust_heap(f, parent, len, f[parent]);
        if (parent == 0) return;
    }
}

static void moe_pop_heap(moe_pair *f, int64_t len, moe_pair *result) {
    moe_pair val = *result;
    *result = f[0];
    moe_adjust_heap(f, 0, len, val);
}

static void moe_heap_select(moe_pair *f, int64_t mid, int64_t last) {
    moe_make_heap(f, mid);
    for (int64_t i = mid; i < last; i++)
        if (moe_before(f + i, f)) moe_pop_heap(f, mid, f + i);
}

/* std::__insertion_sort */
static void moe_insertion_sort(moe_pair *f, int64_t n) {
    for (int64_t i = 1; i < n; i++) {
        moe_pair val = f[i];
        if (moe_before(&val, f)) {
            memmove(f + 1, f, sizeof(moe_pair) * (size_t)i);
            f[0] = val;
        } else {
            int64_t j = i;
            while (moe_before(&val, f + j - 1)) {
                f[j] = f[j - 1];
                j--;
            }
            f[j] = val;
        }
    }
}

/* std::nth_element: __introselect with libstdc++'s median-of-three pivot and unguarded partition */
static void moe_nth_element(moe_pair *base, int64_t nth, int64_t n) {
    if (n == 0 || nth == n) return;
    int64_t first = 0, last = n, depth = 0;
    for (int64_t m = n; m > 1; m >>= 1) depth++;
    depth *= 2;
    while (last - first > 3) {
        if (depth == 0) {
            moe_heap_select(base + first, nth + 1 - first, last - first);
            moe_swap(base + first, base + nth);
            return;
        }
        depth--;
        moe_pair *f = base + first;
        int64_t len = last - first, mid = len / 2;
        moe_pair *a = f + 1, *b = f + mid, *c = f + len - 1; /* __move_median_to_first */
        if (moe_before(a, b)) {
            if (moe_before(b, c)) moe_swap(f, b);
            else if (moe_before(a, c)) moe_swap(f, c);
            else moe_swap(f, a);
        } else if (moe_before(a, c)) moe_swap(f, a);
        else if (moe_before(b, c)) moe_swap(f, c);
        else moe_swap(f, b);
        int64_t lo = 1, hi = len; /* __unguarded_partition(f + 1, f + len, f) */
        for (;;) {
            while (moe_before(f + lo, f)) lo++;
            hi--;
            while (moe_before(f, f + hi)) hi--;
            if (!(lo < hi)) break;
            moe_swap(f + lo, f + hi);
            lo++;
        }
        int64_t cut = first + lo;
        if (cut <= nth) first = cut;
        else last = cut;
    }
    moe_insertion_sort(base + first, last - first);
}

/* softmax of n floats in place: max, exp(x - max), their sum, times 1 / sum */
static void moe_softmax(float *x, int64_t n) {
    float mx = x[0];
    for (int64_t i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    float sum = 0.f;
    for (int64_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * inv;
}

enum { MOE_SOFTMAX_TOPK = 0, MOE_TOPK_SOFTMAX = 1 };

/* logits (B, E) → w (B, k) float32 and ids (B, k) int64, each row's experts in ascending id. scoring
 * MOE_SOFTMAX_TOPK: softmax over all E, the top k (divided by their sum with renorm); MOE_TOPK_SOFTMAX (gpt-oss):
 * the top k logits, softmax over those. k <= 17 (torch's sort of the first k - 1 is then an insertion sort).
 * Returns 0, or -1 when the scratch could not be allocated. */
int moe_route_f32(const float *logits, int64_t B, int64_t E, int64_t k, int scoring, int renorm, float *w,
                  int64_t *ids) {
    moe_pair *q = (moe_pair *)malloc(sizeof(moe_pair) * (size_t)E);
    float *p = (float *)malloc(sizeof(float) * (size_t)E);
    if (!q || !p) {
        free(q);
        free(p);
        return -1;
    }
    for (int64_t b = 0; b < B; b++) {
        memcpy(p, logits + b * E, sizeof(float) * (size_t)E);
        if (scoring == MOE_SOFTMAX_TOPK) moe_softmax(p, E);
        for (int64_t e = 0; e < E; e++) q[e] = (moe_pair){p[e], e};
        if (k * 64 <= E) { /* std::partial_sort: heap select, then sort_heap */
            moe_heap_select(q, k, E);
            for (int64_t last = k; last > 1; last--) moe_pop_heap(q, last - 1, q + last - 1);
        } else {
            moe_nth_element(q, k - 1, E);
            moe_insertion_sort(q, k - 1);
        }
        float v[64];
        for (int64_t j = 0; j < k; j++) v[j] = q[j].v;
        if (scoring == MOE_TOPK_SOFTMAX) moe_softmax(v, k);
        else if (renorm) {
            float sum = 0.f;
            for (int64_t j = 0; j < k; j++) sum += v[j];
            for (int64_t j = 0; j < k; j++) v[j] = v[j] / sum;
        }
        float *wb = w + b * k;
        int64_t *ib = ids + b * k;
        for (int64_t j = 0; j < k; j++) { /* ascending id: insertion by index */
            int64_t at = j;
            while (at > 0 && ib[at - 1] > q[j].i) {
                ib[at] = ib[at - 1];
                wb[at] = wb[at - 1];
                at--;
            }
            ib[at] = q[j].i;
            wb[at] = v[j];
        }
    }
    free(q);
    free(p);
    return 0;
}

/* y = 1 / (1 + exp(-x)) for n floats (the shared expert's gate) */
void sigmoid_f32(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = 1.f / (1.f + expf(-x[i]));
}
/* ============================================ end of moe route ========================================= */
