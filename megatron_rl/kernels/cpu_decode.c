/* Fused CPU kernels of the native engine's forward (rollout/native/model.py), built by kernels/cpu_decode.py
 * with the machine's C compiler on first use and called through ctypes.
 *
 * Each kernel replaces a run of small torch ops with one pass over memory, and keeps the rounding of the
 * transformers expression it stands for: in bf16 every intermediate that transformers casts to bf16 is
 * rounded to bf16 here too (round to nearest even, as torch), in fp32 every product and sum is an fp32
 * operation (built with -ffp-contract=off: no fused multiply-adds, but in the dot products of attention and of
 * the matrix product, whose rounding no torch expression fixes). What differs from torch is the order of a
 * reduction's fp32 additions (RMSNorm's sum of squares, attention's and the GEMM's dot products, softmax sums)
 * and exp / tanh to about an ulp, as between any two CPU kernels.
 *
 * The bodies are in cpu_decode_body.h, included once per activation dtype (fp32 and bf16 as uint16).
 * Threads: OpenMP, resolved at load time to the libgomp torch has loaded (same soname), so the kernels share
 * torch's thread pool; each call passes torch.get_num_threads() of the calling thread.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf16_to_float(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0; /* NaN, as c10::BFloat16 */
    return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* e^x to about 1 ulp (Cephes' expf polynomial on [-ln2/2, ln2/2], scaled by 2^n); branch-free, so loops of
 * it vectorize. Underflows to 0 below -87.3 (where e^x leaves the normal floats). */
static inline float exp_approx(float x) {
    const float hi = 88.3762626647949f, lo = -87.3365447504019f;
    float xc = x > hi ? hi : x;
    xc = xc < lo ? lo : xc;
    float n = nearbyintf(xc * 1.44269504088896341f);  /* (vectorizes; floorf does not) */
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float y = p * scale;
    return x < lo ? 0.0f : y;
}

/* tanh to a few ulp: Cephes' tanhf (odd polynomial below |x| 0.625, 1 - 2 / (e^2|x| + 1) above). */
static inline float tanh_approx(float x) {
    float a = fabsf(x);
    float s = x * x;
    float small = ((((-5.70498872745e-3f * s + 2.06390887954e-2f) * s - 5.37397155531e-2f) * s
                    + 1.33314422036e-1f) * s - 3.33332819422e-1f) * s * x + x;
    float big = 1.0f - 2.0f / (exp_approx(2.0f * (a > 44.0f ? 44.0f : a)) + 1.0f);
    big = x < 0 ? -big : big;
    return a < 0.625f ? small : big;
}

/* GCC vector types of one machine register: 16 fp32 lanes with AVX-512, else 8 (AVX2; GCC splits wider vectors
 * into several registers but lowers their cross-lane shuffles poorly). */
#if defined(__AVX512F__)
#define LANES 16
#define VALUE_VECTORS 4 /* columns of the values' register block: 4 x 16 accumulators per head */
#else
#define LANES 8
#define VALUE_VECTORS 2 /* 16 ymm registers: 4 heads x 2 accumulators, the values and the weight */
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef float vf_unaligned __attribute__((vector_size(LANES * 4), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint16_t vu16_unaligned __attribute__((vector_size(LANES * 2), aligned(2), may_alias));

static inline vf loadv(const float *p) { return *(const vf_unaligned *)p; }

/* *p in every lane: one broadcast load (x - 0 is x, signed zeros too, so the subtraction folds away; 0 + x
 * would not, and a lane-by-lane initialiser compiles to masked inserts) */
static inline vf splat(const float *p) { return *p - (vf){0}; }

/* The 16 lanes of a and b summed in pairs: lanes `first` of (a | b) plus lanes `second` of (a | b). */
#define PAIR_SUM(a, b, first, second) (__builtin_shuffle((a), (b), (first)) + __builtin_shuffle((a), (b), (second)))

/* The LANES vectors folded into one: lane l of the result is the sum of the lanes of partial[l], by a
 * transposing tree of shuffles and adds (log2(LANES) levels). */
static inline vf fold_lanes(const vf partial[LANES]) {
#if LANES == 16
    const vi a1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi b1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi a2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi b2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi a3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi b3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi a4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi b4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf halves[8], quarters[4], eighths[2];
    for (int l = 0; l < 8; l++) halves[l] = PAIR_SUM(partial[2 * l], partial[2 * l + 1], a1, b1);
    for (int l = 0; l < 4; l++) quarters[l] = PAIR_SUM(halves[2 * l], halves[2 * l + 1], a2, b2);
    for (int l = 0; l < 2; l++) eighths[l] = PAIR_SUM(quarters[2 * l], quarters[2 * l + 1], a3, b3);
    return PAIR_SUM(eighths[0], eighths[1], a4, b4);
#else
    const vi a1 = {0, 1, 2, 3, 8, 9, 10, 11}, b1 = {4, 5, 6, 7, 12, 13, 14, 15};
    const vi a2 = {0, 1, 4, 5, 8, 9, 12, 13}, b2 = {2, 3, 6, 7, 10, 11, 14, 15};
    const vi a3 = {0, 2, 4, 6, 8, 10, 12, 14}, b3 = {1, 3, 5, 7, 9, 11, 13, 15};
    vf halves[4], quarters[2];
    for (int l = 0; l < 4; l++) halves[l] = PAIR_SUM(partial[2 * l], partial[2 * l + 1], a1, b1);
    for (int l = 0; l < 2; l++) quarters[l] = PAIR_SUM(halves[2 * l], halves[2 * l + 1], a2, b2);
    return PAIR_SUM(quarters[0], quarters[1], a3, b3);
#endif
}

static inline float max_of(const float *restrict x, int64_t n) {
    float lanes[16];
    for (int l = 0; l < 16; l++) lanes[l] = -INFINITY;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) lanes[l] = x[j + l] > lanes[l] ? x[j + l] : lanes[l];
    float m = -INFINITY;
    for (int l = 0; l < 16; l++) m = lanes[l] > m ? lanes[l] : m;
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

static inline float sum_of(const float *restrict x, int64_t n) {
    float lanes[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) lanes[l] += x[j + l];
    float sum = 0.0f;
    for (int l = 0; l < 16; l++) sum += lanes[l];
    for (; j < n; j++) sum += x[j];
    return sum;
}

#define MAX_GROUP 256 /* query heads per KV head (kernels/cpu_decode.py checks) */
#define ACT_SILU 0
#define ACT_GELU_TANH 1

/* fp32 */
#define SUFFIX f32
#define T float
#define LOAD(v) (v)
#define STORE(f) (f)
#define ROUND(f) (f)
#define IS_FLOAT 1
#include "cpu_decode_body.h"
#undef SUFFIX
#undef T
#undef LOAD
#undef STORE
#undef ROUND
#undef IS_FLOAT

/* bf16 */
#define SUFFIX bf16
#define T bf16_t
#define LOAD(v) bf16_to_float(v)
#define STORE(f) float_to_bf16(f)
#define ROUND(f) bf16_to_float(float_to_bf16(f))
#define IS_FLOAT 0
#include "cpu_decode_body.h"

/* The fp32 matrix products of the decode steps: out [m, n] = x [m, k] @ w [n, k]^T (+ bias [n]) for up to a few
 * hundred rows m, with w packed once per weight update into panels of PANEL_NR output columns, each panel
 * [k, PANEL_NR] contiguous (`mrl_pack_panels_f32`). Per chunk of up to PANEL_KC inputs of a panel, blocks of
 * PANEL_MR rows of x run over it with PANEL_MR x PANEL_NV accumulator registers (one broadcast of x per row and
 * input, fused multiply-adds): the chunk comes from memory once and from L2 for the other row blocks, while the
 * next chunk is prefetched, spread over this one's row blocks. The threads split the panels, each streaming its
 * own contiguous part of w. (MKL's packed GEMM, the alternative, leaves the weight stream and the arithmetic
 * unoverlapped: half the FMA peak at 32 rows.) Block shapes as measured fastest (docs/performance.md). */
#if LANES == 16
#define PANEL_MR 8
#define PANEL_NV 3
#else
#define PANEL_MR 6
#define PANEL_NV 2
#endif
#define PANEL_NR (PANEL_NV * LANES)
/* inputs per pass over a panel: a panel of a long input dimension (an 8B model's 14,336-wide down projection:
 * 2.75 MB) is taken in chunks of at most this many rows, so the chunk its row blocks re-read stays in L2 */
#define PANEL_KC 1024

int64_t mrl_panel_width(void) { return PANEL_NR; }
int64_t mrl_vector_lanes(void) { return LANES; }

/* panels [ceil(n / PANEL_NR), k, PANEL_NR] of w [n, k]: panels[p][j][c] = w[p PANEL_NR + c][j], zero past n */
void mrl_pack_panels_f32(const float *w, int64_t n, int64_t k, float *panels, int threads) {
    int64_t count = (n + PANEL_NR - 1) / PANEL_NR;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < count; p++) {
        float *dst = panels + p * k * PANEL_NR;
        for (int64_t c = 0; c < PANEL_NR; c++) {
            int64_t row = p * PANEL_NR + c;
            if (row < n)
                for (int64_t j = 0; j < k; j++) dst[j * PANEL_NR + c] = w[row * k + j];
            else
                for (int64_t j = 0; j < k; j++) dst[j * PANEL_NR + c] = 0.0f;
        }
    }
}

/* (a matrix product's rounding order is the kernel's own: fused multiply-adds) */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
void mrl_linear_panels_f32(const float *x, int64_t m, int64_t k, const float *panels, int64_t n, const float *bias,
                           float *out, int threads) {
    if (m <= 0 || k <= 0) { /* (an empty product; no rows, or sums of nothing) */
        for (int64_t i = 0; i < m * n; i++) out[i] = bias ? bias[i % n] : 0.0f;
        return;
    }
    int64_t count = (n + PANEL_NR - 1) / PANEL_NR, blocks = (m + PANEL_MR - 1) / PANEL_MR;
    int64_t chunks = (k + PANEL_KC - 1) / PANEL_KC, kc_max = (k + chunks - 1) / chunks;
    const char *end = (const char *)(panels + count * k * PANEL_NR);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < count; p++) {
        int64_t cols = n - p * PANEL_NR < PANEL_NR ? n - p * PANEL_NR : PANEL_NR;
        for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
            int64_t kc = k - k0 < kc_max ? k - k0 : kc_max;
            int first = k0 == 0, last = k0 + kc == k;
            const float *chunk = panels + (p * k + k0) * PANEL_NR;
            /* what follows this chunk in memory (the panel's next chunk, or the next panel's first) is fetched
             * while it computes, spread over its row blocks */
            const char *next = (const char *)(chunk + kc * PANEL_NR);
            int64_t lines = kc * PANEL_NR * (int64_t)sizeof(float) / 64;
            if (next + lines * 64 > end) lines = (end - next) / 64;
            int64_t per_step = (lines + blocks * kc - 1) / (blocks * kc);
            for (int64_t block = 0; block < blocks; block++) {
                int64_t m0 = block * PANEL_MR;
                const float *xr[PANEL_MR];
                for (int r = 0; r < PANEL_MR; r++) /* (tail rows repeat) */
                    xr[r] = x + (m0 + r < m ? m0 + r : m - 1) * k + k0;
                vf acc[PANEL_MR][PANEL_NV];
                float vals[PANEL_NR];
                for (int r = 0; r < PANEL_MR; r++) { /* a later chunk continues the sums kept in `out` */
                    if (!first && m0 + r < m) {
                        memcpy(vals, out + (m0 + r) * n + p * PANEL_NR, (size_t)cols * sizeof(float));
                        for (int v = 0; v < PANEL_NV; v++) acc[r][v] = loadv(vals + v * LANES);
                    } else {
                        for (int v = 0; v < PANEL_NV; v++) acc[r][v] = (vf){0};
                    }
                }
                int64_t line = block * kc * per_step;
                for (int64_t j = 0; j < kc; j++) {
                    for (int64_t q = 0; q < per_step; q++, line++)
                        if (line < lines) __builtin_prefetch(next + line * 64, 0, 2);
                    const float *row = chunk + j * PANEL_NR;
                    vf wv[PANEL_NV];
                    for (int v = 0; v < PANEL_NV; v++) wv[v] = loadv(row + v * LANES);
                    for (int r = 0; r < PANEL_MR; r++) {
                        vf xb = splat(xr[r] + j);
                        for (int v = 0; v < PANEL_NV; v++) acc[r][v] += xb * wv[v];
                    }
                }
                for (int r = 0; r < PANEL_MR && m0 + r < m; r++) {
                    float *o = out + (m0 + r) * n + p * PANEL_NR;
                    for (int v = 0; v < PANEL_NV; v++) *(vf_unaligned *)(vals + v * LANES) = acc[r][v];
                    if (last && bias)
                        for (int64_t c = 0; c < cols; c++) o[c] = vals[c] + bias[p * PANEL_NR + c];
                    else
                        memcpy(o, vals, (size_t)cols * sizeof(float));
                }
            }
        }
    }
}
#pragma GCC pop_options

