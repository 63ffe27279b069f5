/* Bank convolution on NVIDIA tensor cores: an implicit GEMM on mma.sync.m16n8k16 (FP16 inputs,
 * FP32 accumulation) through inline PTX (compute capability >= 8.0).
 *
 * Same input and output as bank_conv.cl: a padded slab (P0, P1, P2) already extended by the
 * boundary mode (pad.cl), filters flipped by the host, responses (N, D, NY, NZ) of a "valid"
 * correlation, exactly scipy.ndimage.convolve of the unpadded data.
 *
 * GEMM: M = 16 outputs along z (the fastest axis), N = 8 filters, K = 16 taps. A is a sliding
 * window (Toeplitz: A[m, k] = row[z0 + m + k]) over rows of one x-plane held in local memory,
 * so it is never materialised: each lane reads its fragment straight from the row. K holds
 * "items", SEG consecutive dz taps of one input row: SEG = 8 for KZ > 4 (two items, one per
 * half of K; rows longer than 8 taps take NSEG items), SEG = 4 or 2 for short rows (4 or 8
 * rows per MMA, each lane's item shifted by its column: LROW below). Taps past the filter's
 * extent carry zero coefficients.
 *
 * Accuracy: uint8/int8 are exact in FP16. The host splits each coefficient, scaled by a power
 * of two per filter, into hi + lo FP16 halves; hi and lo products go to separate FP32
 * accumulators, summed and unscaled at the end (about 22 significant bits, better than FP32's
 * 24-bit sum in practice: DESIGN.md "Tensor cores").
 *
 * Data flow: a work-group of WY x WZ warps owns TY = WY * TYW output rows (y) by 16 * WZ
 * outputs (z) and walks XC outputs along x. A ring of KX + 1 x-planes of its input tile sits
 * in local memory as packed f16 pairs (P[i] = row[i] | row[i + 1] << 16, so a lane's odd start
 * is one aligned load); the next plane is fetched into registers before the MMAs of this step
 * and stored after them, one barrier per x step. Each warp holds TYW x NT output tiles with
 * hi and lo accumulators, and per dx reads its rows once for all of them.
 *
 * Build options (-D), all compile-time invariants (volconv/tensor.py derives them):
 *   KX, KY, KZ   filter extents
 *   IN_T         padded slab type: uchar or char
 *   SEG, NSEG    taps per item (2, 4, 8) and items per input row
 *   NJ           MMAs per dx (items of the KY rows, padded to whole MMAs)
 *   ROWSPAN      input rows one output's items span (padding items included)
 *   LROWS, PL    rows of a plane tile, packed pairs per row
 *   NT           8-filter tiles per warp (filters per pass: 8 * NT)
 *   WY, WZ, TYW  warps along y and z, output rows per warp
 *   XC           outputs along x per work-group (a grid of tiles x chunks)
 *   PERSISTENT   optional: as many work-groups as run at once, each taking an equal run of
 *                the x steps of all tiles in turn (no tail wave; the ring restarts at a tile)
 *   BLOCAL       optional: the pass's B fragments copied to local memory once, not read from
 *                global (L1) memory at every dx
 *   DXU          optional: unroll factor of the loop over dx (default: the compiler's)
 *   IEEE_SUM     optional: each hi MMA starts from zero and is added to its accumulator by an
 *                IEEE FP32 add: the tensor cores' own accumulation truncates, which over the
 *                ~100 MMAs of a 9^3 or 11^3 filter drifts past the FP32 kernel's error
 *   EMULATE_MMA  optional: emulate mma.sync and cvt through local memory (any device; tests)
 */

#define IPH (8 / SEG)       /* items per half of K */
#define IPM (2 * IPH)       /* items per MMA */
#define TY (WY * TYW)
#define NWARPS (WY * WZ)
#define NTHREADS (32 * NWARPS)
#define PLANE (LROWS * PL)  /* packed pairs per plane tile */
#define RING (KX + 1)
#define STAGE ((PLANE + NTHREADS - 1) / NTHREADS)
#define NROWS (TYW - 1 + ROWSPAN) /* rows a warp reads per plane */
#define NQ (NSEG + 1)             /* 8-column steps a lane reads per row */

#if SEG != 2 && SEG != 4 && SEG != 8
#error "SEG must be 2, 4 or 8"
#endif
#if SEG < 8 && NSEG != 1
#error "short items (SEG < 8) take one per row"
#endif

#ifdef EMULATE_MMA
/* f16 bits of a small integer (|v| < 2048, exact), and float of f16 bits. */
static uint f16_bits(int v)
{
    if (v == 0) return 0u;
    const uint a = (uint)abs(v);
    const int e = 31 - (int)clz(a);
    return (v < 0 ? 0x8000u : 0u) | ((uint)(e + 15) << 10) | ((a << (10 - e)) & 0x3ffu);
}

static float f16_value(uint h)
{
    const uint e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    const float v = e == 0 ? (float)m * 0x1p-24f : as_float(((e + 112u) << 23) | (m << 13));
    return (h & 0x8000u) ? -v : v;
}

