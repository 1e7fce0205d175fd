/* Batch-invariant paged attention on the CPU, one (query token, KV head) at a time.
 *
 * Built at first use by kvrecover/ops/native_build.py and called through ctypes
 * (kvrecover/ops/cpu/attention/c_kernel.py). Work item i is query token i % T and KV
 * head i / T (T tokens in the step): all query heads of that KV head attend to keys 0..pos of the
 * token's request (keys pos-window+1..pos with a sliding window: the keys
 * before it are never read), read straight from the paged cache. An item's arithmetic
 * depends only on its own query, its keys and its position: keys are visited
 * in increasing absolute order, in vectors whose lanes are fixed by the key's
 * absolute index, with float32 accumulation and an exact two-pass softmax
 * (pass 1: scores and their maximum; pass 2: exp, the sum and P.V in key order;
 * with a bf16 cache and AVX512-BF16, q.k and P.V run as vdpbf16ps, whose products
 * are exact and sums float32, with P rounded to bf16 for P.V as flash attention does).
 * Soft-capping (Gemma 2) maps each score s = scale * q.k to softcap * tanh(s / softcap)
 * before the softmax, elementwise. Attention sinks (gpt-oss): a head's sink logit joins
 * the row maximum and adds exp(sink - max) to the denominator, no value. How many items share a call, or how a step is split across threads, cannot
 * change a single bit. One code path per build: the AVX-512 one where the
 * compiler targets it, else a portable scalar one (invariance holds within one
 * machine and build, like a library kernel's).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kvr_common.h"

#define KVR_MAX_TILE_ROWS_ANY 64 /* KVR_MAX_TILE_ROWS of query_tile.h, on every path */

/* Mirrored by the ctypes Structure in native_attention.py: keep the order. */
typedef struct {
    const void *query;         /* [T, Hq, D], last dim contiguous */
    int64_t query_token_stride; /* elements */
    int64_t query_head_stride;  /* elements */
    const void *key_cache;     /* [num_blocks, block_size, Hkv, D] contiguous */
    const void *value_cache;   /* same layout */
    void *out;                 /* [T, Hq, D] contiguous */
    const int32_t *block_tables; /* [B, table_stride] */
    int64_t table_stride;
    const int32_t *token_request; /* [T] request row in block_tables */
    const int32_t *token_position; /* [T] absolute position: keys 0..position are visible */
    int32_t num_heads;
    int32_t num_kv_heads;
    int32_t head_dim;
    int32_t block_size;
    int32_t dtype;
    float scale;
    int32_t window;            /* sliding window in keys; 0: every key 0..position */
    float softcap;             /* scores s become softcap * tanh(s / softcap); 0: none */
    const float *sinks;        /* [Hq] per-head sink logits in the softmax; NULL: none */
    const int32_t *tile_first_token; /* [tiles] a tile's first token */
    const int32_t *tile_tokens;      /* [tiles] its consecutive tokens, one request's */
} KvrAttentionArgs;

/* The first key a query at `position` sees: position - window + 1 (at least 0). */
static inline int64_t first_visible_key(const KvrAttentionArgs *a, int64_t position) {
    if (a->window <= 0 || position < a->window) return 0;
    return position - a->window + 1;
}

/* Which path this build runs: 1 = AVX-512, 0 = portable scalar. */
int kvr_vector_path(void) { return KVR_AVX512; }

static inline float load_scalar(const void *base, int64_t index, int dtype) {
    if (dtype == KVR_BFLOAT16) return bf16_to_float(((const uint16_t *)base)[index]);
    if (dtype == KVR_FLOAT16) return (float)((const _Float16 *)base)[index];
    return ((const float *)base)[index];
}

static inline void store_scalar(void *base, int64_t index, int dtype, float value) {
    if (dtype == KVR_BFLOAT16) ((uint16_t *)base)[index] = float_to_bf16(value);
    else if (dtype == KVR_FLOAT16) ((_Float16 *)base)[index] = (_Float16)value;
    else ((float *)base)[index] = value;
}

