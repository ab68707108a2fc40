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
 * - products: vector lanes are output columns, never inputs, so a column's arithmetic is the
 *   same scalar sequence whatever the vector width (scalar, AVX2, AVX-512 builds agree bit for
 *   bit). Float kinds: y[m][n] accumulates w[k][n] x[m][k] for k = 0, 1, ... with one fused
 *   multiply-add each, in input order, for every row count; grouped kinds sum each group of
 *   inputs from 0 and fold it into y at the group's end, in group order. Rows are blocked for
 *   speed, but a block only shares the loads and decoding of the weights, never a sum; threads
 *   split the output columns.
 * - integer-activation kinds (Q4, Q8: the "a8" precisions): each row's inputs are rounded to
 *   int8 per block of 32 (one scale per block, by one scalar routine in every build); a group's
 *   products are summed in int32, which is exact whatever the order or the instruction (VNNI's
 *   dot products, AVX2's pairwise sums, scalar loops agree), then folded into y in fp32 in group
 *   order as above. Matrices with K-quant scales (GGUF's Q4_K, Q5_K, Q6_K) round a row's inputs
 *   per super-block of 256 instead (llama.cpp's Q8_K does the same), so a super-block's groups
 *   times their integer sub-scales are one exact int32 sum, folded once, in super-block order.
 * - attention: per query row and head, the scores of the attended keys in slot order, their
 *   maximum, then the exponentials summed and the values accumulated in slot order; a key that
 *   is masked out is skipped, never added as a zero. Dot products over the head dimension use
 *   eight partial sums and one fixed tree, in every build.
 * - norms and activations: per row, fixed-order sums.
 * Compiled with -ffp-contract=off, so the compiler fuses nothing on its own: every fused
 * multiply-add is written out, the same in the vector and the scalar code.
 *
 * The same source is compiled once per instruction set (models.kernels picks the best one the
 * CPU runs, after trying it in a child process): SD_ISA 0 scalar, 2 AVX2+FMA, 3 AVX-512
 * (F/BW/VL/DQ), with __AVX512VNNI__ for VNNI dot products in the integer kinds.
 *
 * sd_block runs a whole transformer block in one call (one OpenMP region, phases separated by
 * barriers); sd_forward runs every block, the final norm and the LM head in one call.
 * Functions that allocate return 0, or SD_ENOMEM when an allocation failed (nothing written).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define SD_ISA 3
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SD_ISA 2
#else
#define SD_ISA 0
#endif
#if SD_ISA == 3 && defined(__AVX512VNNI__)
#define SD_VNNI 1
#else
#define SD_VNNI 0
#endif

#if SD_ISA == 3
#define YREG_MAX 8   /* a8: blocks of at most this many rows x panels keep their sums in zmm */
/* a8: rows sharing one pass over a panel. 4 rows x 2 panels keep every integer and fp32 sum in
 * zmm; 12 rows spilled them (24 integer sums beside the weights) and each row past the fourth
 * cost more than the one before (Zen 4: 9 positions of the 1.5B pair target 3.7 steps, 2.3 with
 * blocks of 4, whose panels come back from L2, not memory). Blocking never changes a sum's
 * order, so every block size computes the same bits (the trial compares 1..12 and 70 rows). */
#define QROWS_MAX 4
#elif SD_ISA == 2
#define YREG_MAX 0
#define QROWS_MAX 4 /* two ymm of sums per row: the other registers hold weights */
#else
#define YREG_MAX 0
#define QROWS_MAX 6
#endif
/* a8, one row: panels sharing one pass over its inputs. AVX-512 took 8: that kept 16 weight
 * and scale streams in flight per thread, more than the prefetchers follow, and a plain step was
 * slower than with 4 on both pair targets (docs/measurements/2026-12-07-zen4-q6-one-row.md). */
#define QNP_MAX 4
#define SD_ABI 5           /* bumped whenever a struct or a signature below changes */
#define PANEL 16           /* output columns per packed panel */
#define CHUNK 64           /* rows whose inputs stay in cache while every panel passes over them */
#define DECODE_ONCE_ROWS 16 /* rows from which a 5- or 6-bit panel is decoded to bytes once */
#define QBLOCK 32          /* inputs per int8 scale of the a8 kinds' activations */
#define MAX_HEAD_DIM 512   /* the per-row RoPE buffer */
#define SD_ENOMEM 1
#define SD_INLINE static inline __attribute__((always_inline))

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_I8 = 2, KIND_I4 = 3, KIND_I8G = 4, KIND_Q4 = 5, KIND_Q8 = 6,
       KIND_Q5 = 7, KIND_Q6 = 8 };
#define GROUPED(kind) ((kind) == KIND_I4 || (kind) == KIND_I8G)
/* log2 of a grouped or a8 kind's inputs per group, 16 or 32 (kernels.py refuses others): a
 * shift where a 64-bit division once a group and panel cost as much as the group's products */
SD_INLINE int group_shift(int64_t group) { return group == 16 ? 4 : 5; }
#define QUANT(kind) ((kind) == KIND_Q4 || (kind) == KIND_Q8 || (kind) == KIND_Q5 || (kind) == KIND_Q6)


/* A weight matrix (N outputs, K inputs) in panels of PANEL output columns.
 * F32 / BF16: panel p holds W[p*16 + c][k] at [(p*K + k)*16 + c].
 * I8: int8 codes likewise; scale[p*16 + c] per output column: w = code * scale.
 * I4: codes 0..15, byte [(p*K + k)*8 + c] = code of column c | code of column c + 8 << 4;
 *     scale, zero at [(p*(K/G) + g)*16 + c] for input group g of G = `group` inputs:
 *     w = code * scale + zero.
 * I8G: int8 codes as I8, a scale (and, if `zero` is set, a zero) per output column and group,
 *     laid out as I4's: w = code * scale (+ zero) (GGUF's Q8_0, Q5_x and Q6_K blocks).
 * Q8 (a8): byte codes, quad i of inputs 4i..4i+3 of panel p at [((p*(K/4) + i)*16 + c)*4 + j]
 *     for input 4i + j: w = (code - offset) * scale (+ zero), scale/zero per group as I4's.
 * Q4 (a8): 4-bit codes, octet i of inputs 8i..8i+7 at byte [((p*(K/8) + i)*16 + c)*4 + j]:
 *     input 8i + j in the low nibble, 8i + 4 + j in the high one; w = (code - offset) * scale
 *     (+ zero).
 * a8 kinds with `kblock` 256 (GGUF K-quants) hold their scales as the file does instead of one
 *     fp32 scale (and zero) per group: per panel and super-block of 256 inputs, at
 *     scale + (p*(K/256) + s)*kb bytes: 16 fp32 d, then (if `zero`) 16 fp32 dmin, then 256/G
 *     int8 sub-scales per column (group-major), then (if `zero`) 256/G int8 sub-minimums; the
 *     group's scale is d * sc and its zero -(dmin * m), the same fp32 values as the tables.
 * Q5, Q6 (a8): 5- or 6-bit codes as Q4's nibbles plus their high bits in `hbits`, laid out so
 *     that a few shifts and masks put them in place. An octet's 128 codes are four vectors of
 *     32 bytes, V0 = low nibbles of bytes 0..31, V1 = of bytes 32..63, V2, V3 = the high
 *     nibbles'; element e of V_t is input 8i + 4(t/2) + j of column c = 8(t%2) + e/4, j = e%4.
 *     Q6: 32 bytes per octet and panel at ((p*(K/8) + i)*32): byte e holds bits 4-5 of V_t's
 *     element e at bits 2t..2t+1 (GGUF's Q6_K at 0.83 bytes a weight, not 1.08 as bytes).
 *     Q5: 16 bytes at ((p*(K/8) + i)*16): the fifth bit of V_t's element e is bit
 *     Q5_BIT(t, e/16) of byte e%16, Q5_BIT = 4,5 / 6,7 / 0,1 / 2,3 for t = 0..3 (so one
 *     variable shift a vector lands every bit on bit 4; GGUF's Q5_0 / Q5_1 / Q5_K at 0.69
 *     bytes a weight, not 1.1). Either way the integer sums, hence every bit of the output,
 *     are those of the same codes as bytes. */
typedef struct {
    const void *w;
    const float *scale;
    const float *zero;
    const float *bias; /* (N,) or NULL */
    int64_t n, k;
    int32_t kind;
    int32_t round_x; /* round the inputs to bf16 first (the "a16" precisions) */
    int32_t group;   /* inputs per scale of the grouped and a8 kinds: 16 or 32 */
    int32_t offset;  /* a8 kinds: the codes' offset */
    const uint8_t *hbits; /* Q5, Q6: the high bits; else NULL */
    int64_t kblock;       /* a8 kinds: 256 where scales are held K-quant style, else 0 */
} sd_mat;

int sd_abi(void) { return SD_ABI; }

int sd_isa(void) { return SD_ISA * 10 + SD_VNNI; }

int sd_has_avx2(void) { return SD_ISA >= 2; }

/* The constants Python must agree with, checked at load (models.kernels). */
void sd_constants(int64_t *out) {
    out[0] = SD_ABI;
    out[1] = PANEL;
    out[2] = CHUNK;
    out[3] = QBLOCK;
    out[4] = MAX_HEAD_DIM;
    out[5] = (int64_t)sizeof(sd_mat);
}

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

/* ---- products of the float-activation kinds (kernels_fp.h) ------------------------------- */

#define FPCAT2(a, b) a##b
#define FPCAT(a, b) FPCAT2(a, b)
#define NPMAX_ALL 8 /* the most panels a float call takes (the wide width's) */
#if SD_ISA == 3
#define FP_WIDE 1
#define FPN(name) FPCAT(name, _w)
#include "kernels_fp.h"
#undef FP_WIDE
#undef FPN
#define FP_WIDE 0
#define FPN(name) FPCAT(name, _n)
#include "kernels_fp.h"
#undef FP_WIDE
#undef FPN
/* One row or two: the two-ymm width (a 16-lane decode of 4-bit codes costs more than two
 * 8-lane ones, and one row's sums are few); three and more: the zmm width (twice the columns per
 * multiply-add). The same bits either way. */
#define FP_WIDE_ROWS 3
static int panels_per_call(int64_t M) {
    return M >= FP_WIDE_ROWS ? panels_per_call_w(M) : panels_per_call_n(M);
}
static void panel_chunk(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                        const sd_mat *m, int64_t p, int np, int64_t M, float out[][CHUNK][PANEL]) {
    if (M >= FP_WIDE_ROWS) panel_chunk_w(x, ldx, xs, ldxs, m, p, np, M, out);
    else panel_chunk_n(x, ldx, xs, ldxs, m, p, np, M, out);
}
#else
#define FP_WIDE 0
#define FPN(name) name
#include "kernels_fp.h"
#undef FP_WIDE
#undef FPN
#endif

#define OUT_NP (NPMAX_ALL > QNP_MAX ? NPMAX_ALL : QNP_MAX)

/* a8 panels per call for M rows: one row keeps several panels' sums in flight. */
static int qpanels_per_call(int64_t M) { return M == 1 ? QNP_MAX : SD_ISA == 3 ? 2 : 1; }

/* ---- products of the integer-activation (a8) kinds ---------------------------------------- */

/* A row's inputs as the a8 kinds use them: int8 codes q per block of 32 inputs with one scale d
 * (d = max|x| / 127, q = x / d rounded to nearest even, |q| <= 127), the int32 sum of the codes
 * of each 16 inputs, and, for matrices with zeros, xs_g = (float)(sum of group g's codes) * d.
 * One scalar routine, the same in every build. */
typedef struct {
    int8_t *q;    /* (M, K) */
    float *d;     /* (M, K / 32) */
    int32_t *s16; /* (M, K / 16) */
    float *xs;    /* (M, K / group) or NULL */
    int32_t *gp;  /* K-quant matrices: (M, K / group / 2) pairs of groups' sums of codes as
                     int16 halves (low: group 2i), ready to broadcast (each fits: <= 32 x 127) */
} sd_qrows;

static void quantize_row(const float *x, int64_t K, int group, int qb, int8_t *q, float *d,
                         int32_t *s16, float *xs) {
    for (int64_t b = 0; b < K / qb; b++) {
        const float *xb = x + b * qb;
        float amax = 0.0f;
        for (int i = 0; i < qb; i++) {
            float v = fabsf(xb[i]);
            amax = v > amax ? v : amax;
        }
        float db = amax / 127.0f, id = db > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = db;
        for (int i = 0; i < qb; i++) {
            float v = nearbyintf(xb[i] * id);
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
            q[b * qb + i] = (int8_t)v;
        }
    }
    for (int64_t h = 0; h < K / 16; h++) {
        int32_t s = 0;
        for (int i = 0; i < 16; i++) s += q[h * 16 + i];
        s16[h] = s;
    }
    if (xs)
        for (int64_t g = 0; g < K / group; g++) {
            int32_t s = group == 16 ? s16[g] : s16[2 * g] + s16[2 * g + 1];
            xs[g] = (float)s * d[g * group / qb];
        }
}

/* A row's groups' sums of codes in pairs (sd_qrows.gp), from its sums per 16 */
static void group_pairs(const int32_t *s16, int64_t K, int group, int32_t *gp) {
    for (int64_t i = 0; i < K / group / 2; i++) {
        int32_t g0 = group == 16 ? s16[2 * i] : s16[4 * i] + s16[4 * i + 1];
        int32_t g1 = group == 16 ? s16[2 * i + 1] : s16[4 * i + 2] + s16[4 * i + 3];
        gp[i] = (int32_t)(((uint32_t)g0 & 0xffffu) | ((uint32_t)g1 << 16));
    }
}

/* Inputs per activation scale of a matrix: QBLOCK, or a K-quant's super-block of 256 (its sums
 * are then exact integers across the super-block, as llama.cpp's Q8_K activations make them) */
SD_INLINE int act_block(const sd_mat *m) { return m->kblock ? 256 : QBLOCK; }

/* Bytes of a K-quant scale table per panel and super-block (sd_mat's comment) */
SD_INLINE int64_t ktable_bytes(const sd_mat *m) {
    int64_t per = m->kblock >> group_shift(m->group);
    return (m->zero ? 2 : 1) * (PANEL * 4 + per * PANEL);
}

static void quantize_rows(const float *x, int64_t M, const sd_mat *m, const sd_qrows *qr) {
    int64_t K = m->k;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        quantize_row(x + r * K, K, m->group, act_block(m), qr->q + r * K, qr->d + r * (K / QBLOCK),
                     qr->s16 + r * (K / 16), qr->xs ? qr->xs + r * (K / m->group) : NULL);
        if (m->kblock) group_pairs(qr->s16 + r * (K / 16), K, m->group, qr->gp + r * (K / m->group / 2));
    }
#ifdef SD_BROKEN_ROW_COUPLED
    /* A deliberately broken variant for the tests (never built otherwise): one activation
     * scale per block shared by every row of the call, as a per-tensor dynamic quantizer does:
     * a row's codes then depend on the rows beside it. */
#pragma omp single
    for (int64_t b = 0; b < K / act_block(m); b++) {
        const int qb = act_block(m);
        float dmax = 0.0f;
        for (int64_t r = 0; r < M; r++) dmax = qr->d[r * (K / QBLOCK) + b] > dmax ? qr->d[r * (K / QBLOCK) + b] : dmax;
        for (int64_t r = 0; r < M; r++) {
            float dr = qr->d[r * (K / QBLOCK) + b];
            for (int i = 0; i < qb; i++) {
                int8_t *q = qr->q + r * K + b * qb + i;
                *q = dmax > 0.0f ? (int8_t)nearbyintf((float)*q * dr / dmax) : 0;
            }
            qr->d[r * (K / QBLOCK) + b] = dmax;
        }
    }
#endif
}

/* The exact int32 sums of one group of one row against 16 columns: sum over the group's inputs
 * of (code - offset) * q. Every build computes the same integers. */
#if SD_ISA == 3
typedef __m512 yv16;
SD_INLINE yv16 y_zero(void) { return _mm512_setzero_ps(); }
SD_INLINE void y_store(float *p, yv16 v) { _mm512_storeu_ps(p, v); }
SD_INLINE yv16 y_load(const float *p) { return _mm512_loadu_ps(p); }
typedef __m512i i16v;
SD_INLINE i16v i_zero(void) { return _mm512_setzero_si512(); }
/* a quad of inputs (4 codes per column, 64 bytes) against one row's 4 int8 codes */
SD_INLINE i16v i_dot4(i16v acc, __m512i w, int32_t x4, int signed_w) {
#if SD_VNNI
    (void)signed_w;
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4));
#else
    __m512i xv = _mm512_set1_epi32(x4), t;
    if (signed_w) { /* codes over 127: |w - 128| with the sign moved onto x (no saturation) */
        __m512i ws = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
        __mmask64 neg = _mm512_movepi8_mask(ws);
        __m512i xs = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
        t = _mm512_maddubs_epi16(_mm512_abs_epi8(ws), xs);
    } else {
        t = _mm512_maddubs_epi16(w, xv);
    }
    return _mm512_add_epi32(acc, _mm512_madd_epi16(t, _mm512_set1_epi16(1)));
