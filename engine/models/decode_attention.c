/* The engine's bf16 CPU kernels, AVX-512 or AVX2: decode attention over the paged KV cache (one
   query token per row); then, at the end of the file, the rotary embedding fused with the
   KV cache write, the residual add fused with RMSNorm, SwiGLU's silu(gate) * up, a linear
   layer for a decode step's rows (on tiles where the CPU has avx512_bf16: AMX's, or their
   product on vdpbf16ps) and the whole decode step in one call.

   Fuses what took three passes over memory in PyTorch ops (gather K, scores, probs @ V):
   each (row, kv head) walks its blocks once, computing the scores of the query heads
   sharing that KV head, an online softmax, and the weighted sum of V, in fp32. The next
   block's K and V are prefetched while the current one computes, since blocks are
   scattered over the cache. Built by engine/models/decode_attention.py with
   -march=native and loaded with ctypes; it runs on OpenMP threads (torch's runtime). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "decode_attention.c needs AVX2 and FMA"
#endif

#define MAX_GROUP 16
#define MAX_CHUNKS 16 /* head_dim <= 256 */

/* ---- 16 fp32 lanes: one AVX-512 register, or two AVX2 ones -------------------------------

   The kernels compute on vf16, 16 floats, through the few operations below; with AVX-512
   each is one instruction on a __m512, with AVX2 two on a pair of __m256. Code that only
   AVX-512 has (vdpbf16ps, masked stores, two-source permutes) stays under DOT_BF16. */

static inline uint16_t bf16_from_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fff + ((bits >> 16) & 1); /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

#if defined(__AVX512F__)
typedef __m512 vf16;

static inline vf16 vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf16 vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf16 vf_add(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
static inline vf16 vf_sub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
static inline vf16 vf_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
static inline vf16 vf_div(vf16 a, vf16 b) { return _mm512_div_ps(a, b); }
static inline vf16 vf_fmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline void vf_store(float *p, vf16 v) { _mm512_storeu_ps(p, v); }
static inline vf16 vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline float vf_sum(vf16 v) { return _mm512_reduce_add_ps(v); }
static inline float vf_max(vf16 v) { return _mm512_reduce_max_ps(v); }
static inline vf16 vf_max2(vf16 a, vf16 b) { return _mm512_max_ps(a, b); }
static inline vf16 vf_min2(vf16 a, vf16 b) { return _mm512_min_ps(a, b); }
static inline vf16 vf_round(vf16 v) {
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vf16 vf_scale2(vf16 v, vf16 n) { return _mm512_scalef_ps(v, n); } /* v * 2^n */
static inline float vf_lane0(vf16 v) { return _mm512_cvtss_f32(v); }
/* the first `count` lanes of v, `fill` in the others */
static inline vf16 vf_first(vf16 v, int count, float fill) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(fill), (__mmask16)((1u << count) - 1), v);
}

static inline vf16 widen_bf16x16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 fp32 -> 16 bf16, rounded to nearest even (NaN kept, quiet), as torch does. */
static inline __m256i bf16x16_from(vf16 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* The 16 horizontal sums of d[0..15] as one vector (lane t: the sum of d[t]'s lanes), by a
   tree of interleaving adds: 45 instructions where 16 separate reductions take ~130. */
static inline vf16 sum16(const vf16 *d) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]),
                                 _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: that lane's sums of 4 keys, in order */
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* then across the four 128-bit lanes */
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                      _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88),
                         _mm512_shuffle_f32x4(low, high, 0xdd));
}
#else
typedef struct {
    __m256 lo, hi;
} vf16;

static inline vf16 vf_pair(__m256 lo, __m256 hi) {
    vf16 v = {lo, hi};
    return v;
}
static inline vf16 vf_zero(void) { return vf_pair(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf16 vf_set1(float x) { return vf_pair(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
static inline vf16 vf_add(vf16 a, vf16 b) {
    return vf_pair(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi));
}
static inline vf16 vf_sub(vf16 a, vf16 b) {
    return vf_pair(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi));
}
static inline vf16 vf_mul(vf16 a, vf16 b) {
    return vf_pair(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi));
}
static inline vf16 vf_div(vf16 a, vf16 b) {
    return vf_pair(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi));
}
static inline vf16 vf_fmadd(vf16 a, vf16 b, vf16 c) {
    return vf_pair(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline void vf_store(float *p, vf16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline vf16 vf_load(const float *p) {
    return vf_pair(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
}
static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
static inline float vf_sum(vf16 v) { return hsum8(_mm256_add_ps(v.lo, v.hi)); }
static inline float vf_max(vf16 v) {
    const __m256 m = _mm256_max_ps(v.lo, v.hi);
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
static inline vf16 vf_max2(vf16 a, vf16 b) {
    return vf_pair(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi));
}
static inline vf16 vf_min2(vf16 a, vf16 b) {
    return vf_pair(_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi));
}
static inline vf16 vf_round(vf16 v) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return vf_pair(_mm256_round_ps(v.lo, mode), _mm256_round_ps(v.hi, mode));
}
static inline __m256 scale2x8(__m256 v, __m256 n) { /* v * 2^n, n in [-126, 127] */
    const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(exponent, 23)));
}
static inline vf16 vf_scale2(vf16 v, vf16 n) {
    return vf_pair(scale2x8(v.lo, n.lo), scale2x8(v.hi, n.hi));
}
static inline float vf_lane0(vf16 v) { return _mm256_cvtss_f32(v.lo); }
static inline vf16 vf_first(vf16 v, int count, float fill) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), n = _mm256_set1_epi32(count);
    const __m256 low = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, lanes));
    const __m256 high = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(n, _mm256_add_epi32(lanes, _mm256_set1_epi32(8))));
    const __m256 f = _mm256_set1_ps(fill);
    return vf_pair(_mm256_blendv_ps(f, v.lo, low), _mm256_blendv_ps(f, v.hi, high));
}

static inline __m256 widen_bf16x8(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf16 widen_bf16x16(__m256i h) {
    return vf_pair(widen_bf16x8(_mm256_castsi256_si128(h)),
                   widen_bf16x8(_mm256_extracti128_si256(h, 1)));
}

/* 8 fp32 -> their bf16 bits in the low half of each 32-bit lane, rounded as torch does */
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
}
static inline __m256i bf16x16_from(vf16 v) {
    /* packus works per 128-bit lane: [lo 0-3, hi 0-3, lo 4-7, hi 4-7], then reordered */
    const __m256i packed = _mm256_packus_epi32(bf16_bits8(v.lo), bf16_bits8(v.hi));
    return _mm256_permute4x64_epi64(packed, 0xd8);
}

/* lane t: the sum of d[t]'s 8 lanes, for 8 vectors, by a tree of horizontal adds */
static inline __m256 sum8(const __m256 *d) {
    const __m256 a = _mm256_hadd_ps(d[0], d[1]), b = _mm256_hadd_ps(d[2], d[3]);
    const __m256 c = _mm256_hadd_ps(d[4], d[5]), e = _mm256_hadd_ps(d[6], d[7]);
    const __m256 low = _mm256_hadd_ps(a, b), high = _mm256_hadd_ps(c, e);
    /* low: [d0..d3 halves' sums of lanes 0-3 | of lanes 4-7], high: the same for d4..d7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                         _mm256_permute2f128_ps(low, high, 0x31));
}
static inline vf16 sum16(const vf16 *d) {
    __m256 halves[16];
    for (int t = 0; t < 16; t++) halves[t] = _mm256_add_ps(d[t].lo, d[t].hi);
    return vf_pair(sum8(halves), sum8(halves + 8));
}
#endif

static inline vf16 load_bf16x16(const uint16_t *p) {
    return widen_bf16x16(_mm256_loadu_si256((const __m256i *)p));
}
static inline void store_bf16x16(uint16_t *p, vf16 v) {
    _mm256_storeu_si256((__m256i *)p, bf16x16_from(v));
}
static inline vf16 round_bf16x16(vf16 v) { return widen_bf16x16(bf16x16_from(v)); }

/* 16 bf16 widened in whatever lane order is cheapest, for dot products (both sides loaded
   alike) and sums (put back in order by in_order). With AVX2 that is an unpack above a
   zero: one instruction per 8 values where the ordered widening takes two, so the .lo
   half holds values 0-3 and 8-11, the .hi half 4-7 and 12-15. */
#if defined(__AVX512F__)
static inline vf16 load_bf16x16_unordered(const uint16_t *p) { return load_bf16x16(p); }
static inline vf16 in_order(vf16 v) { return v; }
#else
static inline vf16 load_bf16x16_unordered(const uint16_t *p) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), zero = _mm256_setzero_si256();
    return vf_pair(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)),
                   _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v)));
}
static inline vf16 in_order(vf16 v) {
    return vf_pair(_mm256_permute2f128_ps(v.lo, v.hi, 0x20),
                   _mm256_permute2f128_ps(v.lo, v.hi, 0x31));
}
#endif

