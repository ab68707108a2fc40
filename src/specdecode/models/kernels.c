/* Row-invariant kernels of the native runner (specdecode.models.kernels builds and loads this).
 *
 * Every output element is computed by one fixed sequence of floating-point operations that
 * depends only on its own input row and on the weights, never on how many rows a call holds,
 * on which rows sit beside it, or on the number of threads: a position's logits are then the
 * same bit for bit whether it is scored alone (plain decoding), inside a draft, as a node of a
 * token tree, or beside other requests of a batch, which is what makes greedy speculative
 * decoding token-identical to plain decoding (docs/design.md, guarantee 1).
 *
 * The rules that make it so:
 * - products: y[m][n] accumulates w[k][n] x[m][k] for k = 0, 1, ... with one fused multiply-add
 *   each, in input order, for every row count; rows are blocked for speed, but a block only
 *   shares the loads of the weights, never a sum; threads split the output columns;
 *   quantized weights are summed per group of inputs and scaled at the group's end, again in
 *   one fixed order;
 * - attention: per query row and head, the scores of the attended keys in slot order, their
 *   maximum, then the exponentials summed and the values accumulated in slot order; a key that
 *   is masked out is skipped, never added as a zero;
 * - norms and activations: per row, fixed-order sums.
 * Compiled with -ffp-contract=off, so the compiler fuses nothing on its own: every fused
 * multiply-add is written out, the same in the vector and the scalar code.
 *
 * sd_block runs a whole transformer block in one call (one OpenMP region, phases separated by
 * barriers): a plain decoding step is then 30 calls instead of ~700 small PyTorch operators.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SD_AVX2 1
#else
#define SD_AVX2 0
#endif

#define PANEL 16   /* output columns per packed panel */
#define ROWS 4     /* rows sharing one pass over a panel */
#define CHUNK 64   /* rows whose inputs stay in cache while every panel passes over them */
#define GROUP 32   /* inputs per scale of the 4-bit format */

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_I8 = 2, KIND_I4 = 3 };

/* A weight matrix (N outputs, K inputs) in panels of PANEL output columns.
 * F32 / BF16: panel p holds W[p*16 + c][k] at [(p*K + k)*16 + c].
 * I8: int8 codes likewise; scale[p*16 + c] per output column: w = code * scale.
 * I4: codes 0..15, byte [(p*K + k)*8 + c] = code of column c | code of column c + 8 << 4;
 *     scale, zero at [(p*(K/32) + g)*16 + c] for input group g: w = code * scale + zero. */
typedef struct {
    const void *w;
    const float *scale;
    const float *zero;
    const float *bias; /* (N,) or NULL */
    int64_t n, k;
    int32_t kind;
    int32_t round_x; /* round the inputs to bf16 first (the "a16" precisions) */
} sd_mat;

int sd_has_avx2(void) { return SD_AVX2; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float round_bf16(float f) { /* round to nearest even, as torch's .bfloat16() */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u) return f; /* inf / nan */
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---- products ---------------------------------------------------------------------------- */

#if SD_AVX2
/* R rows (1..ROWS, a constant after inlining) against panel p of a float or bf16 matrix. */
static inline void panel_float(const float *x, int64_t ldx, const sd_mat *m, int64_t p, int R,
                               float out[ROWS][PANEL]) {
    __m256 a0[ROWS], a1[ROWS];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    int64_t K = m->k, base = p * K * PANEL;
    for (int64_t k = 0; k < K; k++) {
        __m256 w0, w1;
        if (m->kind == KIND_F32) {
            const float *q = (const float *)m->w + base + k * PANEL;
            w0 = _mm256_loadu_ps(q);
            w1 = _mm256_loadu_ps(q + 8);
        } else {
            const uint16_t *q = (const uint16_t *)m->w + base + k * PANEL;
            __m128i lo = _mm_loadu_si128((const __m128i *)q);
            __m128i hi = _mm_loadu_si128((const __m128i *)(q + 8));
            w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16));
            w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16));
        }
        for (int r = 0; r < R; r++) {
            __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
            a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out[r], a0[r]);
        _mm256_storeu_ps(out[r] + 8, a1[r]);
    }
}

