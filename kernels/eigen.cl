/* Derived features of the values a work-item holds: the eigenvalues of a symmetric 3x3 matrix
 * and a magnitude, as functions that kernels/features.cl (over a slab's responses) and
 * kernels/fused.cl (as its epilogue, from the responses it holds) share:
 * volconv/engines/features.py builds this file in front of theirs.
 *
 * Each function works on EV lanes at once (build option EV: 1, 2, 4, 8 or 16; default 1):
 * CPUs run explicit vectors, not work-items, in SIMD lanes. The code has no branch, so that
 * every lane takes the same path.
 *
 * eigen_sym3: the eigenvalues of the matrix (a00, a11, a22, a01, a02, a12), descending, in
 * float32 within a few roundings of ||A||_F, also where they coincide or nearly do (flat
 * regions, balls, tubes), where the trigonometric closed form in float32 loses
 * sqrt(eps) = 3e-4 of ||A||. The matrix is scaled by a power of two (exact), shifted by its
 * mean and scaled to C = (A - q I) / p, whose eigenvalues are the roots of
 * mu^3 - 3 mu - 2 r (r = det(C) / 2) in [-2, 2]. The root farther from the other two (the
 * largest where r >= 0, else the smallest; its gap to them is at least 1.5) comes by Newton's
 * method, its eigenvector as the largest cross product of two rows of C - mu I, and the
 * other two as the eigenvalues of C on the plane orthogonal to it (a 2x2 matrix, by a formula
 * without cancellation): the eigenvector's error moves them, and the isolated eigenvalue's
 * Rayleigh quotient, only to second order. A diagonal matrix (0 in flat regions) gives its
 * diagonal exactly; a matrix with a non-finite entry NaN.
 *
 * magnitude3: sqrt(x^2 + y^2 + z^2) in float64 where the device has doubles (no overflow, one
 * rounding), else scaled by a power of two; NaN wherever a component is NaN (the float64
 * definition's value, where C's hypot gives Inf beside an Inf).
 */

#ifndef EV
#define EV 1
#endif
#define ECAT(a, b) a##b
#define EXCAT(a, b) ECAT(a, b)
#if EV == 1
typedef float evf;
typedef int evi;
#define EV_AS_F(x) as_float(x)
#else
typedef EXCAT(float, EV) evf;
typedef EXCAT(int, EV) evi;
#define EV_AS_F(x) EXCAT(as_float, EV)(x)
#endif
#define SEL(c, a, b) select(b, a, c) /* c ? a : b, lane by lane */

#if defined(cl_khr_fp64)
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#if EV == 1
typedef double evd;
#define EV_TO_D(x) ((double)(x))
#define EV_TO_F(x) ((float)(x))
#else
typedef EXCAT(double, EV) evd;
#define EV_TO_D(x) EXCAT(convert_double, EV)(x)
#define EV_TO_F(x) EXCAT(convert_float, EV)(x)
#endif
#endif

#define NEWTON_STEPS 2 /* to the root within 1e-6: what is left moves the rest to second order */

