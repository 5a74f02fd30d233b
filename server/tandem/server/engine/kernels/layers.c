/* The elementwise parts of a decoder layer, each one pass over memory instead of several torch
 * ops: RMSNorm, SiLU(gate) * up and rotary embedding. Each rounds where HuggingFace's PyTorch
 * code rounds (every op's result is stored in the model's dtype), so they differ from it only
 * in the order of the RMSNorm sum and in exp's last bit. Each body is inlined twice, for
 * float32 and for bfloat16, so the dtype is a constant in the loops the compiler vectorises.
 */
#include "convert.h"
#include "kernels.h"

#define INLINE static inline __attribute__((always_inline))
#define PARALLEL_WORK 65536 /* below this many elements one thread does it all */

#ifdef __AVX512F__
#include "vector16.h"
/* Rows of a multiple of sixteen values go sixteen at a time: the compiler left the bfloat16
 * loops below scalar (a 4,096 x 576 add_rms_norm took 0.86 ms in bfloat16, 0.70 in float32,
 * two threads). The same roundings as convert.h's, lane by lane. */
#define VECTORS 1

/* convert.h's load and store, sixteen values from element i. */
INLINE __m512 load16_at(const void *p, int64_t i, const int bf16) {
    return widen16((const char *)p + i * (bf16 ? 2 : 4), bf16);
}

INLINE void store16_at(void *p, int64_t i, __m512 x, const int bf16) {
    if (!bf16) return _mm512_storeu_ps((float *)p + i, x);
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(bf16_bits16(x)));
}

/* convert.h's round_to, lane by lane. */
INLINE __m512 round16(__m512 x, const int bf16) {
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(x), 16)) : x;
}

/* A value round16 made (its low 16 bits zero in bfloat16) stored as it is. */
INLINE void store_rounded16(void *p, int64_t i, __m512 x, const int bf16) {
    if (!bf16) return _mm512_storeu_ps((float *)p + i, x);
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(x), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(bits));
}

/* rms_norm_row's second pass, sixteen at a time, against the row's 1 / rms. */
INLINE void scale_row16(const void *restrict x, void *restrict out, const void *restrict w,
                        int dim, float inv, const int bf16) {
    for (int i = 0; i < dim; i += 16) {
        const __m512 v = round16(_mm512_mul_ps(load16_at(x, i, bf16), _mm512_set1_ps(inv)), bf16);
        store16_at(out, i, _mm512_mul_ps(load16_at(w, i, bf16), v), bf16);
    }
}
#else
#define VECTORS 0
#endif

INLINE void rms_norm_row(const void *restrict x, void *restrict out, const void *restrict w,
                         int dim, float eps, const int bf16) {
#if VECTORS
    if (dim % 16 == 0) {
        __m512 squares = _mm512_setzero_ps();
        for (int i = 0; i < dim; i += 16) {
            const __m512 v = load16_at(x, i, bf16);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        return scale_row16(x, out, w, dim, 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / dim + eps), bf16);
    }
#endif
    float sum = 0.0f;
    for (int i = 0; i < dim; i++) {
        float v = load(x, i, bf16);
        sum += v * v;
    }
    float inv = 1.0f / sqrtf(sum / dim + eps);
    for (int i = 0; i < dim; i++)
        store(out, i, load(w, i, bf16) * round_to(load(x, i, bf16) * inv, bf16), bf16);
}

/* out = weight * dtype(x * rsqrt(mean(x^2) + eps)), x in float32 (HF's LlamaRMSNorm);
 * rows of x are x_stride elements apart, out is contiguous. */
void rms_norm(const void *x, void *out, const void *weight, int rows, int dim, int64_t x_stride,
              float eps, int bf16, int threads) {
    int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * dim > PARALLEL_WORK)
    for (int r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * x_stride * elem;
        char *outr = (char *)out + r * dim * elem;
        if (bf16)
            rms_norm_row(xr, outr, weight, dim, eps, 1);
        else
            rms_norm_row(xr, outr, weight, dim, eps, 0);
    }
}

INLINE void add_rms_norm_row(const void *x, const void *residual, void *sum, void *out,
                             const void *restrict w,
                             int dim, float eps, const int bf16) {
#if VECTORS
    if (dim % 16 == 0) { /* the sum's squares taken as it is stored */
        __m512 squares = _mm512_setzero_ps();
        for (int i = 0; i < dim; i += 16) {
            const __m512 v = round16(_mm512_add_ps(load16_at(x, i, bf16), load16_at(residual, i, bf16)), bf16);
            store_rounded16(sum, i, v, bf16);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        return scale_row16(sum, out, w, dim, 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / dim + eps), bf16);
    }
#endif
    for (int i = 0; i < dim; i++) store(sum, i, load(x, i, bf16) + load(residual, i, bf16), bf16);
    rms_norm_row(sum, out, w, dim, eps, bf16);
}