static inline void panel_i8(const float *x, int64_t ldx, const sd_mat *m, int64_t p, int R,
                            float out[ROWS][PANEL]) {
    __m256 a0[ROWS], a1[ROWS];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    int64_t K = m->k;
    const int8_t *q = (const int8_t *)m->w + p * K * PANEL;
    for (int64_t k = 0; k < K; k++) {
        __m128i b = _mm_loadu_si128((const __m128i *)(q + k * PANEL));
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)));
        for (int r = 0; r < R; r++) {
            __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
            a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
        }
    }
    __m256 s0 = _mm256_loadu_ps(m->scale + p * PANEL), s1 = _mm256_loadu_ps(m->scale + p * PANEL + 8);
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out[r], _mm256_mul_ps(a0[r], s0));
        _mm256_storeu_ps(out[r] + 8, _mm256_mul_ps(a1[r], s1));
    }
}

/* xs[r][g]: the sum of row r's inputs of group g (fixed order, computed once per row). */
static inline void panel_i4(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                            const sd_mat *m, int64_t p, int R, float out[ROWS][PANEL]) {
    __m256 y0[ROWS], y1[ROWS];
    for (int r = 0; r < R; r++) y0[r] = y1[r] = _mm256_setzero_ps();
    int64_t K = m->k, G = K / GROUP;
    const uint8_t *q = (const uint8_t *)m->w + p * K * (PANEL / 2);
    const __m256i low = _mm256_set1_epi32(0xf);
    for (int64_t g = 0; g < G; g++) {
        __m256 a0[ROWS], a1[ROWS];
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {
            __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + k * 8)));
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(c, low));
            __m256 w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
            for (int r = 0; r < R; r++) {
                __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
                a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
                a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
            }
        }
        const float *sc = m->scale + (p * G + g) * PANEL, *ze = m->zero + (p * G + g) * PANEL;
        __m256 s0 = _mm256_loadu_ps(sc), s1 = _mm256_loadu_ps(sc + 8);
        __m256 z0 = _mm256_loadu_ps(ze), z1 = _mm256_loadu_ps(ze + 8);
        for (int r = 0; r < R; r++) { /* y += s * sum(x q) + z * sum(x), in that order */
            __m256 sx = _mm256_broadcast_ss(xs + r * ldxs + g);
            y0[r] = _mm256_fmadd_ps(sx, z0, _mm256_fmadd_ps(a0[r], s0, y0[r]));
            y1[r] = _mm256_fmadd_ps(sx, z1, _mm256_fmadd_ps(a1[r], s1, y1[r]));
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out[r], y0[r]);
        _mm256_storeu_ps(out[r] + 8, y1[r]);
    }
}
#else
static inline float weight_at(const sd_mat *m, int64_t p, int64_t k, int c) {
    int64_t K = m->k;
    switch (m->kind) {
    case KIND_F32: return ((const float *)m->w)[(p * K + k) * PANEL + c];
    case KIND_BF16: return bf16_to_f32(((const uint16_t *)m->w)[(p * K + k) * PANEL + c]);
    case KIND_I8: return (float)((const int8_t *)m->w)[(p * K + k) * PANEL + c];
    default: {
        uint8_t b = ((const uint8_t *)m->w)[(p * K + k) * (PANEL / 2) + c % 8];
        return (float)(c < 8 ? b & 0xf : b >> 4);
    }
    }
}

static inline void panel_float(const float *x, int64_t ldx, const sd_mat *m, int64_t p, int R,
                               float out[ROWS][PANEL]) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < PANEL; c++) {
            float a = 0.0f;
            for (int64_t k = 0; k < m->k; k++) a = fmaf(x[r * ldx + k], weight_at(m, p, k, c), a);
            out[r][c] = a;
        }
}

