/* The separable pass tree of a small bank in one kernel, for CPUs: as kernels/fused.cl (the
 * same tables, taps and epilogue) without local memory or barriers, which a CPU driver runs
 * as loops over the work-items of a group, and with explicit vectors along axis 2.
 *
 * A work-item owns V consecutive outputs along axis 2 (a floatV), TY outputs along axis 1 and
 * CX output rows along axis 0, and walks the padded slab's planes along axis 0; for each
 * plane:
 *   1. every root filters the TY + KY - 1 input rows of its columns along axis 2 (each input
 *      vector loaded once for all roots);
 *   2. every mid filters its root's rows along axis 1 (a root at a time, its mids together),
 *      into a ring that holds the mids of the last KX planes (private memory: the CPU's
 *      caches);
 *   3. once KX planes are in, each response of the oldest output row is the sum over its
 *      combos of the axis-0 taps times the ring's planes; the features read it there
 *      (kernels/eigen.cl's epilogue macros, on V lanes; the magnitudes in float32 here,
 *      `magnitude_fast`) and only what is stored is written.
 * So no intermediate volume touches global memory and each input row is read once per plane
 * by the work-items that share it.
 *
 * Build options (-D): those of kernels/fused.cl (KX, KY, KZ, N_ROOTS, N_MIDS, N_COMBOS, N_OUT,
 * MID_ROOT, COMBO_MID, COMBO_OUT, WZ, WY, WX, IN_T, FEATURES), V (= EV) lanes along axis 2,
 * TY outputs along axis 1, CX output rows along axis 0 per work-item.
 */

#define CCAT(a, b) a##b
#define CXCAT(a, b) CCAT(a, b)
#if V == 1
typedef float floatv;
#define CLOAD_IN(p) ((float)*(p))
#define CSTORE(v, p) (*(p) = (v))
#else
typedef CXCAT(float, V) floatv;
#define CLOAD_IN(p) CXCAT(convert_float, V)(CXCAT(vload, V)(0, p))
#define CSTORE(v, p) CXCAT(vstore, V)(v, 0, p)
#endif

/* acc += sum_j w[j] X(j) for the K taps w (constants after unrolling): a symmetric or
 * antisymmetric pair of taps as one multiply of the sum or difference of its inputs (the adds
 * run on the FP adders, beside the multipliers; shared by the factors that read the same
 * inputs), and no multiply by a zero tap (a window's padding, a derivative's centre). */
#define TAPS(acc, w, K, X)                                                          \
    {                                                                               \
        _Pragma("unroll") for (int j_ = 0; j_ < (K) / 2; ++j_) {                    \
            const float a_ = (w)[j_], b_ = (w)[(K) - 1 - j_];                       \
            if (a_ == b_) {                                                         \
                if (a_ != 0.0f) acc += a_ * (X(j_) + X((K) - 1 - j_));              \
            } else if (a_ == -b_) {                                                 \
                acc += a_ * (X(j_) - X((K) - 1 - j_));                              \
            } else {                                                                \
                if (a_ != 0.0f) acc += a_ * X(j_);                                  \
                if (b_ != 0.0f) acc += b_ * X((K) - 1 - j_);                        \
            }                                                                       \
        }                                                                           \
        if ((K) % 2 && (w)[(K) / 2] != 0.0f) acc += (w)[(K) / 2] * X((K) / 2);     \
    }

/* the windows by clang's shuffle where the compiler has it (PoCL's does); else each tap loaded */
#if V == 8 && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define Z_WINDOWS 1
#endif
#endif
#ifdef Z_WINDOWS
#define Z_CHUNKS ((KZ + 14) / 8) /* of 8 inputs: V + KZ - 1 rounded up */
/* lanes s .. s + 7 of the 16 lanes of (a, b), for a constant s < 8 */
#define SHUF(a, b, s) \
    __builtin_shufflevector(a, b, s, s + 1, s + 2, s + 3, s + 4, s + 5, s + 6, s + 7)