#endif
}
typedef __m512i q64; /* 64 codes, as the other builds name them */
SD_INLINE __m512i q_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
SD_INLINE void q_store(uint8_t *p, __m512i v) { _mm512_storeu_si512((void *)p, v); }
/* An octet's high bits (the layout in sd_mat's comment): lo = V0|V1, hi = V2|V3 */
SD_INLINE void q_high5(__m512i *lo, __m512i *hi, const uint8_t *h) {
    __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)h)), m = _mm512_set1_epi8(0x10);
    __m512i rl = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512i lh = _mm512_set_epi32(1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4);
    *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_srlv_epi32(b, rl), m));
    *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_sllv_epi32(b, lh), m));
}
SD_INLINE void q_high6(__m512i *lo, __m512i *hi, const uint8_t *h) {
    __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)h)), m = _mm512_set1_epi8(0x30);
    *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_sllv_epi64(b, _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4)), m));
    *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_srlv_epi64(b, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0)), m));
}
SD_INLINE __m512i q_lo(__m512i b) { return _mm512_and_si512(b, _mm512_set1_epi8(0xf)); }
SD_INLINE __m512i q_hi(__m512i b) { return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(0xf)); }
SD_INLINE yv16 i_fold(i16v acc, int32_t corr, float dx, yv16 scale, yv16 zero, int has_zero,
                      float xs, yv16 y) {
    __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_set1_epi32(corr)));
    y = _mm512_fmadd_ps(_mm512_mul_ps(f, _mm512_set1_ps(dx)), scale, y);
    if (has_zero) y = _mm512_fmadd_ps(_mm512_set1_ps(xs), zero, y);
    return y;
}
/* K-quant super-blocks (qpanel_rows_k): int32 arithmetic, then one fold */
SD_INLINE i16v i_set1(int32_t v) { return _mm512_set1_epi32(v); }
SD_INLINE i16v i_sub(i16v a, i16v b) { return _mm512_sub_epi32(a, b); }
SD_INLINE i16v i_muladd(i16v acc, i16v a, i16v b) { return _mm512_add_epi32(acc, _mm512_mullo_epi32(a, b)); }
SD_INLINE i16v i_add(i16v a, i16v b) { return _mm512_add_epi32(a, b); }
SD_INLINE i16v k_isc(const int8_t *sc) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc)); }
SD_INLINE yv16 i_kfold(i16v sum, i16v msum, float dx, yv16 d, yv16 dmin, int has_zero, yv16 y) {
    __m512 x = _mm512_set1_ps(dx);
    y = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), x), d, y);
    if (has_zero) y = _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(msum), x), dmin, y);
    return y;
}
#elif SD_ISA == 2
typedef v16 yv16;
SD_INLINE yv16 y_zero(void) { return v_zero(); }
SD_INLINE void y_store(float *p, yv16 v) { v_store(p, v); }
SD_INLINE yv16 y_load(const float *p) { return v_load(p); }
typedef struct { __m256i a, b; } i16v;
SD_INLINE i16v i_zero(void) { i16v r = {_mm256_setzero_si256(), _mm256_setzero_si256()}; return r; }
SD_INLINE __m256i dot4_half(__m256i acc, __m256i w, __m256i xv, int signed_w) {
    __m256i t;
    if (signed_w) {
        __m256i ws = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
        t = _mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(xv, ws));
    } else {
        t = _mm256_maddubs_epi16(w, xv);
    }
    return _mm256_add_epi32(acc, _mm256_madd_epi16(t, _mm256_set1_epi16(1)));
}
typedef struct { __m256i a, b; } q64;
SD_INLINE i16v i_dot4(i16v acc, q64 w, int32_t x4, int signed_w) {
    __m256i xv = _mm256_set1_epi32(x4);
    i16v r = {dot4_half(acc.a, w.a, xv, signed_w), dot4_half(acc.b, w.b, xv, signed_w)};
    return r;
}
/* An octet of a nibble kind (codes 0..63): two quads against a row's codes xa, xb. The two
 * pairwise int16 sums are added before widening: each is at most 2 x 63 x 127, so their sum
 * fits in int16 (32004) and one widening serves both. */
