/* Row-local fused kernels for the CPU: add + RMSNorm, RMSNorm (optionally times
 * 1 + weight, Gemma's), rotary; float32, bf16 and fp16.
 *
 * Built at first use by kvrecover/ops/cpu/native_build.py and called through ctypes
 * (kvrecover/ops/cpu/row_ops.py). Each output row is computed from its own
 * input row alone, in one fixed order, in float32, and rounded where TorchOps
 * rounds: so a row's bits cannot depend on the batch or on which thread ran it.
 * The sum of squares runs either in 16 lane partial sums combined in a fixed tree
 * (sum_width 0, the half dtypes) or in the order of torch's own CPU sum over a
 * contiguous row with vectors of sum_width floats (ATen's cascade_sum: four
 * accumulators, cascaded levels), which makes the float32 norm bit-equal to
 * TorchOps where the caller found the width torch runs with.
 * Rows are split across torch's OpenMP threads (the same libgomp) when asked.
 */
#include <math.h>
#include <omp.h>

#include "kvr_common.h"

#define LANES 16

static inline float load(const void *base, int64_t i, int dtype) {
    if (dtype == KVR_FLOAT32) return ((const float *)base)[i];
    if (dtype == KVR_BFLOAT16) return bf16_to_float(((const uint16_t *)base)[i]);
    return (float)((const _Float16 *)base)[i];
}

static inline void store(void *base, int64_t i, int dtype, float value) {
    if (dtype == KVR_FLOAT32) ((float *)base)[i] = value;
    else if (dtype == KVR_BFLOAT16) ((uint16_t *)base)[i] = float_to_bf16(value);
    else ((_Float16 *)base)[i] = (_Float16)value;
}

/* The value `value` takes once rounded to the half dtype. */
static inline float round_half(float value, int dtype) {
    if (dtype == KVR_FLOAT32) return value;
    if (dtype == KVR_BFLOAT16) return bf16_to_float(float_to_bf16(value));
    return (float)(_Float16)value;
}

/* The sum of h[d]^2 in 16 lanes combined in a fixed tree. */
static float tree_sum_squares(const float *h, int64_t hidden) {
    float lanes[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= hidden; d += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] += h[d + l] * h[d + l];
    for (int l = 0; d < hidden; d++, l++) lanes[l] += h[d] * h[d];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return lanes[0];
}

#define MAX_SUM_WIDTH 64
#define SUM_ILP 4    /* ATen's row_sum: ilp_factor */
#define SUM_LEVELS 4 /* ATen's multi_row_sum: num_levels */

static inline void add_squares(float *acc, const float *x, int width) {
    for (int l = 0; l < width; l++) acc[l] += x[l] * x[l];
}

static inline void add_lanes(float *acc, float *from, int width) {
    for (int l = 0; l < width; l++) {
        acc[l] += from[l];
        from[l] = 0.0f;
    }
}

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)x - 1; v; v >>= 1) bits++;
    return bits;
}

/* The sum of h[d]^2 exactly as torch's CPU `x.pow(2).sum(-1)` adds a contiguous row
 * (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum, row_sum, multi_row_sum)
 * with vectors of `width` floats. Always inlined so that a constant width vectorizes. */
static inline __attribute__((always_inline)) float cascade_sum_squares(
    const float *h, int64_t hidden, const int width) {
    const int64_t vectors = hidden / width, rows = vectors / SUM_ILP;
    const int64_t power = ceil_log2(rows) / SUM_LEVELS > 4 ? ceil_log2(rows) / SUM_LEVELS : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[SUM_LEVELS * SUM_ILP * MAX_SUM_WIDTH];
    memset(acc, 0, sizeof(float) * SUM_LEVELS * SUM_ILP * width);
#define ACC(level, k) (acc + ((level) * SUM_ILP + (k)) * width)
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < SUM_ILP; k++)
                add_squares(ACC(0, k), h + (i * SUM_ILP + k) * width, width);
        for (int level = 1; level < SUM_LEVELS; level++) {
            for (int k = 0; k < SUM_ILP; k++) add_lanes(ACC(level, k), ACC(level - 1, k), width);
            if (i & (mask << (level * power))) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < SUM_ILP; k++)
            add_squares(ACC(0, k), h + (i * SUM_ILP + k) * width, width);
    for (int level = 1; level < SUM_LEVELS; level++)
        for (int k = 0; k < SUM_ILP; k++) add_lanes(ACC(0, k), ACC(level, k), width);
    for (int64_t v = rows * SUM_ILP; v < vectors; v++) add_squares(ACC(0, 0), h + v * width, width);
    for (int k = 1; k < SUM_ILP; k++) add_lanes(ACC(0, 0), ACC(0, k), width);
