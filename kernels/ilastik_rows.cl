/* The ilastik preset's second stage on CPUs (volconv/engines/scales.py): kernels/stencils.cl's
 * ilastik_xyz, ilastik_outer_xy and ilastik_outer, the same sums in the same order, in float8
 * vectors of 8 voxels consecutive along axis 2 (a CPU driver runs a work-item's scalar code,
 * with its gathers and branches, one voxel at a time), the eigenvalues by kernels/eigen.cl's
 * eigen_sym3 in 8 lanes (built behind it with EV 8) where they are computed, so that no
 * entries are written out:
 *   ilastik_yz: the passes along axes 0 and 1 (the Gaussian, its first and second
 *     derivatives, DoG's Gaussian) and then along axis 2 over one product row q and row y of
 *     axis 1; the structure tensor's products into T (6 planes of NQ rows) and, on output
 *     rows, the smoothing, LoG, gradient magnitude, DoG and the Hessian's eigenvalues;
 *   ilastik_st: the outer smoothing of T along axes 0, 1 and 2 at an output row and row y,
 *     and its eigenvalues.
 * A work-item walks its row along axis 2 a vector at a time, keeping the vectors before and
 * after the one at hand, whose lanes (shifted by a shuffle) are the neighbours the pass along
 * axis 2 reads: each value of the passes along axes 0 and 1 is computed once.
 * Rows of P and of T come through row tables (-1: cval), axes 1 and 2 through the index maps
 * my, mz (position p at p + 2; -1: cval), as in kernels/stencils.cl: where a tap is out, the
 * value its sums give there over cval (C: a row of cval, at least NZ long) takes its place. */

#define L 8
typedef float8 vf;
typedef int8 vi;

#define TAPS 5 /* the inner scale's radius <= 2, the outer one's <= 1 */
#ifndef R
#define R 2
#define RD 1
#define RO 1
#endif
#define TAPS_OF(wt)                                                                    \
    __global const float *w0 = (wt) + 2, *w1 = (wt) + TAPS + 2, *w2 = (wt) + 2 * TAPS + 2, \
                         *wd = (wt) + 3 * TAPS + 2, *wo = (wt) + 4 * TAPS + 2

/* lanes s .. s + 7 of the 16 lanes of (a, b) */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define SHUFFLES 1
#endif
#endif
#ifdef SHUFFLES
#define WIN1(a, b) __builtin_shufflevector(a, b, 1, 2, 3, 4, 5, 6, 7, 8)
#define WIN2(a, b) __builtin_shufflevector(a, b, 2, 3, 4, 5, 6, 7, 8, 9)
#define WIN6(a, b) __builtin_shufflevector(a, b, 6, 7, 8, 9, 10, 11, 12, 13)
#define WIN7(a, b) __builtin_shufflevector(a, b, 7, 8, 9, 10, 11, 12, 13, 14)
#else
inline vf window(const vf a, const vf b, const int s)
{
    float t[2 * L];
    vstore8(a, 0, t);
    vstore8(b, 0, t + L);
    return vload8(0, t + s);
}
#define WIN1(a, b) window(a, b, 1)
#define WIN2(a, b) window(a, b, 2)
#define WIN6(a, b) window(a, b, 6)
#define WIN7(a, b) window(a, b, 7)
#endif
/* the lanes at shift c (-2 .. 2) along axis 2 of the block at hand, given its vectors before
 * (a), at hand (b) and after (c) */
#define SHIFTED(a, b, c, s)                                                          \
    ((s) == 0 ? (b) : (s) == -1 ? WIN7(a, b) : (s) == -2 ? WIN6(a, b) : (s) == 1 ? WIN1(b, c) \
                                                                        : WIN2(b, c))

