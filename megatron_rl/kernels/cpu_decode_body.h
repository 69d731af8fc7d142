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

/* Decode attention over the KV cache: for each of n_dec sequences and each KV head, its group of
 * heads / kv_heads query heads (q [n_dec, heads, dk]) against the cached keys of positions [lo, len)
 * (len = lens[b]; lo = len - window for a sliding window, else 0) of slot slots[b]: softmax(q . k * scale)
 * in fp32 (scores capped as cap * tanh(s / cap) with softcap > 0; with sinks, each head's learned logit joins
 * the normalisation as one more column), times the values; out [n_dec, heads * dv] in T. The cache of each
 * layer is [slots, kv_heads, t_alloc, row] with keys the first dk values of a row of k_row, values the first
 * dv of a row of v_row (multi-latent attention: v_cache = k_cache, the latents). Each K / V row is read once
 * per group. */
void NAME(mrl_decode_attention)(const T *q, const T *k_cache, const T *v_cache, const int64_t *slots,
                                const int64_t *lens, int64_t n_dec, int64_t heads, int64_t kv_heads,
                                int64_t t_alloc, int64_t dk, int64_t dv, int64_t k_row, int64_t v_row,
                                int64_t window, float scale, float softcap, const float *sinks, T *out,
                                int threads) {
    int64_t group = heads / kv_heads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t item = 0; item < n_dec * kv_heads; item++) {
        int64_t b = item / kv_heads, g = item % kv_heads;
        int64_t len = lens[b], lo = window > 0 && len > window ? len - window : 0, span = len - lo;
        const T *keys = k_cache + ((slots[b] * kv_heads + g) * t_alloc + lo) * k_row;
        const T *values = v_cache + ((slots[b] * kv_heads + g) * t_alloc + lo) * v_row;
        int64_t width = (dk + 15) / 16 * 16; /* a K row in fp32, zero-padded to whole vectors */
        /* fp32 rows of whole vectors are read in place; others are converted / padded into `block` first */
        int in_place = IS_FLOAT && width == dk && k_row % 16 == 0;
        float *scratch = malloc((size_t)(group * (span + 16 + width + dv) + 16 * width + dv) * sizeof(float));
        float *restrict scores = scratch, *restrict qf = scores + group * (span + 16);
        float *restrict acc = qf + group * width, *restrict block = acc + group * dv, *restrict row = block + 16 * width;
        memset(qf, 0, (size_t)(group * width) * sizeof(float));
        memset(block, 0, (size_t)(16 * width) * sizeof(float));
        for (int64_t i = 0; i < group; i++)
            for (int64_t j = 0; j < dk; j++) qf[i * width + j] = LOAD(q[((b * heads) + g * group + i) * dk + j]);
        const float *rows[16];
        for (int64_t t0 = 0; t0 < span; t0 += 16) {
            int64_t count = span - t0 < 16 ? span - t0 : 16;
            /* the next block's keys, and this block's values, on their way while this block's dots run */
            for (int64_t l = 0; l < 16 && t0 + 16 + l < span; l++)
                for (int64_t j = 0; j < dk; j += 64 / (int64_t)sizeof(T)) __builtin_prefetch(keys + (t0 + 16 + l) * k_row + j);
            for (int64_t l = 0; l < count; l++)
                for (int64_t j = 0; j < dv; j += 64 / (int64_t)sizeof(T)) __builtin_prefetch(values + (t0 + l) * v_row + j, 0, 2);
            for (int64_t l = 0; l < 16; l++) {
                if (l >= count) {
                    memset(block + l * width, 0, (size_t)width * sizeof(float));
                    rows[l] = block + l * width;
                } else if (in_place) {
                    rows[l] = (const float *)(keys + (t0 + l) * k_row);
                } else {
                    const T *k = keys + (t0 + l) * k_row;
                    for (int64_t j = 0; j < dk; j++) block[l * width + j] = LOAD(k[j]);
                    rows[l] = block + l * width;
                }
            }
            for (int64_t i = 0; i < group; i++) dot16(qf + i * width, rows, width, scores + i * (span + 16) + t0);
        }
        for (int64_t i = 0; i < group; i++)
            for (int64_t t = 0; t < span; t++) scores[i * (span + 16) + t] *= scale;
        float sums[MAX_GROUP];
        for (int64_t i = 0; i < group; i++) {
            float *restrict s = scores + i * (span + 16);
            if (softcap > 0.0f)
                for (int64_t t = 0; t < span; t++) s[t] = tanh_approx(s[t] / softcap) * softcap;
            float m = max_of(s, span);
            if (sinks) m = sinks[g * group + i] > m ? sinks[g * group + i] : m;
            for (int64_t t = 0; t < span; t++) s[t] = exp_approx(s[t] - m);
            sums[i] = sum_of(s, span) + (sinks ? exp_approx(sinks[g * group + i] - m) : 0.0f);
        }
        memset(acc, 0, (size_t)(group * dv) * sizeof(float));
        for (int64_t t = 0; t < span; t++) {
            const T *v = values + t * v_row;
            const float *restrict vf;
            if (IS_FLOAT) {
                vf = (const float *)v;
            } else {
                for (int64_t j = 0; j < dv; j++) row[j] = LOAD(v[j]);
                vf = row;
            }
            for (int64_t i = 0; i < group; i++) {
                float p = scores[i * (span + 16) + t];
                float *restrict a = acc + i * dv;
                for (int64_t j = 0; j < dv; j++) a[j] += p * vf[j];
            }
        }
        for (int64_t i = 0; i < group; i++) {
            float inv = 1.0f / sums[i];
            T *o = out + (b * heads + g * group + i) * dv;
            for (int64_t j = 0; j < dv; j++) o[j] = STORE(acc[i * dv + j] * inv);
        }
        free(scratch);
    }
}

#undef CAT_
#undef CAT
#undef NAME
