/* The torch engine's decode attention on CPU in float32, for one layer and one new token per slot: RoPE on the
 * new query and key, the new key and value written into the slot KV cache, then each query attending over its own
 * slot's cache. The torch path needs about ten kernels for this (RoPE, two cache writes, a mask,
 * scaled_dot_product_attention), and its attention kernel pays a fixed cost per (slot, head) that dwarfs the
 * arithmetic at decode sizes; here it is one pass, parallel over (slot, head) with the OpenMP team torch itself
 * uses. Loaded through ctypes by rlfabric/engines/native.py, which checks every shape and stride before calling.
 *
 * Layouts (float32, last dimension contiguous):
 *   qk       [n, heads + kv_heads, dim] rows qk_stride apart: q heads, then k heads, before RoPE
 *   v        [n, kv_heads, dim] rows v_stride apart
 *   cos_table, sin_table  [positions, dim]: cos and the signed sin (-sin of the first half, +sin of the second)
 *   positions [n] int64: where slot b's new token goes; it attends to cache rows 0..positions[b]
 *   k_cache, v_cache  [n or more slots, kv_heads, capacity, dim], contiguous
 *   out      [n, heads, dim], contiguous
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_DIM 512
#define STACK_SCORES 1024

/* x * cos + rotate_half(x) * sin, with rotate_half's minus carried by the signed sin table. */
static void rope(const float *x, const float *cos_row, const float *sin_row, int64_t dim, float *out) {
    const int64_t half = dim / 2;
    for (int64_t d = 0; d < half; d++) out[d] = x[d] * cos_row[d] + x[d + half] * sin_row[d];
    for (int64_t d = half; d < dim; d++) out[d] = x[d] * cos_row[d] + x[d - half] * sin_row[d];
}

/* softmax(q . K[0..span) * scale) @ V[0..span) for one head; scores are written to `scores` first. */
static void attend(const float *q, const float *k, const float *v, int64_t span, int64_t dim, float scale,
                   float *scores, float *out) {
    float top = -INFINITY;
    for (int64_t t = 0; t < span; t++) {
        const float *key = k + t * dim;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; d++) s += q[d] * key[d];
        s *= scale;
        scores[t] = s;
        top = s > top ? s : top;
    }
    float total = 0.0f;
    for (int64_t t = 0; t < span; t++) {
        scores[t] = expf(scores[t] - top);
        total += scores[t];
    }
    float acc[MAX_DIM];
    for (int64_t d = 0; d < dim; d++) acc[d] = 0.0f;
    for (int64_t t = 0; t < span; t++) {
        const float *value = v + t * dim;
        const float p = scores[t];
        for (int64_t d = 0; d < dim; d++) acc[d] += p * value[d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < dim; d++) out[d] = acc[d] * inv;
}

/* Returns 0, or -1 when a score buffer could not be allocated (nothing else can fail). */
int rlf_decode_attention_f32(int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, const float *qk,
                             int64_t qk_stride, const float *v, int64_t v_stride, const float *cos_table,
                             const float *sin_table, const int64_t *positions, float *k_cache, float *v_cache,
                             int64_t capacity, float scale, float *out) {
    const int64_t group = heads / kv_heads; /* query heads per key/value head (GQA) */
    int failed = 0;
#pragma omp parallel
    {
        /* The new keys (after RoPE) and values into the cache; the barrier at the loop's end orders them before
         * any read below. */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n * kv_heads; i++) {
            const int64_t b = i / kv_heads, h = i % kv_heads, pos = positions[b];
            const int64_t row = ((b * kv_heads + h) * capacity + pos) * dim;
            rope(qk + b * qk_stride + (heads + h) * dim, cos_table + pos * dim, sin_table + pos * dim, dim,
                 k_cache + row);
            const float *src = v + b * v_stride + h * dim;
            for (int64_t d = 0; d < dim; d++) v_cache[row + d] = src[d];
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n * heads; i++) {
            const int64_t b = i / heads, h = i % heads, pos = positions[b], span = pos + 1;
            const int64_t base = (b * kv_heads + h / group) * capacity * dim;
            float q[MAX_DIM], stack_scores[STACK_SCORES];
            float *scores = span <= STACK_SCORES ? stack_scores : malloc(sizeof(float) * span);
            if (scores == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            rope(qk + b * qk_stride + h * dim, cos_table + pos * dim, sin_table + pos * dim, dim, q);
            attend(q, k_cache + base, v_cache + base, span, dim, scale, scores, out + (b * heads + h) * dim);
            if (scores != stack_scores) free(scores);
        }
    }
    return failed ? -1 : 0;
}