/* exp inline: a libmvec call inside a loop makes the compiler spill every live vector
   register around it. Cephes' expf polynomial (about 1 ulp in fp32); inputs are clamped to
   [-87, 88], so that masked keys and the first chunk's -inf give ~1e-38, not NaN. */
static inline vf16 vf_exp_inline(vf16 x) {
    x = vf_max2(vf_min2(x, vf_set1(88.f)), vf_set1(-87.f));
    const vf16 n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf16 r = vf_sub(x, vf_mul(n, vf_set1(0.693359375f)));
    r = vf_add(r, vf_mul(n, vf_set1(2.12194440e-4f)));
    vf16 poly = vf_set1(1.9875691500e-4f);
    poly = vf_fmadd(poly, r, vf_set1(1.3981999507e-3f));
    poly = vf_fmadd(poly, r, vf_set1(8.3334519073e-3f));
    poly = vf_fmadd(poly, r, vf_set1(4.1665795894e-2f));
    poly = vf_fmadd(poly, r, vf_set1(1.6666665459e-1f));
    poly = vf_fmadd(poly, r, vf_set1(5.0000001201e-1f));
    poly = vf_fmadd(poly, vf_mul(r, r), vf_add(r, vf_set1(1.f)));
    return vf_scale2(poly, n);
}

static inline long chunk_offset(const int32_t *table, int position, int block_size, int dim) {
    return ((long)table[position / block_size] * block_size + position % block_size) * dim;
}

/* With avx512_bf16 and dim a multiple of 32, both products run on vdpbf16ps straight from
   the bf16 cache, with no widening of K and V to fp32: the scores (bf16 q . bf16 k, exact
   products, scaled afterwards) and probs @ V (the probabilities rounded to bf16 first, as
   the PyTorch path rounds them). Otherwise q is widened and scaled, K and V widened. */
#if defined(__AVX512BF16__)
#define DOT_BF16 1
#else
#define DOT_BF16 0
#endif

/* The next two 16-key chunks of K and V are prefetched into L2, not L1. Into L1 (as this
   kernel did first), 64 lines a chunk held the core's few L1 miss buffers and the loads
   waited behind them: on AMD EPYC (Zen 4), 64 rows of 300 to 700 keys over a 1 GB cache,
   16 keys per kv head took 159-176 ns with each row's blocks in order and 239-266 ns
   shuffled, against 217-263 and 389-411 ns with one chunk into L1 (alternated in one
   process; with every block in L2 about 125 ns). The AVX2 build of the same kernel on the
   same CPU: 286 -> 204 ns in order, 346 -> 309 shuffled. The second chunk ahead is what
   covers DRAM's latency where blocks are scattered and the hardware prefetcher cannot
   follow. */
#define PREFETCH_CHUNKS 2

/* Keys of the chunk at `position`: up to 16, all in one block, none past `length`. */
static inline int chunk_keys(int position, int length, int block_size) {
    int count = block_size - position % block_size;
    if (count > 16) count = 16;
    return count < length - position ? count : length - position;
}

/* K and V of the PREFETCH_CHUNKS chunks from position `next` on, into L2. */
static inline void prefetch_chunks(const int32_t *table, int next, int length,
                                   const uint16_t *keys, const uint16_t *values, int block_size,
                                   int dim) {
    for (int ahead = next; ahead < next + 16 * PREFETCH_CHUNKS && ahead < length; ahead += 16) {
        const long offset = chunk_offset(table, ahead, block_size, dim);
        for (int byte = 0; byte < 16 * dim * 2; byte += 64) {
            _mm_prefetch((const char *)(keys + offset) + byte, _MM_HINT_T1);
            _mm_prefetch((const char *)(values + offset) + byte, _MM_HINT_T1);
        }
    }
}

/* One (row, kv head): chunks = dim / 16, a constant where the caller inlines it. */
static inline __attribute__((always_inline)) void attend(
    const uint16_t *q, const uint16_t *keys, const uint16_t *values, const int32_t *table,
    int length, uint16_t *out, int group, int chunks, int block_size, float scale) {
    const int dim = 16 * chunks, paired = DOT_BF16 && chunks % 2 == 0;
    vf16 query[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS];
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];
#if DOT_BF16
    __m512bh query_pairs[MAX_GROUP][MAX_CHUNKS / 2];
#endif
    for (int g = 0; g < group; g++) {
        for (int c = 0; c < chunks; c++) {
            if (!paired)
                query[g][c] = vf_mul(load_bf16x16_unordered(q + g * dim + 16 * c), vf_set1(scale));
            acc[g][c] = vf_zero();
        }
#if DOT_BF16
        if (paired)
            for (int c = 0; c < chunks / 2; c++)
                query_pairs[g][c] = (__m512bh)_mm512_loadu_si512(q + g * dim + 32 * c);
#endif
        running_max[g] = -INFINITY;
        running_sum[g] = 0.f;
    }
    int position = 0;
    while (position < length) {
        const int count = chunk_keys(position, length, block_size);
        const long offset = chunk_offset(table, position, block_size, dim);
        const int next = position + count;
        prefetch_chunks(table, next, length, keys, values, block_size, dim);
        /* Each key's 16-lane partial dot products, summed 16 keys at a time by sum16: with
           the cache in L1 the kernel runs 10 % faster than with a horizontal sum per key;
           from DRAM, the scattered blocks' reads bound it either way (about 18 GB/s). */
        vf16 dots[MAX_GROUP][16];
        for (int t = 0; t < count; t++) {
#if DOT_BF16
            if (paired) {
                __m512bh key[MAX_CHUNKS / 2];
                for (int c = 0; c < chunks / 2; c++)
                    key[c] = (__m512bh)_mm512_loadu_si512(keys + offset + t * dim + 32 * c);
                for (int g = 0; g < group; g++) {
                    __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), query_pairs[g][0], key[0]);
                    for (int c = 1; c < chunks / 2; c++)
                        dot = _mm512_dpbf16_ps(dot, query_pairs[g][c], key[c]);
                    dots[g][t] = dot;
                }
                continue;
            }
#endif
            vf16 key[MAX_CHUNKS];
            for (int c = 0; c < chunks; c++)
                key[c] = load_bf16x16_unordered(keys + offset + t * dim + 16 * c);
            for (int g = 0; g < group; g++) {
                vf16 dot = vf_mul(query[g][0], key[0]);
                for (int c = 1; c < chunks; c++) dot = vf_fmadd(query[g][c], key[c], dot);
                dots[g][t] = dot;
            }
        }
        for (int t = count; t < 16; t++)
            for (int g = 0; g < group; g++) dots[g][t] = vf_zero();
        float scores[MAX_GROUP][16];
        for (int g = 0; g < group; g++) {
            const vf16 sums = paired ? vf_mul(sum16(dots[g]), vf_set1(scale)) : sum16(dots[g]);
            const vf16 s = vf_first(sums, count, -INFINITY);
            const float chunk_max = vf_max(s);
            if (chunk_max > running_max[g]) { /* rescale what the earlier keys summed */
                /* on the first chunk ~1e-38 times a sum and accumulators of 0 */
                const vf16 factor = vf_exp_inline(vf_set1(running_max[g] - chunk_max));
                running_sum[g] *= vf_lane0(factor);
                for (int c = 0; c < chunks; c++) acc[g][c] = vf_mul(acc[g][c], factor);
                running_max[g] = chunk_max;
            }
            const vf16 p = vf_first(vf_exp_inline(vf_sub(s, vf_set1(running_max[g]))), count, 0.f);
            running_sum[g] += vf_sum(p);
            vf_store(scores[g], p);
        }
