/* Query tiles: the same per-query arithmetic as attend_item_avx512, for several
 * consecutive query tokens of one request at once (included by paged_attention.c, after
 * its vector helpers).
 *
 * A tile's rows are its tokens x the query heads of one KV head. Each vector of 16 keys
 * is loaded once for all rows: keys transposed so that lane k holds key k (q . k for 16
 * keys is then one broadcast-multiply chain per row, no reduction across lanes), values
 * unpacked into bf16 pairs once. Every row's scores, maximum, probabilities, sums and
 * P.V run the very operations attend_item_avx512 runs for that query, on the same
 * operands in the same order: transpose_sum16's tree over the 16 d-lanes of a key's
 * partial dot is the same tree over the 16 per-lane vectors here ((l0 + l2) + (l1 + l3)
 * within each group of 4 lanes, then (g0 + g1) + (g2 + g3)). So a token's bits do not
 * depend on whether it runs alone or in a tile, nor on the tile's other tokens, and
 * keys outside a row's own range are never mixed into its sums (edge vectors run the
 * per-query pair loop with that row's bounds).
 */
#ifndef KVR_QUERY_TILE_H
#define KVR_QUERY_TILE_H

#if KVR_AVX512

#define KVR_MAX_TILE_ROWS KVR_MAX_TILE_ROWS_ANY
#define KVR_ROW_BLOCK 4 /* rows that share one load of each transposed key vector */

/* r[i] lane j becomes r[j] lane i (32-bit elements). */
static inline void transpose16x16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4g + j], 128-bit lane c: rows 4g..4g+3 at column 4c + j. */
    for (int g = 0; g < 4; g++) {
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; j++) {
        __m512i x0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
        __m512i x1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
        __m512i y0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        __m512i y1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
        r[j] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
        r[8 + j] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
}

/* kt[w] lane k = 32-bit word w of key row k (rows `offsets`, in elements), for the
 * `words` words of a row; lanes outside [lo, hi) are 0 and never read. */
static inline __attribute__((always_inline)) void transpose_keys(
    const KvrAttentionArgs *a, const int64_t *offsets, int lo, int hi, const int words,
    __m512i *kt, const int dtype) {
    const int halves = dtype == KVR_FLOAT32 ? 1 : 2; /* elements per 32-bit word */
    const uint32_t *cache = (const uint32_t *)a->key_cache;
    for (int w0 = 0; w0 < words; w0 += 16) {
        __m512i r[16];
        for (int k = 0; k < 16; k++)
            r[k] = k >= lo && k < hi ? _mm512_loadu_si512(cache + offsets[k] / halves + w0)
                                     : _mm512_setzero_si512();
        transpose16x16(r);
        for (int i = 0; i < 16; i++) kt[w0 + i] = r[i];
    }
}

static inline uint32_t word_at(const void *base, int64_t element_index) {
    uint32_t word;
    memcpy(&word, (const char *)base + element_index * 2, sizeof word);
    return word;
}

/* One row's partial dot for d-lane l (0..15) against 16 transposed keys: dot_lanes'
 * lane l, i.e. its chain over the head's chunks of 16 (float32) or 32 (bf16) elements. */
static inline __attribute__((always_inline)) __m512 lane_dot(
    const void *query, int64_t query_index, const __m512i *kt, int l, const int dim,
    const int dtype) {
#if defined(__AVX512BF16__)
    if (dtype == KVR_BFLOAT16) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < dim / 32; c++)
            acc = _mm512_dpbf16_ps(
                acc, (__m512bh)_mm512_set1_epi32((int)word_at(query, query_index + 32 * c + 2 * l)),
                (__m512bh)kt[16 * c + l]);
        return acc;
    }
#endif
    const float *q = (const float *)query + query_index;
    __m512 acc = _mm512_mul_ps(_mm512_set1_ps(q[l]), _mm512_castsi512_ps(kt[l]));
    for (int c = 1; c < dim / 16; c++)
        acc = _mm512_fmadd_ps(_mm512_set1_ps(q[16 * c + l]), _mm512_castsi512_ps(kt[16 * c + l]), acc);
    return acc;
}

/* Scores (before the scale) of KVR_ROW_BLOCK query rows against 16 transposed keys:
 * dot_lanes' partials per d-lane, summed by transpose_sum16's tree. */
