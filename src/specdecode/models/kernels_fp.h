/* The float-activation products of kernels.c, included once per float width: on AVX-512 builds
 * twice (FP_WIDE 1: 16 columns as one zmm, names suffixed _w; FP_WIDE 0: as two ymm, names
 * suffixed _n), elsewhere once (FP_WIDE 0, names as they are). kernels.c defines FP_WIDE and
 * FPN(name) before each inclusion and picks a width per call by its row count; both widths give
 * the same bits (vector lanes are output columns, the per-column arithmetic is the same). */
#define v16 FPN(v16)
#define v_zero FPN(v_zero)
#define v_load FPN(v_load)
#define v_store FPN(v_store)
#define v_set1 FPN(v_set1)
#define v_fma FPN(v_fma)
#define v_mul FPN(v_mul)
#define v_bf16 FPN(v_bf16)
#define v_i8 FPN(v_i8)
#define v_u4 FPN(v_u4)
#define decode_k FPN(decode_k)
#define span_of FPN(span_of)
#define fold_group FPN(fold_group)
#define finish FPN(finish)
#define panel_direct FPN(panel_direct)
#define rows_over_block FPN(rows_over_block)
#define panel_buffered FPN(panel_buffered)
#define panels_per_call FPN(panels_per_call)
#define chunk_of_kind FPN(chunk_of_kind)
#define panel_chunk FPN(panel_chunk)

#if FP_WIDE
#define ROWS 12    /* rows sharing one pass over a panel (a register block) */
#define NPMAX 8    /* panels one row keeps in flight */
#else
#define ROWS 6
#define NPMAX 4
#endif

/* ---- 16 output columns as one value: the only place the instruction sets differ ---------- */

#if FP_WIDE
typedef __m512 v16;
SD_INLINE v16 v_zero(void) { return _mm512_setzero_ps(); }
SD_INLINE v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
SD_INLINE void v_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
SD_INLINE v16 v_set1(float f) { return _mm512_set1_ps(f); }
SD_INLINE v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
SD_INLINE v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
SD_INLINE v16 v_bf16(const uint16_t *q) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)q));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
SD_INLINE v16 v_i8(const int8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}
SD_INLINE v16 v_u4(const uint8_t *q) { /* 8 bytes: lanes 0-7 the low nibbles, 8-15 the high */
    __m128i b = _mm_loadl_epi64((const __m128i *)q), f = _mm_set1_epi8(0xf);
    __m128i both = _mm_unpacklo_epi64(_mm_and_si128(b, f), _mm_and_si128(_mm_srli_epi16(b, 4), f));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both));
}
#elif SD_ISA >= 2
typedef struct { __m256 a, b; } v16;
SD_INLINE v16 v_zero(void) { v16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
SD_INLINE v16 v_load(const float *p) { v16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
SD_INLINE void v_store(float *p, v16 v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
SD_INLINE v16 v_set1(float f) { v16 r = {_mm256_set1_ps(f), _mm256_set1_ps(f)}; return r; }
SD_INLINE v16 v_fma(v16 x, v16 y, v16 c) {
    v16 r = {_mm256_fmadd_ps(x.a, y.a, c.a), _mm256_fmadd_ps(x.b, y.b, c.b)};
    return r;
}
SD_INLINE v16 v_mul(v16 x, v16 y) { v16 r = {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; return r; }
SD_INLINE v16 v_bf16(const uint16_t *q) {
    __m128i lo = _mm_loadu_si128((const __m128i *)q), hi = _mm_loadu_si128((const __m128i *)(q + 8));
    v16 r = {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
             _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16))};
    return r;
}
SD_INLINE v16 v_i8(const int8_t *q) {
    __m128i b = _mm_loadu_si128((const __m128i *)q);
    v16 r = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)))};
    return r;
}
SD_INLINE v16 v_u4(const uint8_t *q) {
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    v16 r = {_mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(0xf))),
             _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4))};
    return r;
}
#else
typedef struct { float f[PANEL]; } v16;
SD_INLINE v16 v_zero(void) { v16 r; memset(&r, 0, sizeof r); return r; }
SD_INLINE v16 v_load(const float *p) { v16 r; memcpy(r.f, p, sizeof r.f); return r; }
SD_INLINE void v_store(float *p, v16 v) { memcpy(p, v.f, sizeof v.f); }
SD_INLINE v16 v_set1(float f) { v16 r; for (int c = 0; c < PANEL; c++) r.f[c] = f; return r; }
SD_INLINE v16 v_fma(v16 x, v16 y, v16 acc) {
    for (int c = 0; c < PANEL; c++) acc.f[c] = fmaf(x.f[c], y.f[c], acc.f[c]);
    return acc;
}
SD_INLINE v16 v_mul(v16 x, v16 y) { for (int c = 0; c < PANEL; c++) x.f[c] *= y.f[c]; return x; }
SD_INLINE v16 v_bf16(const uint16_t *q) { v16 r; for (int c = 0; c < PANEL; c++) r.f[c] = bf16_to_f32(q[c]); return r; }
SD_INLINE v16 v_i8(const int8_t *q) { v16 r; for (int c = 0; c < PANEL; c++) r.f[c] = (float)q[c]; return r; }
SD_INLINE v16 v_u4(const uint8_t *q) {
    v16 r;
    for (int c = 0; c < 8; c++) { r.f[c] = (float)(q[c] & 0xf); r.f[c + 8] = (float)(q[c] >> 4); }
    return r;
}
#endif

