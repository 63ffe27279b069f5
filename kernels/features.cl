/* Derived features from the responses of a slab, on the device, before the download.
 *
 * volconv/engines/separable.py leaves the separable responses of a slab in one buffer, plane after
 * plane (slot s at s * n, n = depth * ny * nz); volconv/bank/features.py launches one kernel per
 * feature over the voxels of the slab, reading the planes of its inputs and writing its
 * outputs into a second buffer of planes (plane o at o * n).
 *
 * magnitude: sqrt(a^2 + b^2 [+ c^2]) (gradient magnitude, Gabor energy) in float64 where the
 * device has doubles, else through hypot, which neither overflows nor underflows; NaN
 * wherever a component is NaN (as the float64 definition sqrt(sum of squares) gives it, where
 * C's hypot would give Inf beside an Inf).
 *
 * pick: a response as it is (a linear feature of a preset, stored in the preset's order);
 * difference: a - b (a difference of Gaussians as two responses).
 *
 * product_pad: a structure tensor's product g_p * g_q of two gradient planes, gathered into
 * the padded slab its outer smoothing reads, through the index maps of pad.cl (the product
 * field extended by the bank's mode; -1: cval).
 *
 * eigen3: the eigenvalues of the symmetric 3x3 matrix of six planes (00, 11, 22, 01, 02, 12),
 * in descending order. Where the device has doubles (cl_khr_fp64; PoCL and NVIDIA have), by
 * the shifted trigonometric closed form in float64: near coincident eigenvalues it loses
 * sqrt(eps) of float64, 1.5e-8 of ||A||, far below float32's own tolerance. Elsewhere (or
 * built with -DJACOBI) by cyclic Jacobi rotations in float32 on the matrix scaled by a power
 * of two, which are backward stable: each eigenvalue within a few float32 roundings of
 * ||A||_F. In float32 the closed form would lose sqrt(eps) = 3e-4 of ||A|| where eigenvalues
 * coincide or nearly do (flat regions, balls, tubes). A matrix with a non-finite entry has
 * NaN eigenvalues.
 */

/* doubles where the device has them (the eigenvalues' closed form, magnitudes) */
#if defined(cl_khr_fp64) && !defined(JACOBI)
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#define USE_DOUBLE 1
#endif

__kernel void magnitude(__global const float *restrict src, const int a, const int b,
                        const int c, /* c < 0: two components */
                        __global float *restrict dst, const int o, const long n)
{
    const long i = get_global_id(0);
    if (i >= n) return;
    const float x = src[a * n + i], y = src[b * n + i];
    const float z = c < 0 ? 0.0f : src[c * n + i];
#ifdef USE_DOUBLE /* doubles: no overflow, one rounding */
    float r = (float)sqrt((double)x * x + (double)y * y + (double)z * z);
#else
    float r = c < 0 ? hypot(x, y) : hypot(hypot(x, y), z);
#endif
    if (isnan(x) || isnan(y) || isnan(z)) r = NAN;
    dst[o * n + i] = r;
}

__kernel void pick(__global const float *restrict src, const int a,
                     __global float *restrict dst, const int o, const long n)
{
    const long i = get_global_id(0);
    if (i >= n) return;
    dst[o * n + i] = src[a * n + i];
}

__kernel void difference(__global const float *restrict src, const int a, const int b,
                         __global float *restrict dst, const int o, const long n)
{
    const long i = get_global_id(0);
    if (i >= n) return;
    dst[o * n + i] = src[a * n + i] - src[b * n + i];
}

__kernel void product_pad(__global const float *restrict g, /* 3 planes of NR x NY x NZ */
                          const int p, const int q, const int NR,
                          __global float *restrict dst, /* (P0, P1, P2) */
                          __global const int *restrict m0, /* P0: a row of g, or -1 */
                          __global const int *restrict m1, __global const int *restrict m2,
                          const int P0, const int P1, const int P2, const int NY, const int NZ,
                          const float cval)
{
    const int p2 = (int)get_global_id(0), p1 = (int)get_global_id(1), p0 = (int)get_global_id(2);
    if (p2 >= P2 || p1 >= P1 || p0 >= P0) return;
    const int i0 = m0[p0], i1 = m1[p1], i2 = m2[p2];
    const long at = ((long)p0 * P1 + p1) * P2 + p2;
    if (i0 < 0 || i1 < 0 || i2 < 0) {
        dst[at] = cval;
    } else {
        const long plane = (long)NR * NY * NZ, v = ((long)i0 * NY + i1) * NZ + i2;
        dst[at] = g[p * plane + v] * g[q * plane + v];
    }
}

