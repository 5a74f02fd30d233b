/* Decode attention over a paged KV cache, read in place (no gather): one query token per
 * sequence, every query head of a KV head's group at once, float32 accumulation.
 *
 * Built once per machine by cpu_kernel.py (gcc -O3 -march=native -fopenmp, with reassociation
 * allowed so the dot products vectorise) and called through ctypes; the torch backend's
 * gather + bmm path is its reference (tests/test_torch_attention.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* exp for x <= 0 (scores minus their maximum), Cephes' expf: ~1 ulp, branch-free. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    union { int32_t i; float f; } s;
    s.i = ((int32_t)n + 127) << 23;
    return y * s.f;
}

static inline float dot(const float *a, const float *b, int d) {
    float s = 0.0f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int d) {
    for (int i = 0; i < d; i++) y[i] += a * x[i];
}

/* A row of `dim` values of the cache's dtype (float32 or bfloat16) as float32. */
static inline void load_row(float *dst, const void *src, int dim, int bf16) {
    if (bf16)
        for (int i = 0; i < dim; i++) dst[i] = from_bf16(((const uint16_t *)src)[i]);
    else
        memcpy(dst, src, sizeof(float) * dim);
}

/* One (sequence, KV head) pair: the group's query heads attend to `len` cached tokens, page by
 * page. Inlined per head_dim below, so the common sizes run with the loops fully known. */
static inline __attribute__((always_inline)) void attend(
    const char *q, const char *k, const char *v, char *out, const int32_t *table, int len,
    int group, int dim, int block_size, int64_t page_bytes, int64_t token_bytes, float scale,
    int bf16, float *scores, float *qf, float *acc, float *row) {
    int elem = bf16 ? 2 : 4;
    for (int g = 0; g < group; g++) load_row(qf + g * dim, q + (int64_t)g * dim * elem, dim, bf16);
    float maxs[group];
    for (int g = 0; g < group; g++) maxs[g] = -INFINITY;
    for (int t0 = 0; t0 < len; t0 += block_size) {
        const char *page = k + table[t0 / block_size] * page_bytes;
        int n = len - t0 < block_size ? len - t0 : block_size;
        for (int i = 0; i < n; i++) {
            load_row(row, page + i * token_bytes, dim, bf16);
            for (int g = 0; g < group; g++) {
                float s = dot(qf + g * dim, row, dim) * scale;
                scores[g * len + t0 + i] = s;
                maxs[g] = s > maxs[g] ? s : maxs[g];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float *s = scores + g * len, total = 0.0f;
        for (int t = 0; t < len; t++) s[t] = exp_nonpositive(s[t] - maxs[g]);
        for (int t = 0; t < len; t++) total += s[t];
        for (int t = 0; t < len; t++) s[t] /= total;
    }
    memset(acc, 0, sizeof(float) * group * dim);
    for (int t0 = 0; t0 < len; t0 += block_size) {
        const char *page = v + table[t0 / block_size] * page_bytes;
        int n = len - t0 < block_size ? len - t0 : block_size;
        for (int i = 0; i < n; i++) {
            load_row(row, page + i * token_bytes, dim, bf16);
            for (int g = 0; g < group; g++) axpy(acc + g * dim, scores[g * len + t0 + i], row, dim);
        }
    }
    for (int i = 0; i < group * dim; i++) {
        if (bf16)
            ((uint16_t *)out)[i] = to_bf16(acc[i]);
        else
            ((float *)out)[i] = acc[i];
    }
}

#define ATTEND(DIM)                                                                            \
    attend(q, k, v, out, table, len, group, DIM, block_size, page_bytes, token_bytes, scale,   \
           bf16, scores, qf, acc, row)

static void attend_any(const char *q, const char *k, const char *v, char *out,
                       const int32_t *table, int len, int group, int dim, int block_size,
                       int64_t page_bytes, int64_t token_bytes, float scale, int bf16,
                       float *scores, float *qf, float *acc, float *row) {
    switch (dim) {
    case 64: ATTEND(64); break;
    case 128: ATTEND(128); break;
    default: ATTEND(dim);
    }
}

/* q, out: [B, H, D]; k, v: [blocks, block_size, H_kv, D], contiguous; tables: [B, width] page
 * ids; lens: [B] tokens each sequence attends to (at most max_len); bf16: 1 for bfloat16
 * tensors, 0 for float32. Work is split over (sequence, KV head) pairs. */
void paged_decode(const void *q, const void *k, const void *v, void *out, const int32_t *tables,
                  int width, const int32_t *lens, int batch, int heads, int kv_heads, int dim,
                  int block_size, int max_len, float scale, int bf16, int threads) {
    int group = heads / kv_heads, elem = bf16 ? 2 : 4;
    int64_t token_bytes = (int64_t)kv_heads * dim * elem, page_bytes = block_size * token_bytes;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * ((size_t)group * max_len + 2 * group * dim + dim));
        float *qf = scores + (size_t)group * max_len, *acc = qf + group * dim;
        float *row = acc + group * dim;
#pragma omp for schedule(dynamic)
        for (int item = 0; item < batch * kv_heads; item++) {
            int b = item / kv_heads, h = item % kv_heads;
            int64_t first = ((int64_t)b * heads + (int64_t)h * group) * dim * elem;
            attend_any((const char *)q + first, (const char *)k + (int64_t)h * dim * elem,
                   (const char *)v + (int64_t)h * dim * elem, (char *)out + first,
                   tables + (int64_t)b * width, lens[b], group, dim, block_size, page_bytes,
                   token_bytes, scale, bf16, scores, qf, acc, row);
        }
        free(scores);
    }
}
