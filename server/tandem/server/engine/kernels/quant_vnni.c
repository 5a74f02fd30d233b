/* y[M, N] = x[M, K] @ W^T with W in GGUF's Q8_0 / Q4_0 / Q4_1 blocks, as llama.cpp multiplies
 * them: x is quantized once per call to 8 bits per value with one float scale per block of 32
 * (ggml's Q8_0 for activations: d_x = max|x| / 127, q = round(x / d_x)), and each pair of
 * weight blocks meets each row's pair of x blocks in one AVX512-VNNI `vpdpbusd` (64 u8 x s8
 * products summed into 16 int32 lanes, exact), then d_w * d_x scales each block's integer dot.
 * Same signature, layout and threading as quant_gemv.c's quant_gemv, which stays the exact
 * reference; this one trades x's rounding (|x - d_x q| <= d_x / 2 per value) for about a third
 * of the instructions (tests/engine/test_quant_gemv.py bounds the difference from that).
 *
 * vpdpbusd multiplies unsigned bytes by signed ones, so each type puts its unsigned side where
 * it is and folds the offset into the accumulator the dot starts from (integer, exact):
 *   Q8_0: w signed, x stored as q + 128 (u8): dot(q + 128, w) - 128 sum(w), sum(w) per column
 *         by one more vpdpbusd shared by all rows.
 *   Q4_0: nibbles n unsigned, x signed: d_w (n - 8) . q = d_w (n . q - 8 sum(q)), sum(q) per row.
 *   Q4_1: w = d_w n + m: d_w d_x (n . q) + m sum(x), sum(x) the block's float sum (exact x:
 *         only d_w n's product sees x's rounding).
 * A 4-bit pair of blocks is read as [lo(b), lo(b+1), hi(b), hi(b+1)] (16 bytes each, no
 * shuffle); x is stored in that order, so the int32 lanes 0-3 and 8-11 are block b's. An odd
 * last block pairs with a block of zeros (its scales 0; x's padding is zeros).
 */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdlib.h>

#include "quant_blocks.h"
#include "kernels.h"

/* One row's x, quantized: per pair of blocks 64 bytes of q, 16 float lanes of d_x (each lane
 * the scale of the block its int32 lane sums), and 16 int32 lanes of the offset (Q4_0:
 * -8 sum(q)) or 16 float lanes of sum(x) / 8 (Q4_1), laid out as the lanes they meet. */
typedef struct {
    uint8_t *q;
    float *scale;
    float *sum;    /* Q4_1 */
    int32_t *off;  /* Q4_0 */
} xq_row;

/* Lanes of block b (0) and b+1 (1): Q8_0's halves, a 4-bit pair's alternating quarters. */
INLINE __mmask16 second_block(int qtype) { return qtype == Q8_0 ? 0xFF00 : 0xF0F0; }

/* Where value i (0..31) of block `which` (0, 1) of a pair goes among the pair's 64 bytes. */
INLINE int byte_at(int qtype, int which, int i) {
    if (qtype == Q8_0) return which * QK + i;
    return (i < 16 ? 0 : 32) + which * 16 + (i & 15);
}

/* Quantize one block of 32 x values into its place in the pair; returns sum(q). */
static int quantize_block(const float *x, uint8_t *pair, int which, int qtype, float *d_out,
                          float *sum_out) {
    float amax = 0.0f, sum = 0.0f;
    for (int i = 0; i < QK; i++) {
        amax = fmaxf(amax, fabsf(x[i]));
        sum += x[i];
    }
    float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    int qsum = 0;
    for (int i = 0; i < QK; i++) {
        int q = (int)nearbyintf(x[i] * id);
        qsum += q;
        pair[byte_at(qtype, which, i)] = (uint8_t)(qtype == Q8_0 ? q + 128 : q);
    }
    *d_out = d, *sum_out = sum;
    return qsum;
}

/* Row r of x (float32, K values, zero-padded to whole pairs) into xr's buffers. */
static void quantize_row(const float *x, int K, int qtype, xq_row *xr) {
    const __mmask16 second = second_block(qtype);
    int pairs = (K / QK + 1) / 2;
    for (int p = 0; p < pairs; p++) {
        float d[2] = {0, 0}, s[2] = {0, 0};
        int qs[2] = {0, 0};
        uint8_t *pair = xr->q + (int64_t)p * 64;
        memset(pair, qtype == Q8_0 ? 128 : 0, 64);
        for (int which = 0; which < 2 && (2 * p + which) * QK < K; which++)
            qs[which] = quantize_block(x + (2 * p + which) * QK, pair, which, qtype, &d[which],
                                       &s[which]);
        for (int lane = 0; lane < 16; lane++) {
            int which = (second >> lane) & 1;
            xr->scale[p * 16 + lane] = d[which];
            xr->sum[p * 16 + lane] = s[which] * 0.125f; /* 8 lanes a block: exact */
            xr->off[p * 16 + lane] = -qs[which]; /* 8 lanes a block: -8 sum(q) in all */
        }
    }
}

