/* The presets' second stage: every channel of one scale from that scale's smoothed field,
 * written into the preset's output planes (plane o at o * n, n = depth * NY * NZ): skimage's in
 * one kernel per scale, ilastik's by 1D passes along axes 0, 1 and 2 (scipy's order) and a
 * kernel for a scale's channels.
 *
 * Built behind kernels/eigen.cl (volconv/engines/features.py's build_with_features): its
 * eigen_sym3 and magnitude3, one voxel per work-item (EV 1).
 *
 * skimage_scale: skimage.feature.multiscale_basic_features at one sigma from G, the Gaussian
 * of the image (kernels/smoothing.cl; rows R0 .. of the volume, covering the slab's rows and 2
 * more on each side inside the volume), every channel of a voxel in one work-item: the
 * intensity G * c (c: img_as_float32's scale of integer inputs), the Sobel magnitude as
 * skimage.filters.sobel computes it (the axis Sobels with ndi's 'reflect', sqrt of the sum of
 * their squares / 3) and the descending eigenvalues of the Hessian by
 * np.gradient twice (central differences inside, one-sided at the volume's border).
 *
 * ilastik_xyz, ilastik_outer_xy, ilastik_outer: ilastik's
 * features at its inner scale from P, the presmoothed volume; P's rows are given by row tables
 * (the local row of each neighbour, -1 where constant mode gives cval), the other axes are
 * extended by the bank's mode through index maps, so every stage takes the bank's mode as
 * scipy's gaussian_filter of P would.
 * Taps: the correlation weights w[t], t = -R .. R, of the Gaussian (w0), its first (w1) and
 * second (w2) derivatives at the inner scale, DoG's second Gaussian (wd, radius RD) and the
 * structure tensor's outer Gaussian (wo, radius RO), each stored centred at index 2 of 5. The
 * passes run axis 0, then 1, then 2 (scipy's order) over every tap of each radius (scipy's
 * correlate1d multiplies the zero centre tap of odd orders too), so NaN and Inf spread as
 * they do there. */

#define TAPS 5 /* the inner scale's radius int(2 * sigma + 0.5) <= 2 */
#ifndef VX
#define VX 4 /* skimage_scale's rows per work-item */
#endif

/* The eigenvalues of (a00, .., a12) into planes p .. p + 2 of dst (e: unused; the kernels'
 * argument E is not read: CPUs run kernels/skimage_rows.cl and ilastik_rows.cl instead). */
#if defined(SK_NO_EIGEN) /* timing only: the diagonal, not the eigenvalues */
#define EIGEN(a00, a11, a22, a01, a02, a12, p, e)                                          \
    dst[(p) * n + v] = a00 + a01, dst[((p) + 1) * n + v] = a11 + a02,                       \
    dst[((p) + 2) * n + v] = a22 + a12
#else
#define EIGEN(a00, a11, a22, a01, a02, a12, p, e)                                          \
    do {                                                                                    \
        float l0_, l1_, l2_;                                                                \
        eigen_sym3(a00, a11, a22, a01, a02, a12, &l0_, &l1_, &l2_);                         \
        dst[(p) * n + v] = l0_, dst[((p) + 1) * n + v] = l1_, dst[((p) + 2) * n + v] = l2_; \
    } while (0)
#endif

/* np.gradient at index i of an axis of length n: (f[j0] - f[j1]) * w, one-sided at the ends
 * (w = 1), central inside (w = 1/2); 0 on a 1-voxel axis */
inline float gradient_taps(const int i, const int n, int *j0, int *j1)
{
    *j0 = min(i + 1, n - 1), *j1 = max(i - 1, 0);
    const int span = *j0 - *j1;
    return span == 2 ? 0.5f : span == 1 ? 1.0f : 0.0f;
}

/* D_a D_a g at g[0] by np.gradient twice along an axis of stride S, index i, length n, whose
 * taps at i are j0, j1, w (gradient_taps) */