/* the first min(L, NZ - z0) lanes of v to p + z0 */
inline void put8(__global float *p, const vf v, const int z0, const int NZ)
{
    if (z0 + L <= NZ) {
        vstore8(v, 0, p + z0);
    } else {
        float t[L];
        vstore8(v, 0, t);
        for (int l = 0; z0 + l < NZ; ++l) p[z0 + l] = t[l];
    }
}

/* For a block of lanes at positions z0 .. z0 + 7 of axis 2 that leaves the row: each lane's
 * index (positions -E .. NZ - 1 + E extended through mz; others, never read: 0) into j, -1
 * where the mode gives cval */
inline void edge_lanes(const int z0, const int NZ, const int E, __global const int *restrict mz,
                       int j[L])
{
    for (int l = 0; l < L; ++l) {
        const int m = z0 + l;
        j[l] = m >= 0 && m < NZ ? m : m >= -E && m < NZ + E ? mz[m + 2] : 0;
    }
}

/* the lanes of a row at the indices j (-1: c) */
inline vf gather8(__global const float *row, const int j[L], const float c)
{
    float g[L];
    for (int l = 0; l < L; ++l) g[l] = j[l] < 0 ? c : row[j[l]];
    return vload8(0, g);
}

/* Y's seven sums (ilastik_xyz's Y) over the block whose lanes LOAD(row) reads */
#define Y_BLOCK(yv, LOAD)                                                                  \
    {                                                                                      \
        vf y00 = 0.0f, y10 = 0.0f, y20 = 0.0f, y01 = 0.0f, y11 = 0.0f, y02 = 0.0f,         \
           ydd = 0.0f;                                                                     \
        _Pragma("unroll") for (int cy = -R; cy <= R; ++cy)                                 \
        {                                                                                  \
            vf x0 = 0.0f, x1 = 0.0f, x2 = 0.0f, xd = 0.0f;                                 \
            _Pragma("unroll") for (int cx = -R; cx <= R; ++cx)                             \
            {                                                                              \
                const vf v = LOAD(src[cy + R][cx + R]);                                    \
                x0 += w0[cx] * v;                                                          \
                x1 += w1[cx] * v;                                                          \
                x2 += w2[cx] * v;                                                          \
                if (cx >= -RD && cx <= RD) xd += wd[cx] * v;                               \
            }                                                                              \
            y00 += w0[cy] * x0, y10 += w0[cy] * x1, y20 += w0[cy] * x2;                    \
            y01 += w1[cy] * x0, y11 += w1[cy] * x1, y02 += w2[cy] * x0;                    \
            if (cy >= -RD && cy <= RD) ydd += wd[cy] * xd;                                 \
        }                                                                                  \
        yv[0] = y00, yv[1] = y10, yv[2] = y20, yv[3] = y01, yv[4] = y11, yv[5] = y02;      \
        yv[6] = ydd;                                                                       \
    }

/* Y over the block at zb (-8 .. NZ - 1 + 8) into yv: where it leaves the row, its lanes
 * through mz, the sums over cval where the mode gives cval */
#define LOAD_IN(row) vload8(0, (row) + zb)
#define LOAD_EDGE(row) gather8(row, j, cval)
/* BLOCK (Y_BLOCK, V_BLOCK) of the block at (b) into out, its pass reaching r lanes past it */
#define BLOCK_AT(BLOCK, out, b, r)                                                         \
    {                                                                                      \
        const int zb = (b);                                                                \
        if (zb >= 0 && zb + L <= NZ) {                                                     \
            BLOCK(out, LOAD_IN)                                                            \
        } else {                                                                           \
            int j[L];                                                                      \
            edge_lanes(zb, NZ, r, mz, j);                                                  \
            BLOCK(out, LOAD_EDGE)                                                          \
        }                                                                                  \
    }
#define Y_AT(yv, b) BLOCK_AT(Y_BLOCK, yv, b, R)

