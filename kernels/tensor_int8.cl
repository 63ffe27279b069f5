/* Bank convolution on NVIDIA tensor cores in integers: an implicit GEMM on
 * mma.sync.m16n8k32 (uint8/int8 volume x int8 coefficient digits, int32 accumulation) through
 * inline PTX (compute capability >= 8.0).
 *
 * Same input and output as bank_conv.cl: a padded slab (P0, P1, P2) already extended by the
 * boundary mode (pad.cl), filters flipped by the host, responses (N, D, NY, NZ) of a "valid"
 * correlation, exactly scipy.ndimage.convolve of the unpadded data. P2 is a multiple of 4 (the
 * plan's for this engine): rows are read as aligned 32-bit words.
 *
 * Exactness: the host scales each filter by a power of two 2^e into 24-bit integers and
 * splits them into three signed 8-bit digits (C = d0 + 2^8 d1 + 2^16 d2). The digits are extra
 * GEMM columns: each A fragment feeds the MMAs of all three, whose int32 sums are exact; they
 * are combined in two float FMAs, so the only errors are the coefficients' rounding to 23 bits
 * below the filter's largest and the output's (two roundings; each sum below 2^24 converts
 * exactly up to 514 taps, a larger one rounds once more, 2^-24 of itself).
 * (|sum| <= taps x 128 x 255 < 2^31 for every extent up to 31^3: no int32 overflow.)
 *
 * GEMM: M = 16 outputs along z, N = 8 filters (of one digit), K = 32 taps: four "items" of 8
 * consecutive dz taps of one input row. Lane (g, t) holds k = 4t..4t+3 and 16+4t..16+4t+3 of
 * rows m = g, g + 8: item pair P = 2j + h (h: the register half) is items 2P + (t >> 1), so
 * lanes t < 2 and t >= 2 read different items. A row of KZ taps takes NSEG items: NSEG = 1
 * (KZ <= 8, an item pair spans two rows: the lane's row is shifted by t >> 1) or NSEG even
 * (an item pair is 16 taps of one row: the lane's z is shifted by 8 (t >> 1)). A is a sliding
 * window over a row (Toeplitz), read from a plane tile in local memory stored as byte quads
 * Q[i] = row[i..i+3], so a lane's 4 bytes at any z are one aligned 32-bit load.
 *
 * Data flow: a work-group of WY x WZ warps owns TY = WY * TYW output rows by 16 * WZ outputs
 * along z and walks its run of x, XO outputs per step; a ring of KX + 2 XO - 1 plane tiles,
 * the next step's fetched into registers during the MMAs of a step and stored after some of
 * them, one barrier per x step. Each warp holds TYW x XO x NT x 3 int32 accumulator tiles
 * and reads its rows once per plane; its outputs go through a small stage in local memory,
 * to be written in 16-byte stores.
 *
 * Build options (-D), all compile-time invariants (volconv/engines/tensor.py derives them):
 *   KX, KY, KZ   filter extents
 *   IN_T         padded slab type: uchar or char (then IN_SIGNED)
 *   NSEG         items per input row (1, or even)
 *   NJ           MMAs per dx and digit (item pairs 2 NJ)
 *   NROWS, NQ    rows (past the output's) and 8-word columns a lane reads per dx
 *   LROWS, PL    rows of a plane tile, quads per row (a multiple of 4)
 *   NT           8-filter tiles per warp (filters per pass: 8 * NT)
 *   WY, WZ, TYW  warps along y and z, output rows per warp
 *   XC           outputs along x per work-group (a grid of tiles x chunks)
 *   PERSISTENT   optional: as many work-groups as run at once, each taking an equal run of
 *                the x steps of all tiles in turn
 *   BLOCAL       optional: the pass's B fragments copied to local memory once
 *   DXU          optional: unroll factor of the loop over dx (default: the compiler's)
 *   EMULATE_MMA  optional: emulate mma.sync through local memory (any device; tests)
 *   WGMMA        optional (sm_90a): each warpgroup of 4 warps runs wgmma.mma_async m64nNk32
 *                (N = 24 NT: the NT tiles' three digits) instead of the warps' mma.sync; A
 *                from each warp's registers (rows 16w.. of M are warp w's outputs, the same
 *                fragments as mma.sync's), B from local memory through a matrix descriptor;
 *                1: the dx steps wait for each other's MMAs, 2: the next dx's A registers are
 *                loaded while the MMAs of this one run (wait_group 1)
 *   XO           optional, with WGMMA: outputs along x per step (XO x NT <= 4). Each plane's A
 *                fragments feed outputs x..x + XO - 1 in one wgmma of up to XO times the
 *                columns (filter dx = p for x, p - 1 for x + 1, ...: adjacent tiles in local
 *                memory): 1 / XO of the A loads per MMA, XO times the accumulators per row
 *   WGMMA_COMMENT  optional: the wgmma lines as PTX comments "//@ ..." (NVIDIA's OpenCL
 *                compiles for sm_90, which refuses them: volconv/engines/tensor.py uncomments them
 *                in the PTX and builds that for sm_90a)
 */

