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
#define ROWS 6     /* rows sharing one pass over a panel (a register block) */
#define CHUNK 64   /* rows whose inputs stay in cache while every panel passes over them */
#define GROUP 32   /* inputs per scale of the 4-bit format */
#define SD_INLINE static inline __attribute__((always_inline))

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_I8 = 2, KIND_I4 = 3, KIND_I8G = 4 };
#define GROUPED(kind) ((kind) == KIND_I4 || (kind) == KIND_I8G)

/* A weight matrix (N outputs, K inputs) in panels of PANEL output columns.
 * F32 / BF16: panel p holds W[p*16 + c][k] at [(p*K + k)*16 + c].
 * I8: int8 codes likewise; scale[p*16 + c] per output column: w = code * scale.
 * I4: codes 0..15, byte [(p*K + k)*8 + c] = code of column c | code of column c + 8 << 4;
 *     scale, zero at [(p*(K/32) + g)*16 + c] for input group g: w = code * scale + zero.
 * I8G: int8 codes as I8, a scale per output column and group of 32 inputs (as I4's, no zero):
 *     w = code * scale (GGUF's Q8_0 blocks, which such a matrix reproduces exactly). */
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
/* Input k of panel p as two vectors of 8 floats: the weights (F32, BF16) or the integer codes
 * (I8, I4: scaled later, see below). */
SD_INLINE void decode_k(const sd_mat *m, int kind, int64_t p, int64_t k, __m256 *w0,
                        __m256 *w1) {
    int64_t K = m->k;
    switch (kind) {
    case KIND_F32: {
        const float *q = (const float *)m->w + (p * K + k) * PANEL;
        *w0 = _mm256_loadu_ps(q);
        *w1 = _mm256_loadu_ps(q + 8);
        return;
    }
    case KIND_BF16: {
        const uint16_t *q = (const uint16_t *)m->w + (p * K + k) * PANEL;
        __m128i lo = _mm_loadu_si128((const __m128i *)q);
        __m128i hi = _mm_loadu_si128((const __m128i *)(q + 8));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16));
        *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16));
        return;
    }
    case KIND_I8:
    case KIND_I8G: {
        __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)m->w + (p * K + k) * PANEL));
        *w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        *w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)));
        return;
    }
    default: {
        const uint8_t *q = (const uint8_t *)m->w + (p * K + k) * (PANEL / 2);
        __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        *w0 = _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(0xf)));
        *w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
        return;
    }
    }
}

/* The arithmetic, the same on both paths below (and in the scalar code):
 * F32, BF16: y = sum_k x[k] w[k], one fused multiply-add per k in order, from 0.
 * I8: a = sum_k x[k] code[k] likewise, then y = a * scale.
 * I4: per group g of 32 inputs, a_g = sum x[k] code[k] (from 0), then
 *     y = (y + a_g * scale_g) + xs_g * zero_g (two fused multiply-adds), y from 0. */
SD_INLINE int64_t span_of(const sd_mat *m, int kind) { return GROUPED(kind) ? GROUP : m->k; }

SD_INLINE void fold_group(const sd_mat *m, int kind, int64_t p, int64_t g, __m256 a0,
                          __m256 a1, float sx, float *y) {
    int64_t G = m->k / GROUP;
    const float *sc = m->scale + (p * G + g) * PANEL, *ze = m->zero + (p * G + g) * PANEL;
    if (kind == KIND_I8G) { /* y = y + a_g * scale_g */
        _mm256_storeu_ps(y, _mm256_fmadd_ps(a0, _mm256_loadu_ps(sc), _mm256_loadu_ps(y)));
        _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(a1, _mm256_loadu_ps(sc + 8),
                                                _mm256_loadu_ps(y + 8)));
        return;
    }
    __m256 b = _mm256_set1_ps(sx);
    _mm256_storeu_ps(y, _mm256_fmadd_ps(b, _mm256_loadu_ps(ze),
                                        _mm256_fmadd_ps(a0, _mm256_loadu_ps(sc), _mm256_loadu_ps(y))));
    _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(b, _mm256_loadu_ps(ze + 8),
                                            _mm256_fmadd_ps(a1, _mm256_loadu_ps(sc + 8),
                                                            _mm256_loadu_ps(y + 8))));
}