/* Element offsets of the rows of keys first..first+count-1 for `kv_head` in the
 * paged cache: one division per call, then block by block. */
static inline void key_offsets(const KvrAttentionArgs *a, const int32_t *table, int64_t first,
                               int count, int kv_head, int64_t *offsets) {
    int64_t block = first / a->block_size;
    int64_t in_block = first - block * a->block_size;
    const int64_t row = (int64_t)a->num_kv_heads * a->head_dim;
    int64_t start = ((int64_t)table[block] * a->block_size) * row + (int64_t)kv_head * a->head_dim;
    for (int k = 0; k < count; k++) {
        offsets[k] = start + in_block * row;
        if (++in_block == a->block_size && k + 1 < count) {
            in_block = 0;
            start = ((int64_t)table[++block] * a->block_size) * row + (int64_t)kv_head * a->head_dim;
        }
    }
}

#if KVR_AVX512
/* Vectors of 16 keys whose rows are prefetched ahead of the one being computed. A
 * decode reads its request's rows once, scattered over blocks and strided by the
 * other KV heads: the hardware prefetcher misses them, and once a step's caches no
 * longer fit the CPU's (a real forward: 30 layers) the kernel waited on memory,
 * 2-3x longer (bench/NOTES.md, issue 28 goal 6). */
#define KVR_PREFETCH_VECTORS 4

/* Prefetch the rows of keys first..first+15 (none at or past `end`) of `kv_head` in
 * `cache` into the CPU's caches; changes no result. Inline asm: GCC 12 at -O3 dropped
 * every inlined _mm_prefetch of this loop. */
static inline void prefetch_rows(const KvrAttentionArgs *a, const void *cache,
                                 const int32_t *table, int64_t first, int64_t end,
                                 int kv_head) {
    if (first >= end) return;
    int count = end - first < 16 ? (int)(end - first) : 16;
    int64_t offsets[16];
    key_offsets(a, table, first, count, kv_head, offsets);
    const int element = a->dtype == KVR_FLOAT32 ? 4 : 2;
    const int row_bytes = a->head_dim * element;
    for (int k = 0; k < count; k++) {
        const char *row = (const char *)cache + offsets[k] * element;
        for (int b = 0; b < row_bytes; b += 64)
            __asm__ volatile("prefetcht0 %0" : : "m"(*(row + b)));
    }
}

/* 16 floats from `count` (<= 16) elements; missing lanes are 0. */
static inline __m512 load16(const void *base, int64_t index, int dtype, __mmask16 mask) {
    if (dtype == KVR_BFLOAT16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)base + index);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dtype == KVR_FLOAT16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)base + index);
        return _mm512_cvtph_ps(h);
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)base + index);
}

/* exp(x) for x <= 0 (softmax arguments): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2]. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* softcap * tanh(s / softcap), 16 lanes: an odd polynomial for |y| < 1/8, else
 * (1 - e^-2|y|) / (1 + e^-2|y|) (no cancellation there); relative error ~1e-7. */
static inline __m512 softcap16(__m512 s, float softcap) {
    const __m512 y = _mm512_div_ps(s, _mm512_set1_ps(softcap));
    const __m512 a = _mm512_abs_ps(y);
    const __m512 t = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
    const __m512 far = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), t),
                                     _mm512_add_ps(_mm512_set1_ps(1.0f), t));
    const __m512 a2 = _mm512_mul_ps(a, a);
    __m512 p = _mm512_set1_ps(-17.0f / 315.0f);
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(2.0f / 15.0f));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(-1.0f / 3.0f));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(1.0f));
    const __m512 near = _mm512_mul_ps(p, a);
    const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.125f), _CMP_LT_OQ);
    const __m512 magnitude = _mm512_mask_blend_ps(small, far, near);
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32((int)0x80000000u));
    const __m512 th = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign));
    return _mm512_mul_ps(th, _mm512_set1_ps(softcap));
}

