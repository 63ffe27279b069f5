/* Separable passes: valid 1D correlations along one axis of a slab padded by pad.cl.
 *
 * volconv/separable.py runs, for each distinct axis-2 factor, `pass_fast` over the padded slab
 * (P0, P1, P2) into A (P0, P1, R); for each distinct (axis-2, axis-1) pair `pass_mid` over A
 * into B (P0, NY, R); for each distinct term `pass_out` over B, adding coef * term into every
 * response that holds it. The host flips the factors (convolution = correlation with the
 * flipped kernel) and gives each pass the offset of its own extent's halo inside the bank's
 * common halo, so every pass reads only its own taps.
 *
 * Each work-item computes V consecutive outputs along axis 2 (the fastest), as floatV vectors:
 * the fast pass slides along its row, the others read whole vectors of the rows they sum.
 * Rows have R >= NZ elements (R a multiple of V); only pass_out cuts them to NZ. The host runs
 * the tree over blocks of output rows, so that what a pass writes is still in cache when the
 * next pass reads it.
 *
 * pass_out (pass_mid) also computes U (UM) outputs along the axis it sums, so that each vector
 * it loads feeds up to U of them (the loops are unrolled: the tap conditions vanish).
 *
 * Factors longer than the direct kernel's 31 taps (a Gaussian of sigma 16 has 129) run the
 * same passes with their tap loops rolled: fully unrolled, their code takes PoCL seconds to
 * compile per extent.
 *
 * Build options (-D): K taps, V outputs per work-item along axis 2 (1, 2, 4, 8, 16), U outputs
 * (UM) along the axis pass_out (pass_mid) sums, IN_T the padded slab's element type.
 */

#if K > 31
#define TAP_LOOP _Pragma("unroll 4")
#else
#define TAP_LOOP _Pragma("unroll")
#endif

#define CAT(a, b) a##b
#define XCAT(a, b) CAT(a, b)

#if V == 1
typedef float floatv;
#define LOAD_IN(p) ((float)*(p))
#define LOAD(p) (*(p))
#define STORE(v, p) (*(p) = (v))
#else
typedef XCAT(float, V) floatv;
#define LOAD_IN(p) XCAT(convert_float, V)(XCAT(vload, V)(0, p))
#define LOAD(p) XCAT(vload, V)(0, p)
#define STORE(v, p) XCAT(vstore, V)(v, 0, p)
#endif

/* Axis 2: out[x, y, z] = sum_j w[j] in[x, y, z + off + j], for x in [X0, X0 + NX), y in
 * [Y0, Y0 + NY) of the padded slab; A keeps the slab's coordinates. */
__kernel void pass_fast(__global const IN_T *restrict src,  /* (P0, P1, P2) */
                        __global float *restrict dst,       /* (P0, P1, R) */
                        __constant float *restrict w,       /* K taps */
                        const int X0, const int Y0, const int NX, const int NY,
                        const int P1, const int P2, const int R, const int off)
{
    const int z = (int)get_global_id(0) * V;
    const int y = (int)get_global_id(1);
    const int x = (int)get_global_id(2);
    if (z >= R || y >= NY || x >= NX) return;
    const long row = (long)(x + X0) * P1 + (y + Y0);
    const __global IN_T *p = src + row * P2 + z + off;
    floatv acc = 0.0f;
    TAP_LOOP for (int j = 0; j < K; ++j) acc += w[j] * LOAD_IN(p + j);
    STORE(acc, dst + row * R + z);
}

/* acc[u] = sum_j w[j] row(u + j) for u < n: each of the K + n - 1 rows loaded once (long
 * factors: each row n times, from cache, in a rolled loop). */
#if K > 31
#define SUM_ROWS(acc, row, n)                                                \
    {                                                                        \
        _Pragma("unroll") for (int u = 0; u < n; ++u) acc[u] = 0.0f;         \
        for (int j = 0; j < K; ++j) {                                        \
            const float wj = w[j];                                           \
            _Pragma("unroll") for (int u = 0; u < n; ++u) acc[u] += wj * row(u + j); \
        }                                                                    \
    }
#else
#define SUM_ROWS(acc, row, n)                                                \
    {                                                                        \
        _Pragma("unroll") for (int u = 0; u < n; ++u) acc[u] = 0.0f;         \
        _Pragma("unroll") for (int i = 0; i < K + n - 1; ++i) {              \
            const floatv r = row(i);                                         \
            _Pragma("unroll") for (int u = 0; u < n; ++u) {                  \
                if (i - u >= 0 && i - u < K) acc[u] += w[i - u] * r;         \
            }                                                                \
        }                                                                    \
    }
#endif

/* Axis 1: out[x, y, z] = sum_j w[j] A[x, y + off + j, z], for x in [X0, X0 + NX), y < NY. */
__kernel void pass_mid(__global const float *restrict src,  /* (P0, P1, R) */
                       __global float *restrict dst,        /* (P0, NY, R) */
                       __constant float *restrict w,
                       const int X0, const int NX, const int NY,
                       const int P1, const int R, const int off)
{
    const int z = (int)get_global_id(0) * V;
    const int y = (int)get_global_id(1) * UM;
    const int x = (int)get_global_id(2) + X0;
    if (z >= R || y >= NY || x >= X0 + NX) return;
    const __global float *p = src + ((long)x * P1 + y + off) * R + z;
    floatv acc[UM];
#define ROW_MID(i) LOAD(p + (long)(i) * R)
    SUM_ROWS(acc, ROW_MID, UM)
    for (int u = 0; u < UM && y + u < NY; ++u) STORE(acc[u], dst + ((long)x * NY + y + u) * R + z);
}

/* Axis 0: t[x, y, z] = sum_j w[j] B[x + off + j, y, z] for x in [X0, X1), then for each target
 * f: out[f] = coef * t (the response's first term) or out[f] += coef * t. A target is
 * stored as f, or as -1 - f where it is the response's first term. */
__kernel void pass_out(__global const float *restrict src,  /* (P0, NY, R) */
                       __global float *restrict out,        /* (responses, DEPTH, NY, NZ) */
                       __constant float *restrict w,
                       __constant const int *restrict target,
                       __constant const float *restrict coef,
                       const int n_targets, const int X0, const int X1, const int DEPTH,
                       const int NY, const int NZ, const int R, const int off)
{
    const int z = (int)get_global_id(0) * V;
    const int y = (int)get_global_id(1);
    const int x = (int)get_global_id(2) * U + X0;
    if (z >= NZ || y >= NY || x >= X1) return;
    const long stride = (long)NY * R;
    const __global float *p = src + ((long)(x + off) * NY + y) * R + z;
    floatv acc[U];
#define ROW_OUT(i) LOAD(p + (i) * stride)
    SUM_ROWS(acc, ROW_OUT, U)
    const long plane = (long)DEPTH * NY * NZ;
    for (int t = 0; t < n_targets; ++t) {
        const int first = target[t] < 0;
        __global float *o0 = out + (first ? -1 - target[t] : target[t]) * plane;
        for (int u = 0; u < U && x + u < X1; ++u) {
            __global float *o = o0 + ((long)(x + u) * NY + y) * NZ + z;
            const floatv v = coef[t] * acc[u];
            if (z + V <= NZ) {
                STORE(first ? v : v + LOAD(o), o);
            } else { /* the row's tail: lane by lane */
                float lanes[V];
                STORE(v, lanes);
                for (int l = 0; l < NZ - z; ++l) o[l] = first ? lanes[l] : lanes[l] + o[l];
            }
        }
    }
}