/* One Jacobi rotation zeroing a[pq]; r is the third index. */
#define ROTATE(pp, qq, pq, rp, rq)                                                    \
    if (pq != 0.0f) {                                                                 \
        const float theta = (qq - pp) / (2.0f * pq);                                  \
        const float at = fabs(theta);                                                 \
        float t = at > 1e15f ? 0.5f / at : 1.0f / (at + sqrt(at * at + 1.0f));        \
        t = theta < 0.0f ? -t : t;                                                    \
        const float cs = 1.0f / sqrt(t * t + 1.0f), sn = t * cs;                      \
        pp -= t * pq;                                                                 \
        qq += t * pq;                                                                 \
        pq = 0.0f;                                                                    \
        const float vp = rp, vq = rq;                                                 \
        rp = cs * vp - sn * vq;                                                       \
        rq = sn * vp + cs * vq;                                                       \
    }

/* The eigenvalues, descending, of the symmetric matrix (a00, a11, a22, a01, a02, a12); NaN
 * if an entry is not finite (eigen3's, and kernels/stencils.cl's, built after this file). */
inline void eigen_sym3(float a00, float a11, float a22, float a01, float a02, float a12,
                       float *r0, float *r1, float *r2)
{
    float l0, l1, l2;
    const float m = fmax(fmax(fmax(fabs(a00), fabs(a11)), fmax(fabs(a22), fabs(a01))),
                         fmax(fabs(a02), fabs(a12)));
    const int finite = isfinite(a00) && isfinite(a11) && isfinite(a22) && isfinite(a01) &&
                       isfinite(a02) && isfinite(a12);
    if (!finite) {
        l0 = l1 = l2 = NAN;
    } else if (m == 0.0f) {
        l0 = l1 = l2 = 0.0f;
    } else {
#ifdef USE_DOUBLE
        const double mean = ((double)a00 + a11 + a22) / 3.0;
        const double b00 = a00 - mean, b11 = a11 - mean, b22 = a22 - mean;
        const double d01 = a01, d02 = a02, d12 = a12;
        const double p2 = (b00 * b00 + b11 * b11 + b22 * b22 +
                           2.0 * (d01 * d01 + d02 * d02 + d12 * d12)) / 6.0;
        if (p2 == 0.0) {
            l0 = l1 = l2 = (float)mean;
        } else {
            const double p = sqrt(p2);
            const double det = b00 * (b11 * b22 - d12 * d12) - d01 * (d01 * b22 - d12 * d02) +
                               d02 * (d01 * d12 - b11 * d02);
            const double r = fmin(1.0, fmax(-1.0, det / (2.0 * p2 * p)));
            const double phi = acos(r) / 3.0;
            const double e0 = mean + 2.0 * p * cos(phi);
            const double e2 = mean + 2.0 * p * cos(phi + 2.0943951023931957);
            l0 = (float)e0, l2 = (float)e2, l1 = (float)(3.0 * mean - e0 - e2);
        }
#else
        /* scale by a power of two (exact): no overflow in the rotations */
        const int e = ilogb(m);
        a00 = ldexp(a00, -e), a11 = ldexp(a11, -e), a22 = ldexp(a22, -e);
        a01 = ldexp(a01, -e), a02 = ldexp(a02, -e), a12 = ldexp(a12, -e);
        const float fro = a00 * a00 + a11 * a11 + a22 * a22 +
                          2.0f * (a01 * a01 + a02 * a02 + a12 * a12);
        for (int sweep = 0; sweep < 12; ++sweep) {
            const float off = a01 * a01 + a02 * a02 + a12 * a12;
            /* what is left moves no eigenvalue by more than 1.5e-7 ||A||_F (Weyl): about the
             * rotations' own rounding, which keeps the off-diagonal from going lower */
            if (off <= 1e-14f * fro) break;
            ROTATE(a00, a11, a01, a02, a12) /* (0, 1); r = 2 */
            ROTATE(a00, a22, a02, a01, a12) /* (0, 2); r = 1 */
            ROTATE(a11, a22, a12, a01, a02) /* (1, 2); r = 0 */
        }
        l0 = ldexp(a00, e), l1 = ldexp(a11, e), l2 = ldexp(a22, e);
#endif
        float t;
        if (l0 < l1) t = l0, l0 = l1, l1 = t;
        if (l1 < l2) t = l1, l1 = l2, l2 = t;
        if (l0 < l1) t = l0, l0 = l1, l1 = t;
    }
    *r0 = l0, *r1 = l1, *r2 = l2;
}

__kernel void eigen3(__global const float *restrict src, const int i00, const int i11,
                     const int i22, const int i01, const int i02, const int i12,
                     __global float *restrict dst, const int o, const long n)
{
    const long i = get_global_id(0);
    if (i >= n) return;
    float l0, l1, l2;
    eigen_sym3(src[i00 * n + i], src[i11 * n + i], src[i22 * n + i], src[i01 * n + i],
               src[i02 * n + i], src[i12 * n + i], &l0, &l1, &l2);
    dst[o * n + i] = l0;
    dst[(o + 1) * n + i] = l1;
    dst[(o + 2) * n + i] = l2;
}