#define KVR_MAX_GROUP 16
#define KVR_MAX_DIM 256

/* Lane i of the result = the sum of the 16 lanes of v[i], by one fixed tree. */
static inline __m512 transpose_sum16(const __m512 v[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xee));
    __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                               _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
    __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88),
                         _mm512_shuffle_f32x4(low, high, 0xdd));
}

/* q . k over head_dim for one query head and one key row, 16 lanes still unsummed. */
static inline __m512 dot_lanes(const KvrAttentionArgs *a, const void *query, int64_t q_index,
                               int64_t k_index) {
    const int dim = a->head_dim, dtype = a->dtype;
#if defined(__AVX512BF16__)
    if (dtype == KVR_BFLOAT16 && dim % 32 == 0) {
        /* bf16 pairs: exact products, float32 sums (vdpbf16ps). */
        const uint16_t *q = (const uint16_t *)query + q_index;
        const uint16_t *k = (const uint16_t *)a->key_cache + k_index;
        __m512 acc = _mm512_setzero_ps();
        for (int d = 0; d < dim; d += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d),
                                   (__m512bh)_mm512_loadu_si512(k + d));
        return acc;
    }
#endif
    __m512 acc = _mm512_mul_ps(load16(query, q_index, dtype, 0xffff),
                               load16(a->key_cache, k_index, dtype, 0xffff));
    for (int d = 16; d < dim; d += 16)
        acc = _mm512_fmadd_ps(load16(query, q_index + d, dtype, 0xffff),
                              load16(a->key_cache, k_index + d, dtype, 0xffff), acc);
    return acc;
}

/* A row's output: P.V's lanes back in d order (the bf16 pair path holds a fixed
 * permutation of d), divided by the softmax's sum (with the sink's term), stored at
 * `out_base`. */
static void finish_row(const KvrAttentionArgs *a, __m512 *acc, __m512 sums, float row_max,
                       int head, int64_t out_base) {
    const int dim = a->head_dim, lanes = dim / 16, dtype = a->dtype;
#if defined(__AVX512BF16__)
    if (dtype == KVR_BFLOAT16 && dim % 32 == 0) {
        /* Undo the pair lanes: low lane 4L+m holds d = 8L+m, high lane 4L+m holds d = 8L+4+m. */
        int first_half[16], second_half[16];
        for (int d = 0; d < 16; d++) {
            int m = d % 8;
            first_half[d] = m < 4 ? 4 * (d / 8) + m : 16 | (4 * (d / 8) + m - 4);
            second_half[d] = m < 4 ? 4 * (2 + d / 8) + m : 16 | (4 * (2 + d / 8) + m - 4);
        }
        __m512i first_index = _mm512_loadu_si512(first_half);
        __m512i second_index = _mm512_loadu_si512(second_half);
        for (int c = 0; c < dim / 32; c++) {
            __m512 low = acc[2 * c], high = acc[2 * c + 1];
            acc[2 * c] = _mm512_permutex2var_ps(low, first_index, high);
            acc[2 * c + 1] = _mm512_permutex2var_ps(low, second_index, high);
        }
    }
#endif
    float sum = _mm512_reduce_add_ps(sums);
    if (a->sinks) sum += expf(a->sinks[head] - row_max);
    __m512 inverse = _mm512_set1_ps(1.0f / sum);
    for (int l = 0; l < lanes; l++) {
        __m512 o = _mm512_mul_ps(acc[l], inverse);
        if (dtype == KVR_FLOAT32) {
            _mm512_storeu_ps((float *)a->out + out_base + 16 * l, o);
        } else {
            float tmp[16];
            _mm512_storeu_ps(tmp, o);
            for (int e = 0; e < 16; e++) store_scalar(a->out, out_base + 16 * l + e, dtype, tmp[e]);
        }
    }
}

