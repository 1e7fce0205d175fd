/* What every kvrecover C kernel shares: the vector-path switch, the dtype codes
 * the Python wrappers pass, and the scalar bf16 conversions (torch's rounding). */
#ifndef KVR_COMMON_H
#define KVR_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVR_AVX512 1
#else
#define KVR_AVX512 0
#endif

enum { KVR_FLOAT32 = 0, KVR_BFLOAT16 = 1, KVR_FLOAT16 = 2 };

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even, like torch */
    return (uint16_t)(bits >> 16);
}

#endif