typedef i16v p16v;
SD_INLINE p16v p_zero(void) { return i_zero(); }
SD_INLINE __m256i pair16(__m256i lo, __m256i hi, __m256i xa, __m256i xb) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb));
}
SD_INLINE p16v p_octet(p16v acc, q64 lo, q64 hi, int32_t xa, int32_t xb) {
    __m256i va = _mm256_set1_epi32(xa), vb = _mm256_set1_epi32(xb);
    p16v r = {_mm256_add_epi16(acc.a, pair16(lo.a, hi.a, va, vb)),
              _mm256_add_epi16(acc.b, pair16(lo.b, hi.b, va, vb))};
    return r;
}
SD_INLINE i16v p_widen(p16v acc) {
    __m256i one = _mm256_set1_epi16(1);
    i16v r = {_mm256_madd_epi16(acc.a, one), _mm256_madd_epi16(acc.b, one)};
    return r;
}
SD_INLINE i16v i_octet(i16v acc, q64 lo, q64 hi, int32_t xa, int32_t xb) {
    __m256i va = _mm256_set1_epi32(xa), vb = _mm256_set1_epi32(xb), one = _mm256_set1_epi16(1);
    i16v r = {_mm256_add_epi32(acc.a, _mm256_madd_epi16(pair16(lo.a, hi.a, va, vb), one)),
              _mm256_add_epi32(acc.b, _mm256_madd_epi16(pair16(lo.b, hi.b, va, vb), one))};
    return r;
}
SD_INLINE q64 q_load(const uint8_t *p) {
    q64 r = {_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
    return r;
}
SD_INLINE void q_store(uint8_t *p, q64 v) {
    _mm256_storeu_si256((__m256i *)p, v.a);
    _mm256_storeu_si256((__m256i *)(p + 32), v.b);
}
SD_INLINE q64 q_lo(q64 b) {
    __m256i f = _mm256_set1_epi8(0xf);
    q64 r = {_mm256_and_si256(b.a, f), _mm256_and_si256(b.b, f)};
    return r;
}
SD_INLINE q64 q_hi(q64 b) {
    __m256i f = _mm256_set1_epi8(0xf);
    q64 r = {_mm256_and_si256(_mm256_srli_epi16(b.a, 4), f), _mm256_and_si256(_mm256_srli_epi16(b.b, 4), f)};
    return r;
}
/* An octet's high bits (the layout in sd_mat's comment): V0..V3 = lo.a, lo.b, hi.a, hi.b */
SD_INLINE __m256i h5(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x10)); }
SD_INLINE void q_high5(q64 *lo, q64 *hi, const uint8_t *h) {
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)h));
    lo->a = _mm256_or_si256(lo->a, h5(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1))));
    lo->b = _mm256_or_si256(lo->b, h5(_mm256_srlv_epi32(b, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3))));
    hi->a = _mm256_or_si256(hi->a, h5(_mm256_sllv_epi32(b, _mm256_setr_epi32(4, 4, 4, 4, 3, 3, 3, 3))));
    hi->b = _mm256_or_si256(hi->b, h5(_mm256_sllv_epi32(b, _mm256_setr_epi32(2, 2, 2, 2, 1, 1, 1, 1))));
}
SD_INLINE void q_high6(q64 *lo, q64 *hi, const uint8_t *h) {
    __m256i b = _mm256_loadu_si256((const __m256i *)h), m = _mm256_set1_epi8(0x30);
    lo->a = _mm256_or_si256(lo->a, _mm256_and_si256(_mm256_slli_epi16(b, 4), m));
    lo->b = _mm256_or_si256(lo->b, _mm256_and_si256(_mm256_slli_epi16(b, 2), m));
    hi->a = _mm256_or_si256(hi->a, _mm256_and_si256(b, m));
    hi->b = _mm256_or_si256(hi->b, _mm256_and_si256(_mm256_srli_epi16(b, 2), m));
}
SD_INLINE v16 i_fold(i16v acc, int32_t corr, float dx, v16 scale, v16 zero, int has_zero,
                     float xs, v16 y) {
    __m256i c = _mm256_set1_epi32(corr);
    __m256 d = _mm256_set1_ps(dx);
    __m256 fa = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc.a, c)), d);
    __m256 fb = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc.b, c)), d);
    y.a = _mm256_fmadd_ps(fa, scale.a, y.a);
    y.b = _mm256_fmadd_ps(fb, scale.b, y.b);
    if (has_zero) {
        __m256 s = _mm256_set1_ps(xs);
        y.a = _mm256_fmadd_ps(s, zero.a, y.a);
        y.b = _mm256_fmadd_ps(s, zero.b, y.b);
    }
    return y;
}
SD_INLINE i16v i_set1(int32_t v) { i16v r = {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; return r; }
SD_INLINE i16v i_sub(i16v a, i16v b) {
    i16v r = {_mm256_sub_epi32(a.a, b.a), _mm256_sub_epi32(a.b, b.b)};
    return r;
}
SD_INLINE i16v i_muladd(i16v acc, i16v a, i16v b) {
    i16v r = {_mm256_add_epi32(acc.a, _mm256_mullo_epi32(a.a, b.a)),
              _mm256_add_epi32(acc.b, _mm256_mullo_epi32(a.b, b.b))};
    return r;
}
SD_INLINE i16v i_add(i16v a, i16v b) {
    i16v r = {_mm256_add_epi32(a.a, b.a), _mm256_add_epi32(a.b, b.b)};
    return r;
}
/* A K-quant sub-scale as the int16 stage widens with it: sc[c] in both int16 lanes of column
 * c, so one vpmaddwd gives sc[c] x (the column's pair sums) in int32 */
typedef struct { __m256i a, b; } kscv;
#define SD_INT16_STAGE 1
SD_INLINE kscv k_scv(const int8_t *sc) {
    __m128i b = _mm_loadu_si128((const __m128i *)sc);
    kscv r = {_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(b, b)), _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(b, b))};
    return r;
}
SD_INLINE i16v p_widen_sc(p16v acc, kscv s) {
    i16v r = {_mm256_madd_epi16(acc.a, s.a), _mm256_madd_epi16(acc.b, s.b)};
    return r;
}
SD_INLINE i16v k_isc(const int8_t *sc) {
    __m128i b = _mm_loadu_si128((const __m128i *)sc);
    i16v r = {_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b))};
    return r;
}
/* sum over groups t < per (even) of tab[t][c] x (group t's sum of codes), exact in int32: two
 * groups a vpmaddwd, their int8 entries widened to int16 pairs, the sums' pairs gp broadcast */