#if DOT_BF16
        if (paired) {
            /* probs @ V two keys per vdpbf16ps: the probabilities as bf16 pairs (p[t],
               p[t + 1]) against V rows t and t + 1 interleaved by 16-bit unpacks, so each
               accumulator's lanes hold dims in unpack order (undone at the end). */
            uint32_t pairs[MAX_GROUP][8];
            for (int g = 0; g < group; g++)
                _mm256_storeu_si256((__m256i *)pairs[g],
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores[g])));
            for (int t = 0; t < count; t += 2) {
                const uint16_t *row = values + offset + (long)t * dim;
                for (int c = 0; c < chunks / 2; c++) {
                    const __m512i a = _mm512_loadu_si512(row + 32 * c);
                    const __m512i b = t + 1 < count ? _mm512_loadu_si512(row + dim + 32 * c)
                                                    : _mm512_setzero_si512();
                    const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(a, b);
                    const __m512bh high = (__m512bh)_mm512_unpackhi_epi16(a, b);
                    for (int g = 0; g < group; g++) {
                        const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pairs[g][t / 2]);
                        acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], low, p);
                        acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], high, p);
                    }
                }
            }
            position = next;
            continue;
        }
#endif
        /* One 16-dim chunk of V at a time across the block's keys: the group's accumulators
           for that chunk stay in registers (AVX2 has 16: all of them across a key would
           spill and reload on every key). */
        for (int c = 0; c < chunks; c++) {
            vf16 sums[MAX_GROUP];
            for (int g = 0; g < group; g++) sums[g] = acc[g][c];
            for (int t = 0; t < count; t++) {
                const vf16 value = load_bf16x16_unordered(values + offset + t * dim + 16 * c);
                for (int g = 0; g < group; g++)
                    sums[g] = vf_fmadd(vf_set1(scores[g][t]), value, sums[g]);
            }
            for (int g = 0; g < group; g++) acc[g][c] = sums[g];
        }
        position = next;
    }
#if DOT_BF16
    /* paired: per 32 dims, lane 4L + i of the low accumulator holds dim 8L + i, of the
       high one dim 8L + 4 + i */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
#endif
    for (int g = 0; g < group; g++) {
        float row[16 * MAX_CHUNKS];
        const vf16 inverse = vf_set1(1.f / running_sum[g]);
        for (int c = 0; c < chunks; c++) {
            vf16 v = paired ? acc[g][c] : in_order(acc[g][c]);
#if DOT_BF16
            if (paired) {
                const __m512 low = acc[g][c & ~1], high = acc[g][c | 1];
                v = _mm512_permutex2var_ps(low, c & 1 ? second : first, high);
            }
#endif
            vf_store(row + 16 * c, vf_mul(v, inverse));
        }
        for (int d = 0; d < dim; d++) out[g * dim + d] = bf16_from_float(row[d]);
    }
}

/* One (row, kv head) of decode_attention_bf16; item = row * kv_heads + head. */
static void attend_item(long item, const uint16_t *q, long q_stride, const uint16_t *cache,
                        const int32_t *block_table, int width, const int32_t *lengths,
                        uint16_t *out, int kv_heads, int group, int dim, long plane,
                        int block_size, float scale) {
    const int row = (int)(item / kv_heads), head = (int)(item % kv_heads);
    const uint16_t *query = q + row * q_stride + (long)head * group * dim;
    const uint16_t *keys = cache + head * plane, *values = cache + (kv_heads + head) * plane;
    const int32_t *table = block_table + (long)row * width;
    uint16_t *target = out + ((long)row * kv_heads + head) * group * dim;
    const int length = lengths[row];
    /* Constant shapes for the common ones, so that the accumulators live in registers. */
#define ATTEND(G, C) attend(query, keys, values, table, length, target, G, C, block_size, scale)
    if (dim == 64 && group == 3)
        ATTEND(3, 4);
    else if (dim == 64)
        ATTEND(group, 4);
    else if (dim == 128)
        ATTEND(group, 8);
    else
        ATTEND(group, dim / 16);
#undef ATTEND
}

#if DOT_BF16
/* A 16 x 16 matrix of 32-bit values transposed in registers: pairs, quads, then 128-bit
   lanes twice (64 shuffles instead of 256 scalar moves). */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
        r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
        r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
    }
}

/* ---- Consecutive rows of one prefill chunk, as a tile of queries ---------------------------

   The tokens of a prefill chunk are rows with the same block table and lengths one apart.
   Walked one row at a time, each row reloads every key and value of its context and sums
   each key's dot products across lanes. A tile of up to TILE_VECTORS query vectors (rows x
   the KV head's query heads) instead takes each 16-key chunk once: K transposed to pairs
   by keys (as the row tiles transpose x), so that a score vector is 16 keys' lanes and
   comes from vdpbf16ps with the query's pair broadcast, and V unpacked to key pairs once
   for every vector of the tile. Each row still attends to its own length (causal). */
#define TILE_VECTORS 48
#define TILE_MAX_DIM 128

static inline __m512 vf_first_mask(__m512 v, int count, float fill) {
    const __mmask16 keep = count >= 16 ? 0xffff : count <= 0 ? 0 : (__mmask16)((1u << count) - 1);
    return _mm512_mask_blend_ps(keep, _mm512_set1_ps(fill), v);
}

/* Rows first .. first + n - 1 (same block table, lengths one apart), one KV head; group
   and dim constants where the caller inlines it, so that the accumulators stay in
   registers. */
static inline __attribute__((always_inline)) void attend_tile(const uint16_t *q, long q_stride, const uint16_t *keys,
                        const uint16_t *values, const int32_t *table, const int32_t *lengths,
                        uint16_t *out, int first, int n, int head, int kv_heads, int group,
                        int dim, int block_size, float scale) {
    const int pairs = dim / 2, vectors = n * group, acc_width = dim / 16;
    const int base_length = lengths[first], longest = lengths[first + n - 1];
    float acc[TILE_VECTORS][TILE_MAX_DIM] __attribute__((aligned(64)));
    float running_max[TILE_VECTORS], running_sum[TILE_VECTORS];
    __m512 kt[TILE_MAX_DIM / 2];                          /* K chunk: pair p by 16 keys */
    __m512bh vu[8][TILE_MAX_DIM / 16];                    /* V chunk: key pairs, unpacked */
    uint32_t probs[TILE_VECTORS][8] __attribute__((aligned(64))); /* bf16 pairs by key pair */
    const uint32_t *query[TILE_VECTORS];
    for (int v = 0; v < vectors; v++) {
        const int row = first + v / group, g = v % group;
        query[v] = (const uint32_t *)(q + row * q_stride + ((long)head * group + g) * dim);
        for (int d = 0; d < dim; d += 16) _mm512_store_ps(acc[v] + d, _mm512_setzero_ps());
        running_max[v] = -INFINITY;
        running_sum[v] = 0.f;
    }
    int position = 0;
    while (position < longest) {
        const int count = chunk_keys(position, longest, block_size);
        const long offset = chunk_offset(table, position, block_size, dim);
        const int next = position + count;
        prefetch_chunks(table, next, longest, keys, values, block_size, dim);
        /* K's 16 keys x `pairs` pairs transposed, 16 pairs at a time */
        for (int half = 0; half < pairs / 16; half++) {
            __m512 r[16];
            for (int t = 0; t < 16; t++)
                r[t] = t < count ? _mm512_loadu_ps((const float *)(keys + offset + (long)t * dim) +
                                                   16 * half)
                                 : _mm512_setzero_ps();
            transpose16(r);
            for (int i = 0; i < 16; i++) kt[16 * half + i] = r[i];
        }
        /* V's key pairs (t, t + 1) interleaved by 16-bit unpacks, per 32 dims */
        for (int j = 0; 2 * j < count; j++) {
            const uint16_t *row = values + offset + (long)2 * j * dim;
            for (int c = 0; c < dim / 32; c++) {
                const __m512i a = _mm512_loadu_si512(row + 32 * c);
                const __m512i b = 2 * j + 1 < count ? _mm512_loadu_si512(row + dim + 32 * c)
                                                    : _mm512_setzero_si512();
                vu[j][2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                vu[j][2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
            }
        }
        /* scores, eight vectors at a time against each pair of K (the last ones padded
           with the first vector's query: computed, not used) */
        for (int v0 = 0; v0 < vectors; v0 += 8) {
            const int m = vectors - v0 < 8 ? vectors - v0 : 8;
            const uint32_t *eight[8];
            for (int i = 0; i < 8; i++) eight[i] = query[i < m ? v0 + i : 0];
            __m512 s[8];
            for (int i = 0; i < 8; i++) s[i] = _mm512_setzero_ps();
            for (int p = 0; p < pairs; p++) {
                const __m512bh k = (__m512bh)kt[p];
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++)
                    s[i] = _mm512_dpbf16_ps(s[i], k, (__m512bh)_mm512_set1_epi32((int)eight[i][p]));
            }
            for (int i = 0; i < m; i++) {
                const int v = v0 + i, valid = base_length + v / group - position;
                const __m512 scores = vf_first_mask(_mm512_mul_ps(s[i], _mm512_set1_ps(scale)),
                                                    valid < count ? valid : count, -INFINITY);
                const float chunk_max = _mm512_reduce_max_ps(scores);
                if (chunk_max > running_max[v]) {
                    const __m512 factor = vf_exp_inline(_mm512_set1_ps(running_max[v] - chunk_max));
                    running_sum[v] *= _mm512_cvtss_f32(factor);
                    for (int d = 0; d < dim; d += 16)
                        _mm512_store_ps(acc[v] + d, _mm512_mul_ps(_mm512_load_ps(acc[v] + d), factor));
                    running_max[v] = chunk_max;
                }
                const __m512 e = vf_first_mask(
                    vf_exp_inline(_mm512_sub_ps(scores, _mm512_set1_ps(running_max[v]))),
                    valid < count ? valid : count, 0.f);
                running_sum[v] += _mm512_reduce_add_ps(e);
                _mm256_store_si256((__m256i *)probs[v], (__m256i)_mm512_cvtneps_pbh(e));
            }
        }
        /* probs @ V: a few vectors' accumulators in registers across the chunk's key pairs */
        const int key_pairs = (count + 1) / 2, per = 24 / acc_width;
        for (int v0 = 0; v0 < vectors; v0 += per) {
            const int m = vectors - v0 < per ? vectors - v0 : per;
            __m512 a[24];
            for (int i = 0; i < m; i++)
                for (int c = 0; c < acc_width; c++) a[i * acc_width + c] = _mm512_load_ps(acc[v0 + i] + 16 * c);
            for (int j = 0; j < key_pairs; j++)
                for (int i = 0; i < m; i++) {
                    const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)probs[v0 + i][j]);
                    for (int c = 0; c < acc_width; c++)
                        a[i * acc_width + c] = _mm512_dpbf16_ps(a[i * acc_width + c], vu[j][c], pp);
                }
            for (int i = 0; i < m; i++)
                for (int c = 0; c < acc_width; c++) _mm512_store_ps(acc[v0 + i] + 16 * c, a[i * acc_width + c]);
        }
        position = next;
    }
    /* per 32 dims, lane 4L + i of the low accumulator holds dim 8L + i, of the high one
       dim 8L + 4 + i (the unpack order) */
    const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second_half = _mm512_add_epi32(first_half, _mm512_set1_epi32(8));
    for (int v = 0; v < vectors; v++) {
        const int row = first + v / group, g = v % group;
        uint16_t *target = out + ((long)row * kv_heads + head) * group * dim + (long)g * dim;
        const __m512 inverse = _mm512_set1_ps(1.f / running_sum[v]);
        for (int c = 0; c < acc_width; c++) {
            const __m512 low = _mm512_load_ps(acc[v] + 16 * (c & ~1));
            const __m512 high = _mm512_load_ps(acc[v] + 16 * (c | 1));
            const __m512 ordered = _mm512_permutex2var_ps(low, c & 1 ? second_half : first_half, high);
            _mm256_storeu_si256((__m256i *)(target + 16 * c),
                                bf16x16_from(_mm512_mul_ps(ordered, inverse)));
        }
    }
}
#endif