#define WINDOW(a, b, s)                                                                   \
    ((s) == 0 ? (a) : (s) == 1 ? SHUF(a, b, 1) : (s) == 2 ? SHUF(a, b, 2)                 \
     : (s) == 3 ? SHUF(a, b, 3) : (s) == 4 ? SHUF(a, b, 4) : (s) == 5 ? SHUF(a, b, 5)     \
     : (s) == 6 ? SHUF(a, b, 6) : SHUF(a, b, 7))
#endif

/* the first n lanes of v to p (all V where n >= V: the row's tail otherwise) */
inline void put_lanes(__global float *p, floatv v, int n)
{
    if (n >= V) {
        CSTORE(v, p);
    } else {
        float t[V];
        CSTORE(v, t);
        for (int l = 0; l < n; ++l) p[l] = t[l];
    }
}

/* sqrt(x^2 + y^2 + z^2) in float32, a few roundings (well within the bound its components'
 * errors imply): one vector square root where kernels/eigen.cl's magnitude3 takes two in
 * float64, on a CPU the epilogue's slowest part; magnitude3 itself for a vector whose sum is
 * not finite (an overflow of float32; NaN or Inf components, which it orders as the contract
 * does) */
inline floatv magnitude_fast(floatv x, floatv y, floatv z)
{
    const floatv s = x * x + y * y + z * z;
    /* whether a lane is not finite: the lanes' bits OR-ed by halves (no branch per lane, as
     * any() compiles to) */
#if V == 1
    const int bad = !isfinite(s);
#else
    const CXCAT(int, V) b = !isfinite(s);
#if V == 16
    const int8 b8 = b.lo | b.hi;
#elif V == 8
    const int8 b8 = b;
#endif
#if V >= 8
    const int4 b4 = b8.lo | b8.hi;
#elif V == 4
    const int4 b4 = b;
#endif
#if V >= 4
    const int2 b2 = b4.lo | b4.hi;
#else
    const int2 b2 = b;
#endif
    const int bad = b2.x | b2.y;
#endif
    return bad ? magnitude3(x, y, z) : sqrt(s);
}
#undef MAG2
#undef MAG3
#define MAG2(a, b, o) FEAT_STORE(o, magnitude_fast(RESP(a), RESP(b), (floatv)0.0f))
#define MAG3(a, b, c, o) FEAT_STORE(o, magnitude_fast(RESP(a), RESP(b), RESP(c)))

#define RESP(f) res[f]
#define FEAT_STORE(o, v) put_lanes(feat + (long)(o) * out_plane + at, v, lanes);

