/* Decode attention over the paged KV cache, bf16, AVX-512: one query token per row.

   Fuses what took three passes over memory in PyTorch ops (gather K, scores, probs @ V):
   each (row, kv head) walks its blocks once, computing the scores of the query heads
   sharing that KV head, an online softmax, and the weighted sum of V, in fp32. The next
   block's K and V are prefetched while the current one computes, since blocks are
   scattered over the cache. Built by engine/models/decode_attention.py with
   -march=native and loaded with ctypes; it runs on OpenMP threads (torch's runtime). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(__AVX512F__)
#error "decode_attention.c needs AVX-512"
#endif

#define MAX_GROUP 16
#define MAX_CHUNKS 16 /* head_dim <= 256 */

__m512 _ZGVeN16v_expf(__m512); /* glibc libmvec: 16 expf at once */

static inline __m512 load_bf16x16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline uint16_t bf16_from_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fff + ((bits >> 16) & 1); /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

static inline long chunk_offset(const int32_t *table, int position, int block_size, int dim) {
    return ((long)table[position / block_size] * block_size + position % block_size) * dim;
}

/* One (row, kv head): chunks = dim / 16, a constant where the caller inlines it. */
static inline __attribute__((always_inline)) void attend(
    const uint16_t *q, const uint16_t *keys, const uint16_t *values, const int32_t *table,
    int length, uint16_t *out, int group, int chunks, int block_size, float scale) {
    const int dim = 16 * chunks;
    __m512 query[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS];
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        for (int c = 0; c < chunks; c++) {
            query[g][c] = _mm512_mul_ps(load_bf16x16(q + g * dim + 16 * c), _mm512_set1_ps(scale));
            acc[g][c] = _mm512_setzero_ps();
        }
        running_max[g] = -INFINITY;
        running_sum[g] = 0.f;
    }
    int position = 0;
    while (position < length) {
        /* up to 16 keys, all in one block */
        int count = block_size - position % block_size;
        if (count > 16) count = 16;
        if (count > length - position) count = length - position;
        const long offset = chunk_offset(table, position, block_size, dim);
        const int next = position + count;
        if (next < length) {
            const long next_offset = chunk_offset(table, next, block_size, dim);
            const char *next_keys = (const char *)(keys + next_offset);
            const char *next_values = (const char *)(values + next_offset);
            for (int byte = 0; byte < 16 * dim * 2; byte += 64) {
                _mm_prefetch(next_keys + byte, _MM_HINT_T0);
                _mm_prefetch(next_values + byte, _MM_HINT_T0);
            }
        }
        float scores[MAX_GROUP][16];
        for (int t = 0; t < count; t++) {
            __m512 key[MAX_CHUNKS];
            for (int c = 0; c < chunks; c++) key[c] = load_bf16x16(keys + offset + t * dim + 16 * c);
            for (int g = 0; g < group; g++) {
                __m512 dot = _mm512_mul_ps(query[g][0], key[0]);
                for (int c = 1; c < chunks; c++) dot = _mm512_fmadd_ps(query[g][c], key[c], dot);
                scores[g][t] = _mm512_reduce_add_ps(dot);
            }
        }
        const __mmask16 valid = (__mmask16)((1u << count) - 1);
        for (int g = 0; g < group; g++) {
            const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, scores[g]);
            const float new_max = fmaxf(running_max[g], _mm512_reduce_max_ps(s));
            const float correction = expf(running_max[g] - new_max); /* 0 on the first chunk */
            running_max[g] = new_max;
            const __m512 p = _mm512_maskz_mov_ps(
                valid, _ZGVeN16v_expf(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
            running_sum[g] = running_sum[g] * correction + _mm512_reduce_add_ps(p);
            _mm512_storeu_ps(scores[g], p);
            const __m512 factor = _mm512_set1_ps(correction);
            for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], factor);
        }
        for (int t = 0; t < count; t++) {
            __m512 value[MAX_CHUNKS];
            for (int c = 0; c < chunks; c++) value[c] = load_bf16x16(values + offset + t * dim + 16 * c);
            for (int g = 0; g < group; g++) {
                const __m512 p = _mm512_set1_ps(scores[g][t]);
                for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_fmadd_ps(p, value[c], acc[g][c]);
            }
        }
        position = next;
    }
    for (int g = 0; g < group; g++) {
        float row[16 * MAX_CHUNKS];
        const __m512 inverse = _mm512_set1_ps(1.f / running_sum[g]);
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(row + 16 * c, _mm512_mul_ps(acc[g][c], inverse));
        for (int d = 0; d < dim; d++) out[g * dim + d] = bf16_from_float(row[d]);
    }
}

/* q: rows of q_stride elements, each [kv_heads * group, dim]; cache: one layer,
   [2 * kv_heads, num_blocks, block_size, dim] (K planes, then V planes); block_table:
   [rows, width]; lengths: [rows], keys per row (>= 1); out: [rows, kv_heads * group, dim]. */
void decode_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *cache,
                           const int32_t *block_table, int width, const int32_t *lengths,
                           uint16_t *out, int rows, int kv_heads, int group, int dim,
                           int num_blocks, int block_size, float scale, int threads) {
    const long plane = (long)num_blocks * block_size * dim;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long item = 0; item < (long)rows * kv_heads; item++) {
        const int row = (int)(item / kv_heads), head = (int)(item % kv_heads);
        const uint16_t *query = q + row * q_stride + (long)head * group * dim;
        const uint16_t *keys = cache + head * plane, *values = cache + (kv_heads + head) * plane;
        const int32_t *table = block_table + (long)row * width;
        uint16_t *target = out + ((long)row * kv_heads + head) * group * dim;
        const int length = lengths[row];
        if (dim == 64)
            attend(query, keys, values, table, length, target, group, 4, block_size, scale);
        else if (dim == 128)
            attend(query, keys, values, table, length, target, group, 8, block_size, scale);
        else
            attend(query, keys, values, table, length, target, group, dim / 16, block_size, scale);
    }
}