#undef ACC
    float total = 0.0f;
    for (int64_t d = vectors * width; d < hidden; d++) total += h[d] * h[d];
    for (int l = 0; l < width; l++) total += acc[l];
    return total;
}

/* `cascade_sum_squares` for any width; a row shorter than one vector sums as width 1
 * (ATen's scalar_inner_sum). */
static float torch_sum_squares(const float *h, int64_t hidden, int width) {
    if (hidden < width) width = 1;
    switch (width) {
    case 8: return cascade_sum_squares(h, hidden, 8);
    case 16: return cascade_sum_squares(h, hidden, 16);
    default: return cascade_sum_squares(h, hidden, width);
    }
}

/* One row of out = round(h * rsqrt(mean(h^2) + eps)) * weight (with plus_one:
 * round(h * rsqrt(...) * (1 + weight)), rounded once as TorchOps.rms_norm_plus_one),
 * h already float32. */
static void norm_row(const float *h, const void *weight, void *out, int64_t row_offset,
                     int64_t hidden, float eps, int dtype, int sum_width, int plus_one) {
    const float sum = sum_width ? torch_sum_squares(h, hidden, sum_width)
                                : tree_sum_squares(h, hidden);
    const float scale = 1.0f / sqrtf(sum / (float)hidden + eps);
    if (plus_one) {
        for (int64_t d = 0; d < hidden; d++)
            store(out, row_offset + d, dtype, h[d] * scale * (1.0f + load(weight, d, dtype)));
    } else if (dtype == KVR_FLOAT32) {
        const float *w = weight;
        float *o = (float *)out + row_offset;
        for (int64_t d = 0; d < hidden; d++) o[d] = h[d] * scale * w[d];
    } else {
        for (int64_t d = 0; d < hidden; d++)
            store(out, row_offset + d, dtype,
                  round_half(h[d] * scale, dtype) * load(weight, d, dtype));
    }
}

#define ROW_CHUNK 8192 /* float32 scratch per row; longer rows take the slow two-pass path */

/* residual_out = x + residual (rounded); out = norm(residual_out) * weight.
 * With x == NULL: out = norm(residual) * weight and residual_out is not written.
 * All tensors [rows, hidden] contiguous. sum_width: 0 for the lane tree, else the
 * vector width of torch's sum order (at most MAX_SUM_WIDTH). Returns 0, 1 when hidden
 * is too large, or 3 when sum_width is. */
int kvr_add_rms_norm(const void *x, const void *residual, void *residual_out,
                     const void *weight, void *out, int64_t rows, int64_t hidden, float eps,
                     int dtype, int sum_width, int plus_one, int threads) {
    if (hidden > ROW_CHUNK || hidden < 1) return 1;
    if (sum_width < 0 || sum_width > MAX_SUM_WIDTH) return 3;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        float scratch[ROW_CHUNK];
        const int64_t offset = r * hidden;
        const float *h = scratch;
        if (dtype == KVR_FLOAT32) {
            if (x != NULL) {
                const float *a = (const float *)x + offset, *b = (const float *)residual + offset;
                float *sum = (float *)residual_out + offset;
                for (int64_t d = 0; d < hidden; d++) sum[d] = a[d] + b[d];
                h = sum;
            } else {
                h = (const float *)residual + offset;
            }
        } else if (x != NULL) {
            for (int64_t d = 0; d < hidden; d++) {
                scratch[d] = round_half(
                    load(x, offset + d, dtype) + load(residual, offset + d, dtype), dtype);
                store(residual_out, offset + d, dtype, scratch[d]);
            }
        } else {
            for (int64_t d = 0; d < hidden; d++) scratch[d] = load(residual, offset + d, dtype);
        }
        norm_row(h, weight, out, offset, hidden, eps, dtype, sum_width, plus_one);
    }
    return 0;
}

#if KVR_AVX512
/* 16 lanes of `count` elements from base + i as float32 (missing lanes 0). */
static inline __m512 load16(const void *base, int64_t i, int dtype, __mmask16 mask) {
    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)base + i);
    if (dtype == KVR_BFLOAT16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* The half-dtype bits of 16 floats, rounded to nearest even as float_to_bf16 does. */
static inline __m256i to_half16(__m512 v, int dtype) {
    if (dtype != KVR_BFLOAT16) return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));
    rounded = _mm512_mask_mov_epi32(rounded, nan, quiet);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