inline float second_difference(__global const float *g, const int S, const int i, const int n,
                               const int j0, const int j1, const float w)
{
    int k0, k1, l0, l1;
    const float w0 = gradient_taps(j0, n, &k0, &k1), w1 = gradient_taps(j1, n, &l0, &l1);
    const float d0 = (g[(k0 - i) * S] - g[(k1 - i) * S]) * w0;
    const float d1 = (g[(l0 - i) * S] - g[(l1 - i) * S]) * w1;
    return (d0 - d1) * w;
}

/* ... where i is 2 voxels from either end (second_difference's arithmetic there) */
inline float central_second(__global const float *g, const int S)
{
    return ((g[2 * S] - g[0]) * 0.5f - (g[0] - g[-2 * S]) * 0.5f) * 0.5f;
}

/* skimage's second stage, one kernel (skimage_scale) for every scale: G's 3x3x3
 * neighbourhood of a voxel, clamped at the volume's border, holds the Sobels' taps ('reflect'
 * at distance 1 repeats the border voxel) and np.gradient's first differences (its indices
 * j0, j1 are the same clamped neighbours); the Hessian's diagonal (np.gradient twice along one
 * axis) reads the voxels 2 away too. Each value is computed as scipy and numpy compute it, axis
 * 0 first: the Sobel along an axis is the [1, 0, -1] difference along it and the [1, 2, 1] / 4
 * smoothing along the two others; H_ab = np.gradient along b of np.gradient along a. */
/* the 3x3x3 neighbourhood's indices, unrolled */
#define FOR3(a, e, h)                                 \
    _Pragma("unroll") for (int a = 0; a < 3; ++a)     \
        _Pragma("unroll") for (int e = 0; e < 3; ++e) \
            _Pragma("unroll") for (int h = 0; h < 3; ++h)

inline float sobel_smoothing3(const float m, const float c, const float p)
{
    return 0.25f * m + 0.5f * c + 0.25f * p;
}

/* One voxel's channels from G's 3x3x3 neighbourhood f (clamped at the volume's border), the
 * Hessian's diagonal and np.gradient's weights: into planes o .. o + 4 of dst at v */
inline void skimage_channels(float f[3][3][3], const float h00, const float h11, const float h22,
                             const float wx, const float wy, const float wz, const float c,
                             __global float *restrict dst, const long n, const int o,
                             const long v, __global float *restrict E, const int e)
{
    /* the Sobels: along axis 0, then 1, then 2 */
    float dx[3][3], sx[3][3];
#pragma unroll
    for (int a = 0; a < 3; ++a)
#pragma unroll
        for (int h = 0; h < 3; ++h) {
            dx[a][h] = f[2][a][h] - f[0][a][h];
            sx[a][h] = sobel_smoothing3(f[0][a][h], f[1][a][h], f[2][a][h]);
        }
    float a0[3], a1[3], a2[3];
#pragma unroll
    for (int h = 0; h < 3; ++h) {
        a0[h] = sobel_smoothing3(dx[0][h], dx[1][h], dx[2][h]);
        a1[h] = sx[2][h] - sx[0][h];
        a2[h] = sobel_smoothing3(sx[0][h], sx[1][h], sx[2][h]);
    }
    const float e0 = sobel_smoothing3(a0[0], a0[1], a0[2]);
    const float e1 = sobel_smoothing3(a1[0], a1[1], a1[2]);
    const float e2 = a2[2] - a2[0];
    /* the Hessian's other entries: N_0 G at (y', z'), N_1 G at (z'), then their differences */
    const float h01 = (dx[2][1] * wx - dx[0][1] * wx) * wy;
    const float h02 = (dx[1][2] * wx - dx[1][0] * wx) * wz;
    const float h12 = ((f[1][2][2] - f[1][0][2]) * wy - (f[1][2][0] - f[1][0][0]) * wy) * wz;
    dst[o * n + v] = c * f[1][1][1];
    dst[(o + 1) * n + v] = c * magnitude3(e0, e1, e2) * 0.57735026918962576f; /* / sqrt(3) */
    /* the scale c is linear: applied to the results, not to each tap */
    EIGEN(c * h00, c * h11, c * h22, c * h01, c * h02, c * h12, o + 2, e);
}

