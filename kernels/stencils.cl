/* The presets' second stage: every channel of one scale from that scale's smoothed field, in one
 * kernel, written into the preset's output planes (plane o at o * n, n = depth * NY * NZ).
 *
 * Built after kernels/features.cl (volconv/engines/scales.py concatenates the two sources):
 * eigenvalues3 and USE_DOUBLE are that file's.
 *
 * skimage_scale: skimage.feature.multiscale_basic_features at one sigma from G, the Gaussian of
 * the image (rows R0 .. R0 + NR - 1 of the volume, covering the slab's rows and 2 more on each
 * side inside the volume): the intensity G * c (c: img_as_float32's scale of integer inputs),
 * the Sobel magnitude as skimage.filters.sobel computes it (the axis Sobels with ndi's 'reflect',
 * sqrt of the sum of their squares / 3) and the descending eigenvalues of the Hessian by
 * np.gradient twice (central differences inside, one-sided at the volume's border).
 *
 * ilastik_gradients, ilastik_scale: ilastik's features at its inner scale from P, the
 * presmoothed volume; P's rows are given by row tables (the local row of each neighbour, -1
 * where constant mode gives cval), the other axes are extended by the bank's mode here, so
 * every stage takes the bank's mode as scipy's gaussian_filter of P would. Taps: the
 * correlation weights w[t], t = -R .. R, of the Gaussian (w0), its first (w1) and second (w2)
 * derivatives at the inner scale, DoG's second Gaussian (wd, radius RD) and the structure
 * tensor's outer Gaussian (wo, radius RO), each stored centred at index 2 of 5. The sums run
 * axis 0, then 1, then 2 (scipy's order of 1D passes) and skip the zero centre tap of odd
 * orders, as scipy's correlate1d does, so NaN and Inf spread as they do there.
 */

#define TAPS 5 /* the inner scale's radius int(2 * sigma + 0.5) <= 2 */

/* The index p of an axis of length n extended by mode (0 reflect, 1 mirror, 2 nearest,
 * 3 constant, 4 wrap), as volconv/engines/boundary.py's extend_indices; -1: cval. */
int extend(const int p, const int n, const int mode)
{
    if (p >= 0 && p < n) return p;
    if (mode == 3) return -1;
    if (mode == 2) return p < 0 ? 0 : n - 1;
    if (mode == 4) return ((p % n) + n) % n;
    if (mode == 1 && n == 1) return 0;
    const int period = mode == 0 ? 2 * n : 2 * n - 2;
    const int q = ((p % period) + period) % period;
    return q < n ? q : (mode == 0 ? period - 1 - q : period - q);
}

/* np.gradient's two taps at index i of an axis of length n: (f[j0] - f[j1]) * w */
void gradient_taps(const int i, const int n, int *j0, int *j1, float *w)
{
    if (n < 2) {
        *j0 = *j1 = i, *w = 0.0f;
    } else if (i == 0) {
        *j0 = 1, *j1 = 0, *w = 1.0f;
    } else if (i == n - 1) {
        *j0 = n - 1, *j1 = n - 2, *w = 1.0f;
    } else {
        *j0 = i + 1, *j1 = i - 1, *w = 0.5f;
    }
}