__kernel void ilastik_yz(__global const float *restrict P_all, const int pp, const int NP,
                         __global const int *restrict rows, const int NQ,
                         __global const float *restrict wt, __global const int *restrict my,
                         __global const int *restrict mz, __global const int *restrict qout,
                         const int NY, const int NZ, const float cval,
                         __global const float *restrict C, __global float *restrict T,
                         __global float *restrict dst, const long n, const int os,
                         const int ol, const int om, const int od, const int oh)
{
    const int y = (int)get_global_id(0), q = (int)get_global_id(1);
    if (y >= NY || q >= NQ) return;
    TAPS_OF(wt);
    __global const float *P = P_all + (long)pp * NP * NY * NZ;
    __global const int *rq = rows + q * TAPS;
    __global const float *src[2 * R + 1][2 * R + 1]; /* P's rows the passes read (C: cval) */
#pragma unroll
    for (int cy = -R; cy <= R; ++cy) {
        const int yy = my[y + cy + 2];
#pragma unroll
        for (int cx = -R; cx <= R; ++cx) {
            const int r = rq[2 + cx];
            src[cy + R][cx + R] = r < 0 || yy < 0 ? C : P + ((long)r * NY + yy) * NZ;
        }
    }
    const long plane = (long)NQ * NY * NZ, at = ((long)q * NY + y) * NZ;
    const int i = qout[q];
    __global float *v = dst + ((long)max(i, 0) * NY + y) * NZ;
    vf prv[7], cur[7], nxt[7];
    Y_AT(prv, -L)
    Y_AT(cur, 0)
    for (int z0 = 0; z0 < NZ; z0 += L) {
        Y_AT(nxt, z0 + L)
        vf s = 0.0f, sd = 0.0f, g0 = 0.0f, g1 = 0.0f, g2 = 0.0f, h00 = 0.0f, h11 = 0.0f,
           h22 = 0.0f, h01 = 0.0f, h02 = 0.0f, h12 = 0.0f;
#define YZ(f, cz) SHIFTED(prv[f], cur[f], nxt[f], cz)
#pragma unroll
        for (int cz = -R; cz <= R; ++cz) {
            const vf y00 = YZ(0, cz), y10 = YZ(1, cz), y20 = YZ(2, cz), y01 = YZ(3, cz);
            const vf y11 = YZ(4, cz), y02 = YZ(5, cz);
            s += w0[cz] * y00, h00 += w0[cz] * y20, h11 += w0[cz] * y02, h22 += w2[cz] * y00;
            h01 += w0[cz] * y11, h02 += w1[cz] * y10, h12 += w1[cz] * y01;
            g0 += w0[cz] * y10, g1 += w0[cz] * y01, g2 += w1[cz] * y00;
            if (cz >= -RD && cz <= RD) sd += wd[cz] * YZ(6, cz);
        }
#undef YZ
        __global float *t = T + at;
        put8(t, g0 * g0, z0, NZ), put8(t + plane, g1 * g1, z0, NZ);
        put8(t + 2 * plane, g2 * g2, z0, NZ), put8(t + 3 * plane, g0 * g1, z0, NZ);
        put8(t + 4 * plane, g0 * g2, z0, NZ), put8(t + 5 * plane, g1 * g2, z0, NZ);
        if (i >= 0) {
            put8(v + os * n, s, z0, NZ);
            put8(v + ol * n, h00 + h11 + h22, z0, NZ);
            put8(v + om * n, magnitude3(g0, g1, g2), z0, NZ);
            put8(v + od * n, s - sd, z0, NZ);
            vf l0, l1, l2;
            eigen_sym3(h00, h11, h22, h01, h02, h12, &l0, &l1, &l2);
            put8(v + oh * n, l0, z0, NZ), put8(v + (oh + 1) * n, l1, z0, NZ);
            put8(v + (oh + 2) * n, l2, z0, NZ);
        }
#pragma unroll
        for (int f = 0; f < 7; ++f) prv[f] = cur[f], cur[f] = nxt[f];
    }
}

