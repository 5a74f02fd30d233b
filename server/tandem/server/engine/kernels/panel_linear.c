/* float32 products of a decode step's few rows by a weight kept in column panels (AVX-512),
 * and the same loop over bfloat16 weights where there are no AMX tiles (panel_linear_bf16,
 * panel_linear_pairs).
 *
 * oneDNN's packed float32 product ran the default model's 30 layers and lm_head at 33 ms for
 * one row (the weights' 540 MB at memory speed) but 58 ms at 16 rows and 85 ms at 32 on two
 * Emerald Rapids cores: a third of the cores' FMA rate. Here the weight is packed once into
 * panels of 64 output columns, each panel's k inputs in a row of four vectors, so a panel
 * streams in once and up to ROWS rows at a time meet it while it stays in L2: per input, four
 * vector loads and, per row, one broadcast and four FMAs into accumulators that live in
 * registers for the whole panel. Alone, best of five, cold weights, the default model's
 * layers (ms, oneDNN -> panels): 1 row 29.9 -> 21.5, 16 rows 46.6 -> 41.5, 32 rows 63 -> 61,
 * 64 rows 98 -> 90: at par where the FMAs bind; what it buys is a product the decode chain
 * can call, with no Python between the layers.
 *
 * Where bfloat16 products run as dot pairs at twice the FMAs' rate (AVX512-BF16 on Zen 4),
 * panel_linear_pairs keeps each panel's inputs in pairs and multiplies the bfloat16 rows as
 * they are: one vdpbf16ps a vector per pair of inputs, no widening, half the steps.
 *
 * Every output is the sum over the inputs in their order (in pairs, for panel_linear_pairs),
 * plus the bias: the same bits whatever other rows share the step (speculation's exactness
 * rests on that); in bfloat16 that sum rounded once. Its reference is the float64 product
 * (tests/engine/test_decode_linear.py). */
#include "kernels.h"

#ifdef __AVX512F__
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "vector16.h"

#define PANEL 64 /* output columns a panel holds: four vectors */
#define ROWS 6    /* rows a pass over a panel takes: 24 accumulators */
#define AHEAD 8   /* inputs a lone pass asks for into L2 ahead of its loads */
#define INLINE static inline __attribute__((always_inline))

/* What a panel holds and what x is: float32 weights and rows (F32); bfloat16 weights widened
 * as they load, rows widened beforehand (WIDE); bfloat16 weights and rows as pairs of inputs
 * for dot pairs (PAIRS). A step is one input, or for PAIRS one pair of inputs. */
enum { F32, WIDE, PAIRS };
#define STEP_BYTES(mode) ((mode) == WIDE ? PANEL * 2 : PANEL * 4) /* a panel's bytes a step */
#define STEPS(mode, k) ((mode) == PAIRS ? ((k) + 1) / 2 : (k))

/* w [n, k] float32, rows k apart, into panels: panel p holds columns 64p .. 64p + 63 as
 * [k][64] (zero past the last column); out holds n rounded up to 64, times k. */
void panel_pack(const float *w, int n, int k, float *out) {
    for (int p = 0; p < (n + PANEL - 1) / PANEL; p++)
        for (int i = 0; i < k; i++)
            for (int c = 0; c < PANEL; c++) {
                const int col = PANEL * p + c;
                *out++ = col < n ? w[(int64_t)col * k + i] : 0.0f;
            }
}

/* The same panels in bfloat16, each input's 64 columns as 32 words of two: word d of the
 * first half holds columns d (low) and 16 + d (high), of the second 32 + d and 48 + d, so
 * that a shift and a mask make the four float32 vectors (one instruction each, where
 * converting 16 bfloat16 values takes two). */
void panel_pack_bf16(const uint16_t *w, int n, int k, uint16_t *out) {
    for (int p = 0; p < (n + PANEL - 1) / PANEL; p++)
        for (int i = 0; i < k; i++)
            for (int half = 0; half < 2; half++)
                for (int d = 0; d < 16; d++)
                    for (int hi = 0; hi < 2; hi++) {
                        const int col = PANEL * p + 32 * half + 16 * hi + d;
                        *out++ = col < n ? w[(int64_t)col * k + i] : 0;
                    }
}

/* The same panels with the inputs in pairs: for each pair of inputs 2i, 2i + 1, the 64
 * columns as 32-bit words, input 2i low and 2i + 1 high (zero past the last input): what
 * vdpbf16ps multiplies by a row's pair broadcast. out holds n rounded up to 64, times k
 * rounded up to 2. */
void panel_pack_pairs(const uint16_t *w, int n, int k, uint16_t *out) {
    for (int p = 0; p < (n + PANEL - 1) / PANEL; p++)
        for (int i = 0; i < k; i += 2)
            for (int c = 0; c < PANEL; c++)
                for (int j = i; j < i + 2; j++) {
                    const int col = PANEL * p + c;
                    *out++ = col < n && j < k ? w[(int64_t)col * k + j] : 0;
                }
}