/* q: rows of q_stride elements, each [kv_heads * group, dim]; cache: one layer,
   [2 * kv_heads, num_blocks, block_size, dim] (K planes, then V planes); block_table:
   [rows, width]; lengths: [rows], keys per row (>= 1); out: [rows, kv_heads * group, dim].
   Runs of rows with the same block table and lengths one apart (a prefill chunk's tokens)
   attend as tiles of queries where the build has vdpbf16ps (attend_tile). */
void decode_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *cache,
                           const int32_t *block_table, int width, const int32_t *lengths,
                           uint16_t *out, int rows, int kv_heads, int group, int dim,
                           int num_blocks, int block_size, float scale, int threads) {
    const long plane = (long)num_blocks * block_size * dim;
    int tile_rows = 0;
#if DOT_BF16
    if (dim % 32 == 0 && dim <= TILE_MAX_DIM) tile_rows = TILE_VECTORS / group;
    if (tile_rows > 16) tile_rows = 16;
#endif
    int *starts = tile_rows >= 2 ? malloc(sizeof(int) * (size_t)(rows + 1)) : NULL;
    if (!starts) { /* one row at a time */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (long item = 0; item < (long)rows * kv_heads; item++)
            attend_item(item, q, q_stride, cache, block_table, width, lengths, out, kv_heads,
                        group, dim, plane, block_size, scale);
        return;
    }
    int units = 0;
    for (int row = 0; row < rows;) {
        int n = 1;
        while (n < tile_rows && row + n < rows && lengths[row + n] == lengths[row] + n &&
               memcmp(block_table + (long)row * width, block_table + (long)(row + n) * width,
                      sizeof(int32_t) * (size_t)width) == 0)
            n++;
        starts[units++] = row;
        row += n;
    }
    starts[units] = rows;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long item = 0; item < (long)units * kv_heads; item++) {
        const int unit = (int)(item / kv_heads), head = (int)(item % kv_heads);
        const int first = starts[unit], n = starts[unit + 1] - first;
        if (n == 1) {
            attend_item((long)first * kv_heads + head, q, q_stride, cache, block_table, width,
                        lengths, out, kv_heads, group, dim, plane, block_size, scale);
            continue;
        }
#if DOT_BF16
#define ATTEND_TILE(G, D)                                                                     \
    attend_tile(q, q_stride, cache + head * plane, cache + (kv_heads + head) * plane,           \
                block_table + (long)first * width, lengths, out, first, n, head, kv_heads, G, D, \
                block_size, scale)
        if (group == 3 && dim == 64)
            ATTEND_TILE(3, 64);
        else if (dim == 64)
            ATTEND_TILE(group, 64);
        else if (dim == 128)
            ATTEND_TILE(group, 128);
        else
            ATTEND_TILE(group, dim);
#undef ATTEND_TILE
#endif
    }
    free(starts);
}

/* The residual stream's add and RMSNorm in one pass, in HF's order of operations for bf16:
   residual = bf16(residual + x) (skipped where x is NULL); out = bf16(bf16(residual *
   rsqrt(mean(residual^2) + eps)) * weight), the mean in fp32. PyTorch's ops take eight
   passes and three fp32 copies for this. Rows are [dim] with dim a multiple of 16. */
static void add_rms_norm_row(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                             uint16_t *out, int dim, float eps) {
    vf16 squares = vf_zero();
    for (int i = 0; i < dim; i += 16) {
        vf16 v = load_bf16x16(residual + i);
        if (x) {
            __m256i sum = bf16x16_from(vf_add(v, load_bf16x16(x + i)));
            _mm256_storeu_si256((__m256i *)(residual + i), sum);
            v = widen_bf16x16(sum);
        }
        squares = vf_fmadd(v, v, squares);
    }
    const vf16 inverse = vf_set1(1.0f / sqrtf(vf_sum(squares) / dim + eps));
    for (int i = 0; i < dim; i += 16) {
        vf16 normed = round_bf16x16(vf_mul(load_bf16x16(residual + i), inverse));
        store_bf16x16(out + i, vf_mul(normed, load_bf16x16(weight + i)));
    }
}

/* x (or NULL), residual, out: [rows, dim]; weight: [dim]. Threads only where rows are many
   (a team's start costs more than a few rows' work). */
void add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                       uint16_t *out, int rows, int dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= 64)
    for (int row = 0; row < rows; row++)
        add_rms_norm_row(x ? x + (long)row * dim : NULL, residual + (long)row * dim, weight,
                         out + (long)row * dim, dim, eps);
}

/* Rotary embedding of q and k in place, in HF's bf16 order (each product and the sum
   rounded to bf16, as torch's bf16 ops do): x = x * cos + roll(x, dim / 2) * signed_sin,
   then k and v written to their slots of the cache. qkv: [tokens, qkv_stride] rows of
   [heads + kv_heads heads to rotate, kv_heads of v] x dim; cos, signed_sin: [tokens, dim];
   cache: one layer's [2 * kv_heads, slots, dim] (K planes, then V planes). dim is a
   multiple of 32 and at most 256. */
