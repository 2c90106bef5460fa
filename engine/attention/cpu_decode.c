/* Paged decode attention on the CPU, reading the KV cache in place.
 *
 * One query row per sequence (q_len == 1) attends to that sequence's first seq_lens[b]
 * keys, found through its block table: key t of sequence b is row
 *
 *     cache[block_tables[b * bt_stride + t / bs]][t % bs][h]     (h: the KV head)
 *
 * of a cache laid out [num_blocks][bs][Hkv][D] (K and V each; protocol/kv_layout.py).
 * The G = Hq / Hkv query heads of one KV head share every key and value row read (GQA),
 * and a token's rows of all heads are read together, a block at a time (prefetched a few
 * blocks ahead: block ids jump around the cache, which stops the hardware prefetcher), so
 * each byte of the sequence's KV is read once per step. Per sequence, three passes:
 *
 *     1. s[i][t] = scale * <q[i], k_t[i / G]>     (query head i; float32, into `scores`)
 *     2. m[i] = max_t s, p = exp(s - m), l[i] = sum_t p
 *     3. out[i] = sum_t p[i][t] v_t[i / G] / l[i],  lse[i] = m[i] + log(l[i])
 *
 * A call runs the sequences [seq_begin, seq_end) of the step: callers split a step across
 * threads, each thread with its own `scores` scratch of at least
 * Hq * max(max(seq_lens), D) floats. q, out: [B][Hq][D] float32; lse: [B][Hq] float32,
 * natural log.
 *
 * Everything accumulates in float32; bf16 rows widen exactly (a 16-bit shift). A
 * sequence without keys (a decode-context-parallel rank holding none of its tokens)
 * gets out 0 and lse -inf. Built by engine/attention/cpu_kernel.py with
 * -O3 -march=native and reassociation allowed, so the dot products vectorize.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float f32_load(float x) { return x; }

/* exp(x) for x <= 0 (scores less their maximum): Cephes-style range reduction and a
 * degree-6 polynomial, about 1 ulp; branch-free so the loop vectorizes. */
static inline float exp_nonpos(float x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float xc = x < -87.0f ? -87.0f : x;
    float n = nearbyintf(xc * log2e);
    float r = xc - n * ln2_hi - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    float e = p * two_n;
    return x < -87.0f ? 0.0f : e;
}

/* The one-pass AVX-512 kernel for bf16 caches (cpu_decode_avx512.c): 0 if it ran the
 * sequence, -1 where it does not apply (no AVX-512, a head dim not a multiple of 32). */
int decode_bf16_avx512_seq(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int32_t *table, int64_t len, int64_t hq, int64_t hkv,
                           int64_t D, int64_t bs, float scale, float *scratch, float *out,
                           float *lse);

static inline int no_fast_f32(const float *q, const float *k_cache, const float *v_cache,
                              const int32_t *table, int64_t len, int64_t hq, int64_t hkv,
                              int64_t D, int64_t bs, float scale, float *scratch, float *out,
                              float *lse) {
    (void)q, (void)k_cache, (void)v_cache, (void)table, (void)len, (void)hq, (void)hkv;
    (void)D, (void)bs, (void)scale, (void)scratch, (void)out, (void)lse;
    return -1;
}

#define MAX_HEADS 256
#define PREFETCH_BLOCKS 2

/* Blocks sit anywhere in the cache, so the hardware prefetcher stops at every block
 * boundary: fetch the block PREFETCH_BLOCKS ahead of the one being read, whole. */