/* ---- products of the float-activation kinds ---------------------------------------------- */

/* Input k of panel p: the weights (F32, BF16) or the integer codes (I8, I4, I8G: scaled later). */
SD_INLINE v16 decode_k(const sd_mat *m, int kind, int64_t p, int64_t k) {
    int64_t K = m->k;
    switch (kind) {
    case KIND_F32: return v_load((const float *)m->w + (p * K + k) * PANEL);
    case KIND_BF16: return v_bf16((const uint16_t *)m->w + (p * K + k) * PANEL);
    case KIND_I8:
    case KIND_I8G: return v_i8((const int8_t *)m->w + (p * K + k) * PANEL);
    default: return v_u4((const uint8_t *)m->w + (p * K + k) * (PANEL / 2));
    }
}

/* The arithmetic, the same on every path below:
 * F32, BF16: y = sum_k x[k] w[k], one fused multiply-add per k in order, from 0.
 * I8: a = sum_k x[k] code[k] likewise, then y = a * scale.
 * I4, I8G: per group g, a_g = sum x[k] code[k] (from 0), then y = y + a_g * scale_g, and with
 *     zeros y = (y + a_g * scale_g) + xs_g * zero_g (two fused multiply-adds), y from 0, where
 *     xs_g is the group's plain sum of the inputs. */
SD_INLINE int64_t span_of(const sd_mat *m, int kind) { return GROUPED(kind) ? m->group : m->k; }

SD_INLINE v16 fold_group(const sd_mat *m, int64_t p, int64_t g, v16 a, float sx, v16 y) {
    int64_t G = m->k >> group_shift(m->group);
    y = v_fma(a, v_load(m->scale + (p * G + g) * PANEL), y);
    if (m->zero) y = v_fma(v_set1(sx), v_load(m->zero + (p * G + g) * PANEL), y);
    return y;
}

SD_INLINE v16 finish(const sd_mat *m, int kind, int64_t p, v16 a) {
    return kind == KIND_I8 ? v_mul(a, v_load(m->scale + p * PANEL)) : a;
}

/* R rows against NP consecutive panels, both constants after inlining, weights decoded straight
 * into registers; out[j][r] receives panel p + j's row r. One row keeps NP independent sums in
 * flight: a single panel's sum would wait on the fused multiply-add's latency at every input. */
SD_INLINE void panel_direct(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                            const sd_mat *m, int kind, int64_t p, int NP, int R,
                            float out[][CHUNK][PANEL]) {
    int64_t span = span_of(m, kind), K = m->k;
    v16 a[ROWS][NPMAX], y[ROWS][NPMAX];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NP; j++) a[r][j] = y[r][j] = v_zero();