static void rotary_row(uint16_t *row, const uint16_t *cos, const uint16_t *signed_sin,
                       long slot, uint16_t *cache, long slots, int heads, int kv_heads, int dim) {
    const int chunks = dim / 16, half = chunks / 2;
    vf16 c[MAX_CHUNKS], s[MAX_CHUNKS];
    for (int i = 0; i < chunks; i++) {
        c[i] = load_bf16x16(cos + 16 * i);
        s[i] = load_bf16x16(signed_sin + 16 * i);
    }
    for (int head = 0; head < heads + kv_heads; head++) {
        uint16_t *x = row + (long)head * dim;
        vf16 v[MAX_CHUNKS];
        for (int i = 0; i < chunks; i++) v[i] = load_bf16x16(x + 16 * i);
        for (int i = 0; i < chunks; i++) {
            vf16 straight = round_bf16x16(vf_mul(v[i], c[i]));
            vf16 rolled = round_bf16x16(vf_mul(v[(i + half) % chunks], s[i]));
            store_bf16x16(x + 16 * i, vf_add(straight, rolled));
        }
    }
    for (int plane = 0; plane < 2 * kv_heads; plane++)
        memcpy(cache + (plane * slots + slot) * dim, row + (long)(heads + plane) * dim,
               (size_t)dim * sizeof(uint16_t));
}

void rotary_cache_write_bf16(uint16_t *qkv, long qkv_stride, const uint16_t *cos,
                             const uint16_t *signed_sin, const int64_t *slot_mapping,
                             uint16_t *cache, long slots, int tokens, int heads, int kv_heads,
                             int dim, int threads) {
#pragma omp parallel for num_threads(threads) if (tokens >= 64)
    for (int token = 0; token < tokens; token++)
        rotary_row(qkv + token * qkv_stride, cos + (long)token * dim,
                   signed_sin + (long)token * dim, slot_mapping[token], cache, slots, heads,
                   kv_heads, dim);
}

/* SwiGLU's activation: out = bf16(bf16(silu(gate)) * up), gate_up: [rows, 2 * width] rows
   of [gate | up]; out: [rows, width]; width a multiple of 16. silu in fp32, as torch's
   bf16 silu computes it (exp within about an ulp of glibc's). */
static void silu_mul_row(const uint16_t *gate, uint16_t *target, int width) {
    const uint16_t *up = gate + width;
    for (int i = 0; i < width; i += 16) {
        vf16 g = load_bf16x16(gate + i);
        vf16 e = vf_exp_inline(vf_sub(vf_zero(), g));
        vf16 silu = round_bf16x16(vf_div(g, vf_add(vf_set1(1.0f), e)));
        store_bf16x16(target + i, vf_mul(silu, load_bf16x16(up + i)));
    }
}

void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int width, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= 16)
    for (int row = 0; row < rows; row++)
        silu_mul_row(gate_up + (long)row * 2 * width, out + (long)row * width, width);
}

/* Greedy sampling: each row's index of its first maximum, as torch.max(dim=-1).indices
   gives (a NaN counts as the maximum, its first one wins). torch's reduction with indices
   is scalar: one row of 49k logits took it 47 us in cache, here 6. Right after a decode
   step (AMD EPYC, 2 threads) torch took 110-150 us and this 37: half of the logits come
   from the other core's cache. Splitting a row between the two threads was slower (about
   100 us): the OpenMP team has gone to sleep by then, and waking it costs more. */
#if defined(__AVX512F__)
static inline int first_equal16(const float *p, float value) { /* -1: none of 16 */
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(p), _mm512_set1_ps(value), _CMP_EQ_OQ);
    return hit ? __builtin_ctz(hit) : -1;
}
#else
static inline int first_equal16(const float *p, float value) {
    const __m256 target = _mm256_set1_ps(value);
    const int low = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), target, _CMP_EQ_OQ));
    const int high = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + 8), target, _CMP_EQ_OQ));
    const int hit = low | high << 8;
    return hit ? __builtin_ctz(hit) : -1;
}
#endif

/* One pass finds the maximum and whether there is a NaN (x - x is NaN for NaN and
   infinities; those are settled one value at a time), a second its first index. */
static int32_t argmax_row(const float *x, int n) {
    const int whole = n / 64 * 64;
    vf16 top[4] = {vf_set1(-INFINITY), vf_set1(-INFINITY), vf_set1(-INFINITY), vf_set1(-INFINITY)};
    vf16 nans = vf_zero();
    for (int i = 0; i < whole; i += 64)
        for (int j = 0; j < 4; j++) {
            const vf16 v = vf_load(x + i + 16 * j);
            top[j] = vf_max2(top[j], v);
            nans = vf_add(nans, vf_sub(v, v));
        }
    float best = vf_max(vf_max2(vf_max2(top[0], top[1]), vf_max2(top[2], top[3])));
    int odd = vf_sum(nans) != vf_sum(nans);
    for (int i = whole; i < n; i++) {
        odd |= x[i] != x[i];
        if (x[i] > best) best = x[i];
    }
    if (odd)
        for (int i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const int lane = first_equal16(x + i, best);
        if (lane >= 0) return i + lane;
    }
    for (; i < n; i++)
        if (x[i] == best) return i;
    return 0; /* not reached for n >= 1: the maximum is one of the values */
}

void argmax_rows_f32(const float *x, int rows, int n, int32_t *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= 8)
    for (int row = 0; row < rows; row++) out[row] = argmax_row(x + (long)row * n, n);
}

/* ---- The decode step for a few rows: every layer in one call ------------------------------

   At one to four rows a decode step reads every weight once and computes little: it is
   bound by memory and, in PyTorch, by the ~300 calls it takes. Here the linear layers read
   weights packed for a sequential stream ([out / 16][in / 32][16 rows][32 values], see
   pack_rows in decode_attention.py), the hardware prefetcher's best case: about 0.9 of the
   machine's read bandwidth where oneDNN's packed matmul reaches 0.6 at one row. The whole
   step runs in one OpenMP team; each stage splits its work with an orphaned `omp for`,
   whose barrier orders the stages. Rounding to bf16 happens where the PyTorch path rounds.
   With avx512_bf16 the products run on vdpbf16ps; elsewhere the weights are widened to fp32
   (a shift) and multiplied by fused multiply-adds: the same exact products, summed in fp32. */

#define LINEAR_TILE 16  /* output rows per packed tile */
#define LINEAR_DEPTH 32 /* inputs per step: one vdpbf16ps, or a 64-byte line of a row */
/* Prefetch into L2 this far ahead (36 KB): about 7 % more read bandwidth than the hardware
   prefetcher alone (measured: 28 -> 30 GB/s on 2 AMD EPYC cores; torch's sum reads 33).
   The vdpbf16ps paths prefetch every other line only (PREFETCH_EVERY): the L2 fetches a
   line's 128-byte pair with it, and half the prefetches hold half the miss buffers. On the
   AMD EPYC VM, alternating with one prefetch per line over 269 MB: 9 % less time (13 %
   while the VM's memory ran fast, 4 % while it ran slow), as fast as a plain sum of the
   same bytes; a decode step 1 to 10 % faster in five of six alternated runs. The widening
   paths lost by it (AVX2: a decode step 20 % slower; AVX-512 without bf16: 2 %), so they
   prefetch every line. AMX's loop keeps every line too: not measured on AMX hardware. */
#define LINEAR_PREFETCH (18 * 1024)
#define PREFETCH_EVERY 2 /* lines, in the vdpbf16ps paths */

/* The 16 outputs of tile `tile` for input row x: 16 fp32 dot products over `in` values. A
   prefetch never faults: past the weight's end it is only wasted. */
