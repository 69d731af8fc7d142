/* The kernels of cpu_decode.c for one activation dtype: T the stored type, LOAD / STORE convert to and from
 * float, ROUND(f) is f rounded to T and back (what a cast to T and back does in torch). Included once per
 * dtype; SUFFIX names the variant. */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(n) CAT(n, SUFFIX)

/* The RMSNorm of one row of `dim` values into `out`, as transformers: x * rsqrt(mean(x^2) + eps) in fp32,
 * then (Llama) cast to T and times weight, or (with_offset, Gemma) times (offset + weight) in fp32, then cast. */
static inline void NAME(norm_row)(const T *x, const T *weight, T *out, int64_t dim, float eps, float offset,
                                  int with_offset) {
    float lanes[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= dim; j += 16)
        for (int l = 0; l < 16; l++) {
            float v = LOAD(x[j + l]);
            lanes[l] += v * v;
        }
    float squares = 0.0f;
    for (int l = 0; l < 16; l++) squares += lanes[l];
    for (; j < dim; j++) {
        float v = LOAD(x[j]);
        squares += v * v;
    }
    float rstd = 1.0f / sqrtf(squares / (float)dim + eps);
    if (with_offset) {
        for (j = 0; j < dim; j++) out[j] = STORE(LOAD(x[j]) * rstd * (offset + LOAD(weight[j])));
    } else {
        for (j = 0; j < dim; j++) out[j] = STORE(ROUND(LOAD(x[j]) * rstd) * LOAD(weight[j]));
    }
}

/* out = RMSNorm(x) row by row over [rows, dim]; with `delta`, first x += delta in place (the residual add,
 * rounded to T as torch's add), so a layer's residual update and its next norm are one pass. */
void NAME(mrl_rms_norm)(T *x, const T *delta, const T *weight, T *out, int64_t rows, int64_t dim, float eps,
                        float offset, int with_offset, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= 16384)
    for (int64_t r = 0; r < rows; r++) {
        T *row = x + r * dim;
        if (delta) {
            const T *d = delta + r * dim;
            for (int64_t j = 0; j < dim; j++) row[j] = STORE(LOAD(row[j]) + LOAD(d[j]));
        }
        NAME(norm_row)(row, weight, out + r * dim, dim, eps, offset, with_offset);
    }
}

/* The gated MLP's activation of gate_up [rows, 2 * ffn] (gate | up) into out [rows, ffn]: act(gate) cast to
 * T, times up (transformers' act_fn(gate_proj(x)) * up_proj(x)); act SiLU x / (1 + e^-x) or GeGLU's
 * tanh-approximated GELU 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as torch writes them. */
void NAME(mrl_gated_act)(const T *gate_up, int64_t rows, int64_t ffn, int act, T *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * ffn >= 16384)
    for (int64_t r = 0; r < rows; r++) {
        const T *gate = gate_up + r * 2 * ffn, *up = gate + ffn;
        T *o = out + r * ffn;
        if (act == ACT_SILU) {
            for (int64_t j = 0; j < ffn; j++) {
                float g = LOAD(gate[j]);
                o[j] = STORE(ROUND(g / (1.0f + exp_approx(-g))) * LOAD(up[j]));
            }
        } else {
            for (int64_t j = 0; j < ffn; j++) {
                float g = LOAD(gate[j]);
                float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
                o[j] = STORE(ROUND(0.5f * g * (1.0f + tanh_approx(inner))) * LOAD(up[j]));
            }
        }
    }
}

/* The attention inputs of a step, from qkv [n, (heads + 2 kv_heads) * d] (q | k | v): per head the optional
 * RMSNorm (Qwen3's q_norm / k_norm), then rotate-half RoPE over the first `rot` dims, as transformers:
 * x * cos + rotate_half(x) * sin, each product cast to T, then the sum (cos / sin [n, rot] in T). The rotated
 * q goes to q_out [n, heads, d]; each token's rotated k and its v go straight to the KV cache, row
 * cache_rows[token * kv_heads + g] of the caches seen as [rows, d]. */