#define SD_KTABSUM 1
SD_INLINE i16v k_tabsum(const int8_t *tab, int per, const int32_t *gp) {
    i16v r = i_zero();
    for (int t = 0; t < per; t += 2) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)(tab + t * PANEL));
        __m128i x1 = _mm_loadu_si128((const __m128i *)(tab + (t + 1) * PANEL));
        __m256i gv = _mm256_set1_epi32(gp[t / 2]);
        r.a = _mm256_add_epi32(r.a, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x0, x1)), gv));
        r.b = _mm256_add_epi32(r.b, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_unpackhi_epi8(x0, x1)), gv));
    }
    return r;
}
SD_INLINE v16 i_kfold(i16v sum, i16v msum, float dx, v16 d, v16 dmin, int has_zero, v16 y) {
    __m256 x = _mm256_set1_ps(dx);
    y.a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum.a), x), d.a, y.a);
    y.b = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum.b), x), d.b, y.b);
    if (has_zero) {
        y.a = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(msum.a), x), dmin.a, y.a);
        y.b = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(msum.b), x), dmin.b, y.b);
    }
    return y;
}
#else
typedef v16 yv16;
SD_INLINE yv16 y_zero(void) { return v_zero(); }
SD_INLINE void y_store(float *p, yv16 v) { v_store(p, v); }
SD_INLINE yv16 y_load(const float *p) { return v_load(p); }
typedef struct { int32_t v[PANEL]; } i16v;
typedef struct { uint8_t b[64]; } q64;
SD_INLINE i16v i_zero(void) { i16v r; memset(&r, 0, sizeof r); return r; }
SD_INLINE i16v i_dot4(i16v acc, q64 w, int32_t x4, int signed_w) {
    int8_t x[4];
    memcpy(x, &x4, 4);
    for (int c = 0; c < PANEL; c++)
        for (int j = 0; j < 4; j++) {
            uint8_t b = w.b[c * 4 + j];
            int32_t wv = signed_w ? (int32_t)(int8_t)(b ^ 0x80) : (int32_t)b;
            acc.v[c] += wv * x[j];
        }
    return acc;
}
SD_INLINE q64 q_load(const uint8_t *p) { q64 r; memcpy(r.b, p, 64); return r; }
SD_INLINE void q_store(uint8_t *p, q64 v) { memcpy(p, v.b, 64); }
SD_INLINE q64 q_lo(q64 b) { for (int i = 0; i < 64; i++) b.b[i] &= 0xf; return b; }
SD_INLINE q64 q_hi(q64 b) { for (int i = 0; i < 64; i++) b.b[i] >>= 4; return b; }
/* An octet's high bits (the layout in sd_mat's comment): byte i of lo / hi is element i % 32
 * of V_t, t = i / 32 (+ 2 for hi) */
SD_INLINE void q_high5(q64 *lo, q64 *hi, const uint8_t *h) {
    static const int bit[4][2] = {{4, 5}, {6, 7}, {0, 1}, {2, 3}};
    for (int i = 0; i < 64; i++) {
        int e = i % 32;
        lo->b[i] |= (uint8_t)(((h[e % 16] >> bit[i / 32][e / 16]) & 1) << 4);
        hi->b[i] |= (uint8_t)(((h[e % 16] >> bit[2 + i / 32][e / 16]) & 1) << 4);
    }
}
SD_INLINE void q_high6(q64 *lo, q64 *hi, const uint8_t *h) {
    for (int i = 0; i < 64; i++) {
        lo->b[i] |= (uint8_t)(((h[i % 32] >> (2 * (i / 32))) & 3) << 4);
        hi->b[i] |= (uint8_t)(((h[i % 32] >> (2 * (2 + i / 32))) & 3) << 4);
    }
}
SD_INLINE v16 i_fold(i16v acc, int32_t corr, float dx, v16 scale, v16 zero, int has_zero,
                     float xs, v16 y) {
    for (int c = 0; c < PANEL; c++) {
        float f = (float)(acc.v[c] - corr) * dx;
        y.f[c] = fmaf(f, scale.f[c], y.f[c]);
        if (has_zero) y.f[c] = fmaf(xs, zero.f[c], y.f[c]);
    }
    return y;
}
SD_INLINE i16v i_set1(int32_t v) { i16v r; for (int c = 0; c < PANEL; c++) r.v[c] = v; return r; }
SD_INLINE i16v i_sub(i16v a, i16v b) { for (int c = 0; c < PANEL; c++) a.v[c] -= b.v[c]; return a; }
SD_INLINE i16v i_muladd(i16v acc, i16v a, i16v b) {
    for (int c = 0; c < PANEL; c++) acc.v[c] += a.v[c] * b.v[c];
    return acc;
}
SD_INLINE i16v i_add(i16v a, i16v b) { for (int c = 0; c < PANEL; c++) a.v[c] += b.v[c]; return a; }
SD_INLINE i16v k_isc(const int8_t *sc) { i16v r; for (int c = 0; c < PANEL; c++) r.v[c] = sc[c]; return r; }
SD_INLINE v16 i_kfold(i16v sum, i16v msum, float dx, v16 d, v16 dmin, int has_zero, v16 y) {
    for (int c = 0; c < PANEL; c++) {
        y.f[c] = fmaf((float)sum.v[c] * dx, d.f[c], y.f[c]);
        if (has_zero) y.f[c] = fmaf(-((float)msum.v[c] * dx), dmin.f[c], y.f[c]);
    }
    return y;
}
#endif

#if SD_ISA != 2
/* An octet of a nibble kind (two quads against a row's codes xa, xb) where the build has no
 * int16 stage (AVX2's, above): the partial sums are the int32 sums themselves. AVX-512 has not
 * been measured with one. */
typedef i16v p16v;
SD_INLINE p16v p_zero(void) { return i_zero(); }
SD_INLINE p16v p_octet(p16v acc, q64 lo, q64 hi, int32_t xa, int32_t xb) {
    return i_dot4(i_dot4(acc, lo, xa, 0), hi, xb, 0);
}
SD_INLINE i16v p_widen(p16v acc) { return acc; }
SD_INLINE i16v i_octet(i16v acc, q64 lo, q64 hi, int32_t xa, int32_t xb) {
    return p_octet(acc, lo, hi, xa, xb);
}
#define SD_INT16_STAGE 0
typedef i16v kscv;
SD_INLINE kscv k_scv(const int8_t *sc) { return k_isc(sc); }
SD_INLINE i16v p_widen_sc(p16v acc, kscv s) { return i_muladd(i_zero(), acc, s); }
#endif

#ifndef SD_KTABSUM
SD_INLINE i16v k_tabsum(const int8_t *tab, int per, const int32_t *gp) {
    i16v r = i_zero();
    for (int t = 0; t < per; t++) {
        int32_t g = (int32_t)(int16_t)(uint16_t)((uint32_t)gp[t / 2] >> (16 * (t % 2)));
        r = i_muladd(r, k_isc(tab + t * PANEL), i_set1(g));
    }
    return r;
}
#endif

/* The correction that turns a group's raw dot products into sum (code - offset) * q, and
 * whether the raw sums are taken that way already (the pairwise-sum paths hold codes over 127
 * as signed values, which applies the offset by itself). */
SD_INLINE int32_t group_correction(const sd_mat *m, int kind, const int32_t *s16, int64_t g,
                                   int signed_w) {
    if (m->offset == 0 || signed_w) return 0;
    int32_t s = m->group == 16 ? s16[g] : s16[2 * g] + s16[2 * g + 1];
    (void)kind;
    return m->offset * s;
}

/* Group g's 16 scales and zeros of panel p, from the fp32 tables (K-quant tables have a path of
 * their own, qpanel_rows_k). */
SD_INLINE void group_scales(const sd_mat *m, int64_t p, int64_t g, yv16 *scale, yv16 *zero) {
    int64_t NG = m->k >> group_shift(m->group);
    *scale = y_load(m->scale + (p * NG + g) * PANEL);
    *zero = m->zero ? y_load(m->zero + (p * NG + g) * PANEL) : y_zero();
}

/* Octet o of panel p of an a8 kind as two quads of codes, input 8o + j in lo and 8o + 4 + j in
 * hi: bytes (Q8) are quads 2o and 2o + 1; the nibble kinds' low and high nibbles, with Q5's and
 * Q6's high bits added. */
SD_INLINE void octet_codes(const sd_mat *m, int kind, int64_t p, int64_t o, q64 *lo, q64 *hi) {
    const uint8_t *w = (const uint8_t *)m->w;
    int64_t K = m->k;
    if (kind == KIND_Q8) {
        *lo = q_load(w + (p * (K / 4) + 2 * o) * 64);
        *hi = q_load(w + (p * (K / 4) + 2 * o + 1) * 64);
        return;
    }
    q64 b = q_load(w + (p * (K / 8) + o) * 64);
    *lo = q_lo(b);
    *hi = q_hi(b);
    if (kind == KIND_Q5) q_high5(lo, hi, m->hbits + (p * (K / 8) + o) * 16);
    if (kind == KIND_Q6) q_high6(lo, hi, m->hbits + (p * (K / 8) + o) * 32);
}

