/* Derived features from the responses of a slab, on the device, before the download.
 *
 * volconv/engines/separable.py leaves the separable responses of a slab in one buffer, plane after
 * plane (slot s at s * n, n = depth * ny * nz); volconv/bank/features.py launches one kernel per
 * feature over the voxels of the slab, reading the planes of its inputs and writing its
 * outputs into a second buffer of planes (plane o at o * n).
 *
 * magnitude: sqrt(a^2 + b^2 [+ c^2]) (gradient magnitude, Gabor energy), kernels/eigen.cl's
 * magnitude3.
 *
 * pick: a response as it is (a linear feature of a preset, stored in the preset's order);
 * difference: a - b (a difference of Gaussians as two responses).
 *
 * product_pad: a structure tensor's six products g_p * g_q (00, 11, 22, 01, 02, 12) of three
 * gradient planes, gathered into the six padded slabs its outer smoothing reads (stacked
 * along axis 0), through the index maps of pad.cl (the product field extended by the bank's
 * mode; -1: cval).
 *
 * eigen3: the eigenvalues of the symmetric 3x3 matrix of six planes (00, 11, 22, 01, 02, 12),
 * in descending order (kernels/eigen.cl's eigen_sym3).
 *
 * The element-wise kernels take EV consecutive voxels per work-item (kernels/eigen.cl, which
 * the host builds in front of this file).
 */

#if EV == 1
#define LOADE(p) (*(p))
#define STOREE(v, p) (*(p) = (v))
#else
#define LOADE(p) EXCAT(vload, EV)(0, p)
#define STOREE(v, p) EXCAT(vstore, EV)(v, 0, p)
#endif
/* x = the EV elements of p from i (0 past n) */
#define LOAD_LANES(x, p, i, n)                                            \
    if (i + EV <= n) {                                                    \
        x = LOADE((p) + i);                                               \
    } else {                                                              \
        float t_[EV];                                                     \
        for (int l = 0; l < EV; ++l) t_[l] = i + l < n ? (p)[i + l] : 0.0f; \
        x = LOADE(t_);                                                    \
    }
#define STORE_LANES(x, p, i, n)                                           \
    if (i + EV <= n) {                                                    \
        STOREE(x, (p) + i);                                               \
    } else {                                                              \
        float t_[EV];                                                     \
        STOREE(x, t_);                                                    \
        for (int l = 0; i + l < n; ++l) (p)[i + l] = t_[l];               \
    }

__kernel void magnitude(__global const float *restrict src, const int a, const int b,
                        const int c, /* c < 0: two components */
                        __global float *restrict dst, const int o, const long n)
{
    const long i = get_global_id(0) * EV;
    if (i >= n) return;
    evf x, y, z = 0.0f;
    LOAD_LANES(x, src + a * n, i, n)
    LOAD_LANES(y, src + b * n, i, n)
    if (c >= 0) LOAD_LANES(z, src + c * n, i, n)
    STORE_LANES(magnitude3(x, y, z), dst + o * n, i, n)
}

__kernel void pick(__global const float *restrict src, const int a,
                   __global float *restrict dst, const int o, const long n)
{
    const long i = get_global_id(0) * EV;
    if (i >= n) return;
    evf x;
    LOAD_LANES(x, src + a * n, i, n)
    STORE_LANES(x, dst + o * n, i, n)
}

__kernel void difference(__global const float *restrict src, const int a, const int b,
                         __global float *restrict dst, const int o, const long n)
{
    const long i = get_global_id(0) * EV;
    if (i >= n) return;
    evf x, y;
    LOAD_LANES(x, src + a * n, i, n)
    LOAD_LANES(y, src + b * n, i, n)
    STORE_LANES(x - y, dst + o * n, i, n)
}

__kernel void eigen3(__global const float *restrict src, const int i00, const int i11,
                     const int i22, const int i01, const int i02, const int i12,
                     __global float *restrict dst, const int o, const long n,
                     const long stride) /* of src's planes */
{
    const long i = get_global_id(0) * EV;
    if (i >= n) return;
    evf a00, a11, a22, a01, a02, a12, l0, l1, l2;
    LOAD_LANES(a00, src + i00 * stride, i, n)
    LOAD_LANES(a11, src + i11 * stride, i, n)
    LOAD_LANES(a22, src + i22 * stride, i, n)
    LOAD_LANES(a01, src + i01 * stride, i, n)
    LOAD_LANES(a02, src + i02 * stride, i, n)
    LOAD_LANES(a12, src + i12 * stride, i, n)
    eigen_sym3(a00, a11, a22, a01, a02, a12, &l0, &l1, &l2);
    STORE_LANES(l0, dst + o * n, i, n)
    STORE_LANES(l1, dst + (o + 1) * n, i, n)
    STORE_LANES(l2, dst + (o + 2) * n, i, n)
}

__kernel void product_pad(__global const float *restrict g, /* 3 planes of NR x NY x NZ */
                          const int NR,
                          __global float *restrict dst,         /* 6 x (P0, P1, P2) */
                          __global const int *restrict p0s,     /* the padded rows to fill */
                          __global const int *restrict m0,      /* their rows of g; -1: cval */
                          __global const int *restrict m1, __global const int *restrict m2,
                          const int NP, const int P0, const int P1, const int P2, const int NY,
                          const int NZ, const float cval)
{
    const int p2 = (int)get_global_id(0), p1 = (int)get_global_id(1), k = (int)get_global_id(2);
    if (p2 >= P2 || p1 >= P1 || k >= NP) return;
    const int i0 = m0[k], i1 = m1[p1], i2 = m2[p2];
    const long slab = (long)P0 * P1 * P2, at = ((long)p0s[k] * P1 + p1) * P2 + p2;
    float x = cval, y = cval, z = cval, w = cval, u = cval, v = cval;
    if (i0 >= 0 && i1 >= 0 && i2 >= 0) {
        const long plane = (long)NR * NY * NZ, i = ((long)i0 * NY + i1) * NZ + i2;
        const float a = g[i], b = g[plane + i], c = g[2 * plane + i];
        x = a * a, y = b * b, z = c * c, w = a * b, u = a * c, v = b * c;
    }
    dst[at] = x, dst[slab + at] = y, dst[2 * slab + at] = z;
    dst[3 * slab + at] = w, dst[4 * slab + at] = u, dst[5 * slab + at] = v;
}
