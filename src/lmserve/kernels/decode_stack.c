/* Part of the one kernel library: compiled inside cpu_kernels.c, after the files it #includes before it. */
/* ==================================================================================================== *
 * The decoder stack of a decode step in one call (decode_stack).                                        *
 * ==================================================================================================== *
 *
 * A pure decode step of a few rows spends as long in Python between the kernels above (module calls,
 * argument checks, ctypes, ~9 calls a layer) as in some of the kernels themselves: ~270 us a layer on the
 * benchmark model. decode_stack runs every layer of a plain pre-norm Llama-family decoder (RMSNorm, fused qkv,
 * RoPE, paged attention (with sinks: gpt-oss), o, RMSNorm, gate_up, SiLU*up, down, or a MoE block) and the final
 * norm by calling the same kernels in the same order with the same arguments as the module path does, so its output is
 * bit-identical to the module path. The Python side (lmserve/model/decode_stack.py) fills the layer
 * descriptions once and checks which models and steps qualify.
 */
enum { LS_F32 = 0, LS_BF16W = 1, LS_I8 = 2, LS_I4 = 3, LS_I8W = 4, LS_KQ = 5, LS_W4A8 = 6, LS_W5A8 = 7, LS_W8A8 = 8,
       LS_MXFP4 = 9 };

/* one projection; every field 8 bytes (the ctypes Structure mirrors it). LS_KQ (GGUF K-quants): scales points at
 * the (G, 3) int64 segment table linear_kq_f32 reads, G its row count. */
typedef struct {
    int64_t kind, O, K, G;
    const void *w, *scales, *mins, *row_sums;
    const float *bias;
    int64_t isa; /* LS_W4A8: the W4A8_* path, LS_MXFP4: the MX_* one (the Python side resolved it once) */
} ls_linear;

/* A layer's mixture-of-experts block (in place of gate_up / down): SparseMoE's few-row path (ls_moe_run). */
typedef struct {
    int64_t num_experts, top_k, scoring, renormalize, inter, shared_inter; /* scoring: MOE_SOFTMAX_TOPK / ... */
    const float *router_w, *router_b, *shared_gate;                         /* shared_gate (1, hidden) */
    const ls_linear *gate_up, *down;               /* num_experts each */
    const ls_linear *shared_gate_up, *shared_down; /* NULL: no shared expert */
    int64_t *counts;                               /* NULL, or (num_experts,): rows routed to each, added to */
    int64_t clamped;                               /* 1: gpt-oss's clamped SwiGLU (alpha, limit), 0: SwiGLU */
    double alpha, limit;
} ls_moe;

enum { LS_QK_NONE = 0, LS_QK_HEAD = 1, LS_QK_WHOLE = 2 };
/* ls_layer.mixer: Llama's attention, or a hybrid's gated attention / Gated DeltaNet (hybrid_stack.c) */
enum { LS_MIX_ATTENTION = 0, LS_MIX_GATED = 1, LS_MIX_LINEAR = 2 };
struct ls_gdn; /* a Gated DeltaNet layer's description (hybrid_stack.c) */

typedef struct {
    const float *in_norm, *post_norm;
    void *k_cache, *v_cache;
    float *k_scale, *v_scale; /* int8 / fp8 caches only */
    int64_t window;           /* 0: full attention */
    ls_linear qkv, o, gate_up, down;
    int64_t qk_norm;                 /* LS_QK_*: RMSNorm of q and k per head (Qwen3) or over the projection (OLMoE) */
    const float *q_norm, *k_norm;    /* their weights */
    const ls_moe *moe;               /* NULL: the dense MLP (gate_up, down) */
    const float *sinks;              /* NULL, or (heads,): gpt-oss's attention sinks */
    int64_t mixer;                   /* LS_MIX_*; gated: qkv is q_proj's (query, gate) per head, then k, v */
    const struct ls_gdn *gdn;        /* LS_MIX_LINEAR: the layer (qkv, o and the caches unused) */
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
    int64_t rotary_dim;                   /* cos / sin row width: head_dim, or a gated layer's partial rotary */
    const int64_t *state_slots;           /* (B,): each row's state slot in the Gated DeltaNet layers (or NULL) */
} ls_model;

/* hybrid_stack.c: the scratch floats per row its layers need; ob (B, hidden) = layer L's mixer (gated attention or
 * Gated DeltaNet) on x. Returns 0, or -1 without scratch memory. */