inline void eigen_sym3(evf a00, evf a11, evf a22, evf a01, evf a02, evf a12,
                       evf *l0, evf *l1, evf *l2)
{
#if defined(EIG_FLAT) && EV == 1
    /* EIG_FLAT (one matrix a work-item): a diagonal matrix (flat regions) by a branch, what
     * the code below gives it */
    if (a01 == 0.0f && a02 == 0.0f && a12 == 0.0f) {
        const int ok = isfinite(a00 + a11 + a22) &&
                       !isnan(fmax(fmax(fabs(a00), fabs(a11)), fabs(a22)));
        const float hi = fmax(a00, a11), lo = fmin(a00, a11);
        *l0 = ok ? fmax(hi, a22) : NAN;
        *l1 = ok ? fmax(lo, fmin(hi, a22)) : NAN;
        *l2 = ok ? fmin(lo, a22) : NAN;
        return;
    }
#endif
    const evf big = fmax(fmax(fmax(fabs(a00), fabs(a11)), fmax(fabs(a22), fabs(a01))),
                         fmax(fabs(a02), fabs(a12)));
    const evi finite = isfinite(a00 + a11 + a22 + a01 + a02 + a12) && !isnan(big);
    const evi diagonal = a01 == 0.0f && a02 == 0.0f && a12 == 0.0f;
    /* times 2^-e in two factors, each a normal float: the largest entry in [1, 2) */
    const evi e = SEL(finite && big > 0.0f, ilogb(big), (evi)0);
    const evf s1 = EV_AS_F((127 - e / 2) << 23), s2 = EV_AS_F((127 - (e - e / 2)) << 23);
    const evf b00 = a00 * s1 * s2, b11 = a11 * s1 * s2, b22 = a22 * s1 * s2,
              b01 = a01 * s1 * s2, b02 = a02 * s1 * s2, b12 = a12 * s1 * s2;
    const evf q = (b00 + b11 + b22) * (1.0f / 3.0f);
    const evf p2 = ((b00 - q) * (b00 - q) + (b11 - q) * (b11 - q) + (b22 - q) * (b22 - q) +
                    2.0f * (b01 * b01 + b02 * b02 + b12 * b12)) * (1.0f / 6.0f);
    const evf p = sqrt(p2), ip = 1.0f / fmax(p, 1e-15f);
    const evf c00 = (b00 - q) * ip, c11 = (b11 - q) * ip, c22 = (b22 - q) * ip;
    const evf c01 = b01 * ip, c02 = b02 * ip, c12 = b12 * ip;
    const evf r = 0.5f * (c00 * (c11 * c22 - c12 * c12) - c01 * (c01 * c22 - c12 * c02) +
                          c02 * (c01 * c12 - c11 * c02));
    /* the largest root for |r| (convex there: Newton's steps fall to it) from the chord
     * between sqrt(3) (r = 0) and 2 (r = 1), within 0.02 of it; negated for r < 0 */
    const evf ar = fmin(fabs(r), 1.0f);
    evf mu = 1.7320508f + 0.26794919f * ar;
    for (int k = 0; k < NEWTON_STEPS; ++k)
        mu -= (mu * mu * mu - 3.0f * mu - 2.0f * ar) / (3.0f * mu * mu - 3.0f);
    mu = SEL(r >= 0.0f, mu, -mu);
    /* its eigenvector: the largest cross product of two rows of C - mu I (rank 2) */
    const evf m00 = c00 - mu, m11 = c11 - mu, m22 = c22 - mu;
    const evf xa0 = c01 * c12 - c02 * m11, xa1 = c02 * c01 - m00 * c12,
              xa2 = m00 * m11 - c01 * c01; /* rows 0 x 1 */
    const evf xb0 = c01 * m22 - c02 * c12, xb1 = c02 * c02 - m00 * m22,
              xb2 = m00 * c12 - c01 * c02; /* rows 0 x 2 */
    const evf xc0 = m11 * m22 - c12 * c12, xc1 = c12 * c02 - c01 * m22,
              xc2 = c01 * c12 - m11 * c02; /* rows 1 x 2 */
    const evf na = xa0 * xa0 + xa1 * xa1 + xa2 * xa2, nb = xb0 * xb0 + xb1 * xb1 + xb2 * xb2,
              nc = xc0 * xc0 + xc1 * xc1 + xc2 * xc2;
    const evi ka = na >= nb && na >= nc, kb = !ka && nb >= nc;
    const evf iv = rsqrt(fmax(fmax(na, fmax(nb, nc)), 1e-30f));
    const evf v0 = SEL(ka, xa0, SEL(kb, xb0, xc0)) * iv, v1 = SEL(ka, xa1, SEL(kb, xb1, xc1)) * iv,
              v2 = SEL(ka, xa2, SEL(kb, xb2, xc2)) * iv;
    /* the plane orthogonal to v: u = v x (the unit vector of v's smallest component), so
     * |u| >= sqrt(2 / 3); w = v x u */
    const evf f0 = fabs(v0), f1 = fabs(v1), f2 = fabs(v2);
    const evi e0 = f0 <= f1 && f0 <= f2, e1 = !e0 && f1 <= f2;
    evf u0 = SEL(e0, (evf)0.0f, SEL(e1, -v2, v1)), u1 = SEL(e0, v2, SEL(e1, (evf)0.0f, -v0)),
        u2 = SEL(e0, -v1, SEL(e1, v0, (evf)0.0f));
    const evf iu = rsqrt(u0 * u0 + u1 * u1 + u2 * u2);
    u0 *= iu, u1 *= iu, u2 *= iu;
    const evf w0 = v1 * u2 - v2 * u1, w1 = v2 * u0 - v0 * u2, w2 = v0 * u1 - v1 * u0;
#define QUAD(x0, x1, x2, y0, y1, y2) /* x' C y */                                      \
    (x0 * (c00 * y0 + c01 * y1 + c02 * y2) + x1 * (c01 * y0 + c11 * y1 + c12 * y2) +  \
     x2 * (c02 * y0 + c12 * y1 + c22 * y2))
    const evf vv = QUAD(v0, v1, v2, v0, v1, v2), uu = QUAD(u0, u1, u2, u0, u1, u2),
              ww = QUAD(w0, w1, w2, w0, w1, w2), uw = QUAD(u0, u1, u2, w0, w1, w2);
#undef QUAD
    const evf h = 0.5f * (uu + ww), d = sqrt(0.25f * (uu - ww) * (uu - ww) + uw * uw);
    /* p2 below 1e-30: q is within 1e-15 ||A||_F of every eigenvalue */
    const evf g = SEL(p2 < 1e-30f, (evf)0.0f, p);
    const evf t1 = EV_AS_F((127 + e / 2) << 23), t2 = EV_AS_F((127 + (e - e / 2)) << 23);
    const evf x = SEL(diagonal, a00, (q + g * vv) * t1 * t2),
              y = SEL(diagonal, a11, (q + g * (h + d)) * t1 * t2),
              z = SEL(diagonal, a22, (q + g * (h - d)) * t1 * t2);
    const evf hi = fmax(x, y), lo = fmin(x, y);
    *l0 = SEL(finite, fmax(hi, z), (evf)NAN);
    *l1 = SEL(finite, fmax(lo, fmin(hi, z)), (evf)NAN);
    *l2 = SEL(finite, fmin(lo, z), (evf)NAN);
}