/* the outer smoothing along axes 0 and 1 (ilastik_outer_xy's sums) of T's six planes over the
 * block whose lanes LOAD(row) reads */
#define V_BLOCK(vv, LOAD)                                                                  \
    _Pragma("unroll") for (int p = 0; p < 6; ++p)                                          \
    {                                                                                      \
        vf w = 0.0f;                                                                       \
        _Pragma("unroll") for (int cy = -RO; cy <= RO; ++cy)                               \
        {                                                                                  \
            vf u = 0.0f;                                                                   \
            _Pragma("unroll") for (int cx = -RO; cx <= RO; ++cx)                           \
            {                                                                              \
                const int k = (cy + RO) * (2 * RO + 1) + cx + RO;                          \
                u += wo[cx] * LOAD(src[k] + (ok[k] ? p * plane : 0));                      \
            }                                                                              \
            w += wo[cy] * u;                                                               \
        }                                                                                  \
        vv[p] = w;                                                                         \
    }
#define V_AT(vv, b) BLOCK_AT(V_BLOCK, vv, b, 1)

/* The structure tensor at output row i (grows: its neighbours among T's NQ rows by the mode,
 * -1: cval) and row y: the outer smoothing along axes 0 and 1 (where axis 2 leaves the
 * volume: at its mapped position, or the smoothed cval), then along axis 2, and the
 * eigenvalues into planes ot .. ot + 2 of dst */
__kernel void ilastik_st(__global const float *restrict T, const int NQ,
                         __global const int *restrict grows, __global const float *restrict wt,
                         __global const int *restrict my, __global const int *restrict mz,
                         const int D, const int NY, const int NZ, const float cval,
                         __global const float *restrict C, __global float *restrict dst,
                         const long n, const int ot)
{
    const int y = (int)get_global_id(0), i = (int)get_global_id(1);
    if (y >= NY || i >= D) return;
    TAPS_OF(wt);
    const long plane = (long)NQ * NY * NZ;
    __global const int *gr = grows + i * 3 + 1;
    __global const float *src[(2 * RO + 1) * (2 * RO + 1)]; /* T's rows (C: cval) */
    int ok[(2 * RO + 1) * (2 * RO + 1)];
#pragma unroll
    for (int cy = -RO; cy <= RO; ++cy) {
        const int yy = my[y + cy + 2];
#pragma unroll
        for (int cx = -RO; cx <= RO; ++cx) {
            const int r = gr[cx], k = (cy + RO) * (2 * RO + 1) + cx + RO;
            ok[k] = r >= 0 && yy >= 0;
            src[k] = ok[k] ? T + ((long)r * NY + yy) * NZ : C;
        }
    }
    __global float *v = dst + ((long)i * NY + y) * NZ;
    vf prv[6], cur[6], nxt[6];
#if RO
    V_AT(prv, -L)
#endif
    V_AT(cur, 0)
    for (int z0 = 0; z0 < NZ; z0 += L) {
#if RO
        V_AT(nxt, z0 + L)
#endif
        vf t[6];
#pragma unroll
        for (int p = 0; p < 6; ++p) {
            vf s = 0.0f;
#pragma unroll
            for (int cz = -RO; cz <= RO; ++cz) s += wo[cz] * SHIFTED(prv[p], cur[p], nxt[p], cz);
            t[p] = s;
        }
        vf l0, l1, l2;
        eigen_sym3(t[0], t[1], t[2], t[3], t[4], t[5], &l0, &l1, &l2);
        put8(v + ot * n, l0, z0, NZ), put8(v + (ot + 1) * n, l1, z0, NZ);
        put8(v + (ot + 2) * n, l2, z0, NZ);
#if RO
#pragma unroll
        for (int p = 0; p < 6; ++p) prv[p] = cur[p], cur[p] = nxt[p];
#else
        V_AT(cur, z0 + L)
#endif
    }
}