static inline __attribute__((always_inline)) void dot_tree(
    const void *query, const int64_t *query_index, const __m512i *kt, __m512 *out,
    const int dim, const int dtype) {
    __m512 half[KVR_ROW_BLOCK], group[KVR_ROW_BLOCK];
    for (int g = 0; g < 4; g++) {
        for (int r = 0; r < KVR_ROW_BLOCK; r++) {
            const __m512 even = _mm512_add_ps(lane_dot(query, query_index[r], kt, 4 * g, dim, dtype),
                                              lane_dot(query, query_index[r], kt, 4 * g + 2, dim, dtype));
            const __m512 odd = _mm512_add_ps(lane_dot(query, query_index[r], kt, 4 * g + 1, dim, dtype),
                                             lane_dot(query, query_index[r], kt, 4 * g + 3, dim, dtype));
            const __m512 sum = _mm512_add_ps(even, odd);
            if (g == 0 || g == 2) group[r] = sum;
            else if (g == 1) half[r] = _mm512_add_ps(group[r], sum);
            else out[r] = _mm512_add_ps(half[r], _mm512_add_ps(group[r], sum));
        }
    }
}

/* The lanes of the vector at j0 that the query at `position` reads (0: none). */
static inline __mmask16 row_mask(const KvrAttentionArgs *a, int64_t position, int64_t j0) {
    const int64_t num_keys = position + 1, first_key = first_visible_key(a, position);
    if (j0 >= num_keys || j0 + 16 <= first_key) return 0;
    int count = num_keys - j0 < 16 ? (int)(num_keys - j0) : 16;
    int skip = j0 < first_key ? (int)(first_key - j0) : 0;
    return (__mmask16)(((1u << count) - 1u) & ~((1u << skip) - 1u));
}

/* Per-thread buffers of a tile (allocated once per call by attend_items). */
typedef struct {
    float *scores;    /* [KVR_MAX_TILE_ROWS][span] */
    int64_t span;     /* floats per row: max keys + 32 */
    __m512 *acc;      /* [KVR_MAX_TILE_ROWS][KVR_MAX_DIM / 16] */
    __m512i *keys;    /* [KVR_MAX_DIM] transposed words of one key vector */
    __m512i *values;  /* [8 pairs][KVR_MAX_DIM / 16] unpacked bf16 pairs of one vector */
} KvrTileBuffers;

/* One row's P.V for the vector at j0 over its own lanes [skip, count) only, as
 * attend_item_avx512 computes it (pairs with a missing key get zeros there). */
static inline __attribute__((always_inline)) void edge_values(
    const KvrAttentionArgs *a, const int64_t *offsets, int skip, int count, const float *probs,
    __m512 *acc, const int dim, const int dtype) {
#if defined(__AVX512BF16__)
    if (dtype == KVR_BFLOAT16) {
        uint32_t words[8];
        _mm256_storeu_si256((__m256i *)words, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(probs)));
        for (int k = skip - skip % 2; k < count; k += 2) {
            const int has_first = k >= skip, has_second = k + 1 < count;
            const uint16_t *first = (const uint16_t *)a->value_cache + offsets[has_first ? k : k + 1];
            const uint16_t *second = (const uint16_t *)a->value_cache + offsets[has_second ? k + 1 : k];
            __m512bh p = (__m512bh)_mm512_set1_epi32((int)words[k / 2]);
            for (int c = 0; c < dim / 32; c++) {
                __m512i x0 = has_first ? _mm512_loadu_si512(first + 32 * c) : _mm512_setzero_si512();
                __m512i x1 = has_second ? _mm512_loadu_si512(second + 32 * c) : _mm512_setzero_si512();
                acc[2 * c] = _mm512_dpbf16_ps(acc[2 * c], p, (__m512bh)_mm512_unpacklo_epi16(x0, x1));
                acc[2 * c + 1] = _mm512_dpbf16_ps(acc[2 * c + 1], p, (__m512bh)_mm512_unpackhi_epi16(x0, x1));
            }
        }
        return;
    }
#endif
    for (int k = skip; k < count; k++) {
        const float *value = (const float *)a->value_cache + offsets[k];
        __m512 p = _mm512_set1_ps(probs[k]);
        for (int l = 0; l < dim / 16; l++)
            acc[l] = _mm512_fmadd_ps(p, _mm512_loadu_ps(value + 16 * l), acc[l]);
    }
}

/* P.V of `rows` rows that read all 16 keys of the vector (their accumulators at
 * acc + r * KVR_MAX_DIM / 16): edge_values' operations with skip 0 and count 16, the
 * value loads shared by the rows (bf16: the pairs unpacked once in `pairs`). */
static inline __attribute__((always_inline)) void full_values(
    const KvrAttentionArgs *a, const int64_t *offsets, const __m512i *pairs,
    const float (*probs)[16], __m512 *acc, const int rows, const int dim, const int dtype) {
    const int lanes = dim / 16, stride = KVR_MAX_DIM / 16;
    __m512 local[4][KVR_MAX_DIM / 16];
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < lanes; l++) local[r][l] = acc[r * stride + l];
#if defined(__AVX512BF16__)
    if (dtype == KVR_BFLOAT16) {
        uint32_t words[4][8];
        for (int r = 0; r < rows; r++)
            _mm256_storeu_si256((__m256i *)words[r], (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(probs[r])));
        for (int k = 0; k < 8; k++) {
            __m512bh p[4];
            for (int r = 0; r < rows; r++) p[r] = (__m512bh)_mm512_set1_epi32((int)words[r][k]);
            for (int l = 0; l < lanes; l++) {
                const __m512bh v = (__m512bh)pairs[k * lanes + l];
                for (int r = 0; r < rows; r++) local[r][l] = _mm512_dpbf16_ps(local[r][l], p[r], v);
            }
        }
    } else