/* A row's activation codes for octet o: inputs 8o..8o+3 in xa, 8o+4..8o+7 in xb. */
SD_INLINE void octet_x(const sd_qrows *qr, int64_t row, int64_t K, int64_t o, int32_t *xa,
                       int32_t *xb) {
    memcpy(xa, qr->q + row * K + 8 * o, 4);
    memcpy(xb, qr->q + row * K + 8 * o + 4, 4);
}

/* The exact int32 sums of R rows against NP panels over group g of an a8 kind. */
SD_INLINE void qgroup_sums(const sd_qrows *qr, int64_t r0, const sd_mat *m, int kind, int64_t p,
                           int NP, int R, int64_t g, int signed_w, i16v acc[][QNP_MAX]) {
    int64_t K = m->k, G = m->group;
    const uint8_t *w = (const uint8_t *)m->w;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NP; j++) acc[r][j] = i_zero();
    if (kind == KIND_Q8) {
        for (int64_t i = g * G / 4; i < (g + 1) * G / 4; i++) {
            for (int j = 0; j < NP; j++) {
                __typeof__(q_load(w)) wq = q_load(w + ((p + j) * (K / 4) + i) * 64);
                for (int r = 0; r < R; r++) {
                    int32_t x4;
                    memcpy(&x4, qr->q + (r0 + r) * K + 4 * i, 4);
                    acc[r][j] = i_dot4(acc[r][j], wq, x4, signed_w);
                }
            }
        }
        return;
    }
    /* 4-bit codes keep a whole group's sums in int16 where the paths have such a stage: at
     * most 2 x 15 x 127 per octet and quad pair, 8 quads (32 inputs, the largest group) 30480.
     * Q5's and Q6's codes would overflow it; they widen every octet (i_octet). */
#ifdef SD_BROKEN_INT16
    /* A deliberately broken variant for the tests (never built otherwise): every nibble kind
     * in int16 across its group, which wraps on Q5's and Q6's largest sums. */
    const int narrow = 1;
#else
    const int narrow = kind == KIND_Q4;
#endif
    p16v pacc[QROWS_MAX][QNP_MAX];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NP; j++) pacc[r][j] = p_zero();
    for (int64_t i = g * G / 8; i < (g + 1) * G / 8; i++) {
        for (int j = 0; j < NP; j++) {
            q64 lo, hi;
            octet_codes(m, kind, p + j, i, &lo, &hi);
            for (int r = 0; r < R; r++) {
                int32_t x4a, x4b;
                octet_x(qr, r0 + r, K, i, &x4a, &x4b);
                if (narrow) pacc[r][j] = p_octet(pacc[r][j], lo, hi, x4a, x4b);
                else acc[r][j] = i_octet(acc[r][j], lo, hi, x4a, x4b);
            }
        }
    }
    if (narrow)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NP; j++) acc[r][j] = p_widen(pacc[r][j]);
}

/* R rows against NP panels of an a8 kind whose scales are one per group; out[j][r] receives
 * panel p + j's row r (its sums wait there between groups: the registers hold the integer sums
 * of one group). */
SD_INLINE void qpanel_rows(const sd_qrows *qr, int64_t r0, const sd_mat *m, int kind, int64_t p,
                           int NP, int R, float out[][CHUNK][PANEL]) {
    int64_t K = m->k, G = m->group, NG = K >> group_shift(G), orow = r0 % CHUNK;
#if SD_ISA == 3 && SD_VNNI
    const int signed_w = 0;
#else
    const int signed_w = kind == KIND_Q8 && m->offset == 128;
#endif
    /* a small block keeps its fp32 sums in registers too; a large one in the output buffer */
    const int yreg = R * NP <= YREG_MAX;
    const int has_zero = m->zero != NULL;
    yv16 y[QROWS_MAX][QNP_MAX];
    for (int j = 0; j < NP; j++)
        for (int r = 0; r < R; r++) {
            if (yreg) y[r][j] = y_zero();
            else memset(out[j][orow + r], 0, sizeof(float) * PANEL);
        }
#ifdef SD_BROKEN_WIDTH
    /* a deliberately broken variant for the tests: blocks of several rows fold their groups in
     * reverse order */
    for (int64_t g = R > 1 ? NG - 1 : 0; R > 1 ? g >= 0 : g < NG; g += R > 1 ? -1 : 1) {
#else
    for (int64_t g = 0; g < NG; g++) {
#endif
        i16v acc[QROWS_MAX][QNP_MAX];
        qgroup_sums(qr, r0, m, kind, p, NP, R, g, signed_w, acc);
        yv16 gs[QNP_MAX], gz[QNP_MAX];
        for (int j = 0; j < NP; j++) group_scales(m, p + j, g, gs + j, gz + j);
        for (int r = 0; r < R; r++) {
            int64_t row = r0 + r;
            const int32_t *s16 = qr->s16 + row * (K / 16);
            int32_t corr = group_correction(m, kind, s16, g, signed_w);
            float dx = qr->d[row * (K / QBLOCK) + g * G / QBLOCK];
            float xs = qr->xs ? qr->xs[row * NG + g] : 0.0f;
            for (int j = 0; j < NP; j++) {
                float *yp = out[j][orow + r];
                if (yreg) y[r][j] = i_fold(acc[r][j], corr, dx, gs[j], gz[j], has_zero, xs, y[r][j]);
                else y_store(yp, i_fold(acc[r][j], corr, dx, gs[j], gz[j], has_zero, xs, y_load(yp)));
            }
        }
    }
    if (yreg)
        for (int j = 0; j < NP; j++)
            for (int r = 0; r < R; r++) y_store(out[j][orow + r], y[r][j]);
}

/* Adds group g's exact sums, each column's times its sub-scale sc[j], into sum[r][j] (the
 * codes' offset is not applied: qpanel_rows_k subtracts it once a super-block). Where the build
 * has an int16 stage, 4-bit codes keep the whole group in int16 and the wider codes (at most
 * 6 bits: pack_q8 refuses wider codes with K-quant scales) one octet, and the widening
 * vpmaddwd multiplies by the sub-scale; elsewhere the int32 group sum is multiplied once. */
SD_INLINE void qgroup_ksum(const sd_qrows *qr, int64_t r0, const sd_mat *m, int kind, int64_t p,
                           int NP, int R, int64_t g, const kscv *sc, i16v sum[][QNP_MAX]) {
    int64_t K = m->k, G = m->group;
#ifdef SD_BROKEN_INT16
    const int per_octet = 0;
#else
    const int per_octet = SD_INT16_STAGE && kind != KIND_Q4;
#endif
    p16v pacc[QROWS_MAX][QNP_MAX];
    if (!per_octet)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NP; j++) pacc[r][j] = p_zero();
    for (int64_t o = g * G / 8; o < (g + 1) * G / 8; o++) {
        for (int j = 0; j < NP; j++) {
            q64 lo, hi;
            octet_codes(m, kind, p + j, o, &lo, &hi);
            for (int r = 0; r < R; r++) {
                int32_t x4a, x4b;
                octet_x(qr, r0 + r, K, o, &x4a, &x4b);
                if (per_octet)
                    sum[r][j] = i_add(sum[r][j], p_widen_sc(p_octet(p_zero(), lo, hi, x4a, x4b), sc[j]));
                else pacc[r][j] = p_octet(pacc[r][j], lo, hi, x4a, x4b);
            }
        }
    }
    if (!per_octet)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NP; j++) sum[r][j] = i_add(sum[r][j], p_widen_sc(pacc[r][j], sc[j]));
}

/* R rows against NP panels of an a8 kind with K-quant scales (kblock 256): per super-block of
 * 256 inputs, each group's exact sum times its int8 sub-scale is added in int32 (below 2^28
 * in magnitude for every kind held: 6-bit codes, 16 groups of 16), the codes' offset times the
 * sub-scales and the groups' sums of activation codes is taken off, the sub-minimums times the
 * same sums make msum, then one fold per super-block: y += ((float)sum * dx) * d, then
 * y -= ((float)msum * dx) * dmin, each one fused multiply-add. One activation scale dx per super-block (act_block), so a
 * super-block has one fold where per-group scales had 8 or 16 (they took 40 % of a 4-row pass
 * on AVX2). */
