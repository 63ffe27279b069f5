/* The skimage preset on CPUs. Its second stage (volconv/engines/scales.py): kernels/stencils.cl's
 * skimage_scale, the same arithmetic in the same order, over blocks of 8 voxels consecutive
 * along axis 2 in float8 vectors (CPUs run vectors in SIMD lanes; a work-item's scalar code
 * with branches does not vectorise across work-items): every channel of a scale, the
 * eigenvalues by kernels/eigen.cl's eigen_sym3 in 16 lanes, two blocks at once (built behind it
 * with EV 16). Its first stage: gauss_x, gauss_y, gauss_z below.
 *
 * The neighbours along axes 0 and 1 are whole rows (clamped at the volume's border, as
 * 'reflect' at distance 1 and np.gradient's one-sided differences take them); along axis 2
 * each lane's neighbour is clamped: one unaligned vector load inside the axis, lane by lane at
 * its ends. np.gradient's weights and the second differences' taps follow
 * kernels/stencils.cl's gradient_taps and second_difference, lane by lane along axis 2. */

#define L 8
typedef float8 vf;
typedef int8 vi;

/* the lanes of p at z0 + i + d (i < L), clamped to [0, NZ) */
inline vf row_at(__global const float *p, const int z0, const int d, const int NZ)
{
    if (z0 + d >= 0 && z0 + d + L <= NZ) return vload8(0, p + z0 + d);
    float t[L];
    for (int i = 0; i < L; ++i) t[i] = p[clamp(z0 + d + i, 0, NZ - 1)];
    return vload8(0, t);
}

/* the lanes of p at the indices q */
inline vf gather(__global const float *p, const vi q)
{
    int qi[L];
    float t[L];
    vstore8(q, 0, qi);
    for (int i = 0; i < L; ++i) t[i] = p[qi[i]];
    return vload8(0, t);
}

/* np.gradient's weight at index i of an axis of n: 1/2 inside, 1 at an end, 0 if n is 1 */
inline float weight(const int i, const int n)
{
    const int span = min(i + 1, n - 1) - max(i - 1, 0);
    return span == 2 ? 0.5f : span == 1 ? 1.0f : 0.0f;
}

inline vf weights(const vi i, const int n)
{
    const vi span = min(i + 1, n - 1) - max(i - 1, 0);
    return select(select((vf)0.0f, (vf)1.0f, span == 1), (vf)0.5f, span == 2);
}

/* D_a D_a g (np.gradient twice) along axis 0 or 1 at index i of n, the row at index r being
 * p + r * stride (kernels/stencils.cl's second_difference) */
inline vf second_rows(__global const float *p, const long stride, const int i, const int n,
                      const int z0, const int NZ)
{
    const int j0 = min(i + 1, n - 1), j1 = max(i - 1, 0);
    const vf d0 = (row_at(p + min(j0 + 1, n - 1) * stride, z0, 0, NZ) -
                   row_at(p + max(j0 - 1, 0) * stride, z0, 0, NZ)) * weight(j0, n);
    const vf d1 = (row_at(p + min(j1 + 1, n - 1) * stride, z0, 0, NZ) -
                   row_at(p + max(j1 - 1, 0) * stride, z0, 0, NZ)) * weight(j1, n);
    return (d0 - d1) * weight(i, n);
}

inline vf sobel3(const vf m, const vf c, const vf p)
{
    return 0.25f * m + 0.5f * c + 0.25f * p;
}

/* The inputs of a block's channels at z0 .. z0 + 7 of row y, x of the volume's rows from P:
 * the voxel (g), the Sobels (e0, e1, e2) and the Hessian (h: 00, 11, 22, 01, 02, 12) */