SD_INLINE void finish(const sd_mat *m, int kind, int64_t p, __m256 a0, __m256 a1, float *y) {
    if (kind == KIND_I8) {
        a0 = _mm256_mul_ps(a0, _mm256_loadu_ps(m->scale + p * PANEL));
        a1 = _mm256_mul_ps(a1, _mm256_loadu_ps(m->scale + p * PANEL + 8));
    }
    _mm256_storeu_ps(y, a0);
    _mm256_storeu_ps(y + 8, a1);
}

/* R rows (1..ROWS) against NP consecutive panels (1..4), both constants after inlining, weights
 * decoded straight into registers; out[j][r] receives panel p + j's row r. One row keeps eight
 * independent sums in flight over four panels, two rows over two: a single panel's two sums per
 * row would wait on the fused multiply-add's latency at every input. */
SD_INLINE void panel_direct(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                            const sd_mat *m, int kind, int64_t p, int NP, int R,
                            float out[][CHUNK][PANEL]) {
    int64_t span = span_of(m, kind), K = m->k;
    __m256 a[ROWS][8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 2 * NP; c++) a[r][c] = _mm256_setzero_ps();
    if (GROUPED(kind))
        for (int j = 0; j < NP; j++) memset(out[j], 0, sizeof(float) * PANEL * (size_t)R);
    for (int64_t k0 = 0; k0 < K; k0 += span) {
        if (GROUPED(kind)) /* each group's sums start from 0 */
            for (int r = 0; r < R; r++)
                for (int c = 0; c < 2 * NP; c++) a[r][c] = _mm256_setzero_ps();
        for (int64_t k = k0; k < k0 + span; k++) {
            __m256 xb[ROWS];
            for (int r = 0; r < R; r++) xb[r] = _mm256_broadcast_ss(x + r * ldx + k);
            for (int j = 0; j < NP; j++) {
                __m256 w0, w1;
                decode_k(m, kind, p + j, k, &w0, &w1);
                for (int r = 0; r < R; r++) {
                    a[r][2 * j] = _mm256_fmadd_ps(xb[r], w0, a[r][2 * j]);
                    a[r][2 * j + 1] = _mm256_fmadd_ps(xb[r], w1, a[r][2 * j + 1]);
                }
            }
        }
        if (GROUPED(kind))
            for (int j = 0; j < NP; j++)
                for (int r = 0; r < R; r++)
                    fold_group(m, kind, p + j, k0 / GROUP, a[r][2 * j], a[r][2 * j + 1],
                               xs[r * ldxs + k0 / GROUP], out[j][r]);
    }
    if (!GROUPED(kind))
        for (int j = 0; j < NP; j++)
            for (int r = 0; r < R; r++) finish(m, kind, p + j, a[r][2 * j], a[r][2 * j + 1], out[j][r]);
}

/* R rows against kb decoded inputs in wbuf, continuing the sums in acc (R x PANEL). */
SD_INLINE void rows_over_block(const float *x, int64_t ldx, const float *wbuf, int64_t kb,
                                   int R, float *acc, int fresh) {
    __m256 a0[ROWS], a1[ROWS];
    for (int r = 0; r < R; r++) {
        a0[r] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * PANEL);
        a1[r] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * PANEL + 8);
    }
    for (int64_t k = 0; k < kb; k++) {
        __m256 w0 = _mm256_loadu_ps(wbuf + k * PANEL), w1 = _mm256_loadu_ps(wbuf + k * PANEL + 8);
        for (int r = 0; r < R; r++) {
            __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
            a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(acc + r * PANEL, a0[r]);
        _mm256_storeu_ps(acc + r * PANEL + 8, a1[r]);
    }
}

#define KBLOCK 32 /* inputs decoded at a time on the buffered path (an I4 group) */

