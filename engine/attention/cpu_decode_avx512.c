/* Paged decode attention over a bfloat16 KV cache with AVX-512: one pass over the keys.
 *
 * The same contract as cpu_decode.c's per-sequence kernel (one query row per sequence,
 * its first `len` keys through its block table, out and natural-log lse in float32), for
 * head dims that are a multiple of 32 on CPUs with AVX-512F; decode_bf16_avx512_seq
 * returns -1 where it does not apply and the portable three-pass kernel runs instead.
 *
 * Why a second kernel: the portable one reduces every (token, head) dot product
 * horizontally, writes all scores to a scratch row and reads the cache twice in two
 * passes, which left decode attention at ~7 GB/s of KV on one core where the memory
 * system gives ~30 (docs/benchmarks.md). Here the keys go by in tiles of 16 tokens, K and
 * V of a tile read back to back, with an online softmax (running max and sum per query
 * head, the output rescaled when the max moves):
 *
 *     for each tile of 16 keys, each KV head h, each query head i of h's group:
 *         s[0..16) = scale * q_i . k_t        16 dot products, reduced together
 *         m' = max(m, max s); p = exp(s - m'); l = l * exp(m - m') + sum p
 *         o_i = o_i * exp(m - m') + sum_t p[t] v_t
 *     out = o / l, lse = m + log l
 *
 * A bf16 row widens exactly and without shuffles by splitting each 32-bit lane: the
 * even element is the lane shifted left 16 bits, the odd one the lane with its low half
 * cleared. Dims are then visited in the order (0, 2, .., 30, 1, 3, .., 31) per 32: the
 * query is permuted into that order once per sequence and the output permuted back once,
 * so nothing per token pays for it. The 16 dot products of a tile end as 16 vectors of
 * partial sums, reduced into one vector of 16 scores by a transpose-and-add tree (about
 * 3 instructions per score instead of a horizontal reduction each).
 *
 * Everything accumulates in float32, as in the portable kernel; the result differs from
 * it only in rounding (summation order). `scratch` (the caller's scores scratch, at least
 * hq * D floats) holds the permuted query. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#define TILE 16
#define MAX_D 256
#define HEAD_CHUNK 8 /* query heads of one KV head whose tile scores are kept at once */
#define MAX_Q_HEADS 256
#define PREFETCH_TOKENS 48

/* exp(x) for x <= 0, -inf included (0): cpu_decode.c's exp_nonpos, 16 lanes. */
static inline __m512 exp16_nonpos(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    __m512 xc = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    return _mm512_maskz_mov_ps((__mmask16)~under, e);
}