inline void block_inputs(__global const float *P, const long SX, const int x, const int y,
                         const int z0, const int N0, const int NY, const int NZ, vf *g, vf e[3],
                         vf h[6])
{
    const int xs[3] = {max(x - 1, 0), x, min(x + 1, N0 - 1)};
    const int ys[3] = {max(y - 1, 0), y, min(y + 1, NY - 1)};
    vf f[3][3][3];
#pragma unroll
    for (int a = 0; a < 3; ++a)
#pragma unroll
        for (int e = 0; e < 3; ++e) {
            __global const float *p = P + xs[a] * SX + ys[e] * NZ;
#pragma unroll
            for (int k = 0; k < 3; ++k) f[a][e][k] = row_at(p, z0, k - 1, NZ);
        }
    const float wx = weight(x, N0), wy = weight(y, NY);
    const vi iz = min(z0 + (vi)(0, 1, 2, 3, 4, 5, 6, 7), NZ - 1);
    const vf wz = weights(iz, NZ);
    h[0] = second_rows(P + (long)y * NZ, SX, x, N0, z0, NZ);
    h[1] = second_rows(P + x * SX, NZ, y, NY, z0, NZ);
    __global const float *b = P + x * SX + (long)y * NZ;
    if (z0 >= 2 && z0 + L + 2 <= NZ) {
        const vf c = vload8(0, b + z0);
        h[2] = ((vload8(0, b + z0 + 2) - c) * 0.5f - (c - vload8(0, b + z0 - 2)) * 0.5f) * 0.5f;
    } else {
        const vi j0 = min(iz + 1, NZ - 1), j1 = max(iz - 1, 0);
        const vf d0 = (gather(b, min(j0 + 1, NZ - 1)) - gather(b, max(j0 - 1, 0))) * weights(j0, NZ);
        const vf d1 = (gather(b, min(j1 + 1, NZ - 1)) - gather(b, max(j1 - 1, 0))) * weights(j1, NZ);
        h[2] = (d0 - d1) * wz;
    }
    /* the Sobels: along axis 0, then 1, then 2 (skimage_channels) */
    vf dx[3][3], sx3[3][3];
#pragma unroll
    for (int a = 0; a < 3; ++a)
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            dx[a][k] = f[2][a][k] - f[0][a][k];
            sx3[a][k] = sobel3(f[0][a][k], f[1][a][k], f[2][a][k]);
        }
    vf a0[3], a1[3], a2[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
        a0[k] = sobel3(dx[0][k], dx[1][k], dx[2][k]);
        a1[k] = sx3[2][k] - sx3[0][k];
        a2[k] = sobel3(sx3[0][k], sx3[1][k], sx3[2][k]);
    }
    e[0] = sobel3(a0[0], a0[1], a0[2]), e[1] = sobel3(a1[0], a1[1], a1[2]);
    e[2] = a2[2] - a2[0];
    h[3] = (dx[2][1] * wx - dx[0][1] * wx) * wy;
    h[4] = (dx[1][2] * wx - dx[1][0] * wx) * wz;
    h[5] = ((f[1][2][2] - f[1][0][2]) * wy - (f[1][2][0] - f[1][0][0]) * wy) * wz;
    *g = f[1][1][1];
}

/* the first min(L, NZ - z0) lanes of v to p */
inline void put_row(__global float *p, const vf v, const int z0, const int NZ)
{
    if (z0 + L <= NZ) {
        vstore8(v, 0, p);
    } else {
        float t[L];
        vstore8(v, 0, t);
        for (int l = 0; l < NZ - z0; ++l) p[l] = t[l];
    }
}

/* Output rows A .. A + D - 1 of S scales, scale s along axis 2 of the range at s * D: its field
 * is plane gps[s] (of NR rows each) of G, holding rows R0 .. of the volume (N0, NY, NZ), its
 * channels planes os[s] .. os[s] + 4 of dst (plane o at o * n). A work-item computes two
 * blocks of 8 voxels, whose eigenvalues and magnitudes run in 16 lanes (EV 16), so that the
 * two blocks' dependency chains (eigen_sym3's is long) overlap. */
#if EV != 2 * L
#error "skimage_rows.cl is built with EV 16"
#endif
#define JOIN(a, b) ((evf)((a), (b)))
__kernel void skimage_rows(__global const float *restrict G, __global const int *restrict gps,
                           const int NR, const int R0, const int A, const int N0, const int NY,
                           const int NZ, const int D, const int S, const float c,
                           __global float *restrict dst, const long n,
                           __global const int *restrict os)
{
    const int z0 = (int)get_global_id(0) * 2 * L, y = (int)get_global_id(1);
    const int sx = (int)get_global_id(2);
    if (z0 >= NZ || y >= NY || sx >= S * D) return;
    const int sc = sx / D, i = sx - sc * D, x = A + i, o = os[sc];
    const long SX = (long)NY * NZ;
    __global const float *P = G + ((long)gps[sc] * NR - R0) * SX; /* the volume's row 0 */
    vf g[2], e[2][3], h[2][6];
    block_inputs(P, SX, x, y, z0, N0, NY, NZ, &g[0], e[0], h[0]);
    block_inputs(P, SX, x, y, min(z0 + L, NZ - 1), N0, NY, NZ, &g[1], e[1], h[1]); /* or none */
    evf l0, l1, l2;
    eigen_sym3(c * JOIN(h[0][0], h[1][0]), c * JOIN(h[0][1], h[1][1]),
               c * JOIN(h[0][2], h[1][2]), c * JOIN(h[0][3], h[1][3]),
               c * JOIN(h[0][4], h[1][4]), c * JOIN(h[0][5], h[1][5]), &l0, &l1, &l2);
    const evf mag = c * magnitude3(JOIN(e[0][0], e[1][0]), JOIN(e[0][1], e[1][1]),
                                   JOIN(e[0][2], e[1][2])) * 0.57735026918962576f;
    __global float *at = dst + o * n + ((long)i * NY + y) * NZ + z0;
    for (int k = 0; k < 2 && z0 + k * L < NZ; ++k) {
        const vf out[5] = {c * g[k], k ? mag.hi : mag.lo, k ? l0.hi : l0.lo, k ? l1.hi : l1.lo,
                           k ? l2.hi : l2.lo};
#pragma unroll
        for (int q = 0; q < 5; ++q) put_row(at + q * n + k * L, out[q], z0 + k * L, NZ);
    }
}

