/* Paged prefill attention on the CPU, reading the KV cache in place.
 *
 * A prefill sequence has q_len new tokens behind ctx = seq_len - q_len cached ones; all
 * seq_len keys (the new tokens' own included) are already in the cache, key t of the
 * sequence at row
 *
 *     cache[block_tables[row_b * bt_stride + t / bs]][t % bs][h]      (h: the KV head)
 *
 * of a cache laid out [num_blocks][bs][Hkv][D] (K and V each; protocol/kv_layout.py).
 * New token j (position ctx + j) attends to keys 0 ..= ctx + j (lower-right causal).
 *
 * Work unit: one KV head h of one sequence and ROWS (two vectors: 32 with AVX-512, 16 with
 * AVX2) of its "rows", a row being a (new token, query head of h) pair, token-major: the
 * G = Hq / Hkv query heads of h read the same keys, so every K and V row read serves up
 * to ROWS rows (GQA-shared reads). The rows sit in vector lanes, which makes the softmax
 * lane-wise:
 *
 *     Qt[d][row]   the unit's queries, transposed once per unit
 *     per tile of KT = 16 keys (flash attention, online softmax):
 *        S[key][row] = scale * sum_d K[key][d] * Qt[d][row]   (K broadcast, Q a vector)
 *        masked to -inf where key > the row's position
 *        m' = max(m, max_key S), alpha = exp(m - m'), P = exp(S - m'), l = alpha l + sum P
 *        Ot[d][row] = alpha Ot[d][row] + sum_key V[key][d] * P[key][row]
 *     out[row] = Ot[.][row] / l,  lse[row] = m + log(l)
 *
 * so no horizontal reductions and no transposes of K or V. Float32 rows are read
 * straight from the cache; bf16 rows widen exactly (a 16-bit shift) into a small tile
 * buffer once per unit and tile, except where the CPU has a bf16 dot product
 * (AVX512-BF16) and D is a multiple of 8: there both products take dims (S) or keys
 * (Ot) in pairs, the queries and probabilities rounded to bf16 (exact for a bf16 model's
 * queries; SDPA's CPU flash kernel rounds the probabilities alike in bf16), twice the
 * arithmetic per instruction. Everything accumulates in float32.
 *
 * A call runs the units u with u % num_jobs == job (interleaved: a sequence's later
 * rows see more keys, and interleaving spreads them over the jobs), up to BATCH units of
 * one head together, a chunk of CHUNK keys at a time (the chunk stays in L2 for them). q, out: [T][Hq][D]
 * float32 (rows of the flat step; only the listed sequences' rows are written); lse:
 * [T][Hq] float32, natural log. seqs: [num_seqs][4] int32 (first query row, q_len,
 * seq_len, block table row). scratch: at least prefill_scratch_floats(D) floats.
 * Built by engine/attention/cpu_kernel.py into the same library as cpu_decode.c.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Vectors of the machine's width (a wider generic vector would be split and spilled):
 * LANES floats each, and KG keys x RV row vectors of score accumulators at a time, which
 * with the two query vectors and a broadcast key fit the register file (32 zmm, 16 ymm
 * or xmm). */
#if defined(__AVX512F__)
#define LANES 16
#define KG 8
#elif defined(__AVX__)
#define LANES 8
#define KG 4
#else
#define LANES 4
#define KG 4
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
/* Loads and stores of vectors at 4-byte alignment (scratch and cache rows). */
typedef float vfu __attribute__((vector_size(LANES * 4), aligned(4)));

#define RV 2 /* row vectors per unit */
#define ROWS (RV * LANES)
#define KT 16 /* keys per tile */
#define MAX_D 256
#define DCH 8 /* head dims per register block of the P.V step */

static inline vf vload(const float *p) { return *(const vfu *)p; }
static inline void vstore(float *p, vf x) { *(vfu *)p = x; }