/* One token per row of logits [rows, vocab] (fp32, or bf16 converted exactly to fp32 row by row, so an
 * engine computing in bf16 need not widen the whole [rows, vocab] block first), sampled from softmax(logits)
 * by inverting its CDF at the row's float64 uniform, and its log-prob: rollout/native/sampling.py
 * `_sample_plain` in one pass per row (the max, then exp(z - max) summed per block of `block` tokens in fp32,
 * a float64 CDF over the blocks, the chosen block's tokens in float64; the same clamps). */
static void sample_row(const float *z, int64_t vocab, double uniform, int64_t block, double *cdf, double *inner,
                       int64_t *token_out, float *logprob_out) {
    int64_t n_blocks = (vocab + block - 1) / block;
    float m = max_of(z, vocab);
    double running = 0.0;
    for (int64_t b = 0; b < n_blocks; b++) {
        int64_t start = b * block, end = start + block < vocab ? start + block : vocab;
        float acc[16] = {0};
        int64_t t = start;
        for (; t + 16 <= end; t += 16)
            for (int l = 0; l < 16; l++) acc[l] += exp_approx(z[t + l] - m);
        float sum = 0.0f;
        for (int l = 0; l < 16; l++) sum += acc[l];
        for (; t < end; t++) sum += exp_approx(z[t] - m);
        running += (double)sum;
        cdf[b] = running;
    }
    double total = cdf[n_blocks - 1];
    double target = uniform * total;
    double below_total = nextafter(total, 0.0);
    target = target < below_total ? target : below_total;
    int64_t chosen = 0;
    while (chosen < n_blocks - 1 && cdf[chosen] <= target) chosen++;
    double lower = chosen > 0 ? cdf[chosen - 1] : 0.0;
    double mass = cdf[chosen] - lower;
    int64_t start = chosen * block;
    double in_block = 0.0;
    for (int64_t t = 0; t < block; t++) {
        in_block += start + t < vocab ? (double)exp_approx(z[start + t] - m) : 0.0;
        inner[t] = in_block;
    }
    double within = (target - lower) / mass;
    within = within < 0.0 ? 0.0 : (within > 1.0 ? 1.0 : within);
    within *= inner[block - 1];
    double below_inner = nextafter(inner[block - 1], 0.0);
    within = within < below_inner ? within : below_inner;
    int64_t k = 0;
    while (k < block - 1 && inner[k] <= within) k++;
    int64_t token = start + k;
    *token_out = token;
    *logprob_out = (float)((double)(z[token] - m) - log(total));
}