static int64_t ls_hybrid_scratch(const ls_model *m);
static int ls_hybrid_mixer(const ls_model *m, const ls_layer *L, const float *x, float *ob, const float *cos,
                           const float *sin, const int64_t *slots, const int64_t *tables, const int64_t *lens,
                           int64_t B, int64_t max_blocks, float *scratch, int nthreads);

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
    case LS_MXFP4: /* gpt-oss's experts: w the blocks, scales the e8m0 bytes */
        return linear_mxfp4_f32(x, (const uint8_t *)l->w, (const uint8_t *)l->scales, l->bias, y, M, l->O, l->K,
                                (int)l->isa, nthreads);
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

/* ys[i] (Ms[i], O) = ls[i] of xs[i] for n projections: one linear_w4a8_multi_f32 region when all are W4A8 panels
 * of one kind, K, path and mins-ness (the same bits as one call each), else ls_linear_run each. Returns as it. */
static int ls_linear_run_many(const ls_linear *const *ls, const float *const *xs, float *const *ys, const int64_t *Ms,
                              int64_t n, int nthreads) {
    int multi = n > 1;
    for (int64_t i = 0; multi && i < n; i++) {
        const ls_linear *l = ls[i];
        multi = (l->kind == LS_W4A8 || l->kind == LS_W5A8 || l->kind == LS_W8A8) && l->kind == ls[0]->kind &&
                l->K == ls[0]->K && l->isa == ls[0]->isa && (l->mins != NULL) == (ls[0]->mins != NULL);
    }
    if (!multi) {
        for (int64_t i = 0; i < n; i++)
            if (Ms[i] && ls_linear_run(ls[i], xs[i], ys[i], Ms[i], nthreads)) return -1;
        return 0;
    }
    w4a8_job *jobs = (w4a8_job *)malloc(sizeof(w4a8_job) * (size_t)n);
    if (!jobs) return -1;
    for (int64_t i = 0; i < n; i++) {
        const ls_linear *l = ls[i];
        jobs[i] = (w4a8_job){xs[i], (const uint8_t *)l->w, (const uint16_t *)l->scales, (const uint16_t *)l->mins,
                             l->bias, ys[i], Ms[i], l->O, l->G};
    }
    const int bits = ls[0]->kind == LS_W4A8 ? 4 : ls[0]->kind == LS_W5A8 ? 5 : 8;
    const int rc = linear_w4a8_multi_f32(jobs, n, ls[0]->K, bits, (int)ls[0]->isa, nthreads);
    free(jobs);
    return rc;
}

/* out (B, Hd) = the MoE block of x (B, Hd) as SparseMoE.forward computes it on few rows (model/layers/moe.py): the
 * router's logits by linear_f32, moe_route_f32, each chosen expert once on its rows (token order) through the same
 * kernels as its Linears, its output times the router weight into the row's (token, slot), each token's k slots
 * summed in ascending expert id; then out + sigmoid(gate x) * shared(x). No contraction into FMAs: torch rounds
 * every product and sum on its own. Returns 0, or -1 when the scratch could not be allocated. */