static inline void panel_i8(const float *x, int64_t ldx, const sd_mat *m, int64_t p, int R,
                            float out[ROWS][PANEL]) {
    panel_float(x, ldx, m, p, R, out);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < PANEL; c++) out[r][c] *= m->scale[p * PANEL + c];
}

static inline void panel_i4(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                            const sd_mat *m, int64_t p, int R, float out[ROWS][PANEL]) {
    int64_t G = m->k / GROUP;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < PANEL; c++) {
            float y = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                float a = 0.0f;
                for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++)
                    a = fmaf(x[r * ldx + k], weight_at(m, p, k, c), a);
                int64_t i = (p * G + g) * PANEL + c;
                y = fmaf(xs[r * ldxs + g], m->zero[i], fmaf(a, m->scale[i], y));
            }
            out[r][c] = y;
        }
}
#endif

static inline void panel_rows(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                              const sd_mat *m, int64_t p, int R, float out[ROWS][PANEL]) {
    if (m->kind == KIND_I4) panel_i4(x, ldx, xs, ldxs, m, p, R, out);
    else if (m->kind == KIND_I8) panel_i8(x, ldx, m, p, R, out);
    else panel_float(x, ldx, m, p, R, out);
}

/* The inputs as the product uses them: rounded to bf16 if asked, and for I4 the per-group sums.
 * Each row on its own (a fixed-order sum per group); called inside a parallel region. */
static void prepare_rows(const float *x, int64_t M, const sd_mat *m, float *xr, float *xs) {
    int64_t K = m->k, G = K / GROUP;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        for (int64_t k = 0; k < K; k++) xr[r * K + k] = m->round_x ? round_bf16(x[r * K + k]) : x[r * K + k];
        if (m->kind == KIND_I4)
            for (int64_t g = 0; g < G; g++) {
                float s = 0.0f;
                for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) s += xr[r * K + k];
                xs[r * G + g] = s;
            }
    }
}

/* y (M, N) (row stride ldy) = x (M, K) W^T + bias [+ y if accumulate]; inside a parallel region
 * (orphaned work-sharing loops). x is used as is where no preparation is needed. */
static void matmul_in_region(const float *x, int64_t M, const sd_mat *m, float *y, int64_t ldy,
                             int accumulate, float *xr, float *xs) {
    int64_t K = m->k, N = m->n, P = (N + PANEL - 1) / PANEL, G = K / GROUP;
    const float *xin = x;
    if (m->round_x || m->kind == KIND_I4) {
        prepare_rows(x, M, m, xr, xs);  /* ends with a barrier */
        xin = xr;
    }
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
        int64_t mc = M - m0 < CHUNK ? M - m0 : CHUNK;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            float out[ROWS][PANEL];
            int64_t n0 = p * PANEL, nn = N - n0 < PANEL ? N - n0 : PANEL;
            for (int64_t r0 = 0; r0 < mc; r0 += ROWS) {
                const float *xrow = xin + (m0 + r0) * K;
                const float *srow = xs ? xs + (m0 + r0) * G : NULL;
                int64_t left = mc - r0;
                int R = left >= ROWS ? ROWS : (int)left;
                switch (R) { /* one specialised body per row count: identical arithmetic */
                case 4: panel_rows(xrow, K, srow, G, m, p, 4, out); break;
                case 3: panel_rows(xrow, K, srow, G, m, p, 3, out); break;
                case 2: panel_rows(xrow, K, srow, G, m, p, 2, out); break;
                default: panel_rows(xrow, K, srow, G, m, p, 1, out); break;
                }
                for (int r = 0; r < R; r++) {
                    float *yr = y + (m0 + r0 + r) * ldy + n0;
                    for (int64_t c = 0; c < nn; c++) {
                        float v = m->bias ? out[r][c] + m->bias[n0 + c] : out[r][c];
                        yr[c] = accumulate ? yr[c] + v : v;
                    }
                }
            }
        }
    }
}