/* Step i's 64 weights of a panel as four vectors: float32 (exact in either dtype) or, for
 * PAIRS, 16 pairs of bfloat16 each. */
INLINE void panel_weights(const char *panel, int64_t i, const int mode, __m512 w[4]) {
    if (mode != WIDE) {
        for (int v = 0; v < 4; v++) w[v] = _mm512_loadu_ps(panel + i * STEP_BYTES(mode) + 64 * v);
        return;
    }
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int half = 0; half < 2; half++) {
        const __m512i words = _mm512_loadu_si512(panel + (i * PANEL + 32 * half) * 2);
        w[2 * half] = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
        w[2 * half + 1] = _mm512_castsi512_ps(_mm512_and_si512(words, high));
    }
}

/* A row's pair of bfloat16 inputs 2i, 2i + 1 in every word (an odd k's last pair: the last
 * input and zero, reading only its two bytes). */
INLINE __m512i x_pair(const char *row, int i, int k) {
    if (2 * i + 1 < k) {
        int32_t pair;
        memcpy(&pair, row + 4 * i, 4);
        return _mm512_set1_epi32(pair);
    }
    return _mm512_set1_epi32(*(const uint16_t *)(row + 4 * i));
}

/* `rows` (a constant where inlined) rows of x (byte rows x_stride apart: float32, or bfloat16
 * for PAIRS) times one panel, plus bias, into out's first `cols` columns, in float32 or rounded
 * to bfloat16 once. Pass j of `passes` over the panel asks for its share of the panel's cache
 * lines (`lines` a step) from `ask` on (NULL: none) into L2, spread evenly over its steps, the
 * passes together asking for each line once. */
INLINE void rows_panel(const char *x, int64_t x_stride, const char *panel, int k, const int rows,
                       const char *bias, int cols, char *out, int64_t out_stride,
                       const char *ask, int j, int passes, const int mode) {
    const int lines = STEP_BYTES(mode) / 64, elem = mode == F32 ? 4 : 2, bf16 = mode != F32;
    const int steps = STEPS(mode, k);
    __m512 acc[ROWS][4];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
    int64_t line = (int64_t)j * steps * lines / passes; /* the next line to ask for */
    int due = (int)((int64_t)j * steps * lines % passes); /* passes-ths of a line owed */
    for (int i = 0; i < steps; i++) {
        for (due += ask ? lines : 0; due >= passes; due -= passes)
            _mm_prefetch(ask + 64 * line++, _MM_HINT_T1);
        __m512 w[4];
        panel_weights(panel, i, mode, w);
        for (int r = 0; r < rows; r++) {
            if (mode == PAIRS) {
                const __m512i xr = x_pair(x + r * x_stride, i, k);
                for (int v = 0; v < 4; v++) acc[r][v] = dot_pairs(acc[r][v], _mm512_castps_si512(w[v]), xr);
                continue;
            }
            const __m512 xr = _mm512_set1_ps(((const float *)(x + r * x_stride))[i]);
            for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(xr, w[v], acc[r][v]);
        }
    }
    for (int v = 0; v < 4; v++) {
        const int left = cols - 16 * v;
        const __mmask16 keep = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias && bf16)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_maskz_loadu_epi16(keep, bias + 2 * 16 * v)), 16));
        else if (bias)
            b = _mm512_maskz_loadu_ps(keep, bias + 4 * 16 * v);
        for (int r = 0; r < rows; r++) {
            char *to = out + (r * out_stride + 16 * v) * elem;
            const __m512 y = _mm512_add_ps(acc[r][v], b);
            if (bf16 && keep == 0xffff)
                store16(to, y, 1);
            else if (bf16)
                for (int c = 0; c < left; c++) store(to, c, y[c], 1);
            else
                _mm512_mask_storeu_ps(to, keep, y);
        }
    }
}

/* Up to ROWS rows of x times one panel: the row count made a constant. */
INLINE void group_panel(const char *x, int64_t x_stride, const char *panel, int k, int rows,
                        const char *bias, int cols, char *out, int64_t out_stride,
                        const char *ask, int j, int passes, const int mode) {
#define ROWS_CASE(R)                                                                           \
    case R:                                                                                    \
        return rows_panel(x, x_stride, panel, k, R, bias, cols, out, out_stride, ask, j, passes, \
                          mode);
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
    }
#undef ROWS_CASE
}

/* Passes g0 .. g1 - 1 over one panel, a group of ROWS rows each. Unless this is the thread's
 * last panel, the passes (one or several) share out asking for the next panel, so it streams
 * in from memory while this one is multiplied from L2; on the thread's last panel a lone
 * pass asks for its own panel AHEAD inputs ahead and several ask for nothing. At 16-32
 * rows the passes after the first ran at the FMA rate and the first at the rate lines came
 * in on demand (default model, 2 threads, FMAs a cycle a thread: 576 -> 3072 at 32 rows
 * 1.34 -> 1.57, lm_head 1.0 -> 1.4-1.7). Spread over all the passes' inputs rather than a
 * line an input in the first four, the asks cost the default model's 30 layers 0.97x the
 * time at 16 rows, 0.91x at 32 and 0.85x at 64 (alternating in one process, 11 runs). */