SD_INLINE void qpanel_rows_k(const sd_qrows *qr, int64_t r0, const sd_mat *m, int kind, int64_t p,
                             int NP, int R, float out[][CHUNK][PANEL]) {
    int64_t K = m->k, G = m->group, NS = K / 256, orow = r0 % CHUNK;
    const int per = 256 >> group_shift(G);
    const int yreg = R * NP <= YREG_MAX;
    const int has_zero = m->zero != NULL;
    const int64_t bytes = ktable_bytes(m);
    yv16 y[QROWS_MAX][QNP_MAX];
    for (int j = 0; j < NP; j++)
        for (int r = 0; r < R; r++) {
            if (yreg) y[r][j] = y_zero();
            else memset(out[j][orow + r], 0, sizeof(float) * PANEL);
        }
#ifdef SD_BROKEN_WIDTH
    for (int64_t sb = R > 1 ? NS - 1 : 0; R > 1 ? sb >= 0 : sb < NS; sb += R > 1 ? -1 : 1) {
#else
    for (int64_t sb = 0; sb < NS; sb++) {
#endif
        const uint8_t *base[QNP_MAX];
        for (int j = 0; j < NP; j++) base[j] = (const uint8_t *)m->scale + ((p + j) * NS + sb) * bytes;
        const int64_t sc_at = (has_zero ? 2 : 1) * PANEL * 4, mn_at = sc_at + per * PANEL;
        i16v sum[QROWS_MAX][QNP_MAX];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NP; j++) sum[r][j] = i_zero();
        for (int t = 0; t < per; t++) {
            kscv sc[QNP_MAX];
            for (int j = 0; j < NP; j++) sc[j] = k_scv((const int8_t *)(base[j] + sc_at) + t * PANEL);
            qgroup_ksum(qr, r0, m, kind, p, NP, R, sb * per + t, sc, sum);
        }
        for (int r = 0; r < R; r++) {
            int64_t row = r0 + r;
            float dx = qr->d[row * (K / QBLOCK) + sb];
            for (int j = 0; j < NP; j++) {
                const float *d = (const float *)base[j];
                /* the minimums' share: sum over groups of m x (the group's sum of codes) */
                const int32_t *gp = qr->gp + row * (K / G / 2) + sb * per / 2;
                i16v msum = has_zero ? k_tabsum((const int8_t *)(base[j] + mn_at), per, gp) : i_zero();
                i16v net = sum[r][j];
                if (m->offset) /* offset x (sum over groups of sc x the group's sum of codes) */
                    net = i_sub(net, i_muladd(i_zero(), k_tabsum((const int8_t *)(base[j] + sc_at), per, gp),
                                              i_set1(m->offset)));
                yv16 dv = y_load(d), dmin = has_zero ? y_load(d + PANEL) : y_zero();
                float *yp = out[j][orow + r];
                if (yreg) y[r][j] = i_kfold(net, msum, dx, dv, dmin, has_zero, y[r][j]);
                else y_store(yp, i_kfold(net, msum, dx, dv, dmin, has_zero, y_load(yp)));
            }
        }
    }
    if (yreg)
        for (int j = 0; j < NP; j++)
            for (int r = 0; r < R; r++) y_store(out[j][orow + r], y[r][j]);
}

#define QROWS(NP, R) \
    (m->kblock ? qpanel_rows_k(qr, r0, m, kind, p, NP, R, out) : qpanel_rows(qr, r0, m, kind, p, NP, R, out))

/* Panels p..p+np-1 for rows m0..m0+M-1 (M <= CHUNK) of an a8 kind, in register blocks: one
 * row against up to QNP_MAX panels, or blocks of up to QROWS_MAX rows against np panels. */
SD_INLINE void qchunk_of_kind(const sd_qrows *qr, int64_t m0, const sd_mat *m, int kind,
                              int64_t p, int np, int64_t M, float out[][CHUNK][PANEL]) {
    if (M == 1) {
        int64_t r0 = m0;
        switch (np) {
        case 4: QROWS(4, 1); return;
        case 3: QROWS(3, 1); return;
        case 2: QROWS(2, 1); return;
        default: QROWS(1, 1); return;
        }
    }
    for (int64_t r0 = m0; r0 < m0 + M; r0 += QROWS_MAX) {
        int R = m0 + M - r0 >= QROWS_MAX ? QROWS_MAX : (int)(m0 + M - r0);
#define QROWN(NP) \
        switch (R) { \
        QROWS_CASES(NP) \
        QROWS_CASES56(NP) \
        case 4: QROWS(NP, 4); break; \
        case 3: QROWS(NP, 3); break; \
        case 2: QROWS(NP, 2); break; \
        default: QROWS(NP, 1); break; \
        }
#if QROWS_MAX > 6
#define QROWS_CASES(NP) \
        case 12: QROWS(NP, 12); break; \
        case 11: QROWS(NP, 11); break; \
        case 10: QROWS(NP, 10); break; \
        case 9: QROWS(NP, 9); break; \
        case 8: QROWS(NP, 8); break; \
        case 7: QROWS(NP, 7); break;
#else
#define QROWS_CASES(NP)
#endif
#if QROWS_MAX >= 6
#define QROWS_CASES56(NP) \
        case 6: QROWS(NP, 6); break; \
        case 5: QROWS(NP, 5); break;
#else
#define QROWS_CASES56(NP)
#endif
        if (np == 2) { QROWN(2) }
        else { QROWN(1) }
#undef QROWN
#undef QROWS_CASES
#undef QROWS_CASES56
    }
}

SD_INLINE void decode_panels(const sd_mat *m, int kind, int64_t p, int np, uint8_t *buf) {
    for (int j = 0; j < np; j++)
        for (int64_t o = 0; o < m->k / 8; o++) {
            q64 lo, hi;
            octet_codes(m, kind, p + j, o, &lo, &hi);
            q_store(buf + (j * (m->k / 4) + 2 * o) * 64, lo);
            q_store(buf + (j * (m->k / 4) + 2 * o + 1) * 64, hi);
        }
}

/* Panels p..p+np-1 of a Q5 or Q6 matrix decoded to bytes, Q8's layout (the same codes), in a
 * buffer of the calling thread (kept for its next call: one per thread, at most the largest
 * panel group's K * 16 * np bytes); NULL where it cannot be allocated. */
static const uint8_t *decoded_panels(const sd_mat *m, int64_t p, int np) {
    static __thread uint8_t *buf;
    static __thread size_t cap;
    size_t need = (size_t)m->k * PANEL * (size_t)np;
    if (need > cap) {
        uint8_t *grown = (uint8_t *)realloc(buf, need);
        if (!grown) return NULL;
        buf = grown;
        cap = need;
    }
    if (m->kind == KIND_Q6) decode_panels(m, KIND_Q6, p, np, buf);
    else decode_panels(m, KIND_Q5, p, np, buf);
    return buf;
}

/* m seen from panel p on, its codes at w as bytes (Q8) */
static sd_mat byte_view(const sd_mat *m, int64_t p, const uint8_t *w) {
    sd_mat d = *m;
    d.w = w;
    d.kind = KIND_Q8;
    d.hbits = NULL;
    if (m->kblock) {
        d.scale = (const float *)((const uint8_t *)m->scale + p * (m->k / m->kblock) * ktable_bytes(m));
        d.zero = m->zero ? d.scale : NULL;
    } else {
        int64_t at = p * (m->k >> group_shift(m->group)) * PANEL;
        d.scale = m->scale + at;
        d.zero = m->zero ? m->zero + at : NULL;
    }
    return d;
}

static void qpanel_chunk(const sd_qrows *qr, int64_t m0, const sd_mat *m, int64_t p, int np,
                         int64_t M, float out[][CHUNK][PANEL]) {
    /* Many row blocks over 5- or 6-bit panels (prompts) decode the codes once, not once a
     * block: the byte panels give the same integer sums, hence the same bits (tests: pack_q5 /
     * pack_q6 against pack_q8 at every width). A decode on its own costs about what three
     * blocks' decodes cost inside their loops (there it overlaps the arithmetic), so narrower
     * products decode in the loop. */
    const uint8_t *bytes = (m->kind == KIND_Q5 || m->kind == KIND_Q6) && M >= DECODE_ONCE_ROWS
                               ? decoded_panels(m, p, np) : NULL;
    if (bytes) {
        sd_mat d = byte_view(m, p, bytes);
        qchunk_of_kind(qr, m0, &d, KIND_Q8, 0, np, M, out);
        return;
    }
    if (m->kind == KIND_Q8) qchunk_of_kind(qr, m0, m, KIND_Q8, p, np, M, out);
    else if (m->kind == KIND_Q5) qchunk_of_kind(qr, m0, m, KIND_Q5, p, np, M, out);
    else if (m->kind == KIND_Q6) qchunk_of_kind(qr, m0, m, KIND_Q6, p, np, M, out);
    else qchunk_of_kind(qr, m0, m, KIND_Q4, p, np, M, out);
}

/* ---- a product: prepare the inputs, then every panel ------------------------------------- */

/* Scratch of one product: float kinds use xr (inputs rounded to bf16) and xs (group sums);
 * a8 kinds use qr. Sized for the largest matrix of a block. */
typedef struct {
    float *xr, *xs;
    sd_qrows qr;
} sd_scratch;

/* The float inputs as the product uses them: rounded to bf16 if asked, and for kinds with zeros
 * the per-group sums (plain adds in order). Each row on its own; inside a parallel region. */
static void prepare_rows(const float *x, int64_t M, const sd_mat *m, float *xr, float *xs) {
    int64_t K = m->k, G = m->group > 0 ? K / m->group : 0;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        for (int64_t k = 0; k < K; k++) xr[r * K + k] = m->round_x ? round_bf16(x[r * K + k]) : x[r * K + k];
        if (m->zero && GROUPED(m->kind))
            for (int64_t g = 0; g < G; g++) {
                float s = 0.0f;
                for (int64_t k = g * m->group; k < (g + 1) * m->group; k++) s += xr[r * K + k];
                xs[r * G + g] = s;
            }
    }
}

