/* Paged decode attention on the CPU, reading the KV cache in place.
 *
 * One query row per sequence (q_len == 1) attends to that sequence's first seq_lens[b]
 * keys, found through its block table: key t of sequence b is row
 *
 *     cache[block_tables[b * bt_stride + t / bs]][t % bs][h]     (h: the KV head)
 *
 * of a cache laid out [num_blocks][bs][Hkv][D] (K and V each; protocol/kv_layout.py).
 * The G = Hq / Hkv query heads of one KV head share every key and value row read (GQA),
 * so each row of the cache is read once per step. Per (sequence, KV head), three passes
 * over the sequence's keys:
 *
 *     1. s[g][t] = scale * <q[g], k_t>           (float32, into `scores`)
 *     2. m[g] = max_t s, p = exp(s - m), l[g] = sum_t p
 *     3. out[g] = sum_t p[g][t] v_t / l[g],  lse[g] = m[g] + log(l[g])
 *
 * A call runs the work items [item_begin, item_end) of the step, item b * Hkv + h being
 * (sequence b, KV head h): callers split a step across threads, each thread with its own
 * `scores` scratch of at least G * max(seq_lens) floats. q, out: [B][Hq][D] float32
 * (query head h * G + g reads KV head h); lse: [B][Hq] float32, natural log.
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

#define MAX_GROUP 64

#define DEFINE_KERNEL(NAME, T, LOAD)                                                        \
    static inline void NAME##_head(                                                         \
        const float *q, const T *k_cache, const T *v_cache, const int32_t *table,           \
        int64_t len, int64_t group, int64_t hkv, int64_t h, int64_t D, int64_t bs,          \
        float scale, float *scores, float *out, float *lse) {                               \
        const int64_t row = hkv * D; /* elements per token of one cache part */             \
        float m[MAX_GROUP], l[MAX_GROUP];                                                   \
        for (int64_t g = 0; g < group; g++) m[g] = -INFINITY;                               \
        for (int64_t t = 0; t < len; t++) {                                                 \
            const T *k = k_cache + ((int64_t)table[t / bs] * bs + t % bs) * row + h * D;    \
            for (int64_t g = 0; g < group; g++) {                                           \
                const float *qg = q + g * D;                                                \
                float s = 0.0f;                                                             \
                for (int64_t d = 0; d < D; d++) s += qg[d] * LOAD(k[d]);                    \
                s *= scale;                                                                 \
                scores[g * len + t] = s;                                                    \
                m[g] = s > m[g] ? s : m[g];                                                 \
            }                                                                               \
        }                                                                                   \
        for (int64_t g = 0; g < group; g++) {                                               \
            float *sg = scores + g * len, mg = m[g], sum = 0.0f;                            \
            for (int64_t t = 0; t < len; t++) {                                             \
                float e = exp_nonpos(sg[t] - mg);                                           \
                sg[t] = e;                                                                  \
                sum += e;                                                                   \
            }                                                                               \
            l[g] = sum;                                                                     \
            memset(out + g * D, 0, (size_t)D * sizeof(float));                              \
        }                                                                                   \
        for (int64_t t = 0; t < len; t++) {                                                 \
            const T *v = v_cache + ((int64_t)table[t / bs] * bs + t % bs) * row + h * D;    \
            for (int64_t g = 0; g < group; g++) {                                           \
                float p = scores[g * len + t], *og = out + g * D;                           \
                for (int64_t d = 0; d < D; d++) og[d] += p * LOAD(v[d]);                    \
            }                                                                               \
        }                                                                                   \
        for (int64_t g = 0; g < group; g++) {                                               \
            float inv = 1.0f / l[g], *og = out + g * D;                                     \
            for (int64_t d = 0; d < D; d++) og[d] *= inv;                                   \
            lse[g] = m[g] + logf(l[g]);                                                     \
        }                                                                                   \
    }                                                                                       \
                                                                                            \
    int NAME(const float *q, const T *k_cache, const T *v_cache,                            \
             const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,       \
             int64_t hq, int64_t hkv, int64_t D, int64_t bs, float scale,                   \
             int64_t item_begin, int64_t item_end, float *scores, float *out, float *lse) { \
        int64_t group = hq / hkv;                                                           \
        if (group > MAX_GROUP || group * hkv != hq) return -1;                              \
        for (int64_t item = item_begin; item < item_end; item++) {                          \
            int64_t b = item / hkv, h = item % hkv, len = seq_lens[b];                      \
            {                                                                               \
                const float *qh = q + (b * hq + h * group) * D;                             \
                float *oh = out + (b * hq + h * group) * D, *lh = lse + b * hq + h * group; \
                if (len <= 0) {                                                             \
                    memset(oh, 0, (size_t)(group * D) * sizeof(float));                     \
                    for (int64_t g = 0; g < group; g++) lh[g] = -INFINITY;                  \
                    continue;                                                               \
                }                                                                           \
                if (D == 64)                                                                \
                    NAME##_head(qh, k_cache, v_cache, block_tables + b * bt_stride, len,    \
                                group, hkv, h, 64, bs, scale, scores, oh, lh);              \
                else if (D == 128)                                                          \
                    NAME##_head(qh, k_cache, v_cache, block_tables + b * bt_stride, len,    \
                                group, hkv, h, 128, bs, scale, scores, oh, lh);             \
                else                                                                        \
                    NAME##_head(qh, k_cache, v_cache, block_tables + b * bt_stride, len,    \
                                group, hkv, h, D, bs, scale, scores, oh, lh);               \
            }                                                                               \
        }                                                                                   \
        return 0;                                                                           \
    }

DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf16_to_f32)
DEFINE_KERNEL(paged_decode_f32, float, f32_load)