void NAME(mrl_rope_qkv)(const T *qkv, int64_t n, int64_t heads, int64_t kv_heads, int64_t d, int64_t rot,
                        const T *cos, const T *sin, const T *q_norm, const T *k_norm, float eps, float offset,
                        int with_offset, T *q_out, T *k_cache, T *v_cache, const int64_t *cache_rows,
                        int threads) {
    int64_t width = (heads + 2 * kv_heads) * d, per_token = heads + 2 * kv_heads, half = rot / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * width >= 16384)
    for (int64_t i = 0; i < n * per_token; i++) {
        int64_t token = i / per_token, h = i % per_token;
        const T *src = qkv + token * width + h * d;
        if (h >= heads + kv_heads) { /* v: copied to its cache row */
            T *dst = v_cache + cache_rows[token * kv_heads + (h - heads - kv_heads)] * d;
            memcpy(dst, src, (size_t)d * sizeof(T));
            continue;
        }
        T *dst = h < heads ? q_out + (token * heads + h) * d : k_cache + cache_rows[token * kv_heads + h - heads] * d;
        const T *norm = h < heads ? q_norm : k_norm;
        T normed[1024];
        const T *x = src;
        if (norm) {
            NAME(norm_row)(src, norm, normed, d, eps, offset, with_offset);
            x = normed;
        }
        const T *restrict c = cos + token * rot, *restrict s = sin + token * rot;
        const T *restrict xr = x;
        T *restrict o = dst;
        for (int64_t j = 0; j < half; j++)
            o[j] = STORE(ROUND(LOAD(xr[j]) * LOAD(c[j])) + ROUND(-LOAD(xr[j + half]) * LOAD(s[j])));
        for (int64_t j = half; j < rot; j++)
            o[j] = STORE(ROUND(LOAD(xr[j]) * LOAD(c[j])) + ROUND(LOAD(xr[j - half]) * LOAD(s[j])));
        for (int64_t j = rot; j < d; j++) o[j] = xr[j];
    }
}

/* Attention's dot products and weighted sums may use fused multiply-adds (no torch expression fixes their
 * rounding order). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

/* LANES consecutive values of T as fp32 lanes (bf16: the bits shifted into the high half, exact). */
static inline vf NAME(loadv)(const T *p) {
#if IS_FLOAT
    return loadv(p);
#else
    vi wide = __builtin_convertvector(*(const vu16_unaligned *)p, vi) << 16;
    return (vf)wide;
#endif
}

/* out[l] = q . rows[l] for LANES rows of `width` values (a multiple of 16): one vector of partial sums per row,
 * folded into one vector by `fold_lanes`, so no row pays a horizontal sum of its own. */
static inline void NAME(dot_rows)(const float *restrict q, const T *const *rows, int64_t width, float *restrict out) {
    vf partial[LANES];
    for (int l = 0; l < LANES; l++) {
        vf acc = {0};
        for (int64_t j = 0; j < width; j += LANES) acc += loadv(q + j) * NAME(loadv)(rows[l] + j);
        partial[l] = acc;
    }
    *(vf_unaligned *)out = fold_lanes(partial);
}

/* acc[h][c0 + LANES k] += sum_t p[h][t] v_t[c0 + LANES k] for 4 heads (score rows `stride` apart) and `vectors`
 * (VALUE_VECTORS or 1) vectors of columns: the accumulators stay in registers over the whole span. */
static inline void NAME(weighted_values)(const float *restrict p, int64_t stride, const T *values, int64_t v_row,
                                         int64_t span, int64_t c0, int vectors, float *restrict acc, int64_t dv) {
    vf a[4][VALUE_VECTORS] = {{{0}}};
    if (vectors == VALUE_VECTORS) {
        for (int64_t t = 0; t < span; t++) {
            const T *v = values + t * v_row + c0;
            vf row[VALUE_VECTORS];
            for (int k = 0; k < VALUE_VECTORS; k++) row[k] = NAME(loadv)(v + LANES * k);
            for (int h = 0; h < 4; h++) {
                vf w = splat(p + h * stride + t);
                for (int k = 0; k < VALUE_VECTORS; k++) a[h][k] += w * row[k];
            }
        }
    } else {
        for (int64_t t = 0; t < span; t++) {
            vf v0 = NAME(loadv)(values + t * v_row + c0);
            for (int h = 0; h < 4; h++) a[h][0] += splat(p + h * stride + t) * v0;
        }
    }
    for (int h = 0; h < 4; h++)
        for (int k = 0; k < vectors; k++) *(vf_unaligned *)(acc + h * dv + c0 + LANES * k) = a[h][k];
}

/* Decode attention over the KV cache: for each of n_dec sequences and each KV head, its group of
 * heads / kv_heads query heads (q [n_dec, heads, dk]) against the cached keys of positions [lo, len)
 * (len = lens[b]; lo = len - window for a sliding window, else 0) of slot slots[b]: softmax(q . k * scale)
 * in fp32 (scores capped as cap * tanh(s / cap) with softcap > 0; with sinks, each head's learned logit joins
 * the normalisation as one more column), times the values; out [n_dec, heads * dv] in T. The cache of each
 * layer is [slots, kv_heads, t_alloc, row] with keys the first dk values of a row of k_row, values the first
 * dv of a row of v_row (multi-latent attention: v_cache = k_cache, the latents). Each K row is read once per
 * group, each V row once per 4 heads and register block of columns. Head widths that are not a multiple of 16
 * are copied into zero-padded rows first. */