static inline void prefetch_block(const void *base, int64_t bytes) {
    const char *p = (const char *)base;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

#define DEFINE_KERNEL(NAME, T, LOAD, FAST)                                                      \
    static inline void NAME##_seq(                                                          \
        const float *q, const T *k_cache, const T *v_cache, const int32_t *table,           \
        int64_t len, int64_t hq, int64_t hkv, int64_t D, int64_t bs, float scale,           \
        float *scores, float *out, float *lse) {                                            \
        const int64_t group = hq / hkv, row = hkv * D; /* elements per token and part */   \
        float m[MAX_HEADS], l[MAX_HEADS];                                                   \
        for (int64_t i = 0; i < hq; i++) m[i] = -INFINITY;                                  \
        const int64_t nblocks = (len + bs - 1) / bs, block_bytes = bs * row * sizeof(T);    \
        for (int64_t t = 0; t < len; t++) {                                                 \
            if (t % bs == 0 && t / bs + PREFETCH_BLOCKS < nblocks)                          \
                prefetch_block(k_cache + table[t / bs + PREFETCH_BLOCKS] * bs * row,        \
                               block_bytes);                                                \
            const T *k = k_cache + ((int64_t)table[t / bs] * bs + t % bs) * row;            \
            for (int64_t i = 0; i < hq; i++) {                                              \
                const float *qi = q + i * D;                                                \
                const T *kh = k + (i / group) * D;                                          \
                float s = 0.0f;                                                             \
                for (int64_t d = 0; d < D; d++) s += qi[d] * LOAD(kh[d]);                   \
                s *= scale;                                                                 \
                scores[i * len + t] = s;                                                    \
                m[i] = s > m[i] ? s : m[i];                                                 \
            }                                                                               \
        }                                                                                   \
        for (int64_t i = 0; i < hq; i++) {                                                  \
            float *si = scores + i * len, mi = m[i], sum = 0.0f;                            \
            for (int64_t t = 0; t < len; t++) {                                             \
                float e = exp_nonpos(si[t] - mi);                                           \
                si[t] = e;                                                                  \
                sum += e;                                                                   \
            }                                                                               \
            l[i] = sum;                                                                     \
        }                                                                                   \
        memset(out, 0, (size_t)(hq * D) * sizeof(float));                                   \
        for (int64_t b = 0; b < PREFETCH_BLOCKS && b < nblocks; b++)                        \
            prefetch_block(v_cache + table[b] * bs * row, block_bytes);                     \
        for (int64_t t = 0; t < len; t++) {                                                 \
            if (t % bs == 0 && t / bs + PREFETCH_BLOCKS < nblocks)                          \
                prefetch_block(v_cache + table[t / bs + PREFETCH_BLOCKS] * bs * row,        \
                               block_bytes);                                                \
            const T *v = v_cache + ((int64_t)table[t / bs] * bs + t % bs) * row;            \
            for (int64_t i = 0; i < hq; i++) {                                              \
                const T *vh = v + (i / group) * D;                                          \
                float p = scores[i * len + t], *oi = out + i * D;                           \
                for (int64_t d = 0; d < D; d++) oi[d] += p * LOAD(vh[d]);                   \
            }                                                                               \
        }                                                                                   \
        for (int64_t i = 0; i < hq; i++) {                                                  \
            float inv = 1.0f / l[i], *oi = out + i * D;                                     \
            for (int64_t d = 0; d < D; d++) oi[d] *= inv;                                   \
            lse[i] = m[i] + logf(l[i]);                                                     \
        }                                                                                   \
    }                                                                                       \
                                                                                            \
    int NAME(const float *q, const T *k_cache, const T *v_cache,                            \
             const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,       \
             int64_t hq, int64_t hkv, int64_t D, int64_t bs, float scale,                   \
             int64_t seq_begin, int64_t seq_end, float *scores, float *out, float *lse) {   \
        if (hq > MAX_HEADS || hkv <= 0 || hq % hkv != 0) return -1;                         \
        for (int64_t b = seq_begin; b < seq_end; b++) {                                     \
            int64_t len = seq_lens[b];                                                      \
            const float *qb = q + b * hq * D;                                               \
            float *ob = out + b * hq * D, *lb = lse + b * hq;                               \
            const int32_t *table = block_tables + b * bt_stride;                            \
            if (len <= 0) {                                                                 \
                memset(ob, 0, (size_t)(hq * D) * sizeof(float));                            \
                for (int64_t i = 0; i < hq; i++) lb[i] = -INFINITY;                         \
            } else if (FAST(qb, k_cache, v_cache, table, len, hq, hkv, D, bs, scale, scores, \
                            ob, lb) == 0) {                                                 \
            } else if (D == 64) {                                                           \
                NAME##_seq(qb, k_cache, v_cache, table, len, hq, hkv, 64, bs, scale,        \
                           scores, ob, lb);                                                 \
            } else if (D == 128) {                                                          \
                NAME##_seq(qb, k_cache, v_cache, table, len, hq, hkv, 128, bs, scale,       \
                           scores, ob, lb);                                                 \
            } else {                                                                        \
                NAME##_seq(qb, k_cache, v_cache, table, len, hq, hkv, D, bs, scale,         \
                           scores, ob, lb);                                                 \
            }                                                                               \
        }                                                                                   \
        return 0;                                                                           \
    }

DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf16_to_f32, decode_bf16_avx512_seq)
DEFINE_KERNEL(paged_decode_f32, float, f32_load, no_fast_f32)