static void scratch_for(const sd_mat *m, int64_t M, float **xr, float **xs) {
    *xr = (m->round_x || m->kind == KIND_I4) ? (float *)malloc(sizeof(float) * (size_t)(M * m->k)) : NULL;
    *xs = m->kind == KIND_I4 ? (float *)malloc(sizeof(float) * (size_t)(M * (m->k / GROUP) + 1)) : NULL;
}

/* y (M, N) = x (M, K) W^T (+ bias). */
void sd_matmul(const float *x, int64_t M, const sd_mat *m, float *y) {
    float *xr, *xs;
    scratch_for(m, M, &xr, &xs);
#pragma omp parallel
    matmul_in_region(x, M, m, y, m->n, 0, xr, xs);
    free(xr);
    free(xs);
}

/* ---- attention ---------------------------------------------------------------------------- */

static inline float dot(const float *a, const float *b, int64_t D) {
#if SD_AVX2
    if (D % 8 == 0) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
        for (int64_t d = 8; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
        float l[8];
        _mm256_storeu_ps(l, acc);
        return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    }
#endif
    float s = a[0] * b[0];
    for (int64_t d = 1; d < D; d++) s = fmaf(a[d], b[d], s);
    return s;
}

static inline void axpy(float e, const float *v, float *acc, int64_t D) {
#if SD_AVX2
    if (D % 8 == 0) {
        __m256 eb = _mm256_set1_ps(e);
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(acc + d,
                             _mm256_fmadd_ps(eb, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
        return;
    }
#endif
    for (int64_t d = 0; d < D; d++) acc[d] = fmaf(e, v[d], acc[d]);
}

typedef struct {
    const float *kc, *vc;    /* this layer's cache: slot j of row b, kv head g at b*c_row + g*c_head + j*D */
    int64_t c_row, c_head, kvh;
    const int64_t *rows;     /* (R,) the cache row of each query row */
    const uint8_t *mask;     /* (R, used) 1 = may attend; NULL = every slot below used */
    int64_t used;
} sd_attn;

/* out (R, NH, D) = softmax(q k^T / sqrt(D)) v per query row and head; q row r head h at
 * q + r * q_row + h * D. Inside a parallel region; s: `used` floats of this thread. */
static void attention_in_region(const float *q, int64_t q_row, int64_t R, int64_t NH, int64_t D,
                                const sd_attn *a, float *out, float *s, float *acc) {
    int64_t group = NH / a->kvh;
    float scale = 1.0f / sqrtf((float)D);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < R * NH; t++) {
        int64_t r = t / NH, h = t % NH, g = h / group;
        const float *qv = q + r * q_row + h * D;
        const float *kb = a->kc + a->rows[r] * a->c_row + g * a->c_head;
        const float *vb = a->vc + a->rows[r] * a->c_row + g * a->c_head;
        const uint8_t *mr = a->mask ? a->mask + r * a->used : NULL;
        float mx = -INFINITY;
        for (int64_t j = 0; j < a->used; j++) {
            if (mr && !mr[j]) continue;
            s[j] = dot(qv, kb + j * D, D) * scale;
            if (s[j] > mx) mx = s[j];
        }
        float sum = 0.0f;
        memset(acc, 0, sizeof(float) * (size_t)D);
        for (int64_t j = 0; j < a->used; j++) {
            if (mr && !mr[j]) continue;
            float e = expf(s[j] - mx);
            sum += e;
            axpy(e, vb + j * D, acc, D);
        }
        float *o = out + (r * NH + h) * D;
        for (int64_t d = 0; d < D; d++) o[d] = acc[d] / sum;
    }
}

void sd_attention(const float *q, int64_t q_row, int64_t R, int64_t NH, int64_t D,
                  const sd_attn *a, float *out) {
#pragma omp parallel
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(a->used > 0 ? a->used : 1));
        float *acc = (float *)malloc(sizeof(float) * (size_t)D);
        attention_in_region(q, q_row, R, NH, D, a, out, s, acc);
        free(s);
        free(acc);
    }
}