/* The features as an epilogue (kernels/fused.cl, tree.cl, tree_yz.cl: their FEATURES, a
 * sequence of these over response indices and feature planes): the kernel defines RESP(f),
 * response f of the voxels at hand, and FEAT_STORE(o, v), writing v to feature plane o. */
#define EIG3(a, b, c, d, e, f, o)                                                           \
    {                                                                                       \
        evf l0_, l1_, l2_;                                                                  \
        eigen_sym3(RESP(a), RESP(b), RESP(c), RESP(d), RESP(e), RESP(f), &l0_, &l1_, &l2_); \
        FEAT_STORE(o, l0_) FEAT_STORE(o + 1, l1_) FEAT_STORE(o + 2, l2_)                    \
    }
#define MAG2(a, b, o) FEAT_STORE(o, magnitude3(RESP(a), RESP(b), (evf)0.0f))
#define MAG3(a, b, c, o) FEAT_STORE(o, magnitude3(RESP(a), RESP(b), RESP(c)))
#define PICK(a, o) FEAT_STORE(o, RESP(a))
#define DIFF(a, b, o) FEAT_STORE(o, RESP(a) - RESP(b))

inline evf magnitude3(evf x, evf y, evf z)
{
#ifdef cl_khr_fp64
    const evd dx = EV_TO_D(x), dy = EV_TO_D(y), dz = EV_TO_D(z);
    const evf r = EV_TO_F(sqrt(dx * dx + dy * dy + dz * dz));
#else
    const evf big = fmax(fmax(fabs(x), fabs(y)), fabs(z));
    const evi e = SEL(isfinite(big) && big > 0.0f, ilogb(big), (evi)0);
    const evf s1 = EV_AS_F((127 - e / 2) << 23), s2 = EV_AS_F((127 - (e - e / 2)) << 23);
    const evf t1 = EV_AS_F((127 + e / 2) << 23), t2 = EV_AS_F((127 + (e - e / 2)) << 23);
    const evf sx = x * s1 * s2, sy = y * s1 * s2, sz = z * s1 * s2;
    const evf r = SEL(isinf(big), (evf)INFINITY, sqrt(sx * sx + sy * sy + sz * sz) * t1 * t2);
#endif
    return SEL(isnan(x) || isnan(y) || isnan(z), (evf)NAN, r);
}
