/* FMA probe: the device's measured FP32 multiply-add rate, beside its theoretical peak.
 *
 * Every work-item runs CHAINS independent accumulator chains of VW-wide vectors, so the
 * device always has independent multiply-adds in flight to hide their latency; the loops
 * over BLOCK and CHAINS have compile-time trip counts and are unrolled, so loop control is a
 * negligible share of the issued instructions. Multiplier and addend are kernel arguments and
 * the chains start from the work-item's id, so the compiler can neither fold nor drop them;
 * the sum of the chains is stored for the same reason.
 *
 * fma() rather than mad(): PoCL lowers mad() to a multiply and an add (half the rate of its
 * vfmadd), while fma() is the hardware instruction on every GPU and on CPUs since 2013.
 *
 * One launch performs 2 * VW * CHAINS * BLOCK * iters FLOPs per work-item.
 *
 * Build options (-D), defaulting to the variant that suits NVIDIA GPUs:
 *   VW      vector width: 1, 2, 4, 8 or 16
 *   CHAINS  independent accumulators per work-item
 *   BLOCK   unrolled repetitions of the chains per loop iteration
 */
#ifndef VW
#define VW 4
#endif
#ifndef CHAINS
#define CHAINS 8
#endif
#ifndef BLOCK
#define BLOCK 16
#endif

#if VW == 1
typedef float vecf;
#elif VW == 2
typedef float2 vecf;
#elif VW == 4
typedef float4 vecf;
#elif VW == 8
typedef float8 vecf;
#elif VW == 16
typedef float16 vecf;
#else
#error "VW must be 1, 2, 4, 8 or 16"
#endif

__kernel void fma_probe(__global float *restrict out, const int iters, const float mul,
                        const float add)
{
    const int gid = (int)get_global_id(0);
    const vecf m = (vecf)(mul);
    const vecf a = (vecf)(add);

    vecf acc[CHAINS];
#pragma unroll
    for (int c = 0; c < CHAINS; c++) acc[c] = (vecf)((float)(gid + c));

    for (int i = 0; i < iters; i++) {
#pragma unroll
        for (int b = 0; b < BLOCK; b++) {
#pragma unroll
            for (int c = 0; c < CHAINS; c++) acc[c] = fma(acc[c], m, a);
        }
    }

    vecf sum = acc[0];
#pragma unroll
    for (int c = 1; c < CHAINS; c++) sum += acc[c];
#if VW == 1
    out[gid] = sum;
#else
    /* Every lane is live: a store of one lane would let the compiler drop the others. */
    float s = 0.0f;
    for (int l = 0; l < VW; l++) s += ((float *)&sum)[l];
    out[gid] = s;
#endif
}
