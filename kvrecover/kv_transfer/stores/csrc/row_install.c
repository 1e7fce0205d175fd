/* Copying loaded KV rows into a CPU cache's blocks off the GIL (ctypes releases it).
 *
 * A row holds one stored block's payload in file order: layer 0 K, layer 0 V, layer 1
 * K, ... (2 * num_layers parts of part_nbytes bytes each). In the cache, the K part of
 * layer l of block b lies at layers[l] + b * part_nbytes and its V part v_offset
 * bytes further on (a layer's cache is [2, num_blocks, block_size, kv_heads, head_dim],
 * contiguous). See kv_transfer/native_copy.py.
 */
#include <stdint.h>
#include <string.h>

enum { KVR_COPY = 1, KVR_CHECK = 2 };
enum { KVR_PIECE = 8192 };  /* bytes copied, then compared, at a time */

/* For i in 0..count-1: copy row positions[i] (at rows + positions[i] * row_nbytes) into
 * cache block block_ids[i] (flags & KVR_COPY), then (flags & KVR_CHECK) compare each part
 * of the block with its row, right after its copy while it is in the CPU's cache:
 * mismatched[i] = 1 where any byte differs, else 0. Returns 0, or -1 before anything is
 * written when a block id is outside [0, num_blocks) or a position is negative. */
int kvr_install_rows(const uint8_t *rows, int64_t row_nbytes, const int64_t *positions,
                     const int64_t *block_ids, int64_t count, uint8_t *const *layers,
                     int32_t num_layers, int64_t part_nbytes, int64_t v_offset,
                     int64_t num_blocks, int32_t flags, uint8_t *mismatched) {
    for (int64_t i = 0; i < count; i++) {
        if (block_ids[i] < 0 || block_ids[i] >= num_blocks || positions[i] < 0) {
            return -1;
        }
    }
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = rows + positions[i] * row_nbytes;
        const int64_t offset = block_ids[i] * part_nbytes;
        uint8_t bad = 0;
        for (int32_t layer = 0; layer < num_layers; layer++) {
            for (int half = 0; half < 2; half++) {
                uint8_t *part = layers[layer] + offset + half * v_offset;
                const uint8_t *source = row + (2 * (int64_t)layer + half) * part_nbytes;
                /* In pieces that stay in the L1 cache between the copy and the compare. */
                for (int64_t done = 0; done < part_nbytes; done += KVR_PIECE) {
                    const size_t size = (size_t)(part_nbytes - done < KVR_PIECE
                                                     ? part_nbytes - done : KVR_PIECE);
                    if (flags & KVR_COPY) {
                        memcpy(part + done, source + done, size);
                    }
                    /* The compiler must not assume the copy succeeded and fold the compare. */
                    __asm__ __volatile__("" ::: "memory");
                    if ((flags & KVR_CHECK) && memcmp(part + done, source + done, size) != 0) {
                        bad = 1;
                    }
                }
            }
        }
        if (flags & KVR_CHECK) {
            mismatched[i] = bad;
        }
    }
    return 0;
}
