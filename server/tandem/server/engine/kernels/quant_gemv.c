/* y[M, N] = x[M, K] @ W^T with W kept in GGUF's (ggml's) block formats, for the few rows of a
 * decode step: each block of 32 weights is read once from memory and used for all M rows, so
 * a step reads the file's 4.5 to 8.5 bits per weight instead of the dequantized float32's 32.
 * AVX-512; built without it, the library has no quant_gemv and the layers keep their
 * dequantized weights (loader.py).
 *
 * Blocks (ggml's block_q8_0 / block_q4_0 / block_q4_1, little-endian, packed):
 *   Q8_0: fp16 d, int8 q[32]               w[i] = d * q[i]
 *   Q4_0: fp16 d, uint8 qs[16]             w[i] = d * (nibble(i) - 8)
 *   Q4_1: fp16 d, fp16 m, uint8 qs[16]     w[i] = d * nibble(i) + m
 * nibble(i) is qs[i] & 15 for i < 16 and qs[i - 16] >> 4 for i >= 16.
 *
 * Each weight is rebuilt in float32 exactly as gguf's dequantize builds it (d * q is exact in
 * float32; Q4_1's + m rounds once, fused or not), so the product differs from the
 * dequantized model's only in the order of the float32 sums. Its reference is that product
 * (tests/engine/test_quant_gemv.py).
 */
#ifdef __AVX512F__
#include <immintrin.h>
#include <stdlib.h>

#include "quant_blocks.h"
#include "kernels.h"

INLINE float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* One block's 32 weights in float32: elements 0..15 in *lo, 16..31 in *hi. A 4-bit block's
 * 16 possible weights are made once as a table (the same d * q + m, rounded once) and its
 * nibbles look them up (vpermps reads an index's low 4 bits only: no masking). */
INLINE void block_weights(const uint8_t *b, const int qtype, __m512 *lo, __m512 *hi) {
    if (qtype == Q8_0) {
        __m512 d = _mm512_set1_ps(half_at(b));
        __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2));
        __m128i q1 = _mm_loadu_si128((const __m128i *)(b + 18));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        return;
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table;
    if (qtype == Q4_1) { /* d * q + m */
        int32_t dm;
        memcpy(&dm, b, sizeof dm);
        __m512 pairs = _mm512_cvtph_ps(_mm256_set1_epi32(dm)); /* d, m, d, m, ... */
        table = _mm512_fmadd_ps(_mm512_moveldup_ps(pairs), iota, _mm512_movehdup_ps(pairs));
    } else { /* d * (q - 8): exact */
        int16_t d;
        memcpy(&d, b, sizeof d);
        __m512 dv = _mm512_cvtph_ps(_mm256_set1_epi16(d));
        table = _mm512_mul_ps(dv, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    }
    __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (qtype == Q4_1 ? 4 : 2))));
    *lo = _mm512_permutexvar_ps(idx, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
}

/* One output column n for all rows: x is [rows, K] float32 (contiguous), out[r] = x[r] . w */
INLINE void dot_rows(const float *restrict x, const uint8_t *restrict w, float *out, int K,
                     const int rows, const int qtype, const int block_bytes) {
    __m512 acc[2 * MAX_ROWS];
    for (int r = 0; r < 2 * rows; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < K / QK; b++) {
        __m512 lo, hi;
        block_weights(w + (int64_t)b * block_bytes, qtype, &lo, &hi);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (int64_t)r * K + b * QK;
            acc[2 * r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[2 * r]);
            acc[2 * r + 1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < rows; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * r], acc[2 * r + 1]));
}

/* Columns n and n + 1 for all rows: each block of x is loaded once for both, so a step of
 * several rows issues one load per two FMAs, not one per FMA; each column's sums are
 * dot_rows's, in the same order, so its result is the same bits. */
INLINE void dot_rows_pair(const float *restrict x, const uint8_t *restrict w0,
                          const uint8_t *restrict w1, float *out0, float *out1, int K,
                          const int rows, const int qtype, const int block_bytes) {
    __m512 a0[2 * MAX_ROWS], a1[2 * MAX_ROWS];
    for (int r = 0; r < 2 * rows; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int b = 0; b < K / QK; b++) {
        __m512 lo0, hi0, lo1, hi1;
        block_weights(w0 + (int64_t)b * block_bytes, qtype, &lo0, &hi0);
        block_weights(w1 + (int64_t)b * block_bytes, qtype, &lo1, &hi1);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (int64_t)r * K + b * QK;
            __m512 xl = _mm512_loadu_ps(xr), xh = _mm512_loadu_ps(xr + 16);
            a0[2 * r] = _mm512_fmadd_ps(lo0, xl, a0[2 * r]);
            a0[2 * r + 1] = _mm512_fmadd_ps(hi0, xh, a0[2 * r + 1]);
            a1[2 * r] = _mm512_fmadd_ps(lo1, xl, a1[2 * r]);
            a1[2 * r + 1] = _mm512_fmadd_ps(hi1, xh, a1[2 * r + 1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        out0[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[2 * r], a0[2 * r + 1]));
        out1[r] = _mm512_reduce_add_ps(_mm512_add_ps(a1[2 * r], a1[2 * r + 1]));
    }
}

/* Where columns go in pairs (quant_columns.h), as measured on Zen 4 with the default model's
 * shapes, 1 to 8 rows: a pair's 4 * rows accumulators fit the 32 registers up to 7 rows
 * (3 to 7 rows 5 to 25% faster; 1 and 2 the same); Q8_0's pair was slower than its single
 * column below 6 rows and faster from 6. */
#define PAIR_ROWS 7
#define PAIRS_FOR(qtype, rows) ((rows) <= PAIR_ROWS && ((qtype) != Q8_0 || (rows) >= 6))
#define X_T float
#include "quant_columns.h"

/* y[rows, N] (rows y_stride elements apart, x's dtype) = x[rows, K] @ W^T; x's rows are
 * x_stride elements apart, W's N rows of K / 32 blocks are w_stride bytes apart. rows <= 8,
 * K a multiple of 32, qtype one of Q8_0, Q4_0, Q4_1. x is widened to float32 once. */
void quant_gemv(const void *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, void *y,
                int64_t y_stride, int rows, int N, int K, int qtype, int bf16, int threads) {
    float *xf = aligned_alloc(64, ((size_t)rows * K * sizeof(float) + 63) / 64 * 64);
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < K; k++) xf[(int64_t)r * K + k] = load(x, (int64_t)r * x_stride + k, bf16);
    all_columns(xf, w, w_stride, y, y_stride, rows, N, K, qtype, bf16, threads);
    free(xf);
}
#endif
