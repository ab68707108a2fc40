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
 * - products: y[m][n] = ((w[0][n] x[m][0] + 0) + w[1][n] x[m][1]) + ..., one fused multiply-add
 *   per input in input order, for every row count; rows are blocked for speed, but a block only
 *   shares the loads of the weights, never a sum; threads split the output columns;
 * - attention: per query row and head, the scores of the attended keys in slot order, their
 *   maximum, then the exponentials summed and the values accumulated in slot order; a key that
 *   is masked out is skipped, never added as a zero.
 * Compiled with -ffp-contract=off, so the compiler fuses nothing on its own: every fused
 * multiply-add is written out, the same in the vector and the scalar code.
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

int sd_has_avx2(void) { return SD_AVX2; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---- products ----------------------------------------------------------------------------
 * Packed weights: panel p holds, for k = 0..K-1, the PANEL values W[p*PANEL + c][k], c = 0..15,
 * contiguously (zero beyond N). kind 0: fp32 values, kind 1: bf16 values. */

#if SD_AVX2
static inline void load_panel(const void *w, int kind, int64_t off, __m256 *w0, __m256 *w1) {
    if (kind == 0) {
        const float *p = (const float *)w + off;
        *w0 = _mm256_loadu_ps(p);
        *w1 = _mm256_loadu_ps(p + 8);
    } else {
        const uint16_t *p = (const uint16_t *)w + off;
        __m128i lo = _mm_loadu_si128((const __m128i *)p);
        __m128i hi = _mm_loadu_si128((const __m128i *)(p + 8));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16));
        *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16));
    }
}

/* R rows (1..ROWS) against one panel; R is a constant after inlining. */
static inline void panel_rows(const float *x, int64_t K, const void *w, int kind, int64_t p,
                              int R, float out[ROWS][PANEL]) {
    __m256 a0[ROWS], a1[ROWS];
    for (int r = 0; r < R; r++) {
        a0[r] = _mm256_setzero_ps();
        a1[r] = _mm256_setzero_ps();
    }
    int64_t base = p * K * PANEL;
    for (int64_t k = 0; k < K; k++) {
        __m256 w0, w1;
        load_panel(w, kind, base + k * PANEL, &w0, &w1);
        for (int r = 0; r < R; r++) {
            __m256 xb = _mm256_broadcast_ss(x + r * K + k);
            a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
            a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out[r], a0[r]);
        _mm256_storeu_ps(out[r] + 8, a1[r]);
    }
}
#else
static inline float panel_value(const void *w, int kind, int64_t off) {
    return kind == 0 ? ((const float *)w)[off] : bf16_to_f32(((const uint16_t *)w)[off]);
}

static inline void panel_rows(const float *x, int64_t K, const void *w, int kind, int64_t p,
                              int R, float out[ROWS][PANEL]) {
    float acc[ROWS][PANEL] = {{0}};
    int64_t base = p * K * PANEL;
    for (int64_t k = 0; k < K; k++) {
        for (int r = 0; r < R; r++) {
            float xv = x[r * K + k];
            for (int c = 0; c < PANEL; c++)
                acc[r][c] = fmaf(xv, panel_value(w, kind, base + k * PANEL + c), acc[r][c]);
        }
    }
    memcpy(out, acc, sizeof acc);
}
#endif

static void store_rows(float out[ROWS][PANEL], int R, int64_t n0, int64_t nn, const float *bias,
                       float *y, int64_t N) {
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < nn; c++)
            y[r * N + n0 + c] = bias ? out[r][c] + bias[n0 + c] : out[r][c];
}

/* y (M, N) = x (M, K) W^T (+ bias), W packed (see above). */
void sd_matmul(const float *x, int64_t M, int64_t K, const void *w, int kind, int64_t N,
               const float *bias, float *y) {
    int64_t P = (N + PANEL - 1) / PANEL;
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
        int64_t mc = M - m0 < CHUNK ? M - m0 : CHUNK;
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            float out[ROWS][PANEL];
            int64_t n0 = p * PANEL, nn = N - n0 < PANEL ? N - n0 : PANEL;
            for (int64_t r0 = 0; r0 < mc; r0 += ROWS) {
                const float *xr = x + (m0 + r0) * K;
                int64_t left = mc - r0;
                int R = left >= ROWS ? ROWS : (int)left;
                switch (R) {  /* one specialised body per row count: identical arithmetic */
                case 4: panel_rows(xr, K, w, kind, p, 4, out); break;
                case 3: panel_rows(xr, K, w, kind, p, 3, out); break;
                case 2: panel_rows(xr, K, w, kind, p, 2, out); break;
                default: panel_rows(xr, K, w, kind, p, 1, out); break;
                }
                store_rows(out, R, n0, nn, bias, y + (m0 + r0) * N, N);
            }
        }
    }
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

/* out (R, NH, D) = softmax(q k^T * scale) v per query row r and head h, over the keys of cache
 * row rows[r] in slots 0..used-1 that mask[r][j] allows (mask NULL: all of them).
 * q: row r head h at q + r * q_row + h * D. kc, vc: slot j of cache row b, kv head g at
 * + b * c_row + g * c_head + j * D. Heads share kv heads in groups of NH / KVH. */
void sd_attention(const float *q, int64_t q_row, int64_t R, int64_t NH, int64_t D,
                  const float *kc, const float *vc, int64_t c_row, int64_t c_head, int64_t KVH,
                  const int64_t *rows, const uint8_t *mask, int64_t used, float scale,
                  float *out) {
    int64_t group = NH / KVH;
#pragma omp parallel
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(used > 0 ? used : 1));
        float *acc = (float *)malloc(sizeof(float) * (size_t)D);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < R * NH; t++) {
            int64_t r = t / NH, h = t % NH, g = h / group;
            const float *qv = q + r * q_row + h * D;
            const float *kb = kc + rows[r] * c_row + g * c_head;
            const float *vb = vc + rows[r] * c_row + g * c_head;
            const uint8_t *mr = mask ? mask + r * used : NULL;
            float mx = -INFINITY;
            for (int64_t j = 0; j < used; j++) {
                if (mr && !mr[j]) continue;
                s[j] = dot(qv, kb + j * D, D) * scale;
                if (s[j] > mx) mx = s[j];
            }
            float sum = 0.0f;
            memset(acc, 0, sizeof(float) * (size_t)D);
            for (int64_t j = 0; j < used; j++) {
                if (mr && !mr[j]) continue;
                float e = expf(s[j] - mx);
                sum += e;
                axpy(e, vb + j * D, acc, D);
            }
            float *o = out + (r * NH + h) * D;
            for (int64_t d = 0; d < D; d++) o[d] = acc[d] / sum;
        }
        free(s);
        free(acc);
    }
}
