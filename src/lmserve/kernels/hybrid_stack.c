/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */
/* ==================================================================================================== *
 * The hybrid models' layers in the decode stack (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).                    *
 * ==================================================================================================== *
 *
 * Three of four layers mix tokens by Gated DeltaNet (a recurrent state per sequence, lmserve/model/
 * linear_attention.py), the rest by gated full attention (q with an output gate, q/k RMSNorm per head, partial
 * rotary: lmserve/model/layers/gated_attention.py). gdn_decode_f32 and rope_partial_write_kv are also what those
 * modules call for their decode rows, so the stack's layers compute the module path's bits; decode_stack runs the
 * norms, the residual stream and the feed-forwards around them as for every other layer.
 */

/* A Gated DeltaNet layer: its projections, conv, gates, gated norm and its state tensors (every field 8 bytes;
 * model/hybrid_stack.py's _GDN mirrors it). */
struct ls_gdn {
    int64_t num_k_heads, num_v_heads, k_dim, v_dim, conv_kernel, fused;
    ls_linear in[4];                      /* fused (Qwen3-Next): in_proj_qkvz, in_proj_ba; else qkv, z, b, a */
    ls_linear out;                        /* out_proj */
    const int64_t *qkvz_order, *ba_order; /* fused: the rows of qkvz / ba in Qwen3.5's order (q k v z / b a) */
    const float *conv_w, *A_log, *dt_bias, *norm_w; /* (conv_dim, kernel), (Hv), (Hv), (v_dim) */
    float *conv_state, *ssm;                        /* (slots, conv_dim, kernel - 1), (slots, Hv, K, V) */
    double eps;                                     /* the gated norm's */
};

/* The decode rows of a Gated DeltaNet layer after its input projections: beta = sigmoid(b) and g = -exp(A_log) *
 * softplus(a + dt_bias) per value head, the conv update and silu (gdn_conv_decode_f32), the delta rule
 * (gdn_recurrent_decode_f32) on the slots' states in place, then RMSNorm over each value head times silu(z) (HF's
 * Qwen3_5RMSNormGated, weight as is). mixed (B, conv_dim), z (B, Hv V), b, a (B, Hv): rows *_stride floats apart;
 * out (B, Hv V). No contraction into FMAs, as torch rounds each product. Returns 0, or -1 without scratch memory. */
__attribute__((optimize("fp-contract=off"))) int gdn_decode_f32(
    const float *mixed, int64_t mixed_stride, const float *z, int64_t z_stride, const float *bv, int64_t b_stride,
    const float *av, int64_t a_stride, const float *A_log, const float *dt_bias, const float *conv_w,
    const float *norm_w, float eps, float *conv_state, float *ssm, const int64_t *slots, float *out, int64_t B,
    int64_t Hk, int64_t Hv, int64_t K, int64_t V, int64_t W, int nthreads) {
    const int64_t C = 2 * Hk * K + Hv * V;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(B * (2 * C + 2 * Hv + Hv * V)));
    if (!buf) return -1;
    float *x = buf, *conv = x + B * C, *g = conv + B * C, *beta = g + B * Hv, *core = beta + B * Hv;
    for (int64_t r = 0; r < B; r++) {
        memcpy(x + r * C, mixed + r * mixed_stride, sizeof(float) * (size_t)C);
        for (int64_t h = 0; h < Hv; h++) {
            beta[r * Hv + h] = 1.f / (1.f + expf(-bv[r * b_stride + h]));
            float sp = av[r * a_stride + h] + dt_bias[h];
            sp = sp > 20.f ? sp : log1pf(expf(sp)); /* torch's softplus (beta 1, threshold 20) */
            g[r * Hv + h] = -expf(A_log[h]) * sp;
        }
    }
    gdn_conv_decode_f32(x, conv_state, slots, conv_w, conv, B, C, W, nthreads);
    gdn_recurrent_decode_f32(conv, conv + Hk * K, conv + 2 * Hk * K, g, beta, ssm, slots, core, B, Hk, Hv, K, V, C, C,
                             nthreads);
    for (int64_t r = 0; r < B; r++)
        for (int64_t h = 0; h < Hv; h++) {
            const float *c = core + (r * Hv + h) * V, *zr = z + r * z_stride + h * V;
            float ss = 0.f;
            for (int64_t i = 0; i < V; i++) ss += c[i] * c[i];
            const float inv = 1.f / sqrtf(ss / (float)V + eps);
            float *o = out + (r * Hv + h) * V;
#pragma omp simd
            for (int64_t i = 0; i < V; i++) o[i] = (norm_w[i] * (c[i] * inv)) * (zr[i] / (1.f + exp_f32(-zr[i])));
        }
    free(buf);
    return 0;
}