/* One item on the AVX-512 path; head_dim % 16 == 0, head_dim <= 256, group <= 16.
 * `prefetch`: read the item's key and value rows ahead (a decode: no other token of
 * the step shares them, so they come from memory; prefill tokens of one request find
 * them in L2, where prefetching only cost time: 10-28% at 1024-2048 keys). */
static void attend_item_avx512(const KvrAttentionArgs *a, int64_t token, int kv_head,
                               float *scores, int prefetch) {
    const int group = a->num_heads / a->num_kv_heads;
    const int dim = a->head_dim, lanes = dim / 16, dtype = a->dtype;
    const int64_t position = a->token_position[token];
    const int64_t num_keys = position + 1;
    /* Vectors stay aligned to absolute key 0 (lane j % 16): the first one may
     * start before the window, its lanes below `first_key` masked off and never read. */
    const int64_t first_key = first_visible_key(a, position);
    const int64_t first_vector = first_key - first_key % 16;
    const int32_t *table = a->block_tables + (int64_t)a->token_request[token] * a->table_stride;
    int64_t query_index[KVR_MAX_GROUP];
    for (int h = 0; h < group; h++)
        query_index[h] = token * a->query_token_stride
                         + (int64_t)(kv_head * group + h) * a->query_head_stride;
    /* Pass 1: scores[h * num_keys + j] = scale * q_h . k_j for 16 keys at a time (key j
     * in lane j % 16), and each head's maximum. */
    const __m512 scale = _mm512_set1_ps(a->scale);
    __m512 maxima[KVR_MAX_GROUP];
    for (int h = 0; h < group; h++) maxima[h] = _mm512_set1_ps(-INFINITY);
    const int64_t ahead = prefetch ? 16 * KVR_PREFETCH_VECTORS : 0;
    for (int64_t j0 = first_vector; j0 < first_vector + ahead; j0 += 16)
        prefetch_rows(a, a->key_cache, table, j0 > first_key ? j0 : first_key, num_keys, kv_head);
    for (int64_t j0 = first_vector; j0 < num_keys; j0 += 16) {
        int count = num_keys - j0 < 16 ? (int)(num_keys - j0) : 16;
        int skip = j0 < first_key ? (int)(first_key - j0) : 0;
        __mmask16 mask = (__mmask16)(((1u << count) - 1u) & ~((1u << skip) - 1u));
        int64_t offsets[16];
        key_offsets(a, table, j0 + skip, count - skip, kv_head, offsets + skip);
        if (prefetch) prefetch_rows(a, a->key_cache, table, j0 + ahead, num_keys, kv_head);
        for (int h = 0; h < group; h++) {
            __m512 partial[16];
            for (int k = 0; k < 16; k++)
                partial[k] = k >= skip && k < count
                                 ? dot_lanes(a, a->query, query_index[h], offsets[k])
                                 : _mm512_setzero_ps();
            __m512 s = _mm512_mul_ps(transpose_sum16(partial), scale);
            if (a->softcap > 0.0f) s = softcap16(s, a->softcap);
            _mm512_mask_storeu_ps(scores + h * num_keys + j0, mask, s);
            maxima[h] = _mm512_mask_max_ps(maxima[h], mask, maxima[h], s);
        }
    }
    float row_max[KVR_MAX_GROUP];
    for (int h = 0; h < group; h++) {
        row_max[h] = _mm512_reduce_max_ps(maxima[h]);
        if (a->sinks) row_max[h] = fmaxf(row_max[h], a->sinks[kv_head * group + h]);
    }
    /* Pass 2: p = exp(s - max) in vectors of 16 keys at absolute lanes j % 16. */
#if defined(__AVX512BF16__)
    const int bf16_pairs = dtype == KVR_BFLOAT16 && dim % 32 == 0;
#endif
    __m512 acc[KVR_MAX_GROUP][KVR_MAX_DIM / 16];
    __m512 sums[KVR_MAX_GROUP];
    for (int h = 0; h < group; h++) {
        sums[h] = _mm512_setzero_ps();
        for (int l = 0; l < lanes; l++) acc[h][l] = _mm512_setzero_ps();
    }
    float probs[KVR_MAX_GROUP][16];
    for (int64_t j0 = first_vector; j0 < first_vector + ahead; j0 += 16)
        prefetch_rows(a, a->value_cache, table, j0 > first_key ? j0 : first_key, num_keys, kv_head);
    for (int64_t j0 = first_vector; j0 < num_keys; j0 += 16) {
        int count = num_keys - j0 < 16 ? (int)(num_keys - j0) : 16;
        int skip = j0 < first_key ? (int)(first_key - j0) : 0;
        __mmask16 mask = (__mmask16)(((1u << count) - 1u) & ~((1u << skip) - 1u));
        if (prefetch) prefetch_rows(a, a->value_cache, table, j0 + ahead, num_keys, kv_head);
        for (int h = 0; h < group; h++) {
            __m512 s = _mm512_maskz_loadu_ps(mask, scores + h * num_keys + j0);
            __m512 p = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(s, _mm512_set1_ps(row_max[h]))));
            sums[h] = _mm512_add_ps(sums[h], p);
            _mm512_storeu_ps(probs[h], p);
        }
        int64_t offsets[16];
        key_offsets(a, table, j0 + skip, count - skip, kv_head, offsets + skip);