/* More rows than a register block: each block of KBLOCK inputs is decoded once into wbuf and
 * every row block of the chunk passes over it; the sums wait in acc between blocks. */
SD_INLINE void panel_buffered(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                               const sd_mat *m, int kind, int64_t p, int64_t M,
                               float out[][PANEL]) {
    float wbuf[KBLOCK * PANEL], acc[CHUNK * PANEL];
    int64_t K = m->k;
    memset(out, 0, sizeof(float) * PANEL * (size_t)M);
    for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
        int64_t kb = K - k0 < KBLOCK ? K - k0 : KBLOCK;
        for (int64_t k = 0; k < kb; k++) {
            __m256 w0, w1;
            decode_k(m, kind, p, k0 + k, &w0, &w1);
            _mm256_storeu_ps(wbuf + k * PANEL, w0);
            _mm256_storeu_ps(wbuf + k * PANEL + 8, w1);
        }
        int fresh = k0 == 0 || GROUPED(kind); /* a grouped kind's block is one group */
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            int R = M - r0 >= ROWS ? ROWS : (int)(M - r0);
            const float *xr = x + r0 * ldx + k0;
            float *ar = acc + r0 * PANEL;
            switch (R) {
            case 6: rows_over_block(xr, ldx, wbuf, kb, 6, ar, fresh); break;
            case 5: rows_over_block(xr, ldx, wbuf, kb, 5, ar, fresh); break;
            case 4: rows_over_block(xr, ldx, wbuf, kb, 4, ar, fresh); break;
            case 3: rows_over_block(xr, ldx, wbuf, kb, 3, ar, fresh); break;
            case 2: rows_over_block(xr, ldx, wbuf, kb, 2, ar, fresh); break;
            default: rows_over_block(xr, ldx, wbuf, kb, 1, ar, fresh); break;
            }
            if (GROUPED(kind))
                for (int r = 0; r < R; r++)
                    fold_group(m, kind, p, k0 / GROUP, _mm256_loadu_ps(ar + r * PANEL),
                               _mm256_loadu_ps(ar + r * PANEL + 8),
                               xs[(r0 + r) * ldxs + k0 / GROUP], out[r0 + r]);
        }
    }
    if (!GROUPED(kind))
        for (int64_t r = 0; r < M; r++)
            finish(m, kind, p, _mm256_loadu_ps(acc + r * PANEL), _mm256_loadu_ps(acc + r * PANEL + 8),
                   out[r]);
}

/* Panels p..p+np-1 (np panels per call: 4 for one row, 2 for two, else 1) for M rows. */
SD_INLINE void chunk_of_kind(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                             const sd_mat *m, int kind, int64_t p, int np, int64_t M,
                             float out[][CHUNK][PANEL]) {
    if (M == 1) {
        switch (np) {
        case 4: panel_direct(x, ldx, xs, ldxs, m, kind, p, 4, 1, out); break;
        case 3: panel_direct(x, ldx, xs, ldxs, m, kind, p, 3, 1, out); break;
        case 2: panel_direct(x, ldx, xs, ldxs, m, kind, p, 2, 1, out); break;
        default: panel_direct(x, ldx, xs, ldxs, m, kind, p, 1, 1, out); break;
        }
        return;
    }
    if (M == 2) {
        if (np == 2) panel_direct(x, ldx, xs, ldxs, m, kind, p, 2, 2, out);
        else panel_direct(x, ldx, xs, ldxs, m, kind, p, 1, 2, out);
        return;
    }
    switch (M) {
    case 3: panel_direct(x, ldx, xs, ldxs, m, kind, p, 1, 3, out); break;
    case 4: panel_direct(x, ldx, xs, ldxs, m, kind, p, 1, 4, out); break;
    case 5: panel_direct(x, ldx, xs, ldxs, m, kind, p, 1, 5, out); break;
    case 6: panel_direct(x, ldx, xs, ldxs, m, kind, p, 1, 6, out); break;
    default: panel_buffered(x, ldx, xs, ldxs, m, kind, p, M, out[0]); break;
    }
}