#if DOT_BF16
static inline vf16 linear_tile(const uint16_t *x, const uint16_t *packed, int in, int tile) {
    __m512 acc[LINEAR_TILE];
    for (int j = 0; j < LINEAR_TILE; j++) acc[j] = _mm512_setzero_ps();
    const uint16_t *block = packed + (long)tile * LINEAR_TILE * in;
    for (int k = 0; k < in; k += LINEAR_DEPTH, block += LINEAR_TILE * LINEAR_DEPTH) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
        for (int j = 0; j < LINEAR_TILE; j++) {
            if (j % PREFETCH_EVERY == 0)
                _mm_prefetch((const char *)(block + LINEAR_PREFETCH + j * 32), _MM_HINT_T1);
            acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_loadu_si512(block + j * 32));
        }
    }
    return sum16(acc);
}
#elif defined(__AVX512F__)
static inline vf16 linear_tile(const uint16_t *x, const uint16_t *packed, int in, int tile) {
    vf16 acc[LINEAR_TILE];
    for (int j = 0; j < LINEAR_TILE; j++) acc[j] = vf_zero();
    const uint16_t *block = packed + (long)tile * LINEAR_TILE * in;
    for (int k = 0; k < in; k += LINEAR_DEPTH, block += LINEAR_TILE * LINEAR_DEPTH) {
        const vf16 low = load_bf16x16(x + k), high = load_bf16x16(x + k + 16);
        for (int j = 0; j < LINEAR_TILE; j++) {
            _mm_prefetch((const char *)(block + LINEAR_PREFETCH + j * 32), _MM_HINT_T1);
            acc[j] = vf_fmadd(load_bf16x16(block + j * 32), low, acc[j]);
            acc[j] = vf_fmadd(load_bf16x16(block + j * 32 + 16), high, acc[j]);
        }
    }
    return sum16(acc);
}
#else
/* AVX2: one 8-lane accumulator per output row, so that the 16 of them and the input's 32
   values nearly fit the 16 registers. A row's 32 weights are two loads, widened by
   interleaving each 16-bit value above a zero (unpacklo/hi: lanes 0-3 and 8-11, then
   4-7 and 12-15): the dot product does not mind the order as long as x is widened alike,
   and it takes half the instructions of a widening load and a shift per 8 values. */
static inline void widen_pair(const uint16_t *p, __m256 *low, __m256 *high) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), zero = _mm256_setzero_si256();
    *low = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    *high = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}
static inline vf16 linear_tile(const uint16_t *x, const uint16_t *packed, int in, int tile) {
    __m256 acc[LINEAR_TILE];
    for (int j = 0; j < LINEAR_TILE; j++) acc[j] = _mm256_setzero_ps();
    const uint16_t *block = packed + (long)tile * LINEAR_TILE * in;
    for (int k = 0; k < in; k += LINEAR_DEPTH, block += LINEAR_TILE * LINEAR_DEPTH) {
        __m256 xv[4];
        widen_pair(x + k, &xv[0], &xv[1]);
        widen_pair(x + k + 16, &xv[2], &xv[3]);
        for (int j = 0; j < LINEAR_TILE; j++) {
            _mm_prefetch((const char *)(block + LINEAR_PREFETCH + j * 32), _MM_HINT_T1);
            __m256 w[4];
            widen_pair(block + j * 32, &w[0], &w[1]);
            widen_pair(block + j * 32 + 16, &w[2], &w[3]);
            __m256 dot = _mm256_mul_ps(w[0], xv[0]);
            for (int i = 1; i < 4; i++) dot = _mm256_fmadd_ps(w[i], xv[i], dot);
            acc[j] = _mm256_add_ps(acc[j], dot);
        }
    }
    return vf_pair(sum8(acc), sum8(acc + 8));
}
#endif

/* y[rows, out] = x[rows, in] @ W.T, W packed (its rows padded to whole tiles); y in bf16,
   or (y32) bf16-rounded fp32 as the vocabulary projection's `.float()` gives. A tile's
   later rows reread it from cache. */
static void linear_rows(const uint16_t *x, const uint16_t *packed, uint16_t *y, float *y32,
                        int rows, int in, int out) {
    const int tiles = (out + LINEAR_TILE - 1) / LINEAR_TILE;
#pragma omp for schedule(static)
    for (int tile = 0; tile < tiles; tile++) {
        const int left = out - tile * LINEAR_TILE, whole = left >= LINEAR_TILE;
        for (int row = 0; row < rows; row++) {
            const __m256i sums = bf16x16_from(linear_tile(x + (long)row * in, packed, in, tile));
            const long at = (long)row * out + (long)tile * LINEAR_TILE;
            float wide[LINEAR_TILE];
            uint16_t narrow[LINEAR_TILE];
            if (y32) /* the last tile's padding rows are not stored */
                vf_store(whole ? y32 + at : wide, widen_bf16x16(sums));
            else
                _mm256_storeu_si256((__m256i *)(whole ? y + at : narrow), sums);
            if (!whole && y32) memcpy(y32 + at, wide, (size_t)left * sizeof(float));
            if (!whole && !y32) memcpy(y + at, narrow, (size_t)left * sizeof(uint16_t));
        }
    }
}

/* ---- The same product on tiles, for more rows than the decode step's few ------------------

   A packed weight block (16 outputs x 32 inputs) is AMX's A tile as it lies, so the tiles
   compute y's transpose: C[16 outputs][16 rows] += W block . B, where B holds 16 rows' 32
   inputs as 16 pairs of inputs by 16 rows (VNNI order), that is x's 16 x 32 block seen as
   16 x 16 32-bit pairs and transposed. The C tiles are transposed back to y's rows on the
   way out. With AMX (Intel Xeon since Sapphire Rapids) the tiles are the hardware's; with
   avx512_bf16 alone (AMD Zen 4, Intel Cooper Lake) the same product runs on vdpbf16ps,
   one register per output holding its 16 rows (vnni_tiles below). */
#if DOT_BF16
#define ROW_TILES 1
#define TILE_PASS_ROWS 64 /* rows per pass over the weight: four C tiles */

/* Tiles of 16 rows in the pass that starts at row `first`. */
static inline int row_tiles(int first, int rows) {
    const int count = rows - first < TILE_PASS_ROWS ? rows - first : TILE_PASS_ROWS;
    return (count + 15) / 16;
}

/* B tiles of x's rows [first, first + TILE_PASS_ROWS): per (row tile, input block) 16 x 16
   pairs, rows past the end zero. */
static void tile_pack_rows(const uint16_t *x, uint32_t *b, int first, int rows, int in) {
    const int blocks = in / LINEAR_DEPTH, tiles = row_tiles(first, rows);
#pragma omp for schedule(static)
    for (int item = 0; item < tiles * blocks; item++) {
        const int tile = item / blocks, block = item % blocks;
        __m512 r[16];
        for (int i = 0; i < 16; i++) {
            const int row = first + tile * 16 + i;
            r[i] = row < rows ? _mm512_loadu_ps((const float *)(x + (long)row * in) + 16 * block)
                              : _mm512_setzero_ps();
        }
        transpose16(r);
        uint32_t *target = b + (long)item * 256;
        for (int i = 0; i < 16; i++) _mm512_storeu_ps((float *)target + 16 * i, r[i]);
    }
}

/* C [16 outputs][16 rows] of output tile `tile` and rows [row0, row0 + 16) into y (bf16) or
   y32 (bf16-rounded fp32), rows past `rows` and the last tile's padding outputs left out. */
static inline void store_c_tile(const float *c, uint16_t *y, float *y32, int row0, int rows,
                                int tile, int out) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(c + 16 * i);
    transpose16(r); /* r[i]: row row0 + i, this tile's 16 outputs */
    const int left = out - tile * LINEAR_TILE;
    const __mmask16 mask = left >= LINEAR_TILE ? 0xffff : (__mmask16)((1u << left) - 1);
    for (int i = 0; i < 16 && row0 + i < rows; i++) {
        const __m256i sums = bf16x16_from(r[i]);
        const long at = (long)(row0 + i) * out + (long)tile * LINEAR_TILE;
        if (y32)
            _mm512_mask_storeu_ps(y32 + at, mask, widen_bf16x16(sums));
        else
            _mm256_mask_storeu_epi16(y + at, mask, sums);
    }
}

/* The tile product on vdpbf16ps: for each row tile, one register per output of the tile
   holds its 16 rows, and each step adds (pair p of 16 rows) . (the output's pair p,
   broadcast from the weight block). 256 vdpbf16ps per block and row tile, each with its
   broadcast load, and one load of B per 16 of them: the units' peak where one vdpbf16ps
   issues per cycle. The weight tile (16 outputs x in) is read from memory for the first
   row tile and from cache for the others. */