/* The output rows A .. A + D - 1 of S scales, VX consecutive rows a work-item, scale s along
 * axis 2 of the range at s * ceil(D / VX): its field is plane gps[s] (of NR rows each) of G,
 * holding rows R0 .. of the volume (N0, NY, NZ), its channels planes os[s] .. os[s] + 4 of dst.
 * Where the VX voxels are 2 from every face, the
 * VX + 2 planes of their neighbourhoods are loaded once for all of them, and np.gradient's
 * taps are central; elsewhere each voxel takes its own, clamped. */
__kernel void skimage_scale(__global const float *restrict G, __global const int *restrict gps,
                            const int NR, const int R0, const int A, const int N0, const int NY,
                            const int NZ, const int D, const int S, const float c,
                            __global float *restrict dst, const long n,
                            __global const int *restrict os, __global float *restrict E)
{
    const int z = (int)get_global_id(0), y = (int)get_global_id(1), sb = (int)get_global_id(2);
    const int DB = (D + VX - 1) / VX;
    if (z >= NZ || y >= NY || sb >= S * DB) return;
    const int sc = sb / DB, i0 = (sb - sc * DB) * VX, o = os[sc];
    const int x0 = A + i0, nv = min(VX, D - i0), SX = NY * NZ; /* offsets in a few planes: int */
    __global const float *b0 = G + ((long)gps[sc] * NR - R0 + x0) * SX + y * NZ + z;
    const long v0 = ((long)i0 * NY + y) * NZ + z;
    if (nv == VX && x0 >= 2 && x0 + VX + 1 < N0 && y >= 2 && y < NY - 2 && z >= 2 && z < NZ - 2) {
        float pl[VX + 2][3][3]; /* planes x0 - 1 .. x0 + VX */
#pragma unroll
        for (int a = 0; a < VX + 2; ++a)
#pragma unroll
            for (int e = 0; e < 3; ++e)
#pragma unroll
                for (int h = 0; h < 3; ++h) pl[a][e][h] = b0[(a - 1) * SX + (e - 1) * NZ + h - 1];
        const float below = b0[-2 * SX], above = b0[(VX + 1) * SX];
#pragma unroll
        for (int k = 0; k < VX; ++k) {
            float f[3][3][3];
            FOR3(a, e, h) f[a][e][h] = pl[k + a][e][h];
            const float gm = k == 0 ? below : pl[k - 1][1][1];
            const float gp = k + 3 < VX + 2 ? pl[k + 3][1][1] : above;
            const float h00 = ((gp - f[1][1][1]) * 0.5f - (f[1][1][1] - gm) * 0.5f) * 0.5f;
            __global const float *b = b0 + k * SX;
            skimage_channels(f, h00, central_second(b, NZ), central_second(b, 1), 0.5f, 0.5f,
                             0.5f, c, dst, n, o, v0 + (long)k * SX, E, 6 * sc);
        }
        return;
    }
    for (int k = 0; k < nv; ++k) {
        const int x = x0 + k;
        int jx0, jx1, jy0, jy1, jz0, jz1;
        const float wx = gradient_taps(x, N0, &jx0, &jx1), wy = gradient_taps(y, NY, &jy0, &jy1);
        const float wz = gradient_taps(z, NZ, &jz0, &jz1);
        __global const float *b = b0 + k * SX; /* the voxel */
        const int xs[3] = {(jx1 - x) * SX, 0, (jx0 - x) * SX};
        const int ys[3] = {(jy1 - y) * NZ, 0, (jy0 - y) * NZ}, zs[3] = {jz1 - z, 0, jz0 - z};
        float f[3][3][3];
        FOR3(a, e, h) f[a][e][h] = b[xs[a] + ys[e] + zs[h]];
        skimage_channels(f, second_difference(b, SX, x, N0, jx0, jx1, wx),
                         second_difference(b, NZ, y, NY, jy0, jy1, wy),
                         second_difference(b, 1, z, NZ, jz0, jz1, wz), wx, wy, wz, c, dst, n, o,
                         v0 + (long)k * SX, E, 6 * sc);
    }
}