#define ND 3 /* digits per coefficient */
#ifndef XO
#define XO 1
#endif
#define TY (WY * TYW)
#define NWARPS (WY * WZ)
#define NTHREADS (32 * NWARPS)
#define PLANE (LROWS * PL) /* quads per plane tile */
#define PLANE4 (PLANE / 4) /* uint4 per plane tile */
#define RING (KX + 2 * XO - 1) /* the planes a step reads, and XO being stored */
#define STAGE ((PLANE4 + NTHREADS - 1) / NTHREADS)

#ifdef IN_SIGNED
#define A_PTX "s8"
#define A_SIGNED true
#else
#define A_PTX "u8"
#define A_SIGNED false
#endif

#if NSEG != 1 && NSEG % 2 != 0
#error "NSEG must be 1 or even"
#endif
#if defined(WGMMA) && (NWARPS % 4 != 0 || !defined(BLOCAL))
#error "WGMMA needs whole warpgroups and the B tiles in local memory"
#endif
#if XO != 1 && (XO * NT > 4 || !defined(WGMMA))
#error "XO is 1, or XO x NT <= 4 on WGMMA"
#endif
#if PL % 4 != 0
#error "PL must be a multiple of 4"
#endif

/* Item pair P: its row (past the lane's) and first 8-word column. */
#if NSEG == 1
#define PROW(P) (2 * (P))
#define PCOL(P) 0
#else
#define PROW(P) ((P) / (NSEG / 2))
#define PCOL(P) (2 * ((P) % (NSEG / 2)))
#endif

#ifdef EMULATE_MMA
/* mma.sync.m16n8k32 row.col s32 (u8|s8).s8 s32 by the PTX fragment layout, one warp's
 * fragments exchanged through local memory (every work-item of the group reaches every
 * call). */
static int byte_of(uint w, int i, bool is_signed)
{
    const uint b = (w >> (8 * i)) & 0xffu;
    return is_signed ? (int)(char)b : (int)b;
}