INLINE void panel_passes(const char *x, int64_t x_stride, int m, int k, const char *panel,
                         int g0, int g1, int last, const char *bias, int cols, char *out,
                         int64_t out_stride, const int mode) {
    const int64_t bytes = (int64_t)STEPS(mode, k) * STEP_BYTES(mode), ahead = AHEAD * STEP_BYTES(mode);
    const char *ask = !last ? panel + bytes : g1 - g0 == 1 ? panel + ahead : NULL;
    for (int g = g0; g < g1; g++)
        group_panel(x + g * ROWS * x_stride, x_stride, panel, k,
                    m - g * ROWS < ROWS ? m - g * ROWS : ROWS, bias, cols,
                    out + g * ROWS * out_stride * (mode == F32 ? 4 : 2), out_stride, ask, g - g0,
                    g1 - g0, mode);
}

/* The threads split the (panel, pass) pairs into consecutive runs, so each panel streams in
 * once (twice where two threads split it) and meets its groups of ROWS rows while in L2;
 * splitting pairs rather than panels evens out a panel count the threads do not divide (nine
 * for the default model's 576 outputs). x: rows x_stride bytes apart as `mode` says; the
 * weight, bias and out in float32 (F32) or bfloat16. */
static void panel_product(const char *x, int64_t x_stride, int m, int k, const char *packed, int n,
                          const char *bias, char *out, int64_t out_stride, int threads,
                          int mode) {
    const int panels = (n + PANEL - 1) / PANEL, passes = (m + ROWS - 1) / ROWS;
    const int64_t pairs = (int64_t)panels * passes, elem = mode == F32 ? 4 : 2;
    const int64_t panel_bytes = (int64_t)STEPS(mode, k) * STEP_BYTES(mode);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t end = pairs * (t + 1) / nt;
        for (int64_t u = pairs * t / nt; u < end;) {
            const int p = (int)(u / passes), g0 = (int)(u % passes);
            const int g1 = end - (int64_t)p * passes < passes ? (int)(end - (int64_t)p * passes) : passes;
            const int cols = n - PANEL * p < PANEL ? n - PANEL * p : PANEL, last = (int64_t)(p + 1) * passes >= end;
            const char *panel = packed + p * panel_bytes, *b = bias ? bias + PANEL * p * elem : NULL;
            char *to = out + PANEL * p * elem;
            if (mode == PAIRS)
                panel_passes(x, x_stride, m, k, panel, g0, g1, last, b, cols, to, out_stride, PAIRS);
            else if (mode == WIDE)
                panel_passes(x, x_stride, m, k, panel, g0, g1, last, b, cols, to, out_stride, WIDE);
            else
                panel_passes(x, x_stride, m, k, panel, g0, g1, last, b, cols, to, out_stride, F32);
            u = (int64_t)p * passes + g1;
        }
    }
}

/* out [m, n] (rows out_stride apart) = x [m, k] (rows x_stride apart) times the weight packed
 * by panel_pack, plus bias [n] (or NULL), float32. */
void panel_linear(const float *x, int64_t x_stride, int m, int k, const float *packed, int n,
                  const float *bias, float *out, int64_t out_stride, int threads) {
    panel_product((const char *)x, x_stride * 4, m, k, (const char *)packed, n, (const char *)bias,
                  (char *)out, out_stride, threads, F32);
}

/* The same in bfloat16 (weight packed by panel_pack_bf16), where there are no AMX tiles: x
 * widened to float32 first, each output the float32 sum over the inputs in order (exact
 * products), plus bias, rounded once. Decode products read the weights' bytes once a step, so
 * bfloat16 weights halve what float32 panels of the same model read. */
void panel_linear_bf16(const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *packed,
                       int n, const uint16_t *bias, uint16_t *out, int64_t out_stride,
                       int threads) {
    float *wide = malloc(sizeof(float) * (size_t)m * k);
    for (int r = 0; r < m; r++)
        for (int i = 0; i < k; i++) wide[(int64_t)r * k + i] = from_bf16(x[r * x_stride + i]);
    panel_product((const char *)wide, k * 4, m, k, (const char *)packed, n, (const char *)bias,
                  (char *)out, out_stride, threads, WIDE);
    free(wide);
}

#if HAVE_DPBF16
/* The same in bfloat16 by dot pairs (weight packed by panel_pack_pairs), x read as it is: each
 * output the float32 sum over the pairs of inputs in order (a pair's two products summed
 * first), plus bias, rounded once. */
void panel_linear_pairs(const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *packed,
                        int n, const uint16_t *bias, uint16_t *out, int64_t out_stride,
                        int threads) {
    panel_product((const char *)x, x_stride * 2, m, k, (const char *)packed, n, (const char *)bias,
                  (char *)out, out_stride, threads, PAIRS);
}
#endif
#endif
