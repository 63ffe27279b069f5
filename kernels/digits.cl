/* 8-bit digits of a padded slab, for an engine that holds 8-bit inputs exactly (the tensor
 * cores), and the sum of the digits' responses (volconv/engines/tensor.py, DigitConvolver).
 *
 * A slab of 16-bit integers is exactly x = 256 hi + lo. A float slab is first a fixed-point
 * number q = rint(x / 2^s) of DIGITS x 8 bits, with one power of two 2^s per slab chosen from
 * its largest |x| (slab_max): q's top digit is signed, the others unsigned, and
 * x ~ 2^s (256^(D-1) q_top + ... + 256 q_1 + q_0). Since the convolution is linear, each
 * digit's response is summed the same way, in FP32, by `combine`.
 *
 * Build options (-D): SRC_T the padded slab's element type; DIGITS the number of digits;
 * FIXED_POINT for a float slab (else the slab holds integers, s = 0).
 */

#ifdef FIXED_POINT
/* The slab's exponent s: its largest |x| = f 2^e (f in [0.5, 1)) maps to f 2^(8 DIGITS - 1),
 * the top of the signed fixed point. */
int slab_exponent(__global const uint *restrict max_bits)
{
    int e;
    frexp(as_float(max_bits[0]), &e);
    return e - (8 * DIGITS - 1);
}
#endif

/* The largest |x| of the slab's first n elements, into max_bits[0] (zeroed by the host):
 * non-negative floats order as their bits do, so an integer atomic_max takes it. */
__kernel void slab_max(__global const SRC_T *restrict src, const long n,
                       __global uint *restrict max_bits, __local uint *restrict part)
{
    uint m = 0;
    for (long i = get_global_id(0); i < n; i += get_global_size(0))
        m = max(m, as_uint(fabs((float)src[i])));
    const int l = get_local_id(0);
    part[l] = m;
    for (int w = get_local_size(0) / 2; w > 0; w /= 2) {
        barrier(CLK_LOCAL_MEM_FENCE);
        if (l < w)
            part[l] = max(part[l], part[l + w]);
    }
    if (l == 0)
        atomic_max((volatile __global uint *)max_bits, part[0]);
}

/* Digit `shift` / 8 of each of the slab's first n elements, as a byte (the top digit's byte
 * is its two's complement: read as char it is the signed digit). */
__kernel void split(__global const SRC_T *restrict src, __global uchar *restrict dst,
                    const long n, const int shift, __global const uint *restrict max_bits)
{
    const long i = get_global_id(0);
    if (i >= n)
        return;
#ifdef FIXED_POINT
    const long top = (1L << (8 * DIGITS - 1)) - 1;
    const long q = clamp(convert_long_rte(ldexp((float)src[i], -slab_exponent(max_bits))),
                         -top - 1, top);
#else
    const int q = (int)src[i];
#endif
    dst[i] = (uchar)(q >> shift);
}

/* out = 256 out + part: the responses of the digits so far, top first, and of the next one;
 * after the last digit (`last`) scaled by 2^s. Powers of two scale exactly. */
__kernel void combine(__global float *restrict out, __global const float *restrict part,
                      const long n, const int last, __global const uint *restrict max_bits)
{
    const long i = get_global_id(0);
    if (i >= n)
        return;
    float v = fma(out[i], 256.0f, part[i]);
#ifdef FIXED_POINT
    if (last)
        v = ldexp(v, slab_exponent(max_bits));
#endif
    out[i] = v;
}