__kernel void columns(__global const IN_T *restrict src, /* (P0, P1, P2) padded slab */
                      __global float *restrict out,      /* (N_OUT, DEPTH, NY, NZ) */
                      __global float *restrict feat,     /* (planes, DEPTH, NY, NZ) */
                      const int X0, const int X1,        /* the output rows to compute */
                      const int DEPTH, const int NY, const int NZ, const int P1, const int P2,
                      const int S0, const int S1, const int S2,
                      const int N_STORED) /* responses written: the first N_STORED; < 0: all */
{
    const int z = (int)get_global_id(0) * V;
    const int y0 = (int)get_global_id(1) * TY;
    const int x0 = X0 + (int)get_global_id(2) * CX;
    if (z >= NZ || y0 >= NY || x0 >= X1) return;
    const int mid_root[N_MIDS] = {MID_ROOT};
    const int combo_mid[N_COMBOS] = {COMBO_MID};
    const int combo_out[N_COMBOS] = {COMBO_OUT};
    const float wz[N_ROOTS * KZ] = {WZ};
    const float wy[N_MIDS * KY] = {WY};
    const float wx[N_COMBOS * KX] = {WX}; /* coefficients folded in */
    const int planes = min(CX, X1 - x0) + KX - 1;
    const int lanes = NZ - z;
    const long plane_size = (long)NY * NZ, out_plane = (long)DEPTH * plane_size;
    /* input rows past the slab (y0 + TY > NY) feed only outputs never stored: clamped */
    int row_at[TY + KY - 1];
#pragma unroll
    for (int r = 0; r < TY + KY - 1; ++r) row_at[r] = min(y0 + S1 + r, P1 - 1) * P2;

    /* the mids of plane p at ring[p % KX] and ring[p % KX + KX]: the KX planes of an output
     * row are then KX consecutive entries, each at a constant offset from the first */
    floatv ring[2 * KX][N_MIDS][TY];
    for (int p = 0; p < planes; ++p) {
        const __global IN_T *in = src + (long)(x0 + p + S0) * P1 * P2 + z + S2;
        floatv rows[N_ROOTS][TY + KY - 1];
        for (int r = 0; r < TY + KY - 1; ++r) { /* rolled: a short build */
            const __global IN_T *q = in + row_at[r];
#ifdef Z_WINDOWS
            /* the row's V + KZ - 1 inputs converted once, in chunks of 8; the window at j
             * shuffled from two chunks (a lane shift: no reload, no second conversion) */
            floatv c[Z_CHUNKS];
#pragma unroll
            for (int i = 0; i < Z_CHUNKS; ++i) c[i] = CLOAD_IN(q + 8 * i);
#define IN_Z(j) WINDOW(c[(j) / 8], c[(j) / 8 + ((j) % 8 != 0)], (j) % 8)
#else
            floatv v[KZ];
#pragma unroll
            for (int j = 0; j < KZ; ++j) v[j] = CLOAD_IN(q + j);
#define IN_Z(j) v[j]
#endif
#pragma unroll
            for (int k = 0; k < N_ROOTS; ++k) {
                floatv a = 0.0f;
                TAPS(a, wz + k * KZ, KZ, IN_Z)
                rows[k][r] = a;
            }
        }
        floatv(*m)[TY] = ring[p % KX];
        floatv(*m2)[TY] = ring[p % KX + KX];
        /* a root at a time along axis 1 (rolled), its mids together: they share its rows'
         * loads, and only its mids' windows are live (all mids at once spill registers) */
#pragma unroll
        for (int r = 0; r < N_ROOTS; ++r) {
            for (int y = 0; y < TY; ++y) {
#pragma unroll
                for (int k = 0; k < N_MIDS; ++k) {
                    if (mid_root[k] != r) continue;
                    floatv s = 0.0f;
#define IN_Y(j) rows[r][y + (j)]
                    TAPS(s, wy + k * KY, KY, IN_Y)
                    m[k][y] = m2[k][y] = s;
                }
            }
        }
        if (p < KX - 1) continue;
        const int x = x0 + p - (KX - 1); /* the output row now complete */
        floatv(*w)[N_MIDS][TY] = ring + (p + 1) % KX; /* its planes x + i at w[i] */
        const long at0 = ((long)x * NY + y0) * NZ + z;
        for (int y = 0; y < TY && y0 + y < NY; ++y) {
            floatv res[N_OUT];
#pragma unroll
            for (int f = 0; f < N_OUT; ++f) res[f] = 0.0f;
#pragma unroll
            for (int c = 0; c < N_COMBOS; ++c) {
#define IN_X(i) w[i][combo_mid[c]][y]
                TAPS(res[combo_out[c]], wx + c * KX, KX, IN_X)
            }
            const long at = at0 + (long)y * NZ;
#ifdef FEATURES
#pragma unroll
            for (int f = 0; f < N_OUT; ++f) {
                if (N_STORED < 0 || f < N_STORED) put_lanes(out + f * out_plane + at, res[f], lanes);
            }
            if (N_STORED >= 0) {
                FEATURES
            }
#else
#pragma unroll
            for (int f = 0; f < N_OUT; ++f) put_lanes(out + f * out_plane + at, res[f], lanes);
#endif
        }
    }
}