static inline __m512 round_half16(__m512 v, int dtype) {
    __m256i h = to_half16(v, dtype);
    if (dtype == KVR_BFLOAT16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

#endif

/* Which path this build runs: 1 = AVX-512, 0 = portable scalar. */
int kvr_row_ops_vector_path(void) { return KVR_AVX512; }

/* Rotary embedding of one head: out[d] = round(round(x[d] * c[d]) + round(x[d +- half] * s[d]))
 * with c, s (cs = [c | s]) the cache's cos and signed sin already rounded to the half
 * dtype, exactly as ops/rotary.py computes it in torch. */
static inline void rotate_head(const void *x, int64_t x_index, void *out, int64_t out_index,
                               const float *cs, int64_t dim, int dtype) {
    const int64_t half = dim / 2;
#if KVR_AVX512
    if (half % 16 == 0 && dtype == KVR_FLOAT32) {
        const float *in = (const float *)x + x_index;
        for (int64_t d = 0; d < dim; d += 16) {
            const int64_t partner = d < half ? d + half : d - half;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(in + d), _mm512_loadu_ps(cs + d));
            __m512 b = _mm512_mul_ps(_mm512_loadu_ps(in + partner), _mm512_loadu_ps(cs + dim + d));
            _mm512_storeu_ps((float *)out + out_index + d, _mm512_add_ps(a, b));
        }
        return;
    }
    if (half % 16 == 0) {
        for (int64_t d = 0; d < dim; d += 16) {
            const int64_t partner = d < half ? d + half : d - half;
            __m512 v = load16(x, x_index + d, dtype, 0xffff);
            __m512 p = load16(x, x_index + partner, dtype, 0xffff);
            __m512 a = round_half16(_mm512_mul_ps(v, _mm512_loadu_ps(cs + d)), dtype);
            __m512 b = round_half16(_mm512_mul_ps(p, _mm512_loadu_ps(cs + dim + d)), dtype);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + out_index + d),
                                to_half16(_mm512_add_ps(a, b), dtype));
        }
        return;
    }
#endif
    for (int64_t d = 0; d < dim; d++) {
        const float partner = load(x, x_index + (d < half ? d + half : d - half), dtype);
        const float value = round_half(load(x, x_index + d, dtype) * cs[d], dtype)
                            + round_half(partner * cs[dim + d], dtype);
        store(out, out_index + d, dtype, value);
    }
}

#define MAX_ROTARY_DIM 1024

/* Rotate one head at x[x_index] into out[out_index]; in place (out == x, same index)
 * through a copy of the head, since each element reads its partner half. */
static inline void rotate_head_at(const void *x, int64_t x_index, void *out, int64_t out_index,
                                  const float *cs, int64_t dim, int dtype, int in_place) {
    if (!in_place) {
        rotate_head(x, x_index, out, out_index, cs, dim, dtype);
        return;
    }
    float copy[MAX_ROTARY_DIM]; /* dim elements of 4 or 2 bytes */
    const size_t size = dtype == KVR_FLOAT32 ? 4 : 2;
    memcpy(copy, (const char *)x + x_index * size, dim * size);
    rotate_head(copy, 0, out, out_index, cs, dim, dtype);
}

/* Rotate query [T, Hq, D] and key [T, Hkv, D] (last dim contiguous, given token and head
 * strides) by positions [T] into the float32 cos_sin cache [max_positions, 2 * D]: into
 * contiguous outputs, or with in_place into the inputs themselves (query_out and key_out
 * unused). Returns 0, 1 when a position is outside the cache, or 2 when D is above
 * MAX_ROTARY_DIM. */
int kvr_rotary(void *query, int64_t q_token_stride, int64_t q_head_stride,
               void *key, int64_t k_token_stride, int64_t k_head_stride,
               void *query_out, void *key_out, const float *cos_sin, int64_t max_positions,
               const int64_t *positions, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
               int64_t dim, int dtype, int in_place, int threads) {
    if (dim > MAX_ROTARY_DIM || dim < 2) return 2;
    if (in_place) {
        query_out = query;
        key_out = key;
    }
    int status = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t position = positions[t];
        if (position < 0 || position >= max_positions) {
#pragma omp atomic write
            status = 1;
            continue;
        }
        float row[2 * MAX_ROTARY_DIM];
        for (int64_t d = 0; d < 2 * dim; d++)
            row[d] = round_half(cos_sin[position * 2 * dim + d], dtype);
        for (int64_t h = 0; h < num_heads; h++) {
            const int64_t at = t * q_token_stride + h * q_head_stride;
            rotate_head_at(query, at, query_out, in_place ? at : (t * num_heads + h) * dim, row,
                           dim, dtype, in_place);
        }
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t at = t * k_token_stride + h * k_head_stride;
            rotate_head_at(key, at, key_out, in_place ? at : (t * num_kv_heads + h) * dim, row,
                           dim, dtype, in_place);
        }
    }
    return status;
}
