/* Prefill attention in bfloat16 (AVX512-BF16): each query token of one sequence attends to the
 * keys up to its own position, every head of the step's own K and V, 32 products an
 * instruction (`vdpbf16ps`). PyTorch's CPU flash attention ran these at 85-120 GFLOP/s on two
 * Zen 4 cores, a third of what the instruction gives; a long prompt's prefill spent as long in
 * attention as in its linears.
 *
 * K and V are first repacked per KV head so that both products run with lanes along a
 * contiguous axis: keys as pairs of dimensions (lane = key), values as pairs of tokens (lane =
 * dimension). Each query row's scores are made in full, softmaxed in float32, normalised and
 * rounded to bfloat16 (as HuggingFace's eager attention and torch's SDPA round them before the
 * product with V), then multiplied by V with float32 sums. ROWS query rows share each load.
 * Its reference is torch's scaled_dot_product_attention (tests/engine/test_cpu_kernels.py).
 */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "vector16.h"

#define INLINE static inline __attribute__((always_inline))
#define KEYS 16
#define MAX_CHUNKS 16 /* head_dim up to 256 */

INLINE __m512 dot_pairs(__m512 acc, uint32_t a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)a), (__m512bh)b);
}

/* One KV head's keys as [dim / 2][keys] words (a word: two dimensions of one key) and values
 * as [keys / 2][dim] words (a word: one dimension of two neighbouring keys); padding zero. */
static void pack(const uint16_t *k, const uint16_t *v, int64_t stride, int len, int padded,
                 int dim, uint32_t *kt, uint32_t *vp) {
    memset(kt, 0, sizeof(uint32_t) * (size_t)padded * dim / 2);
    memset(vp, 0, sizeof(uint32_t) * (size_t)padded * dim / 2);
    for (int j = 0; j < len; j++) {
        const uint32_t *kw = (const uint32_t *)(k + j * stride);
        for (int p = 0; p < dim / 2; p++) kt[(int64_t)p * padded + j] = kw[p];
        const uint16_t *vr = v + j * stride;
        uint16_t *half = (uint16_t *)(vp + (int64_t)(j / 2) * dim) + (j & 1);
        for (int d = 0; d < dim; d++) half[2 * d] = vr[d];
    }
}

/* Rows i0 .. i0 + rows - 1 of one query head: scores (scale applied, keys after each row's
 * position masked), softmax, and the rounded probabilities as words of two keys into p. */
INLINE void probabilities(const uint16_t *q, int64_t q_stride, const uint32_t *kt, int padded,
                          int n, int position, const int rows, const int pairs, float scale,
                          float *s, uint16_t *p) {
    __m512 maxv[4];
    for (int r = 0; r < rows; r++) maxv[r] = _mm512_set1_ps(-INFINITY);
    for (int j0 = 0; j0 < n; j0 += KEYS) {
        __m512 acc[4];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int c = 0; c < pairs; c++) {
            __m512i keys = _mm512_loadu_si512(kt + (int64_t)c * padded + j0);
            for (int r = 0; r < rows; r++)
                acc[r] = dot_pairs(acc[r], ((const uint32_t *)(q + r * q_stride))[c], keys);
        }
        __m512i at = _mm512_add_epi32(_mm512_set1_epi32(j0), _mm512_setr_epi32(
            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        for (int r = 0; r < rows; r++) {
            __mmask16 seen = _mm512_cmple_epi32_mask(at, _mm512_set1_epi32(position + r));
            __m512 x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY),
                                            _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
            _mm512_storeu_ps(s + r * padded + j0, x);
            maxv[r] = _mm512_max_ps(maxv[r], x);
        }
    }
    for (int r = 0; r < rows; r++) {
        float *sr = s + r * padded;
        __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(maxv[r])), total = _mm512_setzero_ps();
        for (int j = 0; j < n; j += KEYS) {
            __m512 x = _mm512_loadu_ps(sr + j);
            __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, m)));
            _mm512_storeu_ps(sr + j, e);
            total = _mm512_add_ps(total, e);
        }
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
        for (int j = 0; j < n; j += KEYS)
            store16((char *)(p + r * padded + j), _mm512_mul_ps(_mm512_loadu_ps(sr + j), inv), 1);
    }
}