__attribute__((optimize("fp-contract=off"))) static int ls_moe_run(const ls_moe *e, const float *x, float *out,
                                                                    int64_t B, int64_t Hd, int nthreads) {
    const int64_t E = e->num_experts, k = e->top_k, S = e->shared_inter, I = e->inter, Bk = B * k;
    const int64_t W = I > S ? I : S;
    const size_t nf = (size_t)(B * E + Bk + 2 * Bk * Hd + 3 * Bk * W + Bk * Hd + B);
    float *buf = (float *)malloc(sizeof(float) * nf);
    int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * Bk + 2 * E));
    /* per chosen expert: its weights, rows' inputs and outputs (one region over all experts when they allow it) */
    const ls_linear **lin = (const ls_linear **)malloc(sizeof(void *) * (size_t)(2 * E));
    const float **xs = (const float **)malloc(sizeof(void *) * (size_t)(2 * E));
    float **ys = (float **)malloc(sizeof(void *) * (size_t)(2 * E));
    int rc = -1;
    if (!buf || !ids || !lin || !xs || !ys) goto done;
    float *logits = buf, *w = logits + B * E, *xg = w + Bk, *gu = xg + Bk * Hd, *act = gu + 2 * Bk * W;
    float *y = act + Bk * W, *slots = y + Bk * Hd, *g = slots + Bk * Hd;
    int64_t *rows = ids + Bk, *chosen = rows + Bk, *ns = chosen + E, na = 0;
    linear_f32(x, e->router_w, e->router_b, logits, B, E, Hd, nthreads);
    if (moe_route_f32(logits, B, E, k, (int)e->scoring, (int)e->renormalize, w, ids)) goto done;
    int64_t nr = 0; /* rows[]: every (token, slot), grouped by expert in ascending id, token order within */
    for (int64_t ex = 0; ex < E; ex++) {
        int64_t n = 0;
        for (int64_t r = 0; r < Bk; r++)
            if (ids[r] == ex) rows[nr + n++] = r; /* a token picks an expert once */
        if (!n) continue;
        if (e->counts) e->counts[ex] += n;
        chosen[na] = ex, ns[na++] = n;
        nr += n;
    }
    for (int64_t r = 0; r < Bk; r++) memcpy(xg + r * Hd, x + (rows[r] / k) * Hd, sizeof(float) * (size_t)Hd);
    for (int64_t a = 0, r0 = 0; a < na; r0 += ns[a++]) {
        lin[a] = e->gate_up + chosen[a], xs[a] = xg + r0 * Hd, ys[a] = gu + r0 * 2 * I;
        lin[na + a] = e->down + chosen[a], xs[na + a] = act + r0 * I, ys[na + a] = y + r0 * Hd;
    }
    if (ls_linear_run_many(lin, xs, ys, ns, na, nthreads)) goto done;
    if (e->clamped) /* (row by row: every expert's rows in one call are the same bits as a call each) */
        swiglu_clamped_f32(gu, act, Bk, I, (float)e->alpha, (float)e->limit, nthreads);
    else
        silu_mul_f32(gu, act, Bk, I, nthreads);
    if (ls_linear_run_many(lin + na, xs + na, ys + na, ns, na, nthreads)) goto done;
    for (int64_t r = 0; r < Bk; r++) {
        const float wt = w[rows[r]], *yr = y + r * Hd;
        float *s = slots + rows[r] * Hd;
        for (int64_t i = 0; i < Hd; i++) s[i] = yr[i] * wt;
    }
    for (int64_t t = 0; t < B; t++) {
        float *o = out + t * Hd;
        memcpy(o, slots + t * k * Hd, sizeof(float) * (size_t)Hd);
        for (int64_t j = 1; j < k; j++) {
            const float *s = slots + (t * k + j) * Hd;
            for (int64_t i = 0; i < Hd; i++) o[i] = o[i] + s[i];
        }
    }
    if (e->shared_gate_up) {
        if (ls_linear_run(e->shared_gate_up, x, gu, B, nthreads)) goto done;
        silu_mul_f32(gu, act, B, S, nthreads);
        if (ls_linear_run(e->shared_down, act, y, B, nthreads)) goto done;
        linear_f32(x, e->shared_gate, NULL, g, B, 1, Hd, nthreads);
        sigmoid_f32(g, g, B);
        for (int64_t t = 0; t < B; t++) {
            float *o = out + t * Hd, *yr = y + t * Hd;
            for (int64_t i = 0; i < Hd; i++) yr[i] = g[t] * yr[i];
            for (int64_t i = 0; i < Hd; i++) o[i] = o[i] + yr[i];
        }
    }
    rc = 0;
done:
    free(buf);
    free(ids);
    free(lin);
    free(xs);
    free(ys);
    return rc;
}

/* the module path's (T, 1, ...) entry to ls_moe_run: SparseMoE's few-row forward (the same bits as the stack's) */
int moe_block_f32(const ls_moe *e, const float *x, float *out, int64_t B, int64_t Hd, int nthreads) {
    return ls_moe_run(e, x, out, B, Hd, nthreads);
}

