/* Prefill attention: each query token of one sequence attends to the keys up to its own
 * position, every head, over the step's own K and V (or a sequence's gathered pages). PyTorch's
 * CPU flash attention ran these at 85-120 GFLOP/s on two Zen 4 cores, a third of what
 * `vdpbf16ps` gives in bfloat16; a long prompt's prefill spent as long in attention as in its
 * linears.
 *
 * K and V are first repacked per KV head so that both products run with lanes along a
 * contiguous axis: keys transposed (lane = key; in bfloat16 a word holds two dimensions of a
 * key, the pairs `vdpbf16ps` multiplies), values in rows (lane = dimension; in bfloat16 a word
 * holds one dimension of two neighbouring keys). Each query row's scores are made in full and
 * softmaxed in float32; the probabilities are normalised and stored in the model's dtype (in
 * bfloat16 rounded, as HuggingFace's eager attention and torch's SDPA round them before the
 * product with V), then multiplied by V with float32 sums. Up to four query rows share each
 * load. Its reference is attention in float64 (tests/engine/test_cpu_kernels.py).
 */
#ifdef __AVX512F__
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector16.h"

#define INLINE static inline __attribute__((always_inline))
#define KEYS 16
#define MAX_ROWS 4
#define MAX_CHUNKS 16 /* head_dim up to 256 */

#ifdef __AVX512BF16__
#define HAVE_DPBF16 1
/* acc + the pairwise products of a broadcast word (two bfloat16) and b's 32 bfloat16 */
INLINE __m512 dot_pairs(__m512 acc, uint32_t a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)a), (__m512bh)b);
}
#else
#define HAVE_DPBF16 0
INLINE __m512 dot_pairs(__m512 acc, uint32_t a, __m512i b) { return acc; } /* never called */
#endif

/* Whether bfloat16 tensors may be passed (the CPU has AVX512-BF16): read by kernels/ops.py. */
const int prefill_attention_bf16 = HAVE_DPBF16;

/* One KV head's keys as [dim / 2][keys] words and values as [keys / 2][dim] words (bfloat16),
 * or as [dim][keys] and [keys][dim] floats (float32); padding zero. */
static void pack(const char *k, const char *v, int64_t stride, int len, int padded, int dim,
                 int bf16, void *kt, void *vp) {
    memset(kt, 0, sizeof(float) * (size_t)padded * dim);
    memset(vp, 0, sizeof(float) * (size_t)padded * dim);
    for (int j = 0; j < len; j++) {
        if (bf16) {
            const uint32_t *kw = (const uint32_t *)(k + j * stride * 2);
            for (int p = 0; p < dim / 2; p++) ((uint32_t *)kt)[(int64_t)p * padded + j] = kw[p];
            const uint16_t *vr = (const uint16_t *)(v + j * stride * 2);
            uint16_t *half = (uint16_t *)((uint32_t *)vp + (int64_t)(j / 2) * dim) + (j & 1);
            for (int d = 0; d < dim; d++) half[2 * d] = vr[d];
        } else {
            const float *kr = (const float *)(k + j * stride * 4);
            for (int d = 0; d < dim; d++) ((float *)kt)[(int64_t)d * padded + j] = kr[d];
            memcpy((float *)vp + (int64_t)j * dim, v + j * stride * 4, sizeof(float) * dim);
        }
    }
}

/* Sixteen keys' scores for `rows` query rows (q rows q_stride elements apart). */
INLINE void scores16(const char *q, int64_t q_stride, const void *kt, int padded, int j0,
                     const int rows, const int dim, const int bf16, __m512 acc[MAX_ROWS]) {
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    if (bf16) {
        for (int c = 0; c < dim / 2; c++) {
            __m512i keys = _mm512_loadu_si512((const uint32_t *)kt + (int64_t)c * padded + j0);
            for (int r = 0; r < rows; r++)
                acc[r] = dot_pairs(acc[r], ((const uint32_t *)(q + r * q_stride * 2))[c], keys);
        }
        return;
    }
    for (int d = 0; d < dim; d++) {
        __m512 keys = _mm512_loadu_ps((const float *)kt + (int64_t)d * padded + j0);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(((const float *)(q + r * q_stride * 4))[d]),
                                     keys, acc[r]);
    }
}

/* Rows i0 .. i0 + rows - 1 of one query head (row 0 at `position`): scores (scale applied,
 * keys after each row's position masked), softmax, the probabilities into p in the model's
 * dtype, rows `padded` apart (s: float32 scratch alike). */
INLINE void probabilities(const char *q, int64_t q_stride, const void *kt, int padded, int n,
                          int position, const int rows, const int dim, const int bf16,
                          float scale, float *s, char *p) {
    const int elem = bf16 ? 2 : 4;
    __m512 maxv[MAX_ROWS];
    for (int r = 0; r < rows; r++) maxv[r] = _mm512_set1_ps(-INFINITY);
    for (int j0 = 0; j0 < n; j0 += KEYS) {
        __m512 acc[MAX_ROWS];
        scores16(q, q_stride, kt, padded, j0, rows, dim, bf16, acc);
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
            store16(p + ((int64_t)r * padded + j) * elem, _mm512_mul_ps(_mm512_loadu_ps(sr + j), inv), bf16);
    }
}