/* sum = dtype(x + residual) (torch's add: in float32, rounded once), out = its RMSNorm: the
 * residual stream's add and the next norm in one pass over rows x and residual, contiguous.
 * sum and out may be residual and x themselves: a row is read before it is written. */
void add_rms_norm(const void *x, const void *residual, void *sum, void *out, const void *weight,
                  int rows, int dim, float eps, int bf16, int threads) {
    int64_t row = (int64_t)dim * (bf16 ? 2 : 4);
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * dim > PARALLEL_WORK)
    for (int r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * row, *rr = (const char *)residual + r * row;
        char *sr = (char *)sum + r * row, *outr = (char *)out + r * row;
        if (bf16)
            add_rms_norm_row(xr, rr, sr, outr, weight, dim, eps, 1);
        else
            add_rms_norm_row(xr, rr, sr, outr, weight, dim, eps, 0);
    }
}

INLINE void silu_mul_row(const void *restrict g, const void *restrict u, void *restrict out,
                         int n, const int bf16) {
    for (int i = 0; i < n; i++)
        store(out, i, silu_times(load(g, i, bf16), load(u, i, bf16), bf16), bf16);
}

/* out[r, i] = dtype(silu(gate[r, i])) * up[r, i], gate_up = [gate | up] per row. */
void silu_mul(const void *gate_up, void *out, int rows, int inter, int bf16, int threads) {
    int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * inter > PARALLEL_WORK)
    for (int r = 0; r < rows; r++) {
        const char *g = (const char *)gate_up + r * 2 * inter * elem;
        char *o = (char *)out + r * inter * elem;
        if (bf16)
            silu_mul_row(g, g + inter * elem, o, inter, 1);
        else
            silu_mul_row(g, g + inter * elem, o, inter, 0);
    }
}

INLINE void rope_head(void *restrict x, const void *restrict c, const void *restrict s, int half,
                      const int bf16) {
#if VECTORS
    if (half % 16 == 0) {
        for (int i = 0; i < half; i += 16) {
            const __m512 a = load16_at(x, i, bf16), b = load16_at(x, i + half, bf16);
            const __m512 lo = _mm512_sub_ps(round16(_mm512_mul_ps(a, load16_at(c, i, bf16)), bf16),
                                            round16(_mm512_mul_ps(b, load16_at(s, i, bf16)), bf16));
            const __m512 hi = _mm512_add_ps(round16(_mm512_mul_ps(b, load16_at(c, i + half, bf16)), bf16),
                                            round16(_mm512_mul_ps(a, load16_at(s, i + half, bf16)), bf16));
            store16_at(x, i, lo, bf16);
            store16_at(x, i + half, hi, bf16);
        }
        return;
    }
#endif
    for (int i = 0; i < half; i++) {
        float a = load(x, i, bf16), b = load(x, i + half, bf16);
        float lo = round_to(a * load(c, i, bf16), bf16) + round_to(-b * load(s, i, bf16), bf16);
        float hi = round_to(b * load(c, i + half, bf16), bf16) +
                   round_to(a * load(s, i + half, bf16), bf16);
        store(x, i, lo, bf16);
        store(x, i + half, hi, bf16);
    }
}

/* In place, x: [tokens, heads, head_dim] with heads contiguous in a token (token_stride
 * elements apart); cos, sin: [tokens, rotary_dim] in x's dtype. x * cos + rotate_half(x) * sin
 * on the first rotary_dim values of each head, each product and the sum rounded to the dtype. */
void rope(void *x, const void *cos, const void *sin, int tokens, int heads, int head_dim,
          int rotary_dim, int64_t token_stride, int bf16, int threads) {
    int64_t elem = bf16 ? 2 : 4;
    int half = rotary_dim / 2;
#pragma omp parallel for num_threads(threads) if ((int64_t)tokens * heads * head_dim > PARALLEL_WORK)
    for (int t = 0; t < tokens; t++) {
        const char *c = (const char *)cos + (int64_t)t * rotary_dim * elem;
        const char *s = (const char *)sin + (int64_t)t * rotary_dim * elem;
        for (int h = 0; h < heads; h++) {
            char *xh = (char *)x + ((int64_t)t * token_stride + (int64_t)h * head_dim) * elem;
            if (bf16)
                rope_head(xh, c, s, half, 1);
            else
                rope_head(xh, c, s, half, 0);
        }
    }
}