void NAME(mrl_decode_attention)(const T *q, const T *k_cache, const T *v_cache, const int64_t *slots,
                                const int64_t *lens, int64_t n_dec, int64_t heads, int64_t kv_heads,
                                int64_t t_alloc, int64_t dk, int64_t dv, int64_t k_row, int64_t v_row,
                                int64_t window, float scale, float softcap, const float *sinks, T *out,
                                int threads) {
    int64_t group = heads / kv_heads, heads4 = (group + 3) / 4 * 4;
    int64_t kw = (dk + 15) / 16 * 16, vw = (dv + 15) / 16 * 16; /* padded widths */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t item = 0; item < n_dec * kv_heads; item++) {
        int64_t b = item / kv_heads, g = item % kv_heads;
        int64_t len = lens[b], lo = window > 0 && len > window ? len - window : 0, span = len - lo;
        int64_t stride = (span + 15) / 16 * 16; /* a head's score row */
        const T *keys = k_cache + ((slots[b] * kv_heads + g) * t_alloc + lo) * k_row;
        const T *values = v_cache + ((slots[b] * kv_heads + g) * t_alloc + lo) * v_row;
        int64_t kr = k_row, vr = v_row;
        size_t floats = (size_t)(heads4 * (stride + kw + vw));
        size_t padded = (size_t)((kw != dk ? span * kw : 0) + (vw != dv ? span * vw : 0) + kw);
        float *scratch = malloc(floats * sizeof(float) + padded * sizeof(T));
        float *restrict scores = scratch, *restrict qf = scores + heads4 * stride, *restrict acc = qf + heads4 * kw;
        T *spare = (T *)(scratch + floats), *zero_row = spare;
        memset(scores, 0, (size_t)(heads4 * (stride + kw)) * sizeof(float));
        memset(zero_row, 0, (size_t)kw * sizeof(T));
        spare += kw;
        if (kw != dk) { /* rows of whole vectors, zero-padded */
            T *copy = spare;
            spare += span * kw;
            for (int64_t t = 0; t < span; t++) {
                memcpy(copy + t * kw, keys + t * k_row, (size_t)dk * sizeof(T));
                memset(copy + t * kw + dk, 0, (size_t)(kw - dk) * sizeof(T));
            }
            keys = copy, kr = kw;
        }
        if (vw != dv) {
            T *copy = spare;
            for (int64_t t = 0; t < span; t++) {
                memcpy(copy + t * vw, values + t * v_row, (size_t)dv * sizeof(T));
                memset(copy + t * vw + dv, 0, (size_t)(vw - dv) * sizeof(T));
            }
            values = copy, vr = vw;
        }
        for (int64_t i = 0; i < group; i++)
            for (int64_t j = 0; j < dk; j++) qf[i * kw + j] = LOAD(q[((b * heads) + g * group + i) * dk + j]);
        const T *rows[LANES];
        for (int64_t t0 = 0; t0 < span; t0 += LANES) {
            /* the next block's keys, and this block's values, on their way while this block's dots run */
            for (int64_t l = 0; l < LANES && t0 + LANES + l < span; l++)
                for (int64_t j = 0; j < kw; j += 64 / (int64_t)sizeof(T))
                    __builtin_prefetch(keys + (t0 + LANES + l) * kr + j);
            for (int64_t l = 0; l < LANES && t0 + l < span; l++)
                for (int64_t j = 0; j < vw; j += 64 / (int64_t)sizeof(T))
                    __builtin_prefetch(values + (t0 + l) * vr + j, 0, 2);
            for (int64_t l = 0; l < LANES; l++) rows[l] = t0 + l < span ? keys + (t0 + l) * kr : zero_row;
            for (int64_t i = 0; i < group; i++) NAME(dot_rows)(qf + i * kw, rows, kw, scores + i * stride + t0);
        }
        float sums[MAX_GROUP];
        for (int64_t i = 0; i < group; i++) {
            float *restrict s = scores + i * stride;
            for (int64_t t = 0; t < span; t++) s[t] *= scale;
            if (softcap > 0.0f)
                for (int64_t t = 0; t < span; t++) s[t] = tanh_approx(s[t] / softcap) * softcap;
            float m = max_of(s, span);
            if (sinks) m = sinks[g * group + i] > m ? sinks[g * group + i] : m;
            for (int64_t t = 0; t < span; t++) s[t] = exp_approx(s[t] - m);
            sums[i] = sum_of(s, span) + (sinks ? exp_approx(sinks[g * group + i] - m) : 0.0f);
        }
        for (int64_t h0 = 0; h0 < group; h0 += 4) {
            int64_t c0 = 0;
            for (; c0 + VALUE_VECTORS * LANES <= vw; c0 += VALUE_VECTORS * LANES)
                NAME(weighted_values)(scores + h0 * stride, stride, values, vr, span, c0, VALUE_VECTORS, acc + h0 * vw,
                                      vw);
            for (; c0 < vw; c0 += LANES)
                NAME(weighted_values)(scores + h0 * stride, stride, values, vr, span, c0, 1, acc + h0 * vw, vw);
        }
        for (int64_t i = 0; i < group; i++) {
            float inv = 1.0f / sums[i];
            T *o = out + (b * heads + g * group + i) * dv;
            for (int64_t j = 0; j < dv; j++) o[j] = STORE(acc[i * vw + j] * inv);
        }
        free(scratch);
    }
}

#pragma GCC pop_options

#undef CAT_
#undef CAT
#undef NAME