/* One pair of weight blocks (a, b: b may be the zero block) as vpdpbusd's 64 bytes. */
INLINE __m512i pair_weights(const uint8_t *a, const uint8_t *b, const int qtype) {
    if (qtype == Q8_0) {
        __m256i lo = _mm256_loadu_si256((const __m256i *)(a + 2));
        __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 2));
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    const int head = qtype == Q4_1 ? 4 : 2;
    __m256i v = _mm256_loadu2_m128i((const __m128i *)(b + head), (const __m128i *)(a + head));
    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
}

/* A pair's scales d (and Q4_1's minimums m) in float32, each lane its block's: the two
 * blocks' 4-byte heads converted at once, then spread to the lanes (second_block's). */
INLINE void pair_scales(const uint8_t *a, const uint8_t *b, const int qtype, __m512 *d,
                        __m512 *m) {
    int32_t ha, hb;
    memcpy(&ha, a, sizeof ha);
    memcpy(&hb, b, sizeof hb);
    __m512 heads = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_setr_epi32(ha, hb, 0, 0)));
    /* heads: a.d, a.m, b.d, b.m (a Q8_0 / Q4_0 head is d alone: the m slots unused) */
    const __m512i d_at = qtype == Q8_0
                             ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2)
                             : _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2);
    *d = _mm512_permutexvar_ps(d_at, heads);
    if (qtype == Q4_1) *m = _mm512_permutexvar_ps(_mm512_add_epi32(d_at, _mm512_set1_epi32(1)), heads);
}

/* One output column for all rows: out[r] = x_r . w, w's blocks at `w`. */
INLINE void dot_rows(const xq_row *xs, const uint8_t *restrict w, float *out, int K,
                     const int rows, const int qtype, const int block_bytes) {
    static const uint8_t zero_block[64];
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const int blocks = K / QK;
    for (int p = 0; 2 * p < blocks; p++) {
        const uint8_t *a = w + (int64_t)2 * p * block_bytes;
        const uint8_t *b = 2 * p + 1 < blocks ? a + block_bytes : zero_block;
        __m512i wq = pair_weights(a, b, qtype);
        __m512 dw, m = _mm512_setzero_ps();
        pair_scales(a, b, qtype, &dw, &m);
        __m512i start = _mm512_setzero_si512();
        if (qtype == Q8_0) /* -128 sum(w): x's bytes are q + 128 */
            start = _mm512_sub_epi32(
                start, _mm512_slli_epi32(_mm512_dpbusd_epi32(start, _mm512_set1_epi8(1), wq), 7));
        for (int r = 0; r < rows; r++) {
            __m512i xq = _mm512_loadu_si512(xs[r].q + (int64_t)p * 64);
            __m512i dot;
            if (qtype == Q8_0)
                dot = _mm512_dpbusd_epi32(start, xq, wq);
            else if (qtype == Q4_0)
                dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(xs[r].off + p * 16), wq, xq);
            else
                dot = _mm512_dpbusd_epi32(start, wq, xq);
            __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(xs[r].scale + p * 16));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
            if (qtype == Q4_1) /* + m sum(x) */
                acc[r] = _mm512_fmadd_ps(m, _mm512_loadu_ps(xs[r].sum + p * 16), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

#define X_T xq_row
#include "quant_columns.h"

/* x's rows quantized into one buffer: per row and pair 64 bytes of q, then 16 lanes each of
 * scale, sum and offset (256 bytes a pair). Free the returned pointer. */
static void *quantize_rows(const void *x, int64_t x_stride, int rows, int K, int qtype, int bf16,
                           xq_row *xs) {
    const int pairs = (K / QK + 1) / 2;
    const size_t per_row = (size_t)pairs * 256;
    uint8_t *buf = aligned_alloc(64, per_row * rows + (size_t)pairs * 64 * sizeof(float));
    float *xf = (float *)(buf + per_row * rows); /* one row widened, zero-padded to pairs */
    memset(xf, 0, (size_t)pairs * 64 * sizeof(float));
    for (int r = 0; r < rows; r++) {
        uint8_t *row = buf + per_row * r;
        xs[r] = (xq_row){row, (float *)(row + pairs * 64), (float *)(row + pairs * 128),
                         (int32_t *)(row + pairs * 192)};
        for (int k = 0; k < K; k++) xf[k] = load(x, (int64_t)r * x_stride + k, bf16);
        quantize_row(xf, K, qtype, &xs[r]);
    }
    return buf;
}

/* quant_gemv's contract (quant_gemv.c): y[rows, N] = x[rows, K] @ W^T, x and y in float32 or
 * bfloat16 with rows x_stride / y_stride elements apart, W's N rows of K / 32 blocks w_stride
 * bytes apart, rows <= 8, K a multiple of 32; x quantized to 8 bits per block first. */
void quant_gemv_q8(const void *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, void *y,
                   int64_t y_stride, int rows, int N, int K, int qtype, int bf16, int threads) {
    xq_row xs[MAX_ROWS];
    void *buf = quantize_rows(x, x_stride, rows, K, qtype, bf16, xs);
    all_columns(xs, w, w_stride, y, y_stride, rows, N, K, qtype, bf16, threads);
    free(buf);
}
#endif
