/* What every kernel here shares: bfloat16 <-> float32, a vectorisable exp, and SiLU * up. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded); /* NaN stays NaN */
}

/* f as the model's dtype would hold it: rounded to bfloat16, or unchanged in float32. */
static inline float round_to(float f, int bf16) { return bf16 ? from_bf16(to_bf16(f)) : f; }

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float f, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* Cephes' expf (~1 ulp), branch-free so loops over it vectorise; x is clamped to [-87, 88]. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* dtype(silu(g)) * up, the gated MLP's product before its rounding: silu as torch makes it
 * (g / (1 + exp(-g))), rounded to the dtype. silu_mul and tile_linear_silu both use this, so
 * the fused product's bits are the separate pass's. */
static inline float silu_times(float g, float up, int bf16) {
    return round_to(g / (1.0f + exp_approx(-g)), bf16) * up;
}