static void mma_emulated(int *c, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1,
                         __local uint *scratch, int lane)
{
    __local uint *mine = scratch + lane * 6;
    mine[0] = a0; mine[1] = a1; mine[2] = a2; mine[3] = a3; mine[4] = b0; mine[5] = b1;
    barrier(CLK_LOCAL_MEM_FENCE);
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; i++) {
        const int m = g + 8 * (i >> 1), n = 2 * t + (i & 1);
        int sum = 0;
        for (int k = 0; k < 32; k++) {
            /* A[m][k]: lane (m & 7, (k & 15) / 4), register (m >> 3) + 2 (k >> 4) */
            const uint aw = scratch[((m & 7) * 4 + ((k & 15) >> 2)) * 6 + (m >> 3) + 2 * (k >> 4)];
            /* B[k][n]: lane (n, (k & 15) / 4), register k >> 4 */
            const uint bw = scratch[(n * 4 + ((k & 15) >> 2)) * 6 + 4 + (k >> 4)];
            sum += byte_of(aw, k & 3, A_SIGNED) * byte_of(bw, k & 3, true);
        }
        c[i] += sum;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

#define MMA(c, a0, a1, a2, a3, b0, b1) mma_emulated(c, a0, a1, a2, a3, b0, b1, scratch, lane)
#define WARP_SYNC() barrier(CLK_LOCAL_MEM_FENCE)

#else
#define MMA_PTX(A) "mma.sync.aligned.m16n8k32.row.col.s32." A ".s8.s32 "
#define MMA(c, a0, a1, a2, a3, b0, b1)                                                   \
    asm(MMA_PTX(A_PTX) "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};" \
        : "+r"((c)[0]), "+r"((c)[1]), "+r"((c)[2]), "+r"((c)[3])                         \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
/* the warp's lanes meet, their local memory accesses ordered */
#define WARP_SYNC() asm volatile("bar.warp.sync -1;" ::: "memory")
#endif

#ifdef WGMMA
/* B tile of one (dx, j): NC = 3 NT core-matrix columns of 8 n x 32 k bytes, K-major without
 * swizzle (core matrices of 8 rows x 16 bytes; LBO 128: the second 16 k, SBO 256: the next
 * 8 n); column n = 8 (3 nt + digit) + filter, so the accumulators are acc[yy][xo][nt][digit][4].
 * The tiles of one j lie dx descending, so tiles dx, dx - 1, ... follow each other: the
 * columns of outputs x (dx), x + 1 (dx - 1), ... of one plane, one wgmma of u units of NC
 * columns (u outputs along x). */
#define NC (ND * NT)
#define BTILE (NC * 256) /* bytes */
#define TILE_INDEX(dx, j) ((j) * KX + KX - 1 - (dx))
#define WG_DESC(base) ((ulong)(((base) >> 4) & 0x3fff) | (8ul << 16) | (16ul << 32))
#ifdef EMULATE_MMA
#define WG_FENCE()
#define WG_COMMIT()
#define WG_WAIT0()
#define WG_WAIT1()
#define WG_HOLD(c)
/* the wgmma of one warp's 16 rows and ncols core columns: an emulated m16n8k32 per 8 columns,
 * b read from the tile; accumulate 0: D = A B */
#define WG_EMULATED(c, a0, a1, a2, a3, tile, accumulate, ncols)                           \
    do {                                                                                     \
        for (int ch = 0; ch < (ncols); ch++) {                                               \
            __local const uint *bt = (__local const uint *)(tile) + ch * 64 + g * 4 + t;     \
            if (!(accumulate))                                                               \
                for (int i = 0; i < 4; i++) (c)[4 * ch + i] = 0;                             \
            mma_emulated((c) + 4 * ch, a0, a1, a2, a3, bt[0], bt[32], scratch, lane);        \
        }                                                                                    \
    } while (0)
#define WG_UNITS(u, row, off, a, tile, accumulate) \
    WG_EMULATED((row) + (off), a, tile, accumulate, (u) * NC)
#else
#ifdef WGMMA_COMMENT
#define WG_LINE "//@ "
#else
#define WG_LINE ""
#endif
#define WG_FENCE() asm volatile(WG_LINE "wgmma.fence.sync.aligned;" ::: "memory")
#define WG_COMMIT() asm volatile(WG_LINE "wgmma.commit_group.sync.aligned;" ::: "memory")
#define WG_WAIT0() asm volatile(WG_LINE "wgmma.wait_group.sync.aligned 0;" ::: "memory")
#define WG_WAIT1() asm volatile(WG_LINE "wgmma.wait_group.sync.aligned 1;" ::: "memory")
#define R4(c) "+r"((c)[0]), "+r"((c)[1]), "+r"((c)[2]), "+r"((c)[3])
#define R12(c) R4(c), R4((c) + 4), R4((c) + 8)
#define R24(c) R12(c), R12((c) + 12)
#define R36(c) R24(c), R12((c) + 24)
#define R48(c) R24(c), R24((c) + 24)
#define WG_PTX(N, A) "wgmma.mma_async.sync.aligned.m64n" N "k32.s32." A ".s8 "
#define WG_IN(a0, a1, a2, a3, desc, accumulate) \
    "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(accumulate)
#define D12 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11"
#define D24 D12 ", %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23"
#define D36 D24 ", %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35"
#define D48 D36 ", %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
/* m64nNk32 (N = 24, 48, 96: u8.s8 has no 72): N / 2 accumulators, A's four registers, the B
 * descriptor, the accumulate flag. accumulate 0: D = A B (the accumulators' old values
 * unread: no register writes before an output's first MMA, which wgmma.fence would have to
 * separate); WG_HOLD keeps their reads after the waits */
#define WG_N24(c, a0, a1, a2, a3, desc, accumulate)                                          \
    asm volatile(WG_LINE "{.reg .pred p; setp.ne.b32 p, %17, 0; " WG_PTX("24", A_PTX)        \
                 "{" D12 "}, {%12, %13, %14, %15}, %16, p;}"                                 \
                 : R12(c) : WG_IN(a0, a1, a2, a3, desc, accumulate))
#define WG_N48(c, a0, a1, a2, a3, desc, accumulate)                                          \
    asm volatile(WG_LINE "{.reg .pred p; setp.ne.b32 p, %29, 0; " WG_PTX("48", A_PTX)        \
                 "{" D24 "}, {%24, %25, %26, %27}, %28, p;}"                                 \
                 : R24(c) : WG_IN(a0, a1, a2, a3, desc, accumulate))
#define WG_N96(c, a0, a1, a2, a3, desc, accumulate)                                          \
    asm volatile(WG_LINE "{.reg .pred p; setp.ne.b32 p, %53, 0; " WG_PTX("96", A_PTX)        \
                 "{" D48 "}, {%48, %49, %50, %51}, %52, p;}"                                 \
                 : R48(c) : WG_IN(a0, a1, a2, a3, desc, accumulate))
/* the wgmma of u units of NC columns (u outputs along x: u NT of 24 columns) on the
 * accumulators row[off..]; every branch's registers within the row, also the ones unrolling
 * leaves dead, so that the row stays in registers */
#define WG_AT(row, off, k) ((row) + min((off), 12 * (XO * NT - (k))))
#if XO * NT == 1
#define WG_UNITS(u, row, off, a, tile, accumulate) WG_N24(row, a, tile, accumulate)
#elif XO * NT == 2
#define WG_UNITS(u, row, off, a, tile, accumulate)                                        \
    do {                                                                                     \
        if ((u) * NT == 1) WG_N24(WG_AT(row, off, 1), a, tile, accumulate);                  \
        else WG_N48(row, a, tile, accumulate);                                               \
    } while (0)
#elif XO * NT == 3
#define WG_UNITS(u, row, off, a, tile, accumulate)                                        \
    do {                                                                                     \
        if ((u) * NT == 1) WG_N24(WG_AT(row, off, 1), a, tile, accumulate);                  \
        else if ((u) * NT == 2) WG_N48(WG_AT(row, off, 2), a, tile, accumulate);             \
        else { /* n72 is no u8.s8 shape: 48 + 24 */                                          \
            WG_N48(row, a, tile, accumulate);                                                \
            WG_N24(row + 24, a, (tile) + 2 * BTILE / 16, accumulate);                        \
        }                                                                                    \
    } while (0)
#else
#define WG_UNITS(u, row, off, a, tile, accumulate)                                        \
    do {                                                                                     \
        if ((u) * NT == 1) WG_N24(WG_AT(row, off, 1), a, tile, accumulate);                  \
        else if ((u) * NT == 2) WG_N48(WG_AT(row, off, 2), a, tile, accumulate);             \
        else if ((u) * NT == 3) { /* n72 is no u8.s8 shape: 48 + 24 */                       \
            WG_N48(WG_AT(row, off, 3), a, tile, accumulate);                                 \
            WG_N24(WG_AT(row, off, 3) + 24, a, (tile) + 2 * BTILE / 16, accumulate);         \
        } else WG_N96(row, a, tile, accumulate);                                             \
    } while (0)
#endif
#if XO * NT == 1
#define WG_HOLD(c) asm volatile("" : R12(c) :: "memory")
#elif XO * NT == 2
#define WG_HOLD(c) asm volatile("" : R24(c) :: "memory")
#elif XO * NT == 3
#define WG_HOLD(c) asm volatile("" : R36(c) :: "memory")
#else
#define WG_HOLD(c) asm volatile("" : R48(c) :: "memory")
#endif
#endif
#endif

#define SROW 20 /* floats per filter row of a warp's output stage: stores and loads conflict-free */

__kernel __attribute__((reqd_work_group_size(NTHREADS, 1, 1)))
void tensor_int8(__global const IN_T *restrict in,     /* padded slab (P0, P1, P2) */
                 __global float *restrict out,         /* responses (N, D, NY, NZ) */
                 __global const uint2 *restrict bfrag, /* (KX, NJ, NT, digit, lane) fragments */
                 __global const float *restrict unscale, /* 2^-e per filter of the pass */
                 const int D, const int ny, const int nz,
                 const int P1, const int P2,
                 const long plane,                     /* D * ny * nz */
                 const int f0,                         /* first filter of this pass */
                 const int nreal)                      /* real filters in this pass */
{
    __local uint4 ring4[RING * PLANE4];
    __local const uint *ring = (__local const uint *)ring4;
    const int lid = (int)get_local_id(0);
#define NFRAG (KX * NJ * NT * ND * 32)
#ifdef BLOCAL
    __local uint4 bfrag_local4[NFRAG / 2];
    __local uint2 *bfrag_local = (__local uint2 *)bfrag_local4;
    for (int i = lid; i < NFRAG / 2; i += NTHREADS)
        bfrag_local4[i] = ((__global const uint4 *)bfrag)[i];
#if defined(WGMMA) && !defined(EMULATE_MMA)
    /* read next by the tensor cores (the async proxy) */
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
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
    __local float4 stage_all[NWARPS * 8 * SROW / 4]; /* each warp's outputs of one row */
    __local float *stage = (__local float *)stage_all + warp * 8 * SROW;
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

        /* The lane's place in its A fragments: row m = g (+8), k = 4t.. of item 2P + (t >> 1) */
#if NSEG == 1
        const int lrow = t >> 1, lz = g + 4 * (t & 1);
#else
        const int lrow = 0, lz = g + 4 * (t & 1) + 8 * (t >> 1);
#endif
        const int abase = (wy * TYW + lrow) * PL + wz * 16 + lz;

        /* Plane xp of the padded slab into registers: the 7 bytes of four quads (one uint4)
         * as the two aligned words that hold them (rows start at multiples of 4 bytes: P2 is
         * one), zero outside the slab's planes and rows; packed when stored, after the MMAs,
         * which so need not wait for the loads. The last quads' bytes past a row's end (the
         * next row's) only meet zero coefficients or outputs past nz: never stored. */
        uint pre[STAGE][2];
        const long words = (long)P0 * P1 * P2 / 4;
#define FETCH(xp)                                                                        \
        for (int q = 0; q < STAGE; q++) {                                                    \
            const int idx = lid + q * NTHREADS;                                              \
            const int r = idx / (PL / 4), c = 4 * (idx - r * (PL / 4));                      \
            const int yg = y_wg + r;                                                         \
            const bool ok = idx < PLANE4 && (xp) < P0 && yg < P1;                            \
            const long w = (((long)(xp) * P1 + yg) * P2 + z_wg + c) / 4;                     \
            for (int e = 0; e < 2; e++)                                                      \
                pre[q][e] = (ok && w + e < words) ? ((__global const uint *)in)[w + e] : 0u; \
        }
/* bytes i..i + 3 of the two words */
#define QUAD(b, i) ((i) ? (b)[0] >> (8 * (i)) | (b)[1] << (32 - 8 * (i)) : (b)[0])
#define STORE(slot)                                                                      \
        for (int q = 0; q < STAGE; q++) {                                                    \
            const int idx = lid + q * NTHREADS;                                              \
            if (idx < PLANE4)                                                                \
                ring4[(slot) * PLANE4 + idx] =                                               \
                    (uint4)(QUAD(pre[q], 0), QUAD(pre[q], 1), QUAD(pre[q], 2), QUAD(pre[q], 3)); \
        }

        for (int p = 0; p < KX + XO - 1; p++) {
            FETCH(x_wg + p)
            STORE(p)
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        for (int xl = 0; xl < nx; xl += XO) {
            const bool more = xl + XO < nx;
            if (more) {
                FETCH(x_wg + xl + KX + XO - 1) /* in flight during the MMAs */
            }

            int acc[TYW][XO][NT][ND][4];
#if !defined(WGMMA) /* wgmma's first MMAs do not read them */
#pragma unroll
            for (int yy = 0; yy < TYW; yy++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int d = 0; d < ND; d++)
#pragma unroll
                        for (int i = 0; i < 4; i++) acc[yy][0][nt][d][i] = 0;
#endif

#ifdef WGMMA
#ifdef EMULATE_MMA
#define WG_TILE(dx, j) (bfrag_local4 + TILE_INDEX(dx, j) * (BTILE / 16))
#else
            const uint bsm = (uint)(ulong)bfrag_local4; /* shared window address */
#define WG_TILE(dx, j) (WG_DESC(bsm) + (ulong)(TILE_INDEX(dx, j) * (BTILE / 16)))
#endif
            /* The planes of a step, in the order their MMAs run: plane KX + XO - 2 (output
             * x + XO - 1 alone, dx KX - 1), then planes 0, 1, ..., each output's first MMA one
             * that writes it alone (accumulate 0 sets the whole instruction's D): output xo's
             * at plane xo, but x + XO - 1's at the first. */
#define NSTEP (KX + XO - 1)
#define PLANE_OF(s) ((s) == 0 ? KX + XO - 2 : (s) - 1)
            uint R[2][NROWS][NQ];
#define LOAD_R(buf, p)                                                                    \
            {                                                                                \
                __local const uint *a = ring + ((xl + (p)) % RING) * PLANE + abase;          \
                _Pragma("unroll") for (int r = 0; r < NROWS; r++)                            \
                _Pragma("unroll") for (int q = 0; q < NQ; q++) R[buf][r][q] = a[r * PL + 8 * q]; \
            }
#define A_FRAGS(yy, j) R[cur][(yy) + PROW(2 * (j))][PCOL(2 * (j))],                      \
                       R[cur][(yy) + PROW(2 * (j))][PCOL(2 * (j)) + 1],                      \
                       R[cur][(yy) + PROW(2 * (j) + 1)][PCOL(2 * (j) + 1)],                  \
                       R[cur][(yy) + PROW(2 * (j) + 1)][PCOL(2 * (j) + 1) + 1]
/* Step s of the planes: its MMAs (__VA_ARGS__, per j and row yy; p its plane), then the next
 * plane's A loaded and the next x step's planes fetched, one at a time through the step. */
#if WGMMA == 2
#define WG_WAIT_PREVIOUS() WG_WAIT1() /* step s - 1's MMAs, which read the other buffer */
#else
#define WG_WAIT_PREVIOUS() WG_WAIT0()
#endif
#define PLANE_STEP(s, ...)                                                                \
            {                                                                                \
                const int cur = (s) & 1, p = PLANE_OF(s);                                    \
                WG_FENCE();                                                                  \
                _Pragma("unroll") for (int j = 0; j < NJ; j++)                               \
                _Pragma("unroll") for (int yy = 0; yy < TYW; yy++) {                         \
                    int *row = &acc[yy][0][0][0][0];                                         \
                    __VA_ARGS__                                                              \
                }                                                                            \
                WG_COMMIT();                                                                 \
                if ((s) + 1 < NSTEP) {                                                       \
                    WG_WAIT_PREVIOUS();                                                      \
                    LOAD_R(cur ^ 1, PLANE_OF((s) + 1))                                       \
                }                                                                            \
                _Pragma("unroll") for (int i = 1; i < XO; i++)                               \
                    if (more && (s) == i * NSTEP / XO) {                                     \
                        STORE((xl + KX + XO - 2 + i) % RING)                                 \
                        FETCH(x_wg + xl + KX + XO - 1 + i)                                   \
                    }                                                                        \
            }
            /* Three loops, so that each, unrolled, stays within the compiler's unroll budget
             * (else acc would be indexed at run time: local memory). Output xo meets plane p
             * at dx = p - xo, outputs lo..hi = XO - 1 at once where p >= XO - 1. */
            LOAD_R(0, PLANE_OF(0))
            PLANE_STEP(0, WG_UNITS(1, row, (XO - 1) * NC * 4, A_FRAGS(yy, j),
                                   WG_TILE(KX - 1, j), j > 0);) /* x + XO - 1's first */
#pragma unroll
            for (int s = 1; s < XO; s++) /* planes 0..XO - 2: output p's first MMAs */
                PLANE_STEP(s, const int lo = max(0, p - KX + 1);
                           if (p > lo) WG_UNITS(p - lo, row, lo * NC * 4, A_FRAGS(yy, j),
                                                WG_TILE(p - lo, j), 1);
                           WG_UNITS(1, row, p * NC * 4, A_FRAGS(yy, j), WG_TILE(0, j), j > 0);)
#pragma unroll
            for (int s = XO; s < NSTEP; s++) /* planes XO - 1..KX + XO - 3 */
                PLANE_STEP(s, const int lo = max(0, p - KX + 1);
                           WG_UNITS(XO - lo, row, lo * NC * 4, A_FRAGS(yy, j),
                                    WG_TILE(p - lo, j), 1);)
            WG_WAIT0();
#pragma unroll
            for (int yy = 0; yy < TYW; yy++) WG_HOLD(&acc[yy][0][0][0][0]);
#else
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
                const int bf = dx * (NJ * NT * ND * 32) + lane;
#pragma unroll
                for (int j = 0; j < NJ; j++) {
                    const int r0 = PROW(2 * j), q0 = PCOL(2 * j);
                    const int r1 = PROW(2 * j + 1), q1 = PCOL(2 * j + 1);
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        uint2 b[ND];
#pragma unroll
                        for (int d = 0; d < ND; d++)
                            b[d] = BFRAG[bf + ((j * NT + nt) * ND + d) * 32];
#pragma unroll
                        for (int yy = 0; yy < TYW; yy++)
#pragma unroll
                            for (int d = 0; d < ND; d++)
                                MMA(acc[yy][0][nt][d], R[yy + r0][q0], R[yy + r0][q0 + 1],
                                    R[yy + r1][q1], R[yy + r1][q1 + 1], b[d].x, b[d].y);
                    }
                }
            }

#endif

            /* C fragment: c[i] is output z0 + g (+8 for i >= 2) of filter 2t (+1 for odd i). */
#pragma unroll
            for (int xo = 0; xo < XO; xo++) { /* all XO through the stage (no break: acc in
                                               * registers), stored within the run */
                const bool in_run = xo < nx - xl;
                const long xrow = (long)(x_wg + xl + xo) * ny;
#pragma unroll
                for (int yy = 0; yy < TYW; yy++) {
                    const int y = y_wg + wy * TYW + yy;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        /* through the warp's stage: lane (f, c) then holds z0 + 4c..4c+3 of
                         * filter f, one 16-byte store (a quarter of the store instructions) */
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            /* the digits' sums in FMAs (exact products by powers of two):
                             * two roundings, against int64 sums' one, which cost 5 % at N 8 */
                            const float u = unscale[nt * 8 + 2 * t + (i & 1)];
                            const float v = fma((float)acc[yy][xo][nt][2][i], 65536.0f * u,
                                                fma((float)acc[yy][xo][nt][1][i], 256.0f * u,
                                                    (float)acc[yy][xo][nt][0][i] * u));
                            stage[(2 * t + (i & 1)) * SROW + g + 8 * (i >> 1)] = v;
                        }
                        WARP_SYNC();
                        const float4 v =
                            *(__local const float4 *)(stage + (lane >> 2) * SROW + 4 * (lane & 3));
                        WARP_SYNC();
                        const int f = nt * 8 + (lane >> 2);
                        const int z = z_wg + wz * 16 + 4 * (lane & 3);
                        if (in_run && y < ny && f < nreal) {
                            __global float *o =
                                out + (long)(f0 + f) * plane + (xrow + y) * nz + z;
                            if (z + 3 < nz && ((ulong)o & 15) == 0) {
                                *(__global float4 *)o = v;
                            } else {
                                if (z < nz) o[0] = v.x;
                                if (z + 1 < nz) o[1] = v.y;
                                if (z + 2 < nz) o[2] = v.z;
                                if (z + 3 < nz) o[3] = v.w;
                            }
                        }
                    }
                }
            }

            if (more) { /* the plane fetched last, into plane xl - 1's slot: read by no output
                         * from here */
                STORE((xl + KX + 2 * XO - 2) % RING)
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
    }
}