#if defined(__AVX512BF16__)
        if (bf16_pairs) {
            /* p rounded to bf16 (as flash attention does), two keys per vdpbf16ps: exact
             * products, float32 sums. Lanes hold a fixed permutation of d, undone below. */
            uint32_t words[KVR_MAX_GROUP][8];
            for (int h = 0; h < group; h++)
                _mm256_storeu_si256((__m256i *)words[h],
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(probs[h])));
            for (int k = skip - skip % 2; k < count; k += 2) {
                /* Before the window or past the last key: zeros, never read (the slot
                 * may hold another request's data or a failed load's NaNs). */
                const int has_first = k >= skip, has_second = k + 1 < count;
                const uint16_t *first = (const uint16_t *)a->value_cache + offsets[has_first ? k : k + 1];
                const uint16_t *second = (const uint16_t *)a->value_cache + offsets[has_second ? k + 1 : k];
                for (int c = 0; c < dim / 32; c++) {
                    __m512i x0 = has_first ? _mm512_loadu_si512(first + 32 * c)
                                           : _mm512_setzero_si512();
                    __m512i x1 = has_second ? _mm512_loadu_si512(second + 32 * c)
                                            : _mm512_setzero_si512();
                    __m512bh low = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
                    __m512bh high = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
                    for (int h = 0; h < group; h++) {
                        __m512bh p = (__m512bh)_mm512_set1_epi32((int)words[h][k / 2]);
                        acc[h][2 * c] = _mm512_dpbf16_ps(acc[h][2 * c], p, low);
                        acc[h][2 * c + 1] = _mm512_dpbf16_ps(acc[h][2 * c + 1], p, high);
                    }
                }
            }
            continue;
        }
#endif
        for (int k = skip; k < count; k++) {
            __m512 value[KVR_MAX_DIM / 16];
            for (int l = 0; l < lanes; l++)
                value[l] = load16(a->value_cache, offsets[k] + 16 * l, dtype, 0xffff);
            for (int h = 0; h < group; h++) {
                __m512 p = _mm512_set1_ps(probs[h][k]);
                for (int l = 0; l < lanes; l++) acc[h][l] = _mm512_fmadd_ps(p, value[l], acc[h][l]);
            }
        }
    }
    for (int h = 0; h < group; h++)
        finish_row(a, acc[h], sums[h], row_max[h], kv_head * group + h,
                   (token * a->num_heads + kv_head * group + h) * (int64_t)dim);
}

#endif

/* Whether this build runs query tiles (query_tile.h) for `dtype` and `head_dim`:
 * float32, or bf16 with AVX512-BF16 and head_dim % 32 == 0 (attend_item_avx512's
 * vdpbf16ps path); else a prefill goes token by token, several times slower. */