/* y (M, N) (row stride ldy) = x (M, K) W^T + bias [+ y if accumulate]; inside a parallel region
 * (orphaned work-sharing loops). x is used as is where no preparation is needed. */
static void matmul_in_region(const float *x, int64_t M, const sd_mat *m, float *y, int64_t ldy,
                             int accumulate, const sd_scratch *sc) {
    int64_t K = m->k, N = m->n, P = (N + PANEL - 1) / PANEL;
    int64_t G = m->group > 0 ? K / m->group : 0;
    int quant = QUANT(m->kind);
    const float *xin = x;
    const float *xs = NULL;
    sd_qrows qr = sc->qr;
    if (quant) {
        if (!m->zero || m->kblock) qr.xs = NULL;
        quantize_rows(x, M, m, &qr); /* ends with a barrier */
    } else if (m->round_x || (m->zero && GROUPED(m->kind))) {
        prepare_rows(x, M, m, sc->xr, sc->xs); /* ends with a barrier */
        xin = sc->xr;
        xs = sc->xs;
    }
    int NP = quant ? qpanels_per_call(M) : panels_per_call(M);
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
        int64_t mc = M - m0 < CHUNK ? M - m0 : CHUNK;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < (P + NP - 1) / NP; g++) {
            float out[OUT_NP][CHUNK][PANEL];
            int64_t p0 = g * NP;
            int np = P - p0 < NP ? (int)(P - p0) : NP;
            if (quant) qpanel_chunk(&qr, m0, m, p0, np, mc, out);
            else panel_chunk(xin + m0 * K, K, xs ? xs + m0 * G : NULL, G, m, p0, np, mc, out);
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

static void scratch_free(sd_scratch *s) {
    free(s->xr);
    free(s->xs);
    free(s->qr.q);
    free(s->qr.d);
    free(s->qr.s16);
    free(s->qr.gp);
    free(s->qr.xs);
    memset(s, 0, sizeof *s);
}

/* Scratch for products of M rows with at most kmax inputs and groups of at least gmin inputs;
 * returns 0, or SD_ENOMEM (then nothing is held). */
static int scratch_alloc(sd_scratch *s, int64_t M, int64_t kmax, int64_t gmin) {
    memset(s, 0, sizeof *s);
    size_t rows = (size_t)(M > 0 ? M : 1), k = (size_t)kmax;
    s->xr = (float *)malloc(sizeof(float) * rows * k);
    s->xs = (float *)malloc(sizeof(float) * (rows * k / (size_t)gmin + 1));
    s->qr.q = (int8_t *)malloc(rows * k + 64);
    s->qr.d = (float *)malloc(sizeof(float) * (rows * k / QBLOCK + 1));
    s->qr.s16 = (int32_t *)malloc(sizeof(int32_t) * (rows * k / 16 + 1));
    s->qr.gp = (int32_t *)malloc(sizeof(int32_t) * (rows * k / 32 + 1));
    s->qr.xs = (float *)malloc(sizeof(float) * (rows * k / (size_t)gmin + 1));
    if (!s->xr || !s->xs || !s->qr.q || !s->qr.d || !s->qr.s16 || !s->qr.xs || !s->qr.gp) {
        scratch_free(s);
        return SD_ENOMEM;
    }
    return 0;
}

/* y (M, N) = x (M, K) W^T (+ bias). */
int sd_matmul(const float *x, int64_t M, const sd_mat *m, float *y) {
    sd_scratch sc;
    if (scratch_alloc(&sc, M, m->k, 16)) return SD_ENOMEM;
#pragma omp parallel
    matmul_in_region(x, M, m, y, m->n, 0, &sc);
    scratch_free(&sc);
    return 0;
}

/* ---- attention ---------------------------------------------------------------------------- */

/* The fixed tree that ends a dot product's eight partial sums. */
static inline float tree8(const float *l) {
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* A dot product over D inputs: eight partial sums (input d into sum d % 8, one fused
 * multiply-add each, in order), then tree8; for D not a multiple of 8, one chain in order. The
 * same in every build. */
static inline float dot(const float *a, const float *b, int64_t D) {
    if (D % 8 == 0) {
        float l[8];
#if SD_ISA >= 2
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
        for (int64_t d = 8; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
        _mm256_storeu_ps(l, acc);
#else
        for (int i = 0; i < 8; i++) l[i] = a[i] * b[i];
        for (int64_t d = 8; d < D; d += 8)
            for (int i = 0; i < 8; i++) l[i] = fmaf(a[d + i], b[d + i], l[i]);
#endif
        return tree8(l);
    }
    float s = a[0] * b[0];
    for (int64_t d = 1; d < D; d++) s = fmaf(a[d], b[d], s);
    return s;
}

/* s[i] = dot(q, key idx[i]) * scale for the n attended keys. Vector builds take four keys per
 * pass (four independent chains instead of one waiting on the last); each key's sums are dot's. */
static void scores(const float *q, const float *kb, const int64_t *idx, int64_t n, int64_t D,
                   float scale, float *s) {
    int64_t i = 0;
#if SD_ISA >= 2
    if (D % 8 == 0)
        for (; i + 4 <= n; i += 4) {
            const float *k0 = kb + idx[i] * D, *k1 = kb + idx[i + 1] * D;
            const float *k2 = kb + idx[i + 2] * D, *k3 = kb + idx[i + 3] * D;
            __m256 qd = _mm256_loadu_ps(q);
            __m256 a0 = _mm256_mul_ps(qd, _mm256_loadu_ps(k0));
            __m256 a1 = _mm256_mul_ps(qd, _mm256_loadu_ps(k1));
            __m256 a2 = _mm256_mul_ps(qd, _mm256_loadu_ps(k2));
            __m256 a3 = _mm256_mul_ps(qd, _mm256_loadu_ps(k3));
            for (int64_t d = 8; d < D; d += 8) {
                qd = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k1 + d), a1);
                a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k2 + d), a2);
                a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k3 + d), a3);
            }
            float l[4][8];
            _mm256_storeu_ps(l[0], a0);
            _mm256_storeu_ps(l[1], a1);
            _mm256_storeu_ps(l[2], a2);
            _mm256_storeu_ps(l[3], a3);
            for (int j = 0; j < 4; j++) s[i + j] = tree8(l[j]) * scale;
        }
#endif
    for (; i < n; i++) s[i] = dot(q, kb + idx[i] * D, D) * scale;
}

/* acc[d] = the sum over i in order of e[i] * value idx[i] [d], one fused multiply-add each from
 * 0 (every build). Vector builds hold 64 of the D sums in registers across all keys instead of
 * loading and storing them for each key. */
#if SD_ISA >= 2
SD_INLINE void values_span(const float *e, const float *vb, const int64_t *idx, int64_t n,
                           int64_t D, int64_t c0, const int W, float *acc) {
    __m256 r[8];
    for (int k = 0; k < W / 8; k++) r[k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        __m256 eb = _mm256_set1_ps(e[i]);
        const float *v = vb + idx[i] * D + c0;
        for (int k = 0; k < W / 8; k++) r[k] = _mm256_fmadd_ps(eb, _mm256_loadu_ps(v + 8 * k), r[k]);
    }
    for (int k = 0; k < W / 8; k++) _mm256_storeu_ps(acc + c0 + 8 * k, r[k]);
}
#endif
static void weighted_values(const float *e, const float *vb, const int64_t *idx, int64_t n,
                            int64_t D, float *acc) {
#if SD_ISA >= 2
    if (D % 8 == 0) {
        int64_t c0 = 0;
        for (; c0 + 64 <= D; c0 += 64) values_span(e, vb, idx, n, D, c0, 64, acc);
        for (; c0 < D; c0 += 8) values_span(e, vb, idx, n, D, c0, 8, acc); /* each its own pass */
        return;
    }
#endif
    memset(acc, 0, sizeof(float) * (size_t)D);
    for (int64_t i = 0; i < n; i++) {
        const float *v = vb + idx[i] * D;
        for (int64_t d = 0; d < D; d++) acc[d] = fmaf(e[i], v[d], acc[d]);
    }
}

typedef struct {
    const float *kc, *vc;    /* this layer's cache: slot j of row b, kv head g at b*c_row + g*c_head + j*D */
    int64_t c_row, c_head, kvh;
    const int64_t *rows;     /* (R,) the cache row of each query row */
    const uint8_t *mask;     /* (R, used) 1 = may attend; NULL = every slot below used */
    int64_t used;
} sd_attn;

/* One thread's attention scratch: scores and exponentials, the attended slots, the sums. */
typedef struct {
    float *s;
    int64_t *idx;
    float *acc;
} sd_att_scratch;

/* Allocated inside the parallel region; 0 if an allocation failed (the caller reports it
 * through a shared flag, checked after the region, before anything is trusted). */
static int att_scratch_alloc(sd_att_scratch *t, int64_t used, int64_t D) {
    size_t n = (size_t)(used > 0 ? used : 1);
    t->s = (float *)malloc(sizeof(float) * n);
    t->idx = (int64_t *)malloc(sizeof(int64_t) * n);
    t->acc = (float *)malloc(sizeof(float) * (size_t)(D > 0 ? D : 1));
    return t->s && t->idx && t->acc;
}