/* ---- a transformer block ----------------------------------------------------------------- */

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps;
    const float *attn_norm, *mlp_norm; /* (hidden,) */
    sd_mat qkv, o, gate_up, down;       /* qkv: q | k | v rows; gate_up: gate | up rows */
} sd_block_w;

/* h = x / sqrt(mean(x^2) + eps) * w, per row, in a fixed order. */
static void rms_norm_rows(const float *x, int64_t M, int64_t H, const float *w, float eps,
                          float *h) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * H;
        float ss = 0.0f;
        for (int64_t i = 0; i < H; i++) ss = fmaf(xr[i], xr[i], ss);
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) h[r * H + i] = (xr[i] * inv) * w[i];
    }
}

/* x (M, hidden) <- the block applied to x. cos, sin: (M, head_dim) per row, sin signed as in
 * models.llama.apply_rope; slots (M,): where each row's key and value are written in its cache
 * row (a->rows). */
void sd_block(float *x, int64_t M, const sd_block_w *b, const float *cos, const float *sin,
              const int64_t *slots, const sd_attn *a) {
    int64_t H = b->hidden, NH = b->heads, KVH = b->kv_heads, D = b->head_dim, I = b->inter;
    int64_t NQKV = (NH + 2 * KVH) * D, half = D / 2;
    float *h = (float *)malloc(sizeof(float) * (size_t)(M * H));
    float *qkv = (float *)malloc(sizeof(float) * (size_t)(M * NQKV));
    float *att = (float *)malloc(sizeof(float) * (size_t)(M * NH * D));
    float *gu = (float *)malloc(sizeof(float) * (size_t)(M * 2 * I));
    float *act = (float *)malloc(sizeof(float) * (size_t)(M * I));
    int64_t kmax = H > I ? H : I;
    float *xr = (float *)malloc(sizeof(float) * (size_t)(M * (kmax > NH * D ? kmax : NH * D)));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(M * (kmax / GROUP + 1)));
#pragma omp parallel
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(a->used > 0 ? a->used : 1));
        float *acc = (float *)malloc(sizeof(float) * (size_t)D);
        rms_norm_rows(x, M, H, b->attn_norm, b->eps, h);
        matmul_in_region(h, M, &b->qkv, qkv, NQKV, 0, xr, xs);
        /* RoPE on q and k heads, then the new keys and values into the cache */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            float *row = qkv + r * NQKV, tmp[512];
            const float *c = cos + r * D, *sn = sin + r * D;
            for (int64_t hh = 0; hh < NH + KVH; hh++) {
                float *v = row + hh * D;
                for (int64_t d = 0; d < D; d++) tmp[d] = v[d];
                for (int64_t d = 0; d < D; d++)
                    v[d] = tmp[d] * c[d] + tmp[d < half ? d + half : d - half] * sn[d];
            }
            for (int64_t g = 0; g < KVH; g++) {
                int64_t off = a->rows[r] * a->c_row + g * a->c_head + slots[r] * D;
                memcpy((float *)a->kc + off, row + (NH + g) * D, sizeof(float) * (size_t)D);
                memcpy((float *)a->vc + off, row + (NH + KVH + g) * D, sizeof(float) * (size_t)D);
            }
        }
        attention_in_region(qkv, NQKV, M, NH, D, a, att, s, acc);
        matmul_in_region(att, M, &b->o, x, H, 1, xr, xs); /* x += att Wo^T */
        rms_norm_rows(x, M, H, b->mlp_norm, b->eps, h);
        matmul_in_region(h, M, &b->gate_up, gu, 2 * I, 0, xr, xs);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++)
            for (int64_t i = 0; i < I; i++) {
                float g = gu[r * 2 * I + i];
                act[r * I + i] = (g / (1.0f + expf(-g))) * gu[r * 2 * I + I + i];
            }
        matmul_in_region(act, M, &b->down, x, H, 1, xr, xs); /* x += act Wdown^T */
        free(s);
        free(acc);
    }
    free(h);
    free(qkv);
    free(att);
    free(gu);
    free(act);
    free(xr);
    free(xs);
}