#define PACK(lo, hi) (f16_bits(lo) | (f16_bits(hi) << 16))

/* mma.sync.m16n8k16 row.col f32.f16.f16.f32 by the PTX fragment layout, one warp's fragments
 * exchanged through local memory (every work-item of the group reaches every call). */
static void mma_emulated(float *c, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1,
                         __local uint *scratch, int lane)
{
    __local uint *mine = scratch + lane * 6;
    mine[0] = a0; mine[1] = a1; mine[2] = a2; mine[3] = a3; mine[4] = b0; mine[5] = b1;
    barrier(CLK_LOCAL_MEM_FENCE);
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; i++) {
        const int m = g + 8 * (i >> 1), n = 2 * t + (i & 1);
        float sum = 0.0f;
        for (int k = 0; k < 16; k++) {
            const uint aw = scratch[((m & 7) * 4 + ((k & 7) >> 1)) * 6 + (m >> 3) + 2 * (k >> 3)];
            const uint bw = scratch[(n * 4 + ((k & 7) >> 1)) * 6 + 4 + (k >> 3)];
            const int sh = 16 * (k & 1);
            sum += f16_value((aw >> sh) & 0xffffu) * f16_value((bw >> sh) & 0xffffu);
        }
        c[i] += sum;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

#define MMA(c, a0, a1, a2, a3, b0, b1) mma_emulated(c, a0, a1, a2, a3, b0, b1, scratch, lane)
#define MMA0(d, a0, a1, a2, a3, b0, b1)                                                  \
    {                                                                                    \
        d[0] = d[1] = d[2] = d[3] = 0.0f;                                                \
        MMA(d, a0, a1, a2, a3, b0, b1);                                                  \
    }

#else
/* Two small integers as f16x2 (exact): lo in the low half, as the fragments want it. */
static inline uint pack_f16x2(float lo, float hi)
{
    uint r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

#define PACK(lo, hi) pack_f16x2((float)(lo), (float)(hi))

#define MMA(c, a0, a1, a2, a3, b0, b1)                                                   \
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "                             \
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"                \
        : "+f"((c)[0]), "+f"((c)[1]), "+f"((c)[2]), "+f"((c)[3])                         \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))

/* d = A B, from a zero accumulator */
#define MMA0(d, a0, a1, a2, a3, b0, b1)                                                  \
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "                             \
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"            \
        : "=f"((d)[0]), "=f"((d)[1]), "=f"((d)[2]), "=f"((d)[3])                         \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f))
#endif