static void att_scratch_free(sd_att_scratch *t) {
    free(t->s);
    free(t->idx);
    free(t->acc);
}

/* out (R, NH, D) = softmax(q k^T / sqrt(D)) v per query row and head; q row r head h at
 * q + r * q_row + h * D. Per row and head: the attended slots in slot order, their scores, the
 * maximum, then exponentials summed and values accumulated in that order. Inside a parallel
 * region; t: this thread's scratch. */
static void attention_in_region(const float *q, int64_t q_row, int64_t R, int64_t NH, int64_t D,
                                const sd_attn *a, float *out, const sd_att_scratch *t) {
    int64_t group = NH / a->kvh;
    float scale = 1.0f / sqrtf((float)D);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < R * NH; task++) {
        int64_t r = task / NH, h = task % NH, g = h / group;
        const float *qv = q + r * q_row + h * D;
        const float *kb = a->kc + a->rows[r] * a->c_row + g * a->c_head;
        const float *vb = a->vc + a->rows[r] * a->c_row + g * a->c_head;
        const uint8_t *mr = a->mask ? a->mask + r * a->used : NULL;
        int64_t n = 0;
        for (int64_t j = 0; j < a->used; j++)
            if (!mr || mr[j]) t->idx[n++] = j; /* a masked key is skipped, never added as 0 */
        scores(qv, kb, t->idx, n, D, scale, t->s);
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++)
            if (t->s[i] > mx) mx = t->s[i];
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            float e = expf(t->s[i] - mx);
            t->s[i] = e;
            sum += e;
        }
        weighted_values(t->s, vb, t->idx, n, D, t->acc);
        float *o = out + (r * NH + h) * D;
        for (int64_t d = 0; d < D; d++) o[d] = t->acc[d] / sum;
    }
}

int sd_attention(const float *q, int64_t q_row, int64_t R, int64_t NH, int64_t D,
                 const sd_attn *a, float *out) {
    int failed = 0;
#pragma omp parallel
    {
        sd_att_scratch t;
        if (!att_scratch_alloc(&t, a->used, D)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) attention_in_region(q, q_row, R, NH, D, a, out, &t);
        att_scratch_free(&t);
    }
    return failed ? SD_ENOMEM : 0;
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

static int64_t min_group(const sd_block_w *b, int64_t n) {
    int64_t g = 32;
    for (int64_t l = 0; l < n; l++) {
        const sd_mat *ms[4] = {&b[l].qkv, &b[l].o, &b[l].gate_up, &b[l].down};
        for (int i = 0; i < 4; i++)
            if (ms[i]->group > 0 && ms[i]->group < g) g = ms[i]->group;
    }
    return g;
}

/* Buffers of a block over M rows. */
typedef struct {
    float *h, *qkv, *att, *gu, *act;
    sd_scratch sc;
} sd_block_buf;

static void block_buf_free(sd_block_buf *u) {
    free(u->h);
    free(u->qkv);
    free(u->att);
    free(u->gu);
    free(u->act);
    scratch_free(&u->sc);
    memset(u, 0, sizeof *u);
}

static int block_buf_alloc(sd_block_buf *u, const sd_block_w *b, int64_t M, int64_t gmin) {
    int64_t H = b->hidden, NH = b->heads, KVH = b->kv_heads, D = b->head_dim, I = b->inter;
    size_t rows = (size_t)M;
    memset(u, 0, sizeof *u);
    u->h = (float *)malloc(sizeof(float) * rows * (size_t)H);
    u->qkv = (float *)malloc(sizeof(float) * rows * (size_t)((NH + 2 * KVH) * D));
    u->att = (float *)malloc(sizeof(float) * rows * (size_t)(NH * D));
    u->gu = (float *)malloc(sizeof(float) * rows * (size_t)(2 * I));
    u->act = (float *)malloc(sizeof(float) * rows * (size_t)I);
    int64_t kmax = H > I ? H : I;
    kmax = kmax > NH * D ? kmax : NH * D;
    if (!u->h || !u->qkv || !u->att || !u->gu || !u->act || scratch_alloc(&u->sc, M, kmax, gmin)) {
        block_buf_free(u);
        return SD_ENOMEM;
    }
    return 0;
}

/* The block on x inside a parallel region (s, acc: this thread's attention scratch). */
static void block_in_region(float *x, int64_t M, const sd_block_w *b, const float *cos,
                            const float *sin, const int64_t *slots, const sd_attn *a,
                            sd_block_buf *u, const sd_att_scratch *t) {
    int64_t H = b->hidden, NH = b->heads, KVH = b->kv_heads, D = b->head_dim, I = b->inter;
    int64_t NQKV = (NH + 2 * KVH) * D, half = D / 2;
    rms_norm_rows(x, M, H, b->attn_norm, b->eps, u->h);
    matmul_in_region(u->h, M, &b->qkv, u->qkv, NQKV, 0, &u->sc);
    /* RoPE on q and k heads, then the new keys and values into the cache */
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        float *row = u->qkv + r * NQKV, tmp[MAX_HEAD_DIM];
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
    attention_in_region(u->qkv, NQKV, M, NH, D, a, u->att, t);
    matmul_in_region(u->att, M, &b->o, x, H, 1, &u->sc); /* x += att Wo^T */
    rms_norm_rows(x, M, H, b->mlp_norm, b->eps, u->h);
    matmul_in_region(u->h, M, &b->gate_up, u->gu, 2 * I, 0, &u->sc);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; r++)
        for (int64_t i = 0; i < I; i++) {
            float g = u->gu[r * 2 * I + i];
            u->act[r * I + i] = (g / (1.0f + expf(-g))) * u->gu[r * 2 * I + I + i];
        }
    matmul_in_region(u->act, M, &b->down, x, H, 1, &u->sc); /* x += act Wdown^T */
}

/* x (M, hidden) <- the block applied to x. cos, sin: (M, head_dim) per row, sin signed as in
 * models.llama.apply_rope; slots (M,): where each row's key and value are written in its cache
 * row (a->rows). Returns 0, or SD_ENOMEM (x untouched). */
int sd_block(float *x, int64_t M, const sd_block_w *b, const float *cos, const float *sin,
             const int64_t *slots, const sd_attn *a) {
    sd_block_buf u;
    if (b->head_dim > MAX_HEAD_DIM || block_buf_alloc(&u, b, M, min_group(b, 1))) return SD_ENOMEM;
    int failed = 0;
#pragma omp parallel
    {
        sd_att_scratch t;
        if (!att_scratch_alloc(&t, a->used, b->head_dim)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) block_in_region(x, M, b, cos, sin, slots, a, &u, &t);
        att_scratch_free(&t);
    }
    block_buf_free(&u);
    return failed ? SD_ENOMEM : 0;
}

/* Every block, the final norm and the LM head in one call: x (M, hidden) is the embedded input
 * (overwritten); attns[l]: layer l's attention spec; logits (M, vocab) of the rows in `which`
 * (n_which rows: their indices into x), written to `logits`; with n_which 0 only the blocks run
 * (head, final_norm and logits may be NULL). No per-layer return to Python. */
int sd_forward(float *x, int64_t M, int64_t n_layers, const sd_block_w *blocks,
               const float *cos, const float *sin, const int64_t *slots, const sd_attn *attns,
               const float *final_norm, float eps, const sd_mat *head, const int64_t *which,
               int64_t n_which, float *logits) {
    sd_block_buf u;
    int64_t used_max = 0, H = blocks[0].hidden;
    for (int64_t l = 0; l < n_layers; l++) {
        if (blocks[l].head_dim > MAX_HEAD_DIM) return SD_ENOMEM;
        used_max = attns[l].used > used_max ? attns[l].used : used_max;
    }
    if (block_buf_alloc(&u, &blocks[0], M, min_group(blocks, n_layers))) return SD_ENOMEM;
    sd_scratch hs;
    memset(&hs, 0, sizeof hs);
    float *hx = NULL;
    if (n_which > 0) { /* the head's rows: none when the caller takes the hidden states */
        hx = (float *)malloc(sizeof(float) * (size_t)(n_which * H));
        if (!hx || scratch_alloc(&hs, n_which, head->k, head->group > 0 ? head->group : 32)) {
            free(hx);
            block_buf_free(&u);
            return SD_ENOMEM;
        }
    }
    int failed = 0;
#pragma omp parallel
    {
        sd_att_scratch t;
        if (!att_scratch_alloc(&t, used_max, blocks[0].head_dim)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            for (int64_t l = 0; l < n_layers; l++) {
                block_in_region(x, M, &blocks[l], cos, sin, slots, &attns[l], &u, &t);
            }
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n_which; i++) {
                const float *xr = x + which[i] * H;
                float ss = 0.0f;
                for (int64_t d = 0; d < H; d++) ss = fmaf(xr[d], xr[d], ss);
                float inv = 1.0f / sqrtf(ss / (float)H + eps);
                for (int64_t d = 0; d < H; d++) hx[i * H + d] = (xr[d] * inv) * final_norm[d];
            }
            if (n_which > 0) matmul_in_region(hx, n_which, head, logits, head->n, 0, &hs);
        }
        att_scratch_free(&t);
    }
    free(hx);
    scratch_free(&hs);
    block_buf_free(&u);
    return failed ? SD_ENOMEM : 0;
}
