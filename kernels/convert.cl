/* float32 responses into the stored types on the device, bit for bit as volconv/engines/convert.py's
 * `encode` makes them on the host with numpy, so that only the stored bytes are downloaded.
 *
 * to_float16: finite values saturate at +-65504, then round to nearest even (numpy's
 *   npy_floatbits_to_halfbits, done in integers so that no device's float16 support or
 *   denormal flushing enters); +-inf stays, a NaN keeps its sign and high payload bits.
 * Each call converts values [first, end) (a call stays under 2^31 values, so that a count
 * fits its uint).
 * to_uint8: rint((v - offset) / scale) in float32 (built with
 *   -cl-fp32-correctly-rounded-divide-sqrt, as numpy divides), clipped to [0, 255], NaN as 0;
 *   counts[2 call] gets the NaNs, counts[2 call + 1] the voxels clipped (call: the index of
 *   this call among those of one conversion). Each work-item counts its values,
 *   each work-group adds them in local memory and once into counts, so a badly chosen scale
 *   (half the voxels clipped) costs no contention on two addresses.
 */
#define GROUP 256    /* work-items a group of to_uint8 (volconv/engines/convert.py's GROUP) */
#define PER_ITEM 16  /* values each work-item of to_uint8 converts */

ushort half_bits(const float v)
{
    const uint f = as_uint(v);
    const uint sign = (f >> 16) & 0x8000u;
    const uint e = f & 0x7f800000u;
    uint m = f & 0x007fffffu;
    if (e == 0x7f800000u) {  /* inf; a NaN stays a NaN however its payload is cut */
        uint h = 0x7c00u + (m >> 13);
        if (m != 0 && h == 0x7c00u) h++;
        return (ushort)(sign | h);
    }
    if ((f & 0x7fffffffu) >= 0x477fe000u)  /* |v| >= 65504 = 0x477fe000 */
        return (ushort)(sign | 0x7bffu);  /* |v| >= 65504: saturated, as np.clip does */
    if (e <= 0x38000000u) {  /* a subnormal half or a signed zero */
        if (e < 0x33000000u) return (ushort)sign;
        const uint shift = 113u - (e >> 23);
        m = (0x00800000u + m) >> shift;
        if ((m & 0x3fffu) != 0x1000u || (f & 0x7ffu)) m += 0x1000u;
        return (ushort)(sign + (m >> 13));
    }
    const uint h_exp = (e - 0x38000000u) >> 13;
    if ((m & 0x3fffu) != 0x1000u) m += 0x1000u;
    return (ushort)(sign + h_exp + (m >> 13));  /* a carry into the exponent is right */
}

__kernel void to_float16(__global const float *restrict src, __global ushort *restrict dst,
                         const ulong first, const ulong end)
{
    const ulong i = first + get_global_id(0);
    if (i < end) dst[i] = half_bits(src[i]);
}

__kernel __attribute__((reqd_work_group_size(GROUP, 1, 1)))
void to_uint8(__global const float *restrict src, __global uchar *restrict dst,
              __global uint *restrict counts, const ulong first, const ulong end,
              const float scale, const float offset, const uint call)
{
    __local uint group[2];
    const uint lid = (uint)get_local_id(0);
    if (lid == 0) {
        group[0] = 0;
        group[1] = 0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    /* PER_ITEM values a work-item, GROUP apart (neighbours read neighbours), counted here */
    const ulong at = first + (ulong)get_group_id(0) * GROUP * PER_ITEM + lid;
    uint nans = 0, clipped = 0;
    for (uint j = 0; j < PER_ITEM; j++) {
        const ulong i = at + (ulong)j * GROUP;
        if (i < end) {
            const float q = rint((src[i] - offset) / scale);
            const int nan = isnan(q);
            nans += nan ? 1u : 0u;
            clipped += (q < 0.0f || q > 255.0f) ? 1u : 0u;
            dst[i] = nan ? (uchar)0 : (uchar)clamp(q, 0.0f, 255.0f);
        }
    }
    if (nans) atomic_add(&group[0], nans);
    if (clipped) atomic_add(&group[1], clipped);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid == 0) {
        if (group[0]) atomic_add(&counts[2 * call], group[0]);
        if (group[1]) atomic_add(&counts[2 * call + 1], group[1]);
    }
}