/* out rows = p (rows x n keys, bfloat16) times V (packed), float32 sums rounded once. */
INLINE void weighted_values(const uint16_t *p, const uint32_t *vp, int padded, int n,
                            const int rows, const int chunks, uint16_t *out, int64_t out_stride) {
    __m512 acc[4][MAX_CHUNKS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++) acc[r][c] = _mm512_setzero_ps();
    const int dim = chunks * 16;
    for (int jp = 0; jp < n / 2; jp++) {
        const uint32_t *row = vp + (int64_t)jp * dim;
        __m512i v[MAX_CHUNKS];
        for (int c = 0; c < chunks; c++) v[c] = _mm512_loadu_si512(row + c * 16);
        for (int r = 0; r < rows; r++) {
            uint32_t w = ((const uint32_t *)(p + r * padded))[jp];
            for (int c = 0; c < chunks; c++) acc[r][c] = dot_pairs(acc[r][c], w, v[c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++) store16((char *)(out + r * out_stride + c * 16), acc[r][c], 1);
}

/* A block of query rows of one head: ROWS at once where the head's size leaves registers. */
static void rows_block(const uint16_t *q, int64_t q_stride, const uint32_t *kt,
                       const uint32_t *vp, int padded, int n, int position, int rows,
                       int chunks, float scale, float *s, uint16_t *p, uint16_t *out,
                       int64_t out_stride) {
#define BLOCK(R, C)                                                                            \
    if (rows == R && chunks == C) {                                                            \
        probabilities(q, q_stride, kt, padded, n, position, R, C * 8, scale, s, p);          \
        weighted_values(p, vp, padded, n, R, C, out, out_stride);                              \
        return;                                                                                \
    }
    BLOCK(4, 4) BLOCK(3, 4) BLOCK(2, 4) BLOCK(1, 4) BLOCK(2, 8) BLOCK(1, 8)
    for (int r = 0; r < rows; r++) {
        probabilities(q + r * q_stride, q_stride, kt, padded, n, position + r, 1, chunks * 8,
                      scale, s, p);
        weighted_values(p, vp, padded, n, 1, chunks, out + r * out_stride, out_stride);
    }
#undef BLOCK
}

/* q, out: [q_len, heads, dim] bfloat16 rows q_stride and out_stride elements apart; k, v:
 * [kv_len, kv_heads, dim] rows kv_stride apart; query i sits at position kv_len - q_len + i
 * and attends to keys 0 .. that position. dim: a multiple of 32, at most 16 * MAX_CHUNKS. */
void prefill_attention(const void *q, int64_t q_stride, const void *k, const void *v,
                       int64_t kv_stride, void *out, int64_t out_stride, int q_len, int kv_len,
                       int heads, int kv_heads, int dim, float scale, int threads) {
    const int group = heads / kv_heads, chunks = dim / 16, padded = (kv_len + KEYS - 1) / KEYS * KEYS;
    const int block = chunks <= 4 ? 4 : 2, blocks = (q_len + block - 1) / block;
    const int offset = kv_len - q_len;
    size_t packed = (size_t)padded * dim / 2;
    uint32_t *kt = malloc(sizeof(uint32_t) * packed * kv_heads);
    uint32_t *vp = malloc(sizeof(uint32_t) * packed * kv_heads);
#pragma omp parallel num_threads(threads)
    {
        float *s = malloc(sizeof(float) * (size_t)block * padded);
        uint16_t *p = malloc(sizeof(uint16_t) * (size_t)block * padded);
#pragma omp for
        for (int h = 0; h < kv_heads; h++)
            pack((const uint16_t *)k + h * dim, (const uint16_t *)v + h * dim, kv_stride, kv_len,
                 padded, dim, kt + packed * h, vp + packed * h);
        /* the last rows attend to the most keys: handed out first */
#pragma omp for schedule(dynamic)
        for (int item = 0; item < heads * blocks; item++) {
            int head = item % heads, i0 = (blocks - 1 - item / heads) * block;
            int rows = q_len - i0 < block ? q_len - i0 : block, h = head / group;
            int last = offset + i0 + rows - 1, n = (last + KEYS) / KEYS * KEYS;
            rows_block((const uint16_t *)q + i0 * q_stride + head * dim, q_stride,
                       kt + packed * h, vp + packed * h, padded, n, offset + i0, rows, chunks,
                       scale, s, p, (uint16_t *)out + i0 * out_stride + head * dim, out_stride);
        }
        free(s);
        free(p);
    }
    free(kt);
    free(vp);
}
#endif