#ifdef SD_BROKEN_WIDTH
    /* A deliberately broken variant for the tests (never built otherwise): with several rows the
     * inputs are taken from the last block back, a blocking that depends on the call's width. */
    for (int64_t k0 = R > 1 ? K - span : 0; R > 1 ? k0 >= 0 : k0 < K; k0 += R > 1 ? -span : span) {
#else
    for (int64_t k0 = 0; k0 < K; k0 += span) {
#endif
        if (GROUPED(kind)) /* each group's sums start from 0 */
            for (int r = 0; r < R; r++)
                for (int j = 0; j < NP; j++) a[r][j] = v_zero();
        for (int64_t k = k0; k < k0 + span; k++) {
            v16 w[NPMAX];
            for (int j = 0; j < NP; j++) w[j] = decode_k(m, kind, p + j, k);
            for (int r = 0; r < R; r++) {
                v16 xb = v_set1(x[r * ldx + k]);
                for (int j = 0; j < NP; j++) a[r][j] = v_fma(xb, w[j], a[r][j]);
            }
        }
        if (GROUPED(kind))
            for (int r = 0; r < R; r++)
                for (int j = 0; j < NP; j++)
                    y[r][j] = fold_group(m, p + j, k0 >> group_shift(span), a[r][j],
                                         xs ? xs[r * ldxs + (k0 >> group_shift(span))] : 0.0f, y[r][j]);
    }
    for (int j = 0; j < NP; j++)
        for (int r = 0; r < R; r++)
            v_store(out[j][r], GROUPED(kind) ? y[r][j] : finish(m, kind, p + j, a[r][j]));
}

/* R rows against kb decoded inputs in wbuf, continuing the sums in acc (R x PANEL). */
SD_INLINE void rows_over_block(const float *x, int64_t ldx, const float *wbuf, int64_t kb,
                               int R, float *acc, int fresh) {
    v16 a[ROWS];
    for (int r = 0; r < R; r++) a[r] = fresh ? v_zero() : v_load(acc + r * PANEL);
    for (int64_t k = 0; k < kb; k++) {
        v16 w = v_load(wbuf + k * PANEL);
        for (int r = 0; r < R; r++) a[r] = v_fma(v_set1(x[r * ldx + k]), w, a[r]);
    }
    for (int r = 0; r < R; r++) v_store(acc + r * PANEL, a[r]);
}

#ifndef KBLOCK
#define KBLOCK 32 /* inputs decoded at a time on the buffered path (a group, at most) */
#endif

/* More rows than a register block: each block of inputs (a group for the grouped kinds) is
 * decoded once into wbuf and every row block of the chunk passes over it; the sums wait in acc
 * between blocks. */
SD_INLINE void panel_buffered(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                              const sd_mat *m, int kind, int64_t p, int64_t M,
                              float out[][PANEL]) {
    float wbuf[KBLOCK * PANEL], acc[CHUNK * PANEL];
    int64_t K = m->k, step = GROUPED(kind) ? m->group : KBLOCK;
    memset(out, 0, sizeof(float) * PANEL * (size_t)M);
    for (int64_t k0 = 0; k0 < K; k0 += step) {
        int64_t kb = K - k0 < step ? K - k0 : step;
        for (int64_t k = 0; k < kb; k++) v_store(wbuf + k * PANEL, decode_k(m, kind, p, k0 + k));
        int fresh = k0 == 0 || GROUPED(kind); /* a grouped kind's block is one group */
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            int R = M - r0 >= ROWS ? ROWS : (int)(M - r0);
            const float *xr = x + r0 * ldx + k0;
            float *ar = acc + r0 * PANEL;
            switch (R) {
#if ROWS > 6
            case 12: rows_over_block(xr, ldx, wbuf, kb, 12, ar, fresh); break;
            case 11: rows_over_block(xr, ldx, wbuf, kb, 11, ar, fresh); break;
            case 10: rows_over_block(xr, ldx, wbuf, kb, 10, ar, fresh); break;
            case 9: rows_over_block(xr, ldx, wbuf, kb, 9, ar, fresh); break;
            case 8: rows_over_block(xr, ldx, wbuf, kb, 8, ar, fresh); break;
            case 7: rows_over_block(xr, ldx, wbuf, kb, 7, ar, fresh); break;
#endif
            case 6: rows_over_block(xr, ldx, wbuf, kb, 6, ar, fresh); break;
            case 5: rows_over_block(xr, ldx, wbuf, kb, 5, ar, fresh); break;
            case 4: rows_over_block(xr, ldx, wbuf, kb, 4, ar, fresh); break;
            case 3: rows_over_block(xr, ldx, wbuf, kb, 3, ar, fresh); break;
            case 2: rows_over_block(xr, ldx, wbuf, kb, 2, ar, fresh); break;
            default: rows_over_block(xr, ldx, wbuf, kb, 1, ar, fresh); break;
            }
            if (GROUPED(kind))
                for (int r = 0; r < R; r++)
                    v_store(out[r0 + r],
                            fold_group(m, p, k0 >> group_shift(step), v_load(ar + r * PANEL),
                                       xs ? xs[(r0 + r) * ldxs + (k0 >> group_shift(step))] : 0.0f,
                                       v_load(out[r0 + r])));
        }
    }
    if (!GROUPED(kind))
        for (int64_t r = 0; r < M; r++) v_store(out[r], finish(m, kind, p, v_load(acc + r * PANEL)));
}