/* the first 2 * half dimensions of one head turned (rotate-half), each product rounded as torch rounds it, no FMA (a
 * function of its own: an OpenMP region's outlined body need not keep its parent's optimize attribute) */
__attribute__((noinline, optimize("fp-contract=off"))) static void rope_partial_head(float *x, const float *c,
                                                                                    const float *s, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] + (-x2) * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
}

/* rope_write_kv_f32 / rope_write_kv_q with partial rotary: the first rd of each head's D dimensions turn (cos, sin
 * (T, rd), rotate-half within them), the rest pass through, as lmserve/model/layers/rotary.apply_rotary computes;
 * then k, v rows into the caches at slots[t]: kind -1 float32, else kv_quant.c's. */
void rope_partial_write_kv(
    float *q, int64_t q_stride, float *k, int64_t k_stride, const float *v, int64_t v_stride, const float *cos,
    const float *sin, int64_t rd, void *k_cache, void *v_cache, float *k_scale, float *v_scale, const int64_t *slots,
    int64_t T, int64_t H, int64_t KVH, int64_t D, int kind, int nthreads) {
    const int64_t half = rd / 2, esize = kind < 0 ? 4 : kind == KV_BF16 ? 2 : 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * rd, *s = sin + t * rd;
        for (int64_t h = 0; h < H + KVH; h++)
            rope_partial_head(h < H ? q + t * q_stride + h * D : k + t * k_stride + (h - H) * D, c, s, half);
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t row = slots[t] * KVH + h; /* (slot, head) row of D elements; scales are indexed by it */
            const float *kr = k + t * k_stride + h * D, *vr = v + t * v_stride + h * D;
            char *kd = (char *)k_cache + row * D * esize, *vd = (char *)v_cache + row * D * esize;
            if (kind < 0) {
                memcpy(kd, kr, sizeof(float) * (size_t)D);
                memcpy(vd, vr, sizeof(float) * (size_t)D);
            } else {
                kv_store_row(kr, kd, k_scale ? k_scale + row : NULL, D, kind);
                kv_store_row(vr, vd, v_scale ? v_scale + row : NULL, D, kind);
            }
        }
    }
}

/* floats per decode row the hybrid layers of m need as scratch (decode_stack allocates them with its own) */
static int64_t ls_hybrid_scratch(const ls_model *m) {
    const int64_t qs = m->heads * m->head_dim, kvs = m->kv_heads * m->head_dim;
    int64_t most = 0;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const ls_layer *L = m->layers + l;
        int64_t n = 0;
        if (L->mixer == LS_MIX_GATED) n = 5 * qs + 3 * kvs;
        if (L->mixer == LS_MIX_LINEAR) {
            const struct ls_gdn *g = L->gdn;
            const int64_t vs = g->num_v_heads * g->v_dim, C = 2 * g->num_k_heads * g->k_dim + vs;
            n = 2 * C + 3 * vs + 2 * g->num_v_heads;
        }
        most = n > most ? n : most;
    }
    return most;
}

/* ob (B, hidden) = o_proj(attention(q) * sigmoid(gate)): GatedAttention.forward on the decode rows x (B, hidden) */
__attribute__((optimize("fp-contract=off"))) static int ls_gated_attention(
    const ls_model *m, const ls_layer *L, const float *x, float *ob, const float *cos, const float *sin,
    const int64_t *slots, const int64_t *tables, const int64_t *lens, int64_t B, int64_t max_blocks, float *buf,
    int nthreads) {
    const int64_t NH = m->heads, KVH = m->kv_heads, D = m->head_dim, qs = NH * D, kvs = KVH * D;
    const int64_t w = 2 * qs + 2 * kvs; /* q_proj's rows: each head's query then its gate; then k, v */
    const float eps = (float)m->eps;
    float *qkv = buf, *q = qkv + B * w, *gate = q + B * qs, *k = gate + B * qs, *attn = k + B * kvs;
    if (ls_linear_run(&L->qkv, x, qkv, B, nthreads)) return -1;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < NH; h++) {
            memcpy(q + b * qs + h * D, qkv + b * w + 2 * h * D, sizeof(float) * (size_t)D);
            memcpy(gate + b * qs + h * D, qkv + b * w + 2 * h * D + D, sizeof(float) * (size_t)D);
        }
        memcpy(k + b * kvs, qkv + b * w + 2 * qs, sizeof(float) * (size_t)kvs);
    }
    rmsnorm_f32(q, NULL, L->q_norm, q, B * NH, D, eps, nthreads);
    rmsnorm_f32(k, NULL, L->k_norm, k, B * KVH, D, eps, nthreads);
    const float *v = qkv + 2 * qs + kvs; /* (the kernels kernels.rope_write_kv picks for this rotary width) */
    if (m->rotary_dim < D)
        rope_partial_write_kv(q, qs, k, kvs, v, w, cos, sin, m->rotary_dim, L->k_cache, L->v_cache, L->k_scale,
                              L->v_scale, slots, B, NH, KVH, D, (int)m->kv_kind, nthreads);
    else if (m->kv_kind < 0)
        rope_write_kv_f32(q, qs, k, kvs, v, w, cos, sin, (float *)L->k_cache, (float *)L->v_cache, slots, B, NH, KVH,
                          D, nthreads);
    else
        rope_write_kv_q(q, qs, k, kvs, v, w, cos, sin, L->k_cache, L->v_cache, L->k_scale, L->v_scale, slots, B, NH,
                        KVH, D, (int)m->kv_kind, nthreads);
    if (m->kv_kind < 0)
        paged_decode_attention(q, (const float *)L->k_cache, (const float *)L->v_cache, tables, lens, attn, B, NH, KVH,
                               D, m->block_size, max_blocks, (float)m->scale, L->window, NULL, nthreads);
    else
        paged_decode_attention_q(q, L->k_cache, L->v_cache, L->k_scale, L->v_scale, tables, lens, attn, B, NH, KVH, D,
                                 m->block_size, max_blocks, (float)m->scale, L->window, NULL, (int)m->kv_kind,
                                 nthreads);
    sigmoid_f32(gate, gate, B * qs);
    for (int64_t i = 0; i < B * qs; i++) attn[i] = attn[i] * gate[i];
    return ls_linear_run(&L->o, attn, ob, B, nthreads);
}

