/* Every function the library exports, as kernels/library.py's SIGNATURES call them: each
 * source includes this, so a definition and the calls from another source cannot disagree.
 * Some are built only where the CPU has what they need (AVX-512, AVX512-BF16, AMX): the
 * Python side asks the library which it has. */
#pragma once
#include <stdint.h>

/* layers.c */
void rms_norm(const void *x, void *out, const void *weight, int rows, int dim, int64_t x_stride,
              float eps, int bf16, int threads);
void add_rms_norm(const void *x, const void *residual, void *sum, void *out, const void *weight,
                  int rows, int dim, float eps, int bf16, int threads);
void silu_mul(const void *gate_up, void *out, int rows, int inter, int bf16, int threads);
void rope(void *x, const void *cos, const void *sin, int tokens, int heads, int head_dim,
          int rotary_dim, int64_t token_stride, int bf16, int threads);

/* paged_decode.c */
void paged_decode(const void *q, int64_t q_stride, const void *k, const void *v, void *out,
                  int64_t out_stride, const int32_t *tables, int width, const int32_t *lens,
                  int batch, int heads, int kv_heads, int dim, int block_size, int max_len,
                  float scale, int bf16, int threads, float *lse);
void shared_decode(const void *q, int64_t q_stride, const void *k, const void *v,
                   const int32_t *pages, int num_pages, int block_size, int batch, int heads,
                   int kv_heads, int dim, float scale, int bf16, int threads, float *out,
                   float *lse);
void merge_attention(void *out, int64_t out_stride, const float *lse, const float *shared,
                     const float *shared_lse, int batch, int heads, int dim, int bf16);

/* prefill_attention.c */
void prefill_attention(const void *q, int64_t q_stride, const void *k, const void *v,
                       int64_t kv_stride, void *out, int64_t out_stride, int q_len, int kv_len,
                       int heads, int kv_heads, int dim, float scale, int bf16, int threads);
int shared_attention_tiles(void);
void shared_attention(const void *q, int64_t q_stride, const void *k, const void *v,
                      const int32_t *pages, int num_pages, int block_size, int batch, int heads,
                      int kv_heads, int dim, float scale, int bf16, int threads, float *out,
                      float *lse);

/* quant_gemv.c, quant_vnni.c: y = x W^T from GGUF blocks (the decode chain's gemv_fn) */
void quant_gemv(const void *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, void *y,
                int64_t y_stride, int rows, int N, int K, int qtype, int bf16, int threads);
void quant_gemv_q8(const void *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, void *y,
                   int64_t y_stride, int rows, int N, int K, int qtype, int bf16, int threads);

/* tile_linear.c (AMX only) */
int tile_linear_tiles(void);
void tile_pack(const uint16_t *w, int n, int k, uint16_t *out);
void tile_linear(const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *packed,
                 int n, const uint16_t *bias, uint16_t *out, int64_t out_stride, int threads);
void tile_linear_silu(const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *packed,
                      int inter, uint16_t *out, int64_t out_stride, int threads);

/* plane_linear.c (AMX only) */
int plane_linear_tiles(void);
void plane_pack(const float *w, int n, int k, uint16_t *out);
void plane_linear(const float *x, int64_t x_stride, int m, int k, const uint16_t *packed, int n,
                  const float *bias, float *out, int64_t out_stride, int threads);
void plane_linear_silu(const float *x, int64_t x_stride, int m, int k, const uint16_t *packed,
                       int inter, float *out, int64_t out_stride, int threads);

/* panel_linear.c (AVX-512) */
void panel_pack(const float *w, int n, int k, float *out);
void panel_linear(const float *x, int64_t x_stride, int m, int k, const float *packed, int n,
                  const float *bias, float *out, int64_t out_stride, int threads);
void panel_pack_bf16(const uint16_t *w, int n, int k, uint16_t *out);
void panel_linear_bf16(const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *packed,
                       int n, const uint16_t *bias, uint16_t *out, int64_t out_stride,
                       int threads);
void panel_pack_pairs(const uint16_t *w, int n, int k, uint16_t *out);
void panel_linear_pairs(const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *packed,
                        int n, const uint16_t *bias, uint16_t *out, int64_t out_stride,
                        int threads); /* AVX512-BF16 only */

/* sampling.c (AVX-512) */
void argmax_rows(const void *logits, int64_t stride, int rows, int vocab, int bf16, int threads,
                 float *best, int64_t *ids);
void draw_rows(const void *logits, int64_t stride, int rows, int vocab, int bf16,
               const float *temps, const double *uniforms, int threads, float *best,
               int64_t *ids);