/* Panels per call for M rows (how many one register block holds). */
static int panels_per_call(int64_t M) {
#if FP_WIDE
    return M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1;
#elif SD_ISA >= 2
    return M == 1 ? 4 : M == 2 ? 2 : 1;
#else
    (void)M;
    return 1;
#endif
}

#define DIRECT(NP, R) panel_direct(x, ldx, xs, ldxs, m, kind, p, NP, R, out)

/* Panels p..p+np-1 for M rows: one register block where it holds them, else buffered. */
SD_INLINE void chunk_of_kind(const float *x, int64_t ldx, const float *xs, int64_t ldxs,
                             const sd_mat *m, int kind, int64_t p, int np, int64_t M,
                             float out[][CHUNK][PANEL]) {
#if FP_WIDE
    if (M == 1) {
        switch (np) {
        case 8: DIRECT(8, 1); return;
        case 7: DIRECT(7, 1); return;
        case 6: DIRECT(6, 1); return;
        case 5: DIRECT(5, 1); return;
        case 4: DIRECT(4, 1); return;
        case 3: DIRECT(3, 1); return;
        case 2: DIRECT(2, 1); return;
        default: DIRECT(1, 1); return;
        }
    }
    if (M == 2) {
        switch (np) {
        case 4: DIRECT(4, 2); return;
        case 3: DIRECT(3, 2); return;
        case 2: DIRECT(2, 2); return;
        default: DIRECT(1, 2); return;
        }
    }
    if (M <= 4) {
        if (np == 2) { if (M == 3) DIRECT(2, 3); else DIRECT(2, 4); }
        else { if (M == 3) DIRECT(1, 3); else DIRECT(1, 4); }
        return;
    }
    switch (M) {
    case 5: DIRECT(1, 5); return;
    case 6: DIRECT(1, 6); return;
    case 7: DIRECT(1, 7); return;
    case 8: DIRECT(1, 8); return;
    case 9: DIRECT(1, 9); return;
    case 10: DIRECT(1, 10); return;
    case 11: DIRECT(1, 11); return;
    case 12: DIRECT(1, 12); return;
    default: panel_buffered(x, ldx, xs, ldxs, m, kind, p, M, out[0]); return;
    }
#elif SD_ISA >= 2
    if (M == 1) {
        switch (np) {
        case 4: DIRECT(4, 1); return;
        case 3: DIRECT(3, 1); return;
        case 2: DIRECT(2, 1); return;
        default: DIRECT(1, 1); return;
        }
    }
    if (M == 2) {
        if (np == 2) DIRECT(2, 2);
        else DIRECT(1, 2);
        return;
    }
    switch (M) {
    case 3: DIRECT(1, 3); return;
    case 4: DIRECT(1, 4); return;
    case 5: DIRECT(1, 5); return;
    case 6: DIRECT(1, 6); return;
    default: panel_buffered(x, ldx, xs, ldxs, m, kind, p, M, out[0]); return;
    }
#else
    (void)np;
    panel_buffered(x, ldx, xs, ldxs, m, kind, p, M, out[0]);
#endif
}

/* One body per weight kind, the kind a constant in each. */
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


#undef ROWS
#undef NPMAX
#undef DIRECT
#undef v16
#undef v_zero
#undef v_load
#undef v_store
#undef v_set1
#undef v_fma
#undef v_mul
#undef v_bf16
#undef v_i8
#undef v_u4
#undef decode_k
#undef span_of
#undef fold_group
#undef finish
#undef panel_direct
#undef rows_over_block
#undef panel_buffered
#undef panels_per_call
#undef chunk_of_kind
#undef panel_chunk