__kernel void skimage_scale(__global const float *restrict G, const int gp, const int R0,
                            const int NR, const int A, const int N0, const int NY,
                            const int NZ, const float c, __global float *restrict dst,
                            const long n, const int o)
{
    const int z = (int)get_global_id(0), y = (int)get_global_id(1), i = (int)get_global_id(2);
    if (z >= NZ || y >= NY || (long)i * NY * NZ >= n) return;
    const int x = A + i;
    __global const float *g = G + (long)gp * NR * NY * NZ - (long)R0 * NY * NZ;
#define AT(p, q, r) (c * g[((long)(p) * NY + (q)) * NZ + (r)])
    /* Sobel: 'reflect' at distance 1 repeats the border voxel */
    const int xs[3] = {max(x - 1, 0), x, min(x + 1, N0 - 1)};
    const int ys[3] = {max(y - 1, 0), y, min(y + 1, NY - 1)};
    const int zs[3] = {max(z - 1, 0), z, min(z + 1, NZ - 1)};
    const float sm[3] = {0.25f, 0.5f, 0.25f};
    float e0 = 0.0f, e1 = 0.0f, e2 = 0.0f;
    for (int u = 0; u < 3; ++u)
        for (int v = 0; v < 3; ++v) {
            const float s = sm[u] * sm[v];
            e0 += s * (AT(xs[2], ys[u], zs[v]) - AT(xs[0], ys[u], zs[v]));
            e1 += s * (AT(xs[u], ys[2], zs[v]) - AT(xs[u], ys[0], zs[v]));
            e2 += s * (AT(xs[u], ys[v], zs[2]) - AT(xs[u], ys[v], zs[0]));
        }
#ifdef USE_DOUBLE
    const float edges = (float)sqrt(((double)e0 * e0 + (double)e1 * e1 + (double)e2 * e2) / 3.0);
#else
    const float edges = hypot(hypot(e0, e1), e2) * 0.57735026918962576f;
#endif
    /* the Hessian by np.gradient twice: H[a][b] = D_b D_a G */
    int t[3][2];
    float w[3];
    const int at[3] = {x, y, z}, len[3] = {N0, NY, NZ};
    for (int a = 0; a < 3; ++a) gradient_taps(at[a], len[a], &t[a][0], &t[a][1], &w[a]);
    float h[3][3];
    for (int a = 0; a < 3; ++a)
        for (int b = a; b < 3; ++b) {
            float sum = 0.0f;
            for (int p = 0; p < 2; ++p) { /* D_b's taps */
                int q[3] = {x, y, z};
                q[b] = t[b][p];
                int k0, k1;
                float wa;
                gradient_taps(q[a], len[a], &k0, &k1, &wa); /* D_a at the tap */
                int q0[3] = {q[0], q[1], q[2]}, q1[3] = {q[0], q[1], q[2]};
                q0[a] = k0, q1[a] = k1;
                const float d = (AT(q0[0], q0[1], q0[2]) - AT(q1[0], q1[1], q1[2])) * wa;
                sum += p == 0 ? d : -d;
            }
            h[a][b] = sum * w[b];
        }
    float l[3];
    eigenvalues3(h[0][0], h[1][1], h[2][2], h[0][1], h[0][2], h[1][2], l);
#undef AT
    const long v = ((long)i * NY + y) * NZ + z;
    dst[o * n + v] = c * g[((long)x * NY + y) * NZ + z];
    dst[(o + 1) * n + v] = edges;
    dst[(o + 2) * n + v] = l[0];
    dst[(o + 3) * n + v] = l[1];
    dst[(o + 4) * n + v] = l[2];
}

/* P at local row r (-1: cval), y, z extended by mode */
#define P_AT(r, yy, zz) \
    ((r) < 0 || (yy) < 0 || (zz) < 0 ? cval : P[((long)(r) * NY + (yy)) * NZ + (zz)])

/* The three gradients of P at the inner scale on rows q of the structure tensor's product field
 * (rows: TAPS local P rows per q), into planes 0..2 of gout (NQ rows each). */
__kernel void ilastik_gradients(__global const float *restrict P_all, const int pp, const int NP,
                                __global const int *restrict rows, const int NQ,
                                __global const float *restrict wt, const int R, const int NY,
                                const int NZ, const int mode, const float cval,
                                __global float *restrict gout)
{
    const int z = (int)get_global_id(0), y = (int)get_global_id(1), q = (int)get_global_id(2);
    if (z >= NZ || y >= NY || q >= NQ) return;
    __global const float *P = P_all + (long)pp * NP * NY * NZ;
    __global const float *w0 = wt + 2, *w1 = wt + TAPS + 2;
    float g0 = 0.0f, g1 = 0.0f, g2 = 0.0f;
    for (int cz = -R; cz <= R; ++cz) {
        const int zz = extend(z + cz, NZ, mode);
        float t10 = 0.0f, t01 = 0.0f, t00 = 0.0f;
        for (int cy = -R; cy <= R; ++cy) {
            const int yy = extend(y + cy, NY, mode);
            float x0 = 0.0f, x1 = 0.0f;
            for (int cx = -R; cx <= R; ++cx) {
                const float v = P_AT(rows[q * TAPS + 2 + cx], yy, zz);
                x0 += w0[cx] * v;
                if (cx != 0) x1 += w1[cx] * v;
            }
            t10 += w0[cy] * x1;
            t00 += w0[cy] * x0;
            if (cy != 0) t01 += w1[cy] * x0;
        }
        g0 += w0[cz] * t10;
        g1 += w0[cz] * t01;
        if (cz != 0) g2 += w1[cz] * t00;
    }
    const long plane = (long)NQ * NY * NZ, v = ((long)q * NY + y) * NZ + z;
    gout[v] = g0;
    gout[plane + v] = g1;
    gout[2 * plane + v] = g2;
}

/* One scale's ten channels for output rows i: smoothing, LoG, gradient magnitude, DoG, the
 * structure tensor's eigenvalues (from the gradients g on rows grows[i]) and the Hessian's. */