int kvr_tiles_supported(int dtype, int head_dim) {
#if KVR_AVX512
    if (head_dim % 16 || head_dim > KVR_MAX_DIM) return 0;
    if (dtype == KVR_FLOAT32) return 1;
#if defined(__AVX512BF16__)
    if (dtype == KVR_BFLOAT16 && head_dim % 32 == 0) return 1;
#endif
#endif
    (void)dtype, (void)head_dim;
    return 0;
}

#if KVR_AVX512
#include "query_tile.h"
#endif

/* One item on the portable path: the same algorithm, scalar, in the same key order. */
static void attend_item_scalar(const KvrAttentionArgs *a, int64_t token, int kv_head,
                               float *scores, float *acc) {
    const int group = a->num_heads / a->num_kv_heads;
    const int dim = a->head_dim, dtype = a->dtype;
    const int64_t num_keys = (int64_t)a->token_position[token] + 1;
    const int64_t first_key = first_visible_key(a, num_keys - 1);
    const int32_t *table = a->block_tables + (int64_t)a->token_request[token] * a->table_stride;
    for (int h = 0; h < group; h++) {
        int64_t qbase = token * a->query_token_stride
                        + (int64_t)(kv_head * group + h) * a->query_head_stride;
        float row_max = -INFINITY;
        for (int64_t j = first_key; j < num_keys; j++) {
            int64_t offset;
            key_offsets(a, table, j, 1, kv_head, &offset);
            float dot = 0.0f;
            for (int d = 0; d < dim; d++)
                dot += load_scalar(a->query, qbase + d, dtype) * load_scalar(a->key_cache, offset + d, dtype);
            float s = dot * a->scale;
            if (a->softcap > 0.0f) s = a->softcap * tanhf(s / a->softcap);
            scores[j] = s;
            row_max = s > row_max ? s : row_max;
        }
        const float sink = a->sinks ? a->sinks[kv_head * group + h] : -INFINITY;
        row_max = sink > row_max ? sink : row_max;
        float sum = 0.0f;
        for (int d = 0; d < dim; d++) acc[d] = 0.0f;
        for (int64_t j = first_key; j < num_keys; j++) {
            float p = expf(scores[j] - row_max);
            sum += p;
            int64_t offset;
            key_offsets(a, table, j, 1, kv_head, &offset);
            for (int d = 0; d < dim; d++) acc[d] += p * load_scalar(a->value_cache, offset + d, dtype);
        }
        if (a->sinks) sum += expf(sink - row_max);
        int64_t obase = (token * a->num_heads + kv_head * group + h) * (int64_t)dim;
        for (int d = 0; d < dim; d++) store_scalar(a->out, obase + d, dtype, acc[d] / sum);
    }
}

/* Runs items of the step until none is left, taking `grain` items at a time from
 * the shared counter `next_item`: every thread of a step calls this with the same
 * counter, so a thread the OS deschedules leaves its share to the others. Item i is
 * tile i % tiles for KV head i / tiles; a tile of one token runs attend_item_avx512,
 * a longer one attend_tile_avx512 (the same bits). Which thread computes an item
 * changes none of its bits. 0 on success, 1 when out of memory, 2 for a shape this
 * build does not take. */