static void vnni_tiles(const uint32_t *b, const uint16_t *packed, uint16_t *y, float *y32,
                       int first, int rows, int in, int out) {
    const int blocks = in / LINEAR_DEPTH, tiles = row_tiles(first, rows);
    const int out_tiles = (out + LINEAR_TILE - 1) / LINEAR_TILE;
    float c[256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int tile = 0; tile < out_tiles; tile++) {
        const uint16_t *weights = packed + (long)tile * LINEAR_TILE * in;
        for (int m = 0; m < tiles; m++) {
            __m512 acc[LINEAR_TILE];
            for (int o = 0; o < LINEAR_TILE; o++) acc[o] = _mm512_setzero_ps();
            const uint32_t *w = (const uint32_t *)weights; /* [16 outputs][16 pairs] a block */
            const uint32_t *pairs = b + (long)m * blocks * 256;
            for (int k = 0; k < blocks; k++, w += 256, pairs += 256) {
                if (m == 0)
                    for (int line = 0; line < LINEAR_TILE; line += PREFETCH_EVERY)
                        _mm_prefetch((const char *)(w + LINEAR_PREFETCH / 2 + line * 16),
                                     _MM_HINT_T1);
                for (int p = 0; p < 16; p++) {
                    const __m512bh rows16 = (__m512bh)_mm512_loadu_si512(pairs + 16 * p);
#pragma GCC unroll 16
                    for (int o = 0; o < LINEAR_TILE; o++)
                        acc[o] = _mm512_dpbf16_ps(
                            acc[o], rows16, (__m512bh)_mm512_set1_epi32((int)w[16 * o + p]));
                }
            }
            for (int o = 0; o < LINEAR_TILE; o++) _mm512_store_ps(c + 16 * o, acc[o]);
            store_c_tile(c, y, y32, first + 16 * m, rows, tile, out);
        }
    }
}
#endif

#if DOT_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

static int amx_enabled = 0;

/* Linux hands out AMX's tile state only to a process that asks; 0 when it may use it. */
int amx_enable(void) {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    amx_enabled = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_enabled ? 0 : -1;
}

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

#define AMX_STEP(c, bt, m)                                                          \
    if (m < tiles) {                                                                \
        _tile_loadd(bt, b + ((long)(m) * blocks + k) * 256, 64);                     \
        _tile_dpbf16ps(c, 0, bt);                                                   \
    }

/* y rows [first, first + 64) for the output tiles this thread takes: each weight block is
   read once for the pass's four C tiles. */
static void amx_tiles(const uint32_t *b, const uint16_t *packed, uint16_t *y, float *y32,
                      int first, int rows, int in, int out) {
    const int blocks = in / LINEAR_DEPTH, tiles = row_tiles(first, rows);
    const int out_tiles = (out + LINEAR_TILE - 1) / LINEAR_TILE;
    tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    float c[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int tile = 0; tile < out_tiles; tile++) {
        const uint16_t *w = packed + (long)tile * LINEAR_TILE * in;
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        for (int k = 0; k < blocks; k++) {
            for (int line = 0; line < LINEAR_TILE; line++)
                _mm_prefetch((const char *)(w + LINEAR_PREFETCH + line * 32), _MM_HINT_T1);
            _tile_loadd(0, w, 64); /* tile 0: the weight block, 16 outputs x 32 inputs */
            w += LINEAR_TILE * LINEAR_DEPTH;
            AMX_STEP(2, 1, 0)
            AMX_STEP(3, 6, 1)
            AMX_STEP(4, 7, 2)
            AMX_STEP(5, 1, 3)
        }
        _tile_stored(2, c[0], 64);
        _tile_stored(3, c[1], 64);
        _tile_stored(4, c[2], 64);
        _tile_stored(5, c[3], 64);
        for (int m = 0; m < tiles; m++) store_c_tile(c[m], y, y32, first + 16 * m, rows, tile, out);
    }
    _tile_release();
}
#else
static const int amx_enabled = 0;
#endif

/* 2: the tiles are AMX's; 1: they run on vdpbf16ps; 0: no tiles (more than a decode step's
   few rows are left to oneDNN). */
int row_tiles_kind(void) {
#if DOT_BF16
    return amx_enabled ? 2 : 1;
#else
    return amx_enabled;
#endif
}

/* Rows a decode step keeps on vectors before tiles take them, where the tiles run on
   vdpbf16ps: a 16-row tile pass costs the same at 5 rows as at 16, while each row on
   vectors adds about a seventh of a one-row step (SmolLM2 on 2 AMD EPYC cores: 4 rows
   9.9 ms, 5 to 12 rows 10.7 to 18.8 on vectors against 17.7 to 19.8 on tiles). The
   vector path computes each row alike whatever the count, so a request's drafts
   (speculative decoding) give the logits its plain decode steps would. Other steps
   keep tiles from 5 rows: a prefill chunk after cached blocks then computes its rows as
   the whole prompt's prefill did. AMX's tiles cost little: there, 5 rows go to them. */
#define DECODE_VECTOR_ROWS 12
#define VECTOR_ROWS 4

/* The most rows a decode step computes on vectors when asked to (decode_step_bf16's
   vector_rows): the vectors compute each row exactly as in a step of its own, which
   greedy verification of drafts needs, while tiles sum in another order. Every row count
   where no tiles run. */
int decode_vector_rows(void) {
#if DOT_BF16
    return DECODE_VECTOR_ROWS;
#else
    return 1 << 30;
#endif
}

/* Scratch for the B tiles of up to `rows` rows of `in` inputs, where tiles take more than
   `vector_rows` rows; NULL otherwise, or when out of memory. */
static uint32_t *tile_scratch(int rows, int in, int vector_rows) {
#if DOT_BF16
    if (rows <= vector_rows) return NULL;
    const int chunk = rows < TILE_PASS_ROWS ? rows : TILE_PASS_ROWS;
    return aligned_alloc(64, (size_t)((chunk + 15) / 16) * in * 16 * sizeof(uint16_t));
#else
    (void)rows, (void)in, (void)vector_rows;
    return NULL;
#endif
}

/* linear_rows, on tiles where tile_scratch gave scratch b (inside a parallel region). */
static void linear_stage(const uint16_t *x, const uint16_t *packed, uint16_t *y, float *y32,
                         int rows, int in, int out, uint32_t *b) {
#if DOT_BF16
    if (b) {
        for (int first = 0; first < rows; first += TILE_PASS_ROWS) {
            tile_pack_rows(x, b, first, rows, in); /* its barrier: b is ready */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if (amx_enabled) {
                amx_tiles(b, packed, y, y32, first, rows, in, out); /* its barrier: b is free */
                continue;
            }
#endif
            vnni_tiles(b, packed, y, y32, first, rows, in, out); /* its barrier: b is free */
        }
        return;
    }
#endif
    (void)b;
    linear_rows(x, packed, y, y32, rows, in, out);
}

/* x: [rows, in], W packed from [out, in] (in % 32 == 0), y: [rows, out]. More than a decode
   step's few rows run on tiles where the CPU has avx512_bf16 (AMX's where it has them and
   amx_enable() succeeded). */
void linear_rows_bf16(const uint16_t *x, const uint16_t *packed, uint16_t *y, int rows, int in,
                      int out, int threads) {
    uint32_t *b = tile_scratch(rows, in, VECTOR_ROWS);
#pragma omp parallel num_threads(threads)
    linear_stage(x, packed, y, NULL, rows, in, out, b);
    free(b);
}

/* Each row's greedy token, as argmax_row finds it over the whole row, inside the step's
   team: each thread searches the part of the logits it wrote (the vocabulary projection's
   static split of the same tiles), while that part is still in its own core's cache, and
   one thread joins the parts. Read from one thread after the step, the other core's half
   took 90 us, a step's 1.5 %. found: [rows, team] scratch. */
static void argmax_stage(const float *logits, int rows, int vocab, int32_t *found,
                         int32_t *tokens) {
    const int tiles = (vocab + LINEAR_TILE - 1) / LINEAR_TILE;
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
    int first = -1, end = 0; /* this thread's tiles, [first, end) */
#pragma omp for schedule(static) nowait
    for (int tile = 0; tile < tiles; tile++) {
        if (first < 0) first = tile;
        end = tile + 1;
    }
    const int from = first * LINEAR_TILE, to = end * LINEAR_TILE < vocab ? end * LINEAR_TILE : vocab;
    for (int row = 0; row < rows; row++)
        found[row * team + me] = first < 0 ? -1 : from + argmax_row(logits + (long)row * vocab + from, to - from);
#pragma omp barrier
#pragma omp for
    for (int row = 0; row < rows; row++) { /* the first NaN, else the first maximum */
        const float *x = logits + (long)row * vocab;
        int32_t best = -1;
        for (int t = 0; t < team; t++) {
            const int32_t index = found[row * team + t];
            if (index < 0) continue;
            const float value = x[index];
            const int nan = value != value;
            if (best < 0) {
                best = index;
                continue;
            }
            const float top = x[best];
            const int top_nan = top != top;
            if (nan ? !top_nan || index < best
                    : !top_nan && (value > top || (value == top && index < best)))
                best = index;
        }
        tokens[row] = best;
    }
}