__kernel void ilastik_scale(__global const float *restrict P_all, const int pp, const int NP,
                            __global const int *restrict prows, __global const float *restrict g,
                            const int NQ, __global const int *restrict grows,
                            __global const float *restrict wt, const int R, const int RD,
                            const int RO, const int D, const int NY, const int NZ,
                            const int mode, const float cval, __global float *restrict dst,
                            const long n, const int os, const int ol, const int om,
                            const int od, const int ot, const int oh)
{
    const int z = (int)get_global_id(0), y = (int)get_global_id(1), i = (int)get_global_id(2);
    if (z >= NZ || y >= NY || i >= D) return;
    __global const float *P = P_all + (long)pp * NP * NY * NZ;
    __global const float *w0 = wt + 2, *w1 = wt + TAPS + 2, *w2 = wt + 2 * TAPS + 2;
    __global const float *wd = wt + 3 * TAPS + 2, *wo = wt + 4 * TAPS + 2;
    float s = 0.0f, sd = 0.0f, h00 = 0.0f, h11 = 0.0f, h22 = 0.0f, h01 = 0.0f, h02 = 0.0f,
          h12 = 0.0f;
    for (int cz = -R; cz <= R; ++cz) {
        const int zz = extend(z + cz, NZ, mode);
        float y00 = 0.0f, y10 = 0.0f, y20 = 0.0f, y01 = 0.0f, y11 = 0.0f, y02 = 0.0f, ydd = 0.0f;
        for (int cy = -R; cy <= R; ++cy) {
            const int yy = extend(y + cy, NY, mode);
            float x0 = 0.0f, x1 = 0.0f, x2 = 0.0f, xd = 0.0f;
            for (int cx = -R; cx <= R; ++cx) {
                const float v = P_AT(prows[i * TAPS + 2 + cx], yy, zz);
                x0 += w0[cx] * v;
                x2 += w2[cx] * v;
                if (cx != 0) x1 += w1[cx] * v;
                if (cx >= -RD && cx <= RD) xd += wd[cx] * v;
            }
            y00 += w0[cy] * x0;
            y10 += w0[cy] * x1;
            y20 += w0[cy] * x2;
            y02 += w2[cy] * x0;
            if (cy != 0) y01 += w1[cy] * x0, y11 += w1[cy] * x1;
            if (cy >= -RD && cy <= RD) ydd += wd[cy] * xd;
        }
        s += w0[cz] * y00;
        h00 += w0[cz] * y20;
        h11 += w0[cz] * y02;
        h22 += w2[cz] * y00;
        h01 += w0[cz] * y11;
        if (cz != 0) h02 += w1[cz] * y10, h12 += w1[cz] * y01;
        if (cz >= -RD && cz <= RD) sd += wd[cz] * ydd;
    }
    /* the structure tensor: the products of g, extended by mode, smoothed by wo */
    const long gplane = (long)NQ * NY * NZ;
    float t00 = 0.0f, t11 = 0.0f, t22 = 0.0f, t01 = 0.0f, t02 = 0.0f, t12 = 0.0f;
    for (int cz = -RO; cz <= RO; ++cz) {
        const int zz = extend(z + cz, NZ, mode);
        for (int cy = -RO; cy <= RO; ++cy) {
            const int yy = extend(y + cy, NY, mode);
            for (int cx = -RO; cx <= RO; ++cx) {
                const int r = grows[i * 3 + 1 + cx];
                const float k = wo[cx] * wo[cy] * wo[cz];
                if (r < 0 || yy < 0 || zz < 0) {
                    t00 += k * cval, t11 += k * cval, t22 += k * cval;
                    t01 += k * cval, t02 += k * cval, t12 += k * cval;
                } else {
                    const long v = ((long)r * NY + yy) * NZ + zz;
                    const float a = g[v], b = g[gplane + v], c = g[2 * gplane + v];
                    t00 += k * (a * a), t11 += k * (b * b), t22 += k * (c * c);
                    t01 += k * (a * b), t02 += k * (a * c), t12 += k * (b * c);
                }
            }
        }
    }
    const long own = ((long)grows[i * 3 + 1] * NY + y) * NZ + z;
    const float a = g[own], b = g[gplane + own], c = g[2 * gplane + own];
#ifdef USE_DOUBLE
    float mag = (float)sqrt((double)a * a + (double)b * b + (double)c * c);
#else
    float mag = hypot(hypot(a, b), c);
#endif
    if (isnan(a) || isnan(b) || isnan(c)) mag = NAN;
    const long v = ((long)i * NY + y) * NZ + z;
    dst[os * n + v] = s;
    dst[ol * n + v] = h00 + h11 + h22;
    dst[om * n + v] = mag;
    dst[od * n + v] = s - sd;
    float l[3];
    eigenvalues3(t00, t11, t22, t01, t02, t12, l);
    dst[ot * n + v] = l[0], dst[(ot + 1) * n + v] = l[1], dst[(ot + 2) * n + v] = l[2];
    eigenvalues3(h00, h11, h22, h01, h02, h12, l);
    dst[oh * n + v] = l[0], dst[(oh + 1) * n + v] = l[1], dst[(oh + 2) * n + v] = l[2];
}