__kernel __attribute__((reqd_work_group_size(NTHREADS, 1, 1)))
void tensor_conv(__global const IN_T *restrict in,     /* padded slab (P0, P1, P2) */
                 __global float *restrict out,         /* responses (N, D, NY, NZ) */
                 __global const uint2 *restrict bfrag, /* (KX, NJ, NT, hi/lo, lane) fragments */
                 __global const float *restrict unscale, /* 2^-e per filter of the pass */
                 const int D, const int ny, const int nz,
                 const int P1, const int P2,
                 const long plane,                     /* D * ny * nz */
                 const int f0,                         /* first filter of this pass */
                 const int nreal)                      /* real filters in this pass */
{
    __local uint ring[RING * PLANE];
    const int lid = (int)get_local_id(0);
#define NFRAG (KX * NJ * NT * 2 * 32)
#ifdef BLOCAL
    __local uint2 bfrag_local[NFRAG];
    for (int i = lid; i < NFRAG; i += NTHREADS) bfrag_local[i] = bfrag[i];
    barrier(CLK_LOCAL_MEM_FENCE);
#define BFRAG bfrag_local
#else
#define BFRAG bfrag
#endif
    const int warp = lid >> 5, lane = lid & 31, g = lane >> 2, t = lane & 3;
#ifdef EMULATE_MMA
    __local uint scratch_all[NWARPS * 32 * 6];
    __local uint *scratch = scratch_all + warp * 32 * 6;
#endif
    const int wz = warp % WZ, wy = warp / WZ;
    const int P0 = D + KX - 1;
#ifdef PERSISTENT
    const int tiles_z = (nz + 16 * WZ - 1) / (16 * WZ);
    const long total = (long)tiles_z * ((ny + TY - 1) / TY) * D; /* x steps of all tiles */
    const long per = (total + get_num_groups(0) - 1) / get_num_groups(0);
    const long end = min(total, (long)get_group_id(0) * per + per);
    for (long pos = (long)get_group_id(0) * per; pos < end;) { /* uniform in the group */
        const int tile = (int)(pos / D);
        const int z_wg = (tile % tiles_z) * (16 * WZ);
        const int y_wg = (tile / tiles_z) * TY;
        const int x_wg = (int)(pos - (long)tile * D);
        const int nx = (int)min(end - pos, (long)(D - x_wg));
        pos += nx;
#else
    {
        const int z_wg = (int)get_group_id(0) * (16 * WZ);
        const int y_wg = (int)get_group_id(1) * TY;
        const int x_wg = (int)get_group_id(2) * XC;
        const int nx = min(XC, D - x_wg); /* the same for the whole group: barriers stay uniform */
#endif

        /* The lane's place in its A fragments: k = 2t (+8) of row m = g (+8). */
#if SEG == 8
        const int lrow = 0, lz = g + 2 * t;
#else
        const int lrow = (2 * t) / SEG, lz = g + (2 * t) % SEG;
#endif
        const int abase = (wy * TYW + lrow) * PL + wz * 16 + lz;

        /* Plane xp of the padded slab into registers (as raw 16-bit pairs), zero outside it. */
        uint pre[STAGE];
#define FETCH(xp)                                                                        \
        for (int q = 0; q < STAGE; q++) {                                                    \
            const int idx = lid + q * NTHREADS;                                              \
            const int r = idx / PL, c = idx - r * PL;                                        \
            const int yg = y_wg + r, zg = z_wg + c;                                          \
            const bool ok = idx < PLANE && (xp) < P0 && yg < P1;                             \
            __global const IN_T *src = in + ((long)(xp) * P1 + yg) * P2 + zg;                \
            const int e0 = (ok && zg < P2) ? (int)src[0] : 0;                                \
            const int e1 = (ok && zg + 1 < P2) ? (int)src[1] : 0;                            \
            pre[q] = ((uint)e0 & 0xffffu) | ((uint)e1 << 16);                                \
        }
#define STORE(slot)                                                                      \
        for (int q = 0; q < STAGE; q++) {                                                    \
            const int idx = lid + q * NTHREADS;                                              \
            if (idx < PLANE)                                                                 \
                ring[(slot) * PLANE + idx] =                                                 \
                    PACK((int)(short)(pre[q] & 0xffffu), (int)(short)(pre[q] >> 16));        \
        }

        for (int p = 0; p < KX; p++) {
            FETCH(x_wg + p)
            STORE(p)
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        for (int xl = 0; xl < nx; xl++) {
            const bool more = xl + 1 < nx;
            if (more) {
                FETCH(x_wg + xl + KX) /* in flight during the MMAs */
            }

            float acc[TYW][NT][2][4];
#pragma unroll
            for (int yy = 0; yy < TYW; yy++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) acc[yy][nt][0][i] = acc[yy][nt][1][i] = 0.0f;

#ifdef DXU
#pragma unroll DXU
#endif
            for (int dx = 0; dx < KX; dx++) {
                __local const uint *a = ring + ((xl + dx) % RING) * PLANE + abase;
                uint R[NROWS][NQ];
#pragma unroll
                for (int r = 0; r < NROWS; r++)
#pragma unroll
                    for (int q = 0; q < NQ; q++) R[r][q] = a[r * PL + 8 * q];
                const int bf = dx * (NJ * NT * 2 * 32) + lane;
#pragma unroll
                for (int j = 0; j < NJ; j++) {
                    const int i0 = j * IPM, i1 = j * IPM + IPH; /* the items of each half of K */
                    const int r0 = i0 / NSEG, q0 = i0 % NSEG, r1 = i1 / NSEG, q1 = i1 % NSEG;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        const uint2 bh = BFRAG[bf + ((j * NT + nt) * 2) * 32];
                        const uint2 bl = BFRAG[bf + ((j * NT + nt) * 2 + 1) * 32];
#pragma unroll
                        for (int yy = 0; yy < TYW; yy++) {
#ifdef IEEE_SUM
                            float d[4];
                            MMA0(d, R[yy + r0][q0], R[yy + r0][q0 + 1], R[yy + r1][q1],
                                 R[yy + r1][q1 + 1], bh.x, bh.y);
#pragma unroll
                            for (int i = 0; i < 4; i++) acc[yy][nt][0][i] += d[i];
#else
                            MMA(acc[yy][nt][0], R[yy + r0][q0], R[yy + r0][q0 + 1],
                                R[yy + r1][q1], R[yy + r1][q1 + 1], bh.x, bh.y);
#endif
                            MMA(acc[yy][nt][1], R[yy + r0][q0], R[yy + r0][q0 + 1],
                                R[yy + r1][q1], R[yy + r1][q1 + 1], bl.x, bl.y);
                        }
                    }
                }
            }

            /* C fragment: c[i] is output z0 + g (+8 for i >= 2) of filter 2t (+1 for odd i). */
            const long xrow = (long)(x_wg + xl) * ny;
#pragma unroll
            for (int yy = 0; yy < TYW; yy++) {
                const int y = y_wg + wy * TYW + yy;
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int z = z_wg + wz * 16 + g + 8 * (i >> 1);
                        const int f = nt * 8 + 2 * t + (i & 1);
                        if (y < ny && z < nz && f < nreal)
                            out[(long)(f0 + f) * plane + (xrow + y) * nz + z] =
                                (acc[yy][nt][0][i] + acc[yy][nt][1][i]) * unscale[f];
                    }
            }

            if (more) {
                STORE((xl + KX) % RING) /* plane xl - 1's slot: read by no output from here */
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
    }
}