/* skimage_tile: skimage_scale through local memory. A work-group of TZ x TY work-items holds
 * the field of one scale over VX output rows and a TY x TZ tile, with 2 more on every side
 * (clamped to the volume, as the neighbours are), loaded once, coalesced; each work-item then
 * computes its VX voxels along axis 0 from it, np.gradient's taps (gradient_taps) at every
 * voxel, so that the border needs no other path. Same arithmetic as skimage_scale. */
#ifndef TZ
#define TZ 32
#define TY 8
#endif
#define TW (TZ + 4)
#define TH (TY + 4)

/* second_difference over the tile: t at the voxel, S the tile's stride along the axis */
inline float second_tile(__local const float *t, const int S, const int i, const int n)
{
    int j0, j1, k0, k1, l0, l1;
    const float w = gradient_taps(i, n, &j0, &j1);
    const float w0 = gradient_taps(j0, n, &k0, &k1), w1 = gradient_taps(j1, n, &l0, &l1);
    const float d0 = (t[(k0 - i) * S] - t[(k1 - i) * S]) * w0;
    const float d1 = (t[(l0 - i) * S] - t[(l1 - i) * S]) * w1;
    return (d0 - d1) * w;
}

__kernel __attribute__((reqd_work_group_size(TZ, TY, 1))) void
skimage_tile(__global const float *restrict G, __global const int *restrict gps, const int NR,
             const int R0, const int A, const int N0, const int NY, const int NZ, const int D,
             const int S, const float c, __global float *restrict dst, const long n,
             __global const int *restrict os, __global float *restrict E)
{
    __local float tile[(VX + 4) * TH * TW];
    const int lz = (int)get_local_id(0), ly = (int)get_local_id(1);
    const int z0 = (int)get_group_id(0) * TZ, y0 = (int)get_group_id(1) * TY;
    const int DB = (D + VX - 1) / VX, sb = (int)get_group_id(2);
    const int sc = sb / DB, i0 = (sb - sc * DB) * VX, x0 = A + i0, o = os[sc];
    const long SX = (long)NY * NZ;
    __global const float *P = G + ((long)gps[sc] * NR - R0) * SX; /* the volume's row 0 */
    for (int q = ly * TZ + lz; q < (VX + 4) * TH * TW; q += TZ * TY) {
        const int a = q / (TH * TW), e = (q / TW) % TH, h = q % TW;
        /* rows past the field (a partial block's) are its last, never stored */
        const int gx = clamp(clamp(x0 - 2 + a, 0, N0 - 1), R0, R0 + NR - 1);
        const int gy = clamp(y0 - 2 + e, 0, NY - 1), gz = clamp(z0 - 2 + h, 0, NZ - 1);
        tile[q] = P[gx * SX + (long)gy * NZ + gz];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const int y = y0 + ly, z = z0 + lz;
    if (y >= NY || z >= NZ) return;
    int jy0, jy1, jz0, jz1;
    const float wy = gradient_taps(y, NY, &jy0, &jy1), wz = gradient_taps(z, NZ, &jz0, &jz1);
    const int ys[3] = {(jy1 - y) * TW, 0, (jy0 - y) * TW}, zs[3] = {jz1 - z, 0, jz0 - z};
    const int nv = min(VX, D - i0);
#pragma unroll 1
    for (int k = 0; k < nv; ++k) {
        const int x = x0 + k;
        int jx0, jx1;
        const float wx = gradient_taps(x, N0, &jx0, &jx1);
        __local const float *t = tile + ((k + 2) * TH + ly + 2) * TW + lz + 2; /* the voxel */
        const int xs[3] = {(jx1 - x) * TH * TW, 0, (jx0 - x) * TH * TW};
        float f[3][3][3];
        FOR3(a, e, h) f[a][e][h] = t[xs[a] + ys[e] + zs[h]];
        skimage_channels(f, second_tile(t, TH * TW, x, N0), second_tile(t, TW, y, NY),
                         second_tile(t, 1, z, NZ), wx, wy, wz, c, dst, n, o,
                         ((long)(i0 + k) * NY + y) * NZ + z, E, 6 * sc);
    }
}

/* ilastik's kernels are built for one scale's radii: R (inner), RD (DoG's second Gaussian),
 * RO (outer), so that their loops unroll. The axes 1 and 2 are extended through the index maps
 * my, mz (position p at p + 2: its index, or -1 for cval). */
#ifndef R
#define R 2
#define RD 1
#define RO 1
#endif

/* P at local row r (-1: cval) and mapped yy, zz */
#define P_AT(r, yy, zz) \
    select(P[((long)max(r, 0) * NY + max(yy, 0)) * NZ + max(zz, 0)], cval, \
           (r) < 0 || (yy) < 0 || (zz) < 0)

/* ilastik's features at the inner scale as scipy's gaussian_filter runs them, 1D passes along
 * axes 0, 1 and 2 over the rows q of the structure tensor's product field in one kernel
 * (ilastik_xyz), which writes the products (T: 6 planes of NQ rows) and the output rows'
 * channels but the structure tensor's eigenvalues; then the outer smoothing (ilastik_outer_xy,
 * ilastik_outer: axes 1 and 2 extended by the mode where they leave the volume) and those. */
/* the five tap arrays of a scale's weights wt, each centred: w[t] for t = -R .. R */
#define TAPS_OF(wt)                                                                    \
    __global const float *w0 = (wt) + 2, *w1 = (wt) + TAPS + 2, *w2 = (wt) + 2 * TAPS + 2, \
                         *wd = (wt) + 3 * TAPS + 2, *wo = (wt) + 4 * TAPS + 2
#define LZ 32 /* ilastik_xyz's work-groups: LZ x LY */
#define SLACK 32 /* floats before and after V: its rows stay 128-byte aligned */
#ifndef LY
#define LY 8
#endif

/* The passes along axes 0, 1 and 2 of a work-group's LY x LZ voxels of row q, each into local
 * memory: X (the Gaussian, its first and second derivatives and DoG's Gaussian along axis 0)
 * over the group's rows of axis 1 and R more on each side, Y (its seven combinations along
 * axis 1) over its positions of axis 2 and R more on each side, then along axis 2, and what
 * follows from it at each voxel: the structure tensor's products g_a g_b (00, 11, 22, 01, 02,
 * 12) over the NQ rows into T; on the rows that are output rows (qout: the output row of each
 * q, or -1) the smoothing, LoG, gradient magnitude, DoG and the Hessian's eigenvalues */
__kernel __attribute__((reqd_work_group_size(LZ, LY, 1))) void
ilastik_xyz(__global const float *restrict P_all, const int pp, const int NP,
            __global const int *restrict rows, const int NQ, __global const float *restrict wt,
            __global const int *restrict my, __global const int *restrict mz,
            __global const int *restrict qout, const int NY, const int NZ, const float cval,
            __global float *restrict T, __global float *restrict dst, const long n,
            const int os, const int ol, const int om, const int od, const int oh,
            __global float *restrict E)
{
    __local float Xl[4][LY + 4][LZ + 4];
    __local float Yl[7][LY][LZ + 4];
    const int lz = (int)get_local_id(0), ly = (int)get_local_id(1), lid = ly * LZ + lz;
    const int z = (int)get_global_id(0), y = (int)get_global_id(1), q = (int)get_global_id(2);
    const int y0 = y - ly, z0 = z - lz; /* the group's first voxel */
    __global const float *P = P_all + (long)pp * NP * NY * NZ;
    __global const int *rq = rows + q * TAPS;
    TAPS_OF(wt);
    /* X at positions y0 - 2 + a of axis 1 (my[y0 + a]) and z0 - 2 + j of axis 2 (mz[z0 + j]) */
    for (int k = lid; k < (LY + 4) * (LZ + 4); k += LY * LZ) {
        const int a = k / (LZ + 4), j = k - a * (LZ + 4);
        if (y0 + a < NY + 4 && z0 + j < NZ + 4) {
            const int yy = my[y0 + a], zz = mz[z0 + j];
            float x0 = 0.0f, x1 = 0.0f, x2 = 0.0f, xd = 0.0f;
#pragma unroll
            for (int cx = -R; cx <= R; ++cx) {
                const float v = P_AT(rq[2 + cx], yy, zz);
                x0 += w0[cx] * v;
                x1 += w1[cx] * v;
                x2 += w2[cx] * v;
                if (cx >= -RD && cx <= RD) xd += wd[cx] * v;
            }
            Xl[0][a][j] = x0, Xl[1][a][j] = x1, Xl[2][a][j] = x2, Xl[3][a][j] = xd;
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    /* Y at positions y0 + a of axis 1 and z0 - 2 + j of axis 2 */
    for (int k = lid; k < LY * (LZ + 4); k += LY * LZ) {
        const int a = k / (LZ + 4), j = k - a * (LZ + 4);
        if (y0 + a < NY && z0 + j < NZ + 4) {
            float y00 = 0.0f, y10 = 0.0f, y20 = 0.0f, y01 = 0.0f, y11 = 0.0f, y02 = 0.0f;
            float ydd = 0.0f;
#pragma unroll
            for (int cy = -R; cy <= R; ++cy) {
                const float x0 = Xl[0][a + 2 + cy][j], x1 = Xl[1][a + 2 + cy][j];
                const float x2 = Xl[2][a + 2 + cy][j];
                y00 += w0[cy] * x0, y10 += w0[cy] * x1, y20 += w0[cy] * x2;
                y01 += w1[cy] * x0, y11 += w1[cy] * x1, y02 += w2[cy] * x0;
                if (cy >= -RD && cy <= RD) ydd += wd[cy] * Xl[3][a + 2 + cy][j];
            }
            Yl[0][a][j] = y00, Yl[1][a][j] = y10, Yl[2][a][j] = y20, Yl[3][a][j] = y01;
            Yl[4][a][j] = y11, Yl[5][a][j] = y02, Yl[6][a][j] = ydd;
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (z >= NZ || y >= NY) return;
    float s = 0.0f, sd = 0.0f, g0 = 0.0f, g1 = 0.0f, g2 = 0.0f, h00 = 0.0f, h11 = 0.0f,
          h22 = 0.0f, h01 = 0.0f, h02 = 0.0f, h12 = 0.0f;
#pragma unroll
    for (int cz = -R; cz <= R; ++cz) {
        const int u = lz + 2 + cz;
        const float y00 = Yl[0][ly][u], y10 = Yl[1][ly][u], y20 = Yl[2][ly][u];
        const float y01 = Yl[3][ly][u], y11 = Yl[4][ly][u], y02 = Yl[5][ly][u];
        s += w0[cz] * y00, h00 += w0[cz] * y20, h11 += w0[cz] * y02, h22 += w2[cz] * y00;
        h01 += w0[cz] * y11, h02 += w1[cz] * y10, h12 += w1[cz] * y01;
        g0 += w0[cz] * y10, g1 += w0[cz] * y01, g2 += w1[cz] * y00;
        if (cz >= -RD && cz <= RD) sd += wd[cz] * Yl[6][ly][u];
    }
    const long plane = (long)NQ * NY * NZ, t = ((long)q * NY + y) * NZ + z;
    T[t] = g0 * g0, T[plane + t] = g1 * g1, T[2 * plane + t] = g2 * g2;
    T[3 * plane + t] = g0 * g1, T[4 * plane + t] = g0 * g2, T[5 * plane + t] = g1 * g2;
    const int i = qout[q];
    if (i < 0) return;
    const long v = ((long)i * NY + y) * NZ + z;
    dst[os * n + v] = s;
    dst[ol * n + v] = h00 + h11 + h22;
    dst[om * n + v] = magnitude3(g0, g1, g2);
    dst[od * n + v] = s - sd;
    EIGEN(h00, h11, h22, h01, h02, h12, oh, 6);
}

/* The outer smoothing of the products along axes 0 and 1 (summed in that order, as scipy's
 * passes sum them) at output rows i (grows: each one's neighbours among the NQ rows by the
 * mode, -1: cval), axis 1 extended by the mode through my (position p at p + 2; -1: cval):
 * V (6 planes of D rows, from V + SLACK) */
__kernel void ilastik_outer_xy(__global const float *restrict T, const int NQ,
                               __global const int *restrict grows,
                               __global const float *restrict wt,
                               __global const int *restrict my, const int D, const int NY,
                               const int NZ, const float cval, __global float *restrict V)
{
    const int z = (int)get_global_id(0), y = (int)get_global_id(1), i = (int)get_global_id(2);
    if (z >= NZ || y >= NY || i >= D) return;
    TAPS_OF(wt);
    const long plane = (long)NQ * NY * NZ, vplane = (long)D * NY * NZ;
    __global const int *gr = grows + i * 3 + 1;
    const long v = ((long)i * NY + y) * NZ + z;
#pragma unroll
    for (int p = 0; p < 6; ++p) {
        float w = 0.0f;
#pragma unroll
        for (int cy = -RO; cy <= RO; ++cy) {
            const int yy = my[y + cy + 2];
            float u = 0.0f;
#pragma unroll
            for (int cx = -RO; cx <= RO; ++cx) {
                const int r = gr[cx], out = r < 0 || yy < 0;
                const long at = ((long)max(r, 0) * NY + max(yy, 0)) * NZ + z;
                u += wo[cx] * (out ? cval : T[p * plane + at]);
            }
            w += wo[cy] * u;
        }
        V[SLACK + p * vplane + v] = w; /* after the slack ilastik_outer reads past */
    }
}

/* ... along axis 2, extended by the mode through mz (where it gives cval, the product field's
 * cval smoothed along axes 0 and 1 as above), and the structure tensor's eigenvalues of output
 * rows i. V has SLACK floats at either end: the neighbours along axis 2 are read at their
 * offsets (the same for every z), then the two past the ends replaced (RO <= 1) */
__kernel void ilastik_outer(__global const float *restrict V, __global const float *restrict wt,
                            __global const int *restrict mz, const int D, const int NY,
                            const int NZ, const float cval, __global float *restrict dst,
                            const long n, const int ot, __global float *restrict E)
{
    const int z = (int)get_global_id(0), y = (int)get_global_id(1), i = (int)get_global_id(2);
    if (z >= NZ || y >= NY || i >= D) return;
    TAPS_OF(wt);
    float c1 = 0.0f, c2 = 0.0f; /* cval along axis 0, then 1 */
#pragma unroll
    for (int cx = -RO; cx <= RO; ++cx) c1 += wo[cx] * cval;
#pragma unroll
    for (int cy = -RO; cy <= RO; ++cy) c2 += wo[cy] * c1;
    const long vplane = (long)D * NY * NZ, at = ((long)i * NY + y) * NZ;
    __global const float *Vs = V + SLACK;
    const int lo = mz[1], hi = mz[NZ + 2]; /* positions -1 and NZ */
    float t[6];
#pragma unroll
    for (int p = 0; p < 6; ++p) {
        __global const float *row = Vs + p * vplane + at;
        const float below = lo < 0 ? c2 : row[max(lo, 0)], above = hi < 0 ? c2 : row[max(hi, 0)];
        float s = 0.0f;
#pragma unroll
        for (int cz = -RO; cz <= RO; ++cz) {
            const float x = row[z + cz];
            s += wo[cz] * (z + cz < 0 ? below : z + cz >= NZ ? above : x);
        }
        t[p] = s;
    }
    const long v = at + z;
    EIGEN(t[0], t[1], t[2], t[3], t[4], t[5], ot, 0);
}