void mrl_sample_plain_f32(const float *logits, int64_t rows, int64_t vocab, const double *uniforms, int64_t block,
                          int64_t *tokens, float *logprobs, int threads) {
    int64_t n_blocks = (vocab + block - 1) / block;
#pragma omp parallel num_threads(threads)
    {
        double *cdf = malloc((size_t)(n_blocks + block) * sizeof(double));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            sample_row(logits + r * vocab, vocab, uniforms[r], block, cdf, cdf + n_blocks, tokens + r, logprobs + r);
        free(cdf);
    }
}

void mrl_sample_plain_bf16(const bf16_t *logits, int64_t rows, int64_t vocab, const double *uniforms, int64_t block,
                           int64_t *tokens, float *logprobs, int threads) {
    int64_t n_blocks = (vocab + block - 1) / block;
#pragma omp parallel num_threads(threads)
    {
        double *cdf = malloc((size_t)(n_blocks + block) * sizeof(double));
        float *row = malloc((size_t)vocab * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const bf16_t *src = logits + r * vocab;
            for (int64_t t = 0; t < vocab; t++) row[t] = bf16_to_float(src[t]);
            sample_row(row, vocab, uniforms[r], block, cdf, cdf + n_blocks, tokens + r, logprobs + r);
        }
        free(row);
        free(cdf);
    }
}