#endif
    {
        (void)pairs;
        for (int k = 0; k < 16; k++) {
            const float *value = (const float *)a->value_cache + offsets[k];
            __m512 p[4];
            for (int r = 0; r < rows; r++) p[r] = _mm512_set1_ps(probs[r][k]);
            for (int l = 0; l < lanes; l++) {
                const __m512 v = _mm512_loadu_ps(value + 16 * l);
                for (int r = 0; r < rows; r++) local[r][l] = _mm512_fmadd_ps(p[r], v, local[r][l]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < lanes; l++) acc[r * stride + l] = local[r][l];
}

/* attend_tile_avx512 for one head_dim and dtype (constants once inlined). */
static inline __attribute__((always_inline)) void attend_tile_body(
    const KvrAttentionArgs *a, int64_t first_token, int tokens, int kv_head,
    const KvrTileBuffers *buffers, const int dim, const int dtype) {
    const int group = a->num_heads / a->num_kv_heads;
    const int lanes = dim / 16, rows = tokens * group;
    const int words = dtype == KVR_FLOAT32 ? dim : dim / 2;
    const int32_t *table = a->block_tables + (int64_t)a->token_request[first_token] * a->table_stride;
    int64_t position[KVR_MAX_TILE_ROWS], query_index[KVR_MAX_TILE_ROWS];
    for (int m = 0; m < rows; m++) {
        const int64_t token = first_token + m / group;
        position[m] = a->token_position[token];
        query_index[m] = token * a->query_token_stride
                         + (int64_t)(kv_head * group + m % group) * a->query_head_stride;
    }
    /* The tile reads keys [tile_first, tile_end): every one inside some row's range. */
    const int64_t tile_first = first_visible_key(a, position[0]);
    const int64_t tile_end = position[rows - 1] + 1;
    const int64_t base = tile_first - tile_first % 16;
    float *scores = buffers->scores;
    const int64_t span = buffers->span;
    const __m512 scale = _mm512_set1_ps(a->scale);
    __m512 maxima[KVR_MAX_TILE_ROWS];
    for (int m = 0; m < rows; m++) maxima[m] = _mm512_set1_ps(-INFINITY);
    int64_t offsets[16];
    /* Pass 1: scores and each row's maximum, 16 keys at a time (lane j % 16). */
    for (int64_t j0 = base; j0 < tile_end; j0 += 16) {
        const int lo = j0 < tile_first ? (int)(tile_first - j0) : 0;
        const int hi = tile_end - j0 < 16 ? (int)(tile_end - j0) : 16;
        key_offsets(a, table, j0 + lo, hi - lo, kv_head, offsets + lo);
        transpose_keys(a, offsets, lo, hi, words, buffers->keys, dtype);
        for (int m0 = 0; m0 < rows; m0 += KVR_ROW_BLOCK) {
            const int block = rows - m0 < KVR_ROW_BLOCK ? rows - m0 : KVR_ROW_BLOCK;
            /* A short last block repeats its first row (results dropped). */
            int64_t indices[KVR_ROW_BLOCK];
            for (int r = 0; r < KVR_ROW_BLOCK; r++)
                indices[r] = query_index[m0 + (r < block ? r : 0)];
            __m512 dots[KVR_ROW_BLOCK];
            dot_tree(a->query, indices, buffers->keys, dots, dim, dtype);
            for (int r = 0; r < block; r++) {
                const __mmask16 mask = row_mask(a, position[m0 + r], j0);
                if (!mask) continue;
                __m512 s = _mm512_mul_ps(dots[r], scale);
                if (a->softcap > 0.0f) s = softcap16(s, a->softcap);
                _mm512_mask_storeu_ps(scores + (m0 + r) * span + (j0 - base), mask, s);
                maxima[m0 + r] = _mm512_mask_max_ps(maxima[m0 + r], mask, maxima[m0 + r], s);
            }
        }
    }
    float row_max[KVR_MAX_TILE_ROWS];
    __m512 sums[KVR_MAX_TILE_ROWS];
    __m512 *acc = buffers->acc;
    for (int m = 0; m < rows; m++) {
        row_max[m] = _mm512_reduce_max_ps(maxima[m]);
        if (a->sinks) row_max[m] = fmaxf(row_max[m], a->sinks[kv_head * group + m % group]);
        sums[m] = _mm512_setzero_ps();
        for (int l = 0; l < lanes; l++) acc[m * (KVR_MAX_DIM / 16) + l] = _mm512_setzero_ps();
    }
    /* Pass 2: p = exp(s - max), the sums and P.V, key vector by key vector. */
    for (int64_t j0 = base; j0 < tile_end; j0 += 16) {
        const int lo = j0 < tile_first ? (int)(tile_first - j0) : 0;
        const int hi = tile_end - j0 < 16 ? (int)(tile_end - j0) : 16;
        key_offsets(a, table, j0 + lo, hi - lo, kv_head, offsets + lo);
#if defined(__AVX512BF16__)
        if (dtype == KVR_BFLOAT16 && lo == 0 && hi == 16) /* rows that read all 16 keys share these */
            for (int k = 0; k < 16; k += 2)
                for (int c = 0; c < dim / 32; c++) {
                    __m512i x0 = _mm512_loadu_si512((const uint16_t *)a->value_cache + offsets[k] + 32 * c);
                    __m512i x1 = _mm512_loadu_si512((const uint16_t *)a->value_cache + offsets[k + 1] + 32 * c);
                    buffers->values[(k / 2) * lanes + 2 * c] = _mm512_unpacklo_epi16(x0, x1);
                    buffers->values[(k / 2) * lanes + 2 * c + 1] = _mm512_unpackhi_epi16(x0, x1);
                }
#endif
        float probs[KVR_MAX_TILE_ROWS][16];
        __mmask16 masks[KVR_MAX_TILE_ROWS];
        for (int m = 0; m < rows; m++) {
            const __mmask16 mask = masks[m] = row_mask(a, position[m], j0);
            if (!mask) continue;
            __m512 s = _mm512_maskz_loadu_ps(mask, scores + m * span + (j0 - base));
            __m512 p = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(s, _mm512_set1_ps(row_max[m]))));
            sums[m] = _mm512_add_ps(sums[m], p);
            _mm512_storeu_ps(probs[m], p);
        }
        /* Rows that read all 16 keys share each value load, a block of rows at a time (as
         * many independent accumulator chains); the others run their own lanes only. */
        for (int m = 0; m < rows;) {
            if (masks[m] != 0xffff) {
                if (masks[m])
                    edge_values(a, offsets, __builtin_ctz((unsigned)masks[m]),
                                32 - __builtin_clz((unsigned)masks[m]), probs[m],
                                acc + m * (KVR_MAX_DIM / 16), dim, dtype);
                m++;
                continue;
            }
            const int block = dim <= 64 ? 4 : 2;
            int together = m + block <= rows;
            for (int r = 1; together && r < block; r++) together = masks[m + r] == 0xffff;
            __m512 *row_acc = acc + m * (KVR_MAX_DIM / 16);
            if (together && block == 4)
                full_values(a, offsets, buffers->values, probs + m, row_acc, 4, dim, dtype);
            else if (together)
                full_values(a, offsets, buffers->values, probs + m, row_acc, 2, dim, dtype);
            else
                full_values(a, offsets, buffers->values, probs + m, row_acc, 1, dim, dtype);
            m += together ? block : 1;
        }
    }
    for (int m = 0; m < rows; m++) {
        const int64_t token = first_token + m / group;
        const int head = kv_head * group + m % group;
        finish_row(a, acc + m * (KVR_MAX_DIM / 16), sums[m], row_max[m], head,
                   (token * a->num_heads + head) * (int64_t)dim);
    }
}