/* rows (B, n) = src (B, width) columns order[0..n) */
static void ls_gather_cols(const float *src, int64_t width, const int64_t *order, float *dst, int64_t B, int64_t n) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < n; j++) dst[b * n + j] = src[b * width + order[j]];
}

/* ob (B, hidden) = GatedDeltaNet.forward on the decode rows x (B, hidden), each on its state slot m->state_slots[b] */
static int ls_linear_attention(const ls_model *m, const ls_layer *L, const float *x, float *ob, int64_t B, float *buf,
                               int nthreads) {
    const struct ls_gdn *g = L->gdn;
    const int64_t Hk = g->num_k_heads, Hv = g->num_v_heads, K = g->k_dim, V = g->v_dim, vs = Hv * V;
    const int64_t C = 2 * Hk * K + vs;
    float *mixed = buf, *z = mixed + B * C, *b = z + B * vs, *a = b + B * Hv, *tmp = a + B * Hv;
    float *core = tmp + B * (C + vs);
    /* the input projections of x in one region where their kernels allow it (ls_linear_run_many) */
    const ls_linear *in[4] = {&g->in[0], &g->in[1], &g->in[2], &g->in[3]};
    const float *xs[4] = {x, x, x, x};
    const int64_t Ms[4] = {B, B, B, B};
    if (g->fused) { /* qkvz into tmp, ba into core (free until the delta rule), then in Qwen3.5's order (gathers) */
        float *outs[2] = {tmp, core};
        if (ls_linear_run_many(in, xs, outs, Ms, 2, nthreads)) return -1;
        ls_gather_cols(tmp, C + vs, g->qkvz_order, mixed, B, C);
        ls_gather_cols(tmp, C + vs, g->qkvz_order + C, z, B, vs);
        ls_gather_cols(core, 2 * Hv, g->ba_order, b, B, Hv);
        ls_gather_cols(core, 2 * Hv, g->ba_order + Hv, a, B, Hv);
    } else {
        float *outs[4] = {mixed, z, b, a};
        if (ls_linear_run_many(in, xs, outs, Ms, 4, nthreads)) return -1;
    }
    if (gdn_decode_f32(mixed, C, z, vs, b, Hv, a, Hv, g->A_log, g->dt_bias, g->conv_w, g->norm_w, (float)g->eps,
                       g->conv_state, g->ssm, m->state_slots, core, B, Hk, Hv, K, V, g->conv_kernel, nthreads))
        return -1;
    return ls_linear_run(&g->out, core, ob, B, nthreads);
}

static int ls_hybrid_mixer(const ls_model *m, const ls_layer *L, const float *x, float *ob, const float *cos,
                           const float *sin, const int64_t *slots, const int64_t *tables, const int64_t *lens,
                           int64_t B, int64_t max_blocks, float *scratch, int nthreads) {
    if (L->mixer == LS_MIX_LINEAR) return ls_linear_attention(m, L, x, ob, B, scratch, nthreads);
    return ls_gated_attention(m, L, x, ob, cos, sin, slots, tables, lens, B, max_blocks, scratch, nthreads);
}
/* ========================================== end of hybrid_stack ========================================== */