/* The skimage preset's first stage on CPUs (volconv/engines/gaussians.py): one scale's
 * Gaussian in mode 'nearest' as scipy's gaussian_filter runs it, 1D passes along axes 0, 1
 * and 2 in that order, each over taps w[t] = wp[U + t], t = 0 .. 2 RW (symmetric: correlation and
 * convolution agree) in order, the indices clamped to the volume; so each pass computes only
 * the rows the next one reads (no padded rows). */

/* Axis 0: rows G0 .. G0 + NG - 1 of the volume (N0 rows) from src (float rows S0 .. of it)
 * into dst (NG rows), U consecutive rows a work-item: each input row it reads, loaded once,
 * feeds every output whose window holds it; wp: the taps with U zeros before and after */
#ifndef U
#define U 8
#endif
__kernel void gauss_x(__global const float *restrict src, const int S0, const int G0,
                      const int NG, const int N0, const int NY, const int NZ,
                      __global const float *restrict wp, const int RW,
                      __global float *restrict dst)
{
    const int z0 = (int)get_global_id(0) * L, y = (int)get_global_id(1);
    const int g0 = (int)get_global_id(2) * U;
    if (z0 >= NZ || y >= NY || g0 >= NG) return;
    const long plane = (long)NY * NZ;
    __global const float *p = src + (long)y * NZ;
    vf acc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) acc[u] = 0.0f;
#pragma unroll 2
    for (int j = 0; j < 2 * RW + U; ++j) { /* input row G0 + g0 - RW + j */
        const int x = clamp(G0 + g0 - RW + j, 0, N0 - 1) - S0;
        const vf v = row_at(p + x * plane, z0, 0, NZ);
#pragma unroll
        for (int u = 0; u < U; ++u) acc[u] += wp[j - u + U] * v; /* tap j - u */
    }
    for (int u = 0; u < U && g0 + u < NG; ++u)
        put_row(dst + (long)(g0 + u) * plane + (long)y * NZ + z0, acc[u], z0, NZ);
}

/* Axis 1: over NG rows of src into dst, U consecutive rows of axis 1 a work-item (as
 * gauss_x) */
__kernel void gauss_y(__global const float *restrict src, const int NG, const int NY,
                      const int NZ, __global const float *restrict wp, const int RW,
                      __global float *restrict dst)
{
    const int z0 = (int)get_global_id(0) * L, y0 = (int)get_global_id(1) * U;
    const int g = (int)get_global_id(2);
    if (z0 >= NZ || y0 >= NY || g >= NG) return;
    __global const float *p = src + (long)g * NY * NZ;
    vf acc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) acc[u] = 0.0f;
#pragma unroll 2
    for (int j = 0; j < 2 * RW + U; ++j) { /* row y0 - RW + j of axis 1 */
        const vf v = row_at(p + clamp(y0 - RW + j, 0, NY - 1) * NZ, z0, 0, NZ);
#pragma unroll
        for (int u = 0; u < U; ++u) acc[u] += wp[j - u + U] * v;
    }
    for (int u = 0; u < U && y0 + u < NY; ++u)
        put_row(dst + ((long)g * NY + y0 + u) * NZ + z0, acc[u], z0, NZ);
}

/* Axis 2: a work-item a row of src (NG rows) into dst from float F, through the row extended
 * by RW on each side (clamped) in line (local memory: NZ + 2 RW + 4 L floats) */
__kernel void gauss_z(__global const float *restrict src, const int NG, const int NY,
                      const int NZ, __global const float *restrict wp, const int RW,
                      __global float *restrict dst_all, const long F, __local float *line)
{
    const int y = (int)get_global_id(0), g = (int)get_global_id(1);
    if (y >= NY || g >= NG) return;
    const long at = ((long)g * NY + y) * NZ;
    __global const float *p = src + at;
    __global float *dst = dst_all + F + at;
    for (int j = 0; j < NZ + 2 * RW + 4 * L; ++j) line[j] = p[clamp(j - RW, 0, NZ - 1)];
    for (int z0 = 0; z0 < NZ; z0 += 4 * L) { /* four blocks a tap: its weight loaded once */
        vf acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 2
        for (int t = 0; t <= 2 * RW; ++t) {
            const float w = wp[U + t];
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[k] += w * vload8(0, line + z0 + k * L + t);
        }
        for (int k = 0; k < 4 && z0 + k * L < NZ; ++k)
            put_row(dst + z0 + k * L, acc[k], z0 + k * L, NZ);
    }
}