/* Tokens first_token..first_token+tokens-1 (one request, consecutive positions) for
 * `kv_head`; tokens * group <= KVR_MAX_TILE_ROWS and kvr_tiles_supported(a->dtype,
 * a->head_dim). The common head sizes get their own compiled copy. */
static void attend_tile_avx512(const KvrAttentionArgs *a, int64_t first_token, int tokens,
                               int kv_head, const KvrTileBuffers *buffers) {
    const int dim = a->head_dim;
    if (a->dtype == KVR_FLOAT32) {
        if (dim == 64) attend_tile_body(a, first_token, tokens, kv_head, buffers, 64, KVR_FLOAT32);
        else if (dim == 128) attend_tile_body(a, first_token, tokens, kv_head, buffers, 128, KVR_FLOAT32);
        else attend_tile_body(a, first_token, tokens, kv_head, buffers, dim, KVR_FLOAT32);
    } else {
        if (dim == 64) attend_tile_body(a, first_token, tokens, kv_head, buffers, 64, KVR_BFLOAT16);
        else if (dim == 128) attend_tile_body(a, first_token, tokens, kv_head, buffers, 128, KVR_BFLOAT16);
        else attend_tile_body(a, first_token, tokens, kv_head, buffers, dim, KVR_BFLOAT16);
    }
}

#endif
#endif