/* out rows = p (rows x n keys) times the packed values, float32 sums stored once. */
INLINE void weighted_values(const char *p, const void *vp, int padded, int n, const int rows,
                            const int chunks, const int bf16, char *out, int64_t out_stride) {
    const int dim = chunks * 16, elem = bf16 ? 2 : 4;
    __m512 acc[MAX_ROWS][MAX_CHUNKS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++) acc[r][c] = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 1 + bf16) { /* bfloat16: a word holds keys j and j + 1 */
        const char *row = (const char *)vp + (int64_t)(j >> bf16) * dim * 4;
        __m512 v[MAX_CHUNKS];
        for (int c = 0; c < chunks; c++) v[c] = _mm512_loadu_ps(row + c * 64);
        for (int r = 0; r < rows; r++) {
            const char *pr = p + ((int64_t)r * padded + j) * elem;
            for (int c = 0; c < chunks; c++)
                acc[r][c] = bf16 ? dot_pairs(acc[r][c], *(const uint32_t *)pr, _mm512_castps_si512(v[c]))
                                 : _mm512_fmadd_ps(_mm512_set1_ps(*(const float *)pr), v[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++)
            store16(out + (r * out_stride + c * 16) * elem, acc[r][c], bf16);
}

/* A block of query rows of one head, inlined for the common shapes (rows, head size, dtype). */
static void rows_block(const char *q, int64_t q_stride, const void *kt, const void *vp,
                       int padded, int n, int position, int rows, int chunks, int bf16,
                       float scale, float *s, char *p, char *out, int64_t out_stride) {
#define BLOCK(R, C, B)                                                                         \
    if (rows == R && chunks == C && bf16 == B) {                                               \
        probabilities(q, q_stride, kt, padded, n, position, R, C * 16, B, scale, s, p);        \
        weighted_values(p, vp, padded, n, R, C, B, out, out_stride);                           \
        return;                                                                                \
    }
    BLOCK(4, 4, 1) BLOCK(3, 4, 1) BLOCK(2, 4, 1) BLOCK(1, 4, 1) BLOCK(2, 8, 1) BLOCK(1, 8, 1)
    BLOCK(4, 4, 0) BLOCK(3, 4, 0) BLOCK(2, 4, 0) BLOCK(1, 4, 0) BLOCK(2, 8, 0) BLOCK(1, 8, 0)
#undef BLOCK
    const int elem = bf16 ? 2 : 4;
    for (int r = 0; r < rows; r++) {
        probabilities(q + r * q_stride * elem, q_stride, kt, padded, n, position + r, 1,
                      chunks * 16, bf16, scale, s, p);
        weighted_values(p, vp, padded, n, 1, chunks, bf16, out + r * out_stride * elem, out_stride);
    }
}

/* q, out: [q_len, heads, dim] rows q_stride and out_stride elements apart; k, v: [kv_len,
 * kv_heads, dim] rows kv_stride apart; query i sits at position kv_len - q_len + i and attends
 * to keys 0 .. that position. bf16: 1 for bfloat16 tensors (this library built with
 * AVX512-BF16), 0 for float32. dim: a multiple of 32, at most 16 * MAX_CHUNKS. */
void prefill_attention(const void *q, int64_t q_stride, const void *k, const void *v,
                       int64_t kv_stride, void *out, int64_t out_stride, int q_len, int kv_len,
                       int heads, int kv_heads, int dim, float scale, int bf16, int threads) {
    const int group = heads / kv_heads, chunks = dim / 16, elem = bf16 ? 2 : 4;
    const int padded = (kv_len + KEYS - 1) / KEYS * KEYS, offset = kv_len - q_len;
    const int block = chunks <= 4 ? 4 : 2, blocks = (q_len + block - 1) / block;
    const size_t packed = sizeof(float) * (size_t)padded * dim; /* bytes per head */
    char *kt = malloc(packed * kv_heads), *vp = malloc(packed * kv_heads);
#pragma omp parallel num_threads(threads)
    {
        float *s = malloc(sizeof(float) * (size_t)block * padded);
        char *p = malloc(sizeof(float) * (size_t)block * padded);
#pragma omp for
        for (int h = 0; h < kv_heads; h++)
            pack((const char *)k + (int64_t)h * dim * elem, (const char *)v + (int64_t)h * dim * elem,
                 kv_stride, kv_len, padded, dim, bf16, kt + packed * h, vp + packed * h);
        /* the last rows attend to the most keys: handed out first */
#pragma omp for schedule(dynamic)
        for (int item = 0; item < heads * blocks; item++) {
            int head = item % heads, i0 = (blocks - 1 - item / heads) * block;
            int rows = q_len - i0 < block ? q_len - i0 : block, h = head / group;
            int last = offset + i0 + rows - 1, n = (last + KEYS) / KEYS * KEYS;
            rows_block((const char *)q + ((int64_t)i0 * q_stride + head * dim) * elem, q_stride,
                       kt + packed * h, vp + packed * h, padded, n, offset + i0, rows, chunks,
                       bf16, scale, s, p, (char *)out + ((int64_t)i0 * out_stride + head * dim) * elem,
                       out_stride);
        }
        free(s);
        free(p);
    }
    free(kt);
    free(vp);
}
#endif