/* One vector of 16 sums: lane t = the sum of acc[t]'s 16 lanes. */
static inline __m512 sum16(const float *acc /* [16][16] */) {
    __m512 r[8], t[4];
    for (int j = 0; j < 8; j++) {
        __m512 a = _mm512_loadu_ps(acc + 32 * j), b = _mm512_loadu_ps(acc + 32 * j + 16);
        /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        r[j] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    for (int k = 0; k < 4; k++) {
        __m512d x = _mm512_castps_pd(r[2 * k]), y = _mm512_castps_pd(r[2 * k + 1]);
        /* per 128-bit lane: tokens 4k .. 4k+3, each summed over that lane's 4 floats */
        t[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(t[2], t[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v01, v23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* 32 bf16 at p as 16 floats of the even elements and 16 of the odd ones. */
static inline void widen32(const uint16_t *p, __m512 *even, __m512 *odd) {
    __m512i x = _mm512_loadu_si512((const void *)p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline void prefetch_row(const uint16_t *row, int64_t bytes) {
    const char *p = (const char *)row;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

static inline __attribute__((always_inline)) void seq_kernel(
    const float *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
    int64_t len, int64_t hq, int64_t hkv, const int64_t D, int64_t bs, float scale,
    float *qp, float *out, float *lse) {
    const int64_t group = hq / hkv, row = hkv * D, nv = D / 16;
    float acc[HEAD_CHUNK][TILE * 16] __attribute__((aligned(64)));
    float pt[HEAD_CHUNK][TILE] __attribute__((aligned(64)));
    float vf[TILE][MAX_D] __attribute__((aligned(64)));
    float alpha[HEAD_CHUNK], m[MAX_Q_HEADS], l[MAX_Q_HEADS];
    const uint16_t *krow[TILE], *vrow[TILE];
    /* the query in the widened order; the output accumulates in it too */
    for (int64_t i = 0; i < hq; i++)
        for (int64_t c = 0; c < D; c += 32)
            for (int64_t j = 0; j < 16; j++) {
                qp[i * D + c + j] = q[i * D + c + 2 * j];
                qp[i * D + c + 16 + j] = q[i * D + c + 2 * j + 1];
            }
    for (int64_t i = 0; i < hq; i++) m[i] = -INFINITY, l[i] = 0.0f;
    memset(out, 0, (size_t)(hq * D) * sizeof(float));
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        for (int64_t t = 0; t < n; t++) {
            int64_t off = ((int64_t)table[(t0 + t) / bs] * bs + (t0 + t) % bs) * row;
            krow[t] = k_cache + off;
            vrow[t] = v_cache + off;
            int64_t ahead = t0 + t + PREFETCH_TOKENS;
            if (ahead < len) {
                int64_t aoff = ((int64_t)table[ahead / bs] * bs + ahead % bs) * row;
                prefetch_row(k_cache + aoff, row * 2);
                prefetch_row(v_cache + aoff, row * 2);
            }
        }
        for (int64_t h = 0; h < hkv; h++) {
            for (int64_t i0 = 0; i0 < group; i0 += HEAD_CHUNK) {
                const int64_t gi = group - i0 < HEAD_CHUNK ? group - i0 : HEAD_CHUNK;
                const int64_t first = h * group + i0; /* this chunk's first query head */
                /* scores: per token, its K row widened once for the chunk's heads */
                for (int64_t t = 0; t < TILE; t++) {
                    if (t >= n) {
                        for (int64_t ii = 0; ii < gi; ii++)
                            _mm512_store_ps(acc[ii] + 16 * t, _mm512_setzero_ps());
                        continue;
                    }
                    __m512 kw[MAX_D / 16];
                    for (int64_t c = 0; c < nv; c += 2)
                        widen32(krow[t] + h * D + 16 * c, &kw[c], &kw[c + 1]);
                    for (int64_t ii = 0; ii < gi; ii++) {
                        const float *qi = qp + (first + ii) * D;
                        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qi), kw[0]);
                        for (int64_t c = 1; c < nv; c++)
                            a = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * c), kw[c], a);
                        _mm512_store_ps(acc[ii] + 16 * t, a);
                    }
                }
                const __mmask16 valid = (__mmask16)((1u << n) - 1u);
                for (int64_t ii = 0; ii < gi; ii++) {
                    const int64_t i = first + ii;
                    __m512 s = _mm512_mul_ps(sum16(acc[ii]), vscale);
                    s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
                    float mt = _mm512_reduce_max_ps(s), mn = mt > m[i] ? mt : m[i];
                    __m512 p = exp16_nonpos(_mm512_sub_ps(s, _mm512_set1_ps(mn)));
                    /* exp(m - m'): 0 on the first tile (m = -inf) */
                    float a = _mm512_cvtss_f32(
                        exp16_nonpos(_mm512_set1_ps(m[i] == -INFINITY ? -INFINITY : m[i] - mn)));
                    l[i] = l[i] * a + _mm512_reduce_add_ps(p);
                    m[i] = mn;
                    alpha[ii] = a;
                    _mm512_store_ps(pt[ii], p);
                }
                /* values: the tile's V rows of head h widened once (for the first chunk) */
                if (i0 == 0)
                    for (int64_t t = 0; t < n; t++)
                        for (int64_t c = 0; c < nv; c += 2) {
                            __m512 e, o;
                            widen32(vrow[t] + h * D + 16 * c, &e, &o);
                            _mm512_store_ps(vf[t] + 16 * c, e);
                            _mm512_store_ps(vf[t] + 16 * c + 16, o);
                        }
                for (int64_t ii = 0; ii < gi; ii++) {
                    float *oi = out + (first + ii) * D;
                    const __m512 va = _mm512_set1_ps(alpha[ii]);
                    __m512 o[MAX_D / 16];
                    for (int64_t c = 0; c < nv; c++)
                        o[c] = _mm512_mul_ps(_mm512_loadu_ps(oi + 16 * c), va);
                    for (int64_t t = 0; t < n; t++) {
                        const __m512 pv = _mm512_set1_ps(pt[ii][t]);
                        for (int64_t c = 0; c < nv; c++)
                            o[c] = _mm512_fmadd_ps(pv, _mm512_load_ps(vf[t] + 16 * c), o[c]);
                    }
                    for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(oi + 16 * c, o[c]);
                }
            }
        }
    }
    /* out / l, back in the natural order of dims */
    for (int64_t i = 0; i < hq; i++) {
        float *oi = out + i * D, tmp[MAX_D], inv = 1.0f / l[i];
        memcpy(tmp, oi, (size_t)D * sizeof(float));
        for (int64_t c = 0; c < D; c += 32)
            for (int64_t j = 0; j < 16; j++) {
                oi[c + 2 * j] = tmp[c + j] * inv;
                oi[c + 2 * j + 1] = tmp[c + 16 + j] * inv;
            }
        lse[i] = m[i] + logf(l[i]);
    }
}

int decode_bf16_avx512_seq(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int32_t *table, int64_t len, int64_t hq, int64_t hkv,
                           int64_t D, int64_t bs, float scale, float *scratch, float *out,
                           float *lse) {
    if (len <= 0 || D % 32 != 0 || D > MAX_D || hq > MAX_Q_HEADS || hkv <= 0 || hq % hkv)
        return -1;
    if (D == 64)
        seq_kernel(q, k_cache, v_cache, table, len, hq, hkv, 64, bs, scale, scratch, out, lse);
    else if (D == 128)
        seq_kernel(q, k_cache, v_cache, table, len, hq, hkv, 128, bs, scale, scratch, out, lse);
    else
        seq_kernel(q, k_cache, v_cache, table, len, hq, hkv, D, bs, scale, scratch, out, lse);
    return 0;
}

#else /* no AVX-512: the portable kernel runs */

int decode_bf16_avx512_seq(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int32_t *table, int64_t len, int64_t hq, int64_t hkv,
                           int64_t D, int64_t bs, float scale, float *scratch, float *out,
                           float *lse) {
    (void)q, (void)k_cache, (void)v_cache, (void)table, (void)len, (void)hq, (void)hkv;
    (void)D, (void)bs, (void)scale, (void)scratch, (void)out, (void)lse;
    return -1;
}

#endif