/* q (B, qw) → qn (B, qw) normed per head (rows of D) or over the whole row, as Attention.forward norms q / k */
static void ls_qk_norm(int64_t mode, const float *src, int64_t stride, float *dst, int64_t B, int64_t width,
                       int64_t D, const float *w, float eps, int nthreads) {
    for (int64_t b = 0; b < B; b++) memcpy(dst + b * width, src + b * stride, sizeof(float) * (size_t)width);
    if (mode == LS_QK_HEAD) rmsnorm_f32(dst, NULL, w, dst, B * (width / D), D, eps, nthreads);
    else rmsnorm_f32(dst, NULL, w, dst, B, width, eps, nthreads);
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
    const int64_t n = B * (4 * Hd + qkvw + 2 * qs + 3 * I + kvs + ls_hybrid_scratch(m));
    float *buf = (float *)malloc(sizeof(float) * (size_t)n);
    if (!buf) return -1;
    int rc = -1;
    float *res = buf, *x = res + B * Hd, *hb = x + B * Hd, *ob = hb + B * Hd, *qkv = ob + B * Hd;
    float *q = qkv + B * qkvw, *attn = q + B * qs, *gu = attn + B * qs, *act = gu + 2 * B * I;
    float *kn = act + B * I; /* k normed (q normed goes to q) */
    float *hyb = kn + B * kvs; /* the hybrid layers' scratch */
    for (int64_t l = 0; l < m->num_layers; l++) {
        const ls_layer *L = m->layers + l;
        if (l == 0) { /* the residual stream starts as the embeddings */
            memcpy(res, h, sizeof(float) * (size_t)(B * Hd));
            rmsnorm_f32(h, NULL, L->in_norm, x, B, Hd, eps, nthreads);
        } else {
            rmsnorm_f32(hb, res, L->in_norm, x, B, Hd, eps, nthreads);
        }
        if (L->mixer != LS_MIX_ATTENTION) { /* a hybrid's layer (no LoRA, one rank: the engine refuses both) */
            if (ls_hybrid_mixer(m, L, x, ob, cos, sin, slots, tables, lens, B, max_blocks, hyb, nthreads)) {
                rc = -1;
                goto fail;
            }
        } else {
            if (ls_linear_run(&L->qkv, x, qkv, B, nthreads)) goto fail;
            if (m->lora && ls_lora_add(m->lora, l, 0, x, qkv, nthreads)) goto fail;
            /* q / k rows: in qkv (token stride qkvw), or normed into q / kn (strides qs / kvs) */
            float *qp = qkv, *kp = qkv + qs;
            int64_t qst = qkvw, kst = qkvw;
            if (L->qk_norm) {
                ls_qk_norm(L->qk_norm, qkv, qkvw, q, B, qs, D, L->q_norm, eps, nthreads);
                ls_qk_norm(L->qk_norm, qkv + qs, qkvw, kn, B, kvs, D, L->k_norm, eps, nthreads);
                qp = q, kp = kn, qst = qs, kst = kvs;
            }
            if (m->kv_kind < 0)
                rope_write_kv_f32(qp, qst, kp, kst, qkv + qs + kvs, qkvw, cos, sin, (float *)L->k_cache,
                                  (float *)L->v_cache, slots, B, NH, KVH, D, nthreads);
            else
                rope_write_kv_q(qp, qst, kp, kst, qkv + qs + kvs, qkvw, cos, sin, L->k_cache, L->v_cache, L->k_scale,
                                L->v_scale, slots, B, NH, KVH, D, (int)m->kv_kind, nthreads);
            if (!L->qk_norm)
                for (int64_t b = 0; b < B; b++) memcpy(q + b * qs, qkv + b * qkvw, sizeof(float) * (size_t)qs);
            if (m->kv_kind < 0)
                paged_decode_attention(q, (const float *)L->k_cache, (const float *)L->v_cache, tables, lens, attn, B,
                                       NH, KVH, D, m->block_size, max_blocks, scale, L->window, L->sinks, nthreads);
            else
                paged_decode_attention_q(q, L->k_cache, L->v_cache, L->k_scale, L->v_scale, tables, lens, attn, B,
                                         NH, KVH, D, m->block_size, max_blocks, scale, L->window, L->sinks,
                                         (int)m->kv_kind, nthreads);
            if (ls_linear_run(&L->o, attn, ob, B, nthreads)) goto fail;
            if (m->lora && ls_lora_add(m->lora, l, 1, attn, ob, nthreads)) goto fail;
        }
        if (m->allreduce && (rc = ls_all_reduce(m->allreduce, ob, B * Hd))) goto fail;
        rmsnorm_f32(ob, res, L->post_norm, x, B, Hd, eps, nthreads);
        if (L->moe) {
            if (ls_moe_run(L->moe, x, hb, B, Hd, nthreads)) {
                rc = -1; /* (rc may hold an earlier all-reduce's 0) */
                goto fail;
            }
            if (m->allreduce && (rc = ls_all_reduce(m->allreduce, hb, B * Hd))) goto fail;
            continue;
        }
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