/* The first LINEAR_PREFETCH values of this thread's part of the matrix linear_rows reads
   next (its output tiles under schedule(static), split as GCC's OpenMP splits them: the
   first tiles % team threads take one more), fetched into L2 while a one-row stage runs
   on one thread and the other waits at its barrier: each matrix otherwise started from
   memory with nothing prefetched. A single-stream decode step 1.2 % faster (alternated
   step by step on the AMD EPYC VM, 381 pairs, twice); every other line, or twice as
   far, no better. */
static inline void prefetch_own_tiles(const uint16_t *packed, int in, int out) {
    const int tiles = (out + LINEAR_TILE - 1) / LINEAR_TILE;
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
    int share = tiles / team, extra = tiles % team;
    if (me < extra) share++, extra = 0;
    if (!share) return;
    const char *start = (const char *)(packed + (long)(share * me + extra) * LINEAR_TILE * in);
    const long bytes = (long)share * LINEAR_TILE * in * 2;
    const long end = bytes < LINEAR_PREFETCH * 2 ? bytes : LINEAR_PREFETCH * 2;
    for (long byte = 0; byte < end; byte += 64) _mm_prefetch(start + byte, _MM_HINT_T1);
}

/* The model's shapes, mirrored by DecodeStepShape in decode_attention.py. */
typedef struct {
    int layers, hidden, heads, kv_heads, dim, intermediate, vocab, num_blocks, block_size;
    int positions; /* rows of the rotary tables */
    float eps, scale;
} step_shape;

enum { INPUT_NORM, QKV, OUTPUT, POST_NORM, GATE_UP, DOWN, PER_LAYER };
/* after the layers' pointers */
enum { FINAL_NORM, HEAD, EMBEDDING, COS, SIGNED_SIN };

/* The step's inputs, checked before anything is read through them: each token in the
   vocabulary, each length in the rotary tables and in its block table row, each row's
   block for its new token in the cache. */
static int step_inputs_fit(const step_shape *m, const int64_t *token_ids,
                           const int32_t *block_table, int width, const int32_t *lengths,
                           int rows) {
    for (int row = 0; row < rows; row++) {
        const int length = lengths[row];
        if (token_ids[row] < 0 || token_ids[row] >= m->vocab || length < 1 ||
            length > m->positions || (length - 1) / m->block_size >= width)
            return 0;
        const int32_t block = block_table[(long)row * width + (length - 1) / m->block_size];
        if (block < 0 || block >= m->num_blocks) return 0;
    }
    return 1;
}

/* weights: PER_LAYER pointers per layer (norm weights plain, matrices packed), then the
   final norm's weight, the packed vocabulary projection, the embedding table [vocab,
   hidden] and the rotary tables cos, signed sin [positions, dim]. cache: every layer's
   [2 * kv_heads, num_blocks * block_size, dim]. token_ids: [rows], each row's token;
   block_table [rows, width] and lengths [rows] as for decode_attention_bf16: a row's
   token is at position lengths[row] - 1, its K and V written to that position's slot.
   logits: [rows, vocab] fp32; tokens: NULL, or [rows] for each row's greedy token
   (argmax_rows_f32's). vector_rows: up to this many rows stay on vectors (a step with
   drafts asks decode_vector_rows()), 0 for the target's own choice. Returns 0, -1 if
   out of memory, -2 if an input is out of range
   (step_inputs_fit; nothing is written then). */
int decode_step_bf16(const step_shape *m, const uint16_t *const *weights, uint16_t *cache,
                     const int64_t *token_ids, const int32_t *block_table, int width,
                     const int32_t *lengths, float *logits, int32_t *tokens, int rows,
                     int vector_rows, int threads) {
    if (!step_inputs_fit(m, token_ids, block_table, width, lengths, rows)) return -2;
    const int hidden = m->hidden, dim = m->dim, group = m->heads / m->kv_heads;
    const int qkv_width = (m->heads + 2 * m->kv_heads) * dim;
    const long slots = (long)m->num_blocks * m->block_size;
    const long layer_size = 2 * m->kv_heads * slots * dim;
    const uint16_t *const *model = weights + (long)m->layers * PER_LAYER;
    const size_t widths = (size_t)3 * hidden + qkv_width + m->heads * dim + 3 * m->intermediate;
    uint16_t *scratch = aligned_alloc(64, ((size_t)rows * widths * sizeof(uint16_t) + 63) / 64 * 64);
    if (!scratch) return -1;
    uint16_t *residual = scratch, *normed = residual + (long)rows * hidden;
    uint16_t *update = normed + (long)rows * hidden;
    uint16_t *qkv = update + (long)rows * hidden, *attended = qkv + (long)rows * qkv_width;
    uint16_t *gate_up = attended + (long)rows * m->heads * dim;
    uint16_t *activated = gate_up + (long)rows * 2 * m->intermediate;
    int widest = hidden > m->intermediate ? hidden : m->intermediate;
    if (m->heads * dim > widest) widest = m->heads * dim;
    /* 0: the target's own choice: AMX's tiles from 5 rows (they cost little), else
       vectors up to 12 rows */
    if (vector_rows <= 0) vector_rows = amx_enabled ? VECTOR_ROWS : DECODE_VECTOR_ROWS;
    uint32_t *b = tile_scratch(rows, widest, vector_rows); /* NULL: vectors */
    int32_t *found = tokens ? malloc((size_t)rows * (threads > 0 ? threads : 1) * sizeof(int32_t)) : NULL;
    if (tokens && !found) {
        free(b);
        free(scratch);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    for (int layer = 0; layer <= m->layers; layer++) {
        const uint16_t *const *w = weights + (long)layer * PER_LAYER;
        if (!b) /* few rows: the one-row stages leave a thread idle */
            layer < m->layers ? prefetch_own_tiles(w[QKV], hidden, qkv_width)
                              : prefetch_own_tiles(model[HEAD], hidden, m->vocab);
#pragma omp for
        for (int row = 0; row < rows; row++) { /* the last sub-layer's output joins the residual */
            if (!layer) /* the residual stream starts as the token's embedding */
                memcpy(residual + (long)row * hidden, model[EMBEDDING] + token_ids[row] * hidden,
                       (size_t)hidden * sizeof(uint16_t));
            add_rms_norm_row(layer ? update + (long)row * hidden : NULL,
                             residual + (long)row * hidden, w[INPUT_NORM],
                             normed + (long)row * hidden, hidden, m->eps);
        }
        if (layer == m->layers) { /* the final norm, then the vocabulary projection */
            linear_stage(normed, model[HEAD], NULL, logits, rows, hidden, m->vocab, b);
            if (tokens) argmax_stage(logits, rows, m->vocab, found, tokens);
            break;
        }
        uint16_t *layer_cache = cache + layer * layer_size;
        linear_stage(normed, w[QKV], qkv, NULL, rows, hidden, qkv_width, b);
#pragma omp for
        for (int row = 0; row < rows; row++) {
            const int position = lengths[row] - 1, size = m->block_size;
            const long slot = (long)block_table[(long)row * width + position / size] * size + position % size;
            rotary_row(qkv + (long)row * qkv_width, model[COS] + (long)position * dim,
                       model[SIGNED_SIN] + (long)position * dim, slot, layer_cache, slots,
                       m->heads, m->kv_heads, dim);
        }
        if (!b) prefetch_own_tiles(w[OUTPUT], m->heads * dim, hidden);
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < (long)rows * m->kv_heads; item++)
            attend_item(item, qkv, qkv_width, layer_cache, block_table, width, lengths, attended,
                        m->kv_heads, group, dim, slots * dim, m->block_size, m->scale);
        linear_stage(attended, w[OUTPUT], update, NULL, rows, m->heads * dim, hidden, b);
        if (!b) prefetch_own_tiles(w[GATE_UP], hidden, 2 * m->intermediate);
#pragma omp for
        for (int row = 0; row < rows; row++)
            add_rms_norm_row(update + (long)row * hidden, residual + (long)row * hidden,
                             w[POST_NORM], normed + (long)row * hidden, hidden, m->eps);
        linear_stage(normed, w[GATE_UP], gate_up, NULL, rows, hidden, 2 * m->intermediate, b);
        if (!b) prefetch_own_tiles(w[DOWN], m->intermediate, hidden);
#pragma omp for
        for (int row = 0; row < rows; row++)
            silu_mul_row(gate_up + (long)row * 2 * m->intermediate,
                         activated + (long)row * m->intermediate, m->intermediate);
        linear_stage(activated, w[DOWN], update, NULL, rows, m->intermediate, hidden, b);
    }
    free(found);
    free(b);
    free(scratch);
    return 0;
}