static int attend_items(const KvrAttentionArgs *a, int64_t *next_item, int64_t num_items,
                        int64_t grain) {
    if (a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads || grain < 1) return 2;
    const int group = a->num_heads / a->num_kv_heads;
    const int64_t num_tiles = num_items / a->num_kv_heads;
    if (num_tiles < 1) return 0;
    const int64_t num_tokens = (int64_t)a->tile_first_token[num_tiles - 1] + a->tile_tokens[num_tiles - 1];
    int64_t max_keys = 0;
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t keys = (int64_t)a->token_position[t] + 1;
        max_keys = keys > max_keys ? keys : max_keys;
    }
    int64_t tile_rows = 0; /* the most rows of a tile of several tokens */
    for (int64_t i = 0; i < num_tiles; i++) {
        const int64_t rows = (int64_t)a->tile_tokens[i] * group;
        if (a->tile_tokens[i] < 1 || rows > KVR_MAX_TILE_ROWS_ANY) return 2;
        if (a->tile_tokens[i] > 1 && rows > tile_rows) tile_rows = rows;
    }
    (void)tile_rows; /* read by the AVX-512 path only */
    float *scores = malloc(sizeof(float) * (size_t)(group * max_keys + a->head_dim + 16));
    if (!scores) return 1;
    float *acc = scores + group * max_keys;
#if KVR_AVX512
    int vector = a->head_dim % 16 == 0 && a->head_dim <= KVR_MAX_DIM && group <= KVR_MAX_GROUP;
    const int tiles = vector && tile_rows > 0 && kvr_tiles_supported(a->dtype, a->head_dim);
    KvrTileBuffers buffers = {0};
    if (tiles) {
        buffers.span = max_keys + 32;
        buffers.scores = malloc(sizeof(float) * (size_t)(tile_rows * buffers.span));
        buffers.acc = aligned_alloc(64, sizeof(__m512) * KVR_MAX_TILE_ROWS * (KVR_MAX_DIM / 16));
        buffers.keys = aligned_alloc(64, sizeof(__m512i) * KVR_MAX_DIM);
        buffers.values = aligned_alloc(64, sizeof(__m512i) * 8 * (KVR_MAX_DIM / 16));
        if (!buffers.scores || !buffers.acc || !buffers.keys || !buffers.values) {
            free(buffers.scores), free(buffers.acc), free(buffers.keys), free(buffers.values);
            free(scores);
            return 1;
        }
    }
#endif
    for (;;) {
        int64_t begin = __atomic_fetch_add(next_item, grain, __ATOMIC_RELAXED);
        if (begin >= num_items) break;
        int64_t end = begin + grain < num_items ? begin + grain : num_items;
        for (int64_t i = begin; i < end; i++) {
            /* KV head major: consecutive items share one head's keys in the caches. */
            const int64_t tile = i % num_tiles;
            const int kv_head = (int)(i / num_tiles);
            const int64_t first = a->tile_first_token[tile];
            const int tokens = a->tile_tokens[tile];
#if KVR_AVX512
            if (tiles && tokens > 1) {
                attend_tile_avx512(a, first, tokens, kv_head, &buffers);
                continue;
            }
#endif
            for (int64_t token = first; token < first + tokens; token++) {
#if KVR_AVX512
                if (vector) {
                    const int32_t request = a->token_request[token];
                    const int alone = (token == 0 || a->token_request[token - 1] != request)
                                      && (token + 1 == num_tokens || a->token_request[token + 1] != request);
                    attend_item_avx512(a, token, kv_head, scores, alone);
                    continue;
                }
#endif
                attend_item_scalar(a, token, kv_head, scores, acc);
            }
        }
    }
#if KVR_AVX512
    free(buffers.scores), free(buffers.acc), free(buffers.keys), free(buffers.values);
#endif
    free(scores);
    return 0;
}

/* The step's `num_items` items on `threads` OpenMP threads. Built with -fopenmp, this
 * library shares torch's OpenMP runtime (the same libgomp.so.1, already loaded), so
 * the threads are torch's own, still spinning from the previous op: no second pool
 * competing for the cores. Returns attend_items' code. */
int kvr_paged_attention(const KvrAttentionArgs *a, int64_t num_items, int64_t grain,
                        int threads) {
    int64_t next_item = 0;
    if (threads <= 1) return attend_items(a, &next_item, num_items, grain);
    int status = 0;
#pragma omp parallel num_threads(threads)
    {
        int code = attend_items(a, &next_item, num_items, grain);
        if (code) {
#pragma omp atomic write
            status = code;
        }
    }
    return status;
}