/* One body per weight kind, row count and panel count, the kind a constant in each. */
static void panel_chunk(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                        const sd_mat *m, int64_t p, int np, int64_t M, float out[][CHUNK][PANEL]) {
    switch (m->kind) {
    case KIND_F32: chunk_of_kind(x, ldx, xs, ldxs, m, KIND_F32, p, np, M, out); break;
    case KIND_BF16: chunk_of_kind(x, ldx, xs, ldxs, m, KIND_BF16, p, np, M, out); break;
    case KIND_I8: chunk_of_kind(x, ldx, xs, ldxs, m, KIND_I8, p, np, M, out); break;
    case KIND_I8G: chunk_of_kind(x, ldx, xs, ldxs, m, KIND_I8G, p, np, M, out); break;
    default: chunk_of_kind(x, ldx, xs, ldxs, m, KIND_I4, p, np, M, out); break;
    }
}
#else
static inline float weight_at(const sd_mat *m, int64_t p, int64_t k, int c) {
    int64_t K = m->k;
    switch (m->kind) {
    case KIND_F32: return ((const float *)m->w)[(p * K + k) * PANEL + c];
    case KIND_BF16: return bf16_to_f32(((const uint16_t *)m->w)[(p * K + k) * PANEL + c]);
    case KIND_I8:
    case KIND_I8G: return (float)((const int8_t *)m->w)[(p * K + k) * PANEL + c];
    default: {
        uint8_t b = ((const uint8_t *)m->w)[(p * K + k) * (PANEL / 2) + c % 8];
        return (float)(c < 8 ? b & 0xf : b >> 4);
    }
    }
}

/* The vector code's arithmetic (see there), one element at a time. */
static void panel_one(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                      const sd_mat *m, int64_t p, int64_t M, float out[][PANEL]) {
    int64_t K = m->k, G = K / GROUP;
    for (int64_t r = 0; r < M; r++)
        for (int c = 0; c < PANEL; c++) {
            if (GROUPED(m->kind)) {
                float y = 0.0f;
                for (int64_t g = 0; g < G; g++) {
                    float a = 0.0f;
                    for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++)
                        a = fmaf(x[r * ldx + k], weight_at(m, p, k, c), a);
                    int64_t i = (p * G + g) * PANEL + c;
                    y = m->kind == KIND_I8G ? fmaf(a, m->scale[i], y)
                                            : fmaf(xs[r * ldxs + g], m->zero[i], fmaf(a, m->scale[i], y));
                }
                out[r][c] = y;
            } else {
                float a = 0.0f;
                for (int64_t k = 0; k < K; k++) a = fmaf(x[r * ldx + k], weight_at(m, p, k, c), a);
                out[r][c] = m->kind == KIND_I8 ? a * m->scale[p * PANEL + c] : a;
            }
        }
}

static void panel_chunk(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                        const sd_mat *m, int64_t p, int np, int64_t M, float out[][CHUNK][PANEL]) {
    for (int j = 0; j < np; j++) panel_one(x, ldx, xs, ldxs, m, p + j, M, out[j]);
}
#endif

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
    int NP = M == 1 ? 4 : M == 2 ? 2 : 1; /* panels per call (chunk_of_kind) */
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
        int64_t mc = M - m0 < CHUNK ? M - m0 : CHUNK;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < (P + NP - 1) / NP; g++) {
            float out[4][CHUNK][PANEL];
            int64_t p0 = g * NP;
            int np = P - p0 < NP ? (int)(P - p0) : NP;
            panel_chunk(xin + m0 * K, K, xs ? xs + m0 * G : NULL, G, m, p0, np, mc, out);
            for (int j = 0; j < np; j++) {
                int64_t n0 = (p0 + j) * PANEL, nn = N - n0 < PANEL ? N - n0 : PANEL;
                for (int64_t r = 0; r < mc; r++) {
                    float *yr = y + (m0 + r) * ldy + n0;
                    for (int64_t c = 0; c < nn; c++) {
                        float v = m->bias ? out[j][r][c] + m->bias[n0 + c] : out[j][r][c];
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