static inline vf vselect(vi mask, vf a, vf b) { /* mask ? a : b, lane-wise */
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

/* exp(x) for x <= 0 lane-wise (also -inf -> 0): the decode kernel's range reduction and
 * polynomial (cpu_decode.c, exp_nonpos), rounding n by truncating t - 0.5 (t <= 0). */
static inline vf vexp_nonpos(vf x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    vi tiny = x < -87.0f;
    vf xc = vselect(tiny, (vf){} - 87.0f, x);
    vi n = __builtin_convertvector(xc * log2e - 0.5f, vi);
    vf nf = __builtin_convertvector(n, vf);
    vf r = xc - nf * ln2_hi - nf * ln2_lo;
    vf p = (vf){} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vf two_n = (vf)((n + 127) << 23);
    return (vf)((vi)(p * two_n) & ~tiny);
}

int64_t prefill_rows_per_unit(void) { return ROWS; }

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A tile's rows as float32: bf16 rows widen into `buf`; float32 rows are used in place. */
static inline const float *row_bf16(const uint16_t *src, float *buf, int64_t D) {
    for (int64_t d = 0; d < D; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}
static inline const float *row_f32(const float *src, float *buf, int64_t D) {
    (void)buf;
    (void)D;
    return src;
}

/* S[v][j] = <Qt[.][rows of vector v], key row j> for a tile: keys broadcast, rows in lanes;
 * two row vectors x KG keys of accumulators at a time. */
static inline void scores_f32(const float *qt, const float *const *kr, int64_t D,
                              vf s[RV][KT]) {
    for (int jh = 0; jh < KT; jh += KG) {
        vf a0[KG], a1[KG];
        _Pragma("GCC unroll 8") for (int j = 0; j < KG; j++) {
            a0[j] = (vf){};
            a1[j] = (vf){};
        }
        for (int64_t d = 0; d < D; d++) {
            vf q0 = vload(qt + d * ROWS), q1 = vload(qt + d * ROWS + LANES);
            _Pragma("GCC unroll 8") for (int j = 0; j < KG; j++) {
                float kd = kr[jh + j][d];
                a0[j] += q0 * kd;
                a1[j] += q1 * kd;
            }
        }
        _Pragma("GCC unroll 8") for (int j = 0; j < KG; j++) {
            s[0][jh + j] = a0[j];
            s[1][jh + j] = a1[j];
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
/* The same over bf16 rows with the CPU's bf16 dot product (AVX512-BF16): each lane takes
 * the products of a pair of dims (exact in float32) and adds them to its float32 sum, so
 * one instruction does two dims, and key rows are read as they sit in the cache. qp:
 * [D / 2][ROWS] pairs of the queries rounded to bf16 (exact for a bf16 model's queries). */
static inline void scores_bf16_dot(const uint32_t *qp, const uint32_t *const *kr, int64_t D,
                                   vf s[RV][KT]) {
    for (int jh = 0; jh < KT; jh += KT / 2) {
        __m512 a0[KT / 2], a1[KT / 2];
        _Pragma("GCC unroll 8") for (int j = 0; j < KT / 2; j++) {
            a0[j] = _mm512_setzero_ps();
            a1[j] = _mm512_setzero_ps();
        }
        for (int64_t d2 = 0; d2 < D / 2; d2++) {
            __m512bh q0 = (__m512bh)_mm512_loadu_si512(qp + d2 * ROWS);
            __m512bh q1 = (__m512bh)_mm512_loadu_si512(qp + d2 * ROWS + LANES);
            _Pragma("GCC unroll 8") for (int j = 0; j < KT / 2; j++) {
                __m512bh kd = (__m512bh)_mm512_set1_epi32((int)kr[jh + j][d2]);
                a0[j] = _mm512_dpbf16_ps(a0[j], q0, kd);
                a1[j] = _mm512_dpbf16_ps(a1[j], q1, kd);
            }
        }
        _Pragma("GCC unroll 8") for (int j = 0; j < KT / 2; j++) {
            s[0][jh + j] = (vf)a0[j];
            s[1][jh + j] = (vf)a1[j];
        }
    }
}

/* Ot[d][rows of vector v] = alpha Ot + sum_key V[key][d] P[key][rows], the keys in pairs
 * with the bf16 dot product: the probabilities rounded to bf16 (as SDPA's CPU flash
 * kernel rounds them for its second product in bf16), a pair of keys' values of one dim
 * broadcast. vr: the tile's KT bf16 value rows; vpair: scratch of KT / 2 * D pairs. */
static inline void values_bf16_dot(float *ot, const float *pbuf, const uint16_t *const *vr,
                                   int64_t D, const vf *alpha, uint32_t *vpair) {
    for (int jp = 0; jp < KT / 2; jp++) {
        const uint16_t *a = vr[2 * jp], *b = vr[2 * jp + 1];
        for (int64_t d = 0; d < D; d++) vpair[jp * D + d] = a[d] | (uint32_t)b[d] << 16;
    }
    for (int v = 0; v < RV; v++) {
        __m512i pp[KT / 2];
        _Pragma("GCC unroll 8") for (int jp = 0; jp < KT / 2; jp++) {
            __m512 p0 = _mm512_loadu_ps(pbuf + 2 * jp * ROWS + v * LANES);
            __m512 p1 = _mm512_loadu_ps(pbuf + (2 * jp + 1) * ROWS + v * LANES);
            __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p0));
            __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p1));
            pp[jp] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
        }
        for (int64_t d0 = 0; d0 + DCH <= D; d0 += DCH) {
            __m512 acc[DCH];
            _Pragma("GCC unroll 8") for (int e = 0; e < DCH; e++) acc[e] =
                (__m512)(vload(ot + (d0 + e) * ROWS + v * LANES) * alpha[v]);
            _Pragma("GCC unroll 8") for (int jp = 0; jp < KT / 2; jp++) {
                const uint32_t *vp = vpair + jp * D + d0;
                _Pragma("GCC unroll 8") for (int e = 0; e < DCH; e++) acc[e] =
                    _mm512_dpbf16_ps(acc[e], (__m512bh)pp[jp], (__m512bh)_mm512_set1_epi32(vp[e]));
            }
            _Pragma("GCC unroll 8") for (int e = 0; e < DCH; e++)
                _mm512_storeu_ps(ot + (d0 + e) * ROWS + v * LANES, acc[e]);
        }
    }
}
#else
#define HAVE_BF16_DOT 0
static inline void scores_bf16_dot(const uint32_t *qp, const uint32_t *const *kr, int64_t D,
                                   vf s[RV][KT]) {
    (void)qp, (void)kr, (void)D, (void)s;
}
static inline void values_bf16_dot(float *ot, const float *pbuf, const uint16_t *const *vr,
                                   int64_t D, const vf *alpha, uint32_t *vpair) {
    (void)ot, (void)pbuf, (void)vr, (void)D, (void)alpha, (void)vpair;
}
#endif

static inline uint16_t f32_to_bf16(float x) { /* round to nearest even (finite x) */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* One work unit's state: its queries and output accumulators, transposed, and per row
 * vector the running max and sum and the rows' positions. */
typedef struct {
    vf m[RV], l[RV], pos[RV];
    float first[RV]; /* each row vector's smallest position */
    float *qt, *ot;  /* [D][ROWS] each; qt holds bf16 pairs [D / 2][ROWS] when dot */
    int64_t r0, nrows, last; /* first row, rows, the last row's position */
} unit_t;

/* A tile's KT key and value rows: float32 (in the cache or widened into a buffer), or
 * as they sit in the cache in bf16 when dot. */
typedef struct {
    const float *kr[KT], *vr[KT];
    const uint32_t *kp[KT];
    const uint16_t *vraw[KT];
} tile_t;

static inline __attribute__((always_inline)) void unit_begin(
    unit_t *u, const float *q, int64_t q_start, int64_t q_len, int64_t ctx, int64_t h,
    int64_t r0, int64_t hq, int64_t group, int64_t D, int dot, float *qt, float *ot) {
    u->qt = qt, u->ot = ot, u->r0 = r0;
    u->nrows = q_len * group - r0 < ROWS ? q_len * group - r0 : ROWS;
    u->last = ctx + (r0 + u->nrows - 1) / group;
    uint32_t *qp = (uint32_t *)qt;
    float posf[ROWS];
    for (int64_t r = 0; r < ROWS; r++) {
        int64_t rr = r < u->nrows ? r0 + r : r0 + u->nrows - 1, tok = rr / group;
        const float *qr = q + ((q_start + tok) * hq + h * group + rr % group) * D;
        if (dot)
            for (int64_t d = 0; d < D; d += 2)
                qp[d / 2 * ROWS + r] =
                    r < u->nrows ? f32_to_bf16(qr[d]) | (uint32_t)f32_to_bf16(qr[d + 1]) << 16
                                 : 0;
        else
            for (int64_t d = 0; d < D; d++) qt[d * ROWS + r] = r < u->nrows ? qr[d] : 0.0f;
        posf[r] = (float)(ctx + tok);
    }
    memset(ot, 0, (size_t)(D * ROWS) * sizeof(float));
    for (int v = 0; v < RV; v++) {
        u->m[v] = (vf){} - INFINITY;
        u->l[v] = (vf){};
        u->pos[v] = vload(posf + v * LANES);
        u->first[v] = posf[v * LANES];
    }
}

/* The online-softmax step of one unit over one tile of keys k0 .. k0 + KT - 1. */
static inline __attribute__((always_inline)) void unit_tile(
    unit_t *u, const tile_t *t, int64_t k0, int64_t D, float scale, int dot, float *pbuf,
    uint32_t *vpair) {
    vf s[RV][KT];
    if (dot)
        scores_bf16_dot((const uint32_t *)u->qt, t->kp, D, s);
    else
        scores_f32(u->qt, t->kr, D, s);
    vf alpha[RV];
    for (int v = 0; v < RV; v++) {
        for (int j = 0; j < KT; j++) s[v][j] *= scale;
        if ((float)(k0 + KT - 1) > u->first[v]) /* the diagonal: some keys masked */
            for (int j = 0; j < KT; j++)
                s[v][j] = vselect((vf){} + (float)(k0 + j) > u->pos[v], (vf){} - INFINITY,
                                  s[v][j]);
        vf mx = s[v][0];
        for (int j = 1; j < KT; j++) mx = vmax(mx, s[v][j]);
        vf mn = vmax(u->m[v], mx), sum = (vf){};
        alpha[v] = vexp_nonpos(u->m[v] - mn);
        for (int j = 0; j < KT; j++) {
            vf p = vexp_nonpos(s[v][j] - mn);
            vstore(pbuf + j * ROWS + v * LANES, p);
            sum += p;
        }
        u->l[v] = u->l[v] * alpha[v] + sum;
        u->m[v] = mn;
    }
    float *ot = u->ot;
    if (dot) {
        values_bf16_dot(ot, pbuf, t->vraw, D, alpha, vpair);
        return;
    }
    for (int v = 0; v < RV; v++) {
        for (int64_t d0 = 0; d0 + DCH <= D; d0 += DCH) {
            vf acc[DCH];
            _Pragma("GCC unroll 8") for (int e = 0; e < DCH; e++) acc[e] =
                vload(ot + (d0 + e) * ROWS + v * LANES) * alpha[v];
            for (int j = 0; j < KT; j++) {
                vf p = vload(pbuf + j * ROWS + v * LANES);
                const float *vj = t->vr[j] + d0;
                _Pragma("GCC unroll 8") for (int e = 0; e < DCH; e++) acc[e] += p * vj[e];
            }
            _Pragma("GCC unroll 8") for (int e = 0; e < DCH; e++)
                vstore(ot + (d0 + e) * ROWS + v * LANES, acc[e]);
        }
        for (int64_t d = D - D % DCH; d < D; d++) { /* D not a multiple of DCH */
            vf acc = vload(ot + d * ROWS + v * LANES) * alpha[v];
            for (int j = 0; j < KT; j++)
                acc += vload(pbuf + j * ROWS + v * LANES) * t->vr[j][d];
            vstore(ot + d * ROWS + v * LANES, acc);
        }
    }
}

static inline void unit_end(const unit_t *u, int64_t q_start, int64_t h, int64_t hq,
                            int64_t group, int64_t D, float *out, float *lse) {
    float lf[ROWS], mf[ROWS];
    for (int v = 0; v < RV; v++) {
        vstore(lf + v * LANES, u->l[v]);
        vstore(mf + v * LANES, u->m[v]);
    }
    for (int64_t r = 0; r < u->nrows; r++) {
        int64_t rr = u->r0 + r, tok = rr / group, head = h * group + rr % group;
        float inv = 1.0f / lf[r], *o = out + ((q_start + tok) * hq + head) * D;
        for (int64_t d = 0; d < D; d++) o[d] = u->ot[d * ROWS + r] * inv;
        lse[(q_start + tok) * hq + head] = mf[r] + logf(lf[r]);
    }
}

#define BATCH 8
/* Units run together over the keys, a chunk of CHUNK keys at a time: the chunk's K and V
 * rows of one head (64 KB at D = 64 in float32) stay in the core's L2 while every unit
 * of the batch reads them, where one unit after another would each stream the whole
 * head's KV from memory (3.3 MB at 6K keys in float32). */
#define CHUNK 128

/* The rows of tile k0 (bf16 rows widened into kbuf / vbuf unless dot; keys past the
 * sequence read a zero row: masked, and 0 * 0 keeps NaN out). */
#define DEFINE_TILE_ROWS(NAME, T, ROW)                                                      \
    static inline __attribute__((always_inline)) void NAME##_tile_rows(                     \
        tile_t *t, const T *k_cache, const T *v_cache, const int32_t *table, int64_t k0,    \
        int64_t seq_len, int64_t h, int64_t row, int64_t D, int64_t bs, int dot,            \
        float *kbuf, float *vbuf, const float *zero) {                                      \
        for (int j = 0; j < KT; j++) {                                                      \
            int64_t p = k0 + j;                                                             \
            if (p >= seq_len) {                                                             \
                t->kr[j] = t->vr[j] = zero;                                                 \
                t->kp[j] = (const uint32_t *)zero;                                          \
                t->vraw[j] = (const uint16_t *)zero;                                        \
                continue;                                                                   \
            }                                                                               \
            int64_t at = ((int64_t)table[p / bs] * bs + p % bs) * row + h * D;              \
            if (dot) {                                                                      \
                t->kp[j] = (const uint32_t *)(k_cache + at);                                \
                t->vraw[j] = (const uint16_t *)(v_cache + at);                              \
            } else {                                                                        \
                t->kr[j] = ROW(k_cache + at, kbuf + j * D, D);                              \
                t->vr[j] = ROW(v_cache + at, vbuf + j * D, D);                              \
            }                                                                               \
        }                                                                                   \
    }

DEFINE_TILE_ROWS(bf16, uint16_t, row_bf16)
DEFINE_TILE_ROWS(f32, float, row_f32)

int64_t prefill_scratch_floats(int64_t D) {
    /* per unit of a batch Qt and Ot [D][ROWS]; two tiles [KT][D], P [KT][ROWS], a zero
     * row, alignment */
    return BATCH * 2 * D * ROWS + 2 * KT * D + KT * ROWS + D + LANES;
}

#define DEFINE_PREFILL(NAME, TR, T, DOT)                                                    \
    static inline __attribute__((always_inline)) void NAME##_batch(                         \
        const int64_t *r0s, int n, const float *q, const T *k_cache, const T *v_cache,      \
        const int32_t *table, int64_t q_start, int64_t q_len, int64_t seq_len, int64_t h,   \
        int64_t hq, int64_t hkv, int64_t D, int64_t bs, float scale, float *sc,             \
        float *out, float *lse) {                                                           \
        const int64_t group = hq / hkv, ctx = seq_len - q_len;                              \
        const int dot = DOT && D % DCH == 0;                                                \
        float *kbuf = sc + BATCH * 2 * D * ROWS, *vbuf = kbuf + KT * D;                     \
        float *pbuf = vbuf + KT * D, *zero = pbuf + KT * ROWS;                              \
        memset(zero, 0, (size_t)D * sizeof(float));                                         \
        unit_t units[BATCH];                                                                \
        int64_t last = 0;                                                                   \
        for (int i = 0; i < n; i++) {                                                       \
            float *qt = sc + i * 2 * D * ROWS;                                              \
            unit_begin(&units[i], q, q_start, q_len, ctx, h, r0s[i], hq, group, D, dot, qt, \
                       qt + D * ROWS);                                                      \
            last = units[i].last > last ? units[i].last : last;                             \
        }                                                                                   \
        tile_t t;                                                                           \
        for (int64_t c0 = 0; c0 <= last; c0 += CHUNK)                                       \
            for (int i = 0; i < n; i++)                                                     \
                for (int64_t k0 = c0; k0 < c0 + CHUNK && k0 <= units[i].last; k0 += KT) {  \
                    TR##_tile_rows(&t, k_cache, v_cache, table, k0, seq_len, h, hkv * D, D, \
                                   bs, dot, kbuf, vbuf, zero);                              \
                    unit_tile(&units[i], &t, k0, D, scale, dot, pbuf, (uint32_t *)kbuf);    \
                }                                                                           \
        for (int i = 0; i < n; i++) unit_end(&units[i], q_start, h, hq, group, D, out, lse); \
    }                                                                                       \
                                                                                            \
    int NAME(const float *q, const T *k_cache, const T *v_cache,                            \
             const int32_t *block_tables, int64_t bt_stride, const int32_t *seqs,           \
             int64_t num_seqs, int64_t hq, int64_t hkv, int64_t D, int64_t bs, float scale, \
             int64_t job, int64_t num_jobs, float *scratch, float *out, float *lse) {       \
        if (hkv <= 0 || hq % hkv != 0 || D <= 0 || D > MAX_D) return -1;                   \
        /* vectors of the scratch on 64-byte boundaries */                                  \
        float *sc = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);                  \
        const int64_t group = hq / hkv;                                                     \
        int64_t u = 0, r0s[BATCH];                                                          \
        for (int64_t i = 0; i < num_seqs; i++) {                                            \
            const int32_t *s = seqs + 4 * i;                                                \
            const int32_t *table = block_tables + (int64_t)s[3] * bt_stride;                \
            const int64_t nrows = (int64_t)s[1] * group;                                    \
            for (int64_t h = 0; h < hkv; h++) {                                             \
                int n = 0;                                                                  \
                for (int64_t r0 = 0; r0 < nrows; r0 += ROWS, u++) {                         \
                    if (u % num_jobs == job) r0s[n++] = r0;                                 \
                    if (n < BATCH && r0 + ROWS < nrows) continue;                           \
                    if (n == 0) continue;                                                   \
                    if (D == 64)                                                            \
                        NAME##_batch(r0s, n, q, k_cache, v_cache, table, s[0], s[1], s[2],  \
                                     h, hq, hkv, 64, bs, scale, sc, out, lse);              \
                    else if (D == 128)                                                      \
                        NAME##_batch(r0s, n, q, k_cache, v_cache, table, s[0], s[1], s[2],  \
                                     h, hq, hkv, 128, bs, scale, sc, out, lse);             \
                    else                                                                    \
                        NAME##_batch(r0s, n, q, k_cache, v_cache, table, s[0], s[1], s[2],  \
                                     h, hq, hkv, D, bs, scale, sc, out, lse);               \
                    n = 0;                                                                  \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        return 0;                                                                           \
    }

DEFINE_PREFILL(paged_prefill_bf16, bf16, uint16_t, HAVE_BF16_DOT)
DEFINE_PREFILL(paged_prefill_f32, f32, float, 0)
