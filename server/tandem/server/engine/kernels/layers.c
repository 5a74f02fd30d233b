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

INLINE void rms_norm_row(const void *restrict x, void *restrict out, const void *restrict w,
                         int dim, float eps, const int bf16) {
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
