/* Bank convolution: NV filters at once, UNROLL outputs per work-item along the fastest axis.
 *
 * After M. Broxvall's register-blocked kernel (seed 003): every input value loaded feeds every
 * unrolled output it touches, for all NV filters at once through a floatNV accumulator, and
 * the loop over the fastest-axis kernel offsets is expanded by macros whose conditions are
 * compile-time constants, so the compiler keeps only the multiply-adds that exist.
 *
 * On CPUs (PoCL) the work-item loops are not vectorised: the SIMD lanes are the NV filters of
 * the accumulator, and with a float slab (plan.py pads as float32 on CPUs) the hot loop is one
 * vfmadd231ps per tap and output with the input broadcast straight from memory.
 *
 * The input is a padded slab (P0, P1, P2) already extended by the boundary mode (pad.cl), the
 * filters are flipped by the host, so this computes a "valid" correlation whose output
 * (D, NY, NZ) is exactly scipy.ndimage.convolve of the unpadded data.
 *
 * Build options (-D), all compile-time invariants:
 *   KX, KY, KZ   filter extents along axes 0, 1, 2 (axis 2 is the fastest in memory)
 *   NV           filters per pass: 1, 2, 4, 8 or 16 (the accumulator vector width)
 *   UNROLL       outputs per work-item along axis 2, 1..32, KZ + UNROLL - 1 <= 64
 *   ROWS         optional: outputs per work-item along axis 1, 1..8 (default 1)
 *   ROW_UNROLL   optional: unroll factor of the loop over input rows (0: whole, the default
 *                when ROWS > 1 without ROLL, which needs it; otherwise the compiler's choice;
 *                with ROLL, of the loop over filter rows)
 *   ROLL         optional, 1: the loop runs over filter rows, each coefficient loaded once
 *                and applied to all ROWS output rows, with a window of ROWS input rows kept
 *                in registers as floats (one new row loaded and converted per filter row);
 *                0 (default): the loop runs over input rows (below)
 *   IN_T         element type of the padded slab (uchar, char, ushort, short, float)
 *   FILT_LOCAL   1: stage the filters in local memory (seed 003); 0: read them from global
 *   BLOCK_TAPS   optional: sum blocked from this many taps on (default below)
 *   INPUT_LOCAL  optional, 1 or 2: the work-group stages each input plane it reads (x + dx)
 *                in local memory as floats, converted once per work-group, and the hot loop
 *                reads its input rows from there as float4s (below); 2: two tiles, the next
 *                plane loaded into registers before this plane's multiply-adds and stored
 *                after them (one barrier per plane); 1: one tile (two barriers per plane).
 *                Needs LZ, LY (the work-group, which the launch must use), UNROLL and P2
 *                multiples of 4; 0 (default): rows read from global memory
 */
#pragma OPENCL FP_CONTRACT ON

#if NV == 1
typedef float vecf;
#elif NV == 2
typedef float2 vecf;
#elif NV == 4
typedef float4 vecf;
#elif NV == 8
typedef float8 vecf;
#elif NV == 16
typedef float16 vecf;
#else
#error "NV must be 1, 2, 4, 8 or 16"
#endif

#if UNROLL < 1 || UNROLL > 32 || KZ + UNROLL - 1 > 64
#error "UNROLL must be 1..32 with KZ + UNROLL - 1 <= 64"
#endif

#ifndef ROWS
#define ROWS 1
#endif
#if ROWS < 1 || ROWS > 8
#error "ROWS must be 1..8"
#endif
#define PRAGMA(x) _Pragma(#x)
#define PRAGMA_UNROLL(n) PRAGMA(unroll n)
#ifndef ROLL
#define ROLL 0
#endif
#if !defined(ROW_UNROLL) && ROWS > 1 && !ROLL
#define ROW_UNROLL 0
#endif
#ifndef ROW_UNROLL
#define ROW_LOOP /* the compiler's choice */
#elif ROW_UNROLL == 0
#define ROW_LOOP PRAGMA(unroll)
#else
#define ROW_LOOP PRAGMA_UNROLL(ROW_UNROLL)
#endif

#define NTAPS (KX * KY * KZ)

/* Blocked summation for large filters: one FP32 running sum over a 31^3 filter's 29,791 taps
 * drifts past the contract's tolerance (1e-5 * sum|k| * max|v|) on bright data, so from BLOCK_TAPS taps
 * on each dx plane is summed apart and then added into the total. Measured (Gaussians of sigma
 * 0.5..10 over 255s): one sum stays within 0.25 of the tolerance up to 10^3 taps and reaches
 * 1.9x at 31^3; per plane, 0.1x at most. Smaller filters keep a single running sum: no extra
 * registers, the same code as before. */
#ifndef BLOCK_TAPS
#define BLOCK_TAPS 1000
#endif
#define BLOCKED (NTAPS >= BLOCK_TAPS)
#if BLOCKED
#define SUM part
#else
#define SUM acc
#endif

#ifndef INPUT_LOCAL
#define INPUT_LOCAL 0
#endif
#if INPUT_LOCAL
/* The input tile of one plane: TR rows of NQ float4 chunks covering the work-group's
 * LZ * UNROLL + KZ - 1 input columns. A work-item's window of WIN values starts at chunk
 * l0 * SPLIT; chunk q of a row is stored at (q % SPLIT) * PART + q / SPLIT, so that window
 * chunk k of the 8 work-items of a quarter-warp lies in 8 consecutive float4s (one LDS.128
 * without bank conflicts; in plain order they lie 32 * SPLIT bytes apart, two or more to a
 * bank) and each work-item reads chunk k at a constant offset from its own l0. PART is
 * skewed so that the staging stores of 8 consecutive chunks miss each other too. */
#if UNROLL % 4
#error "INPUT_LOCAL needs UNROLL a multiple of 4"
#endif
#if INPUT_LOCAL != 1 && INPUT_LOCAL != 2
#error "INPUT_LOCAL must be 0, 1 or 2"
#endif
#define WIN (KZ + UNROLL - 1)
#define NW ((WIN + 3) / 4)
#define SPLIT (UNROLL / 4)
#define NQ ((LZ * UNROLL + KZ - 1 + 3) / 4)
#define TR (LY * ROWS + KY - 1)
#define PART0 ((NQ + SPLIT - 1) / SPLIT)
#if SPLIT > 1 && 8 % SPLIT == 0
#define PART (PART0 + ((8 / SPLIT) - PART0 % 8 + 8) % 8)
#else
#define PART PART0
#endif
#define RS (SPLIT * PART)
#define TILE (TR * RS)
#define WG (LZ * LY)
#define STAGE_N ((TR * NQ + WG - 1) / WG)

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define IN_T4 CAT(IN_T, 4)

/* Load this work-item's share of plane `xp`'s tile, 4 values a load (P2 and zbase are
 * multiples of 4): chunk i = t + k * WG, rows past the slab and chunks past P2 clamped (read
 * only for outputs that are never stored). */
inline void tile_load(IN_T4 pre[STAGE_N], __global const IN_T *restrict in, const int xp,
                      const int ybase, const int zbase, const int P1, const int P2,
                      const int t)
{
    __global const IN_T *plane_in = in + (long)xp * P1 * P2;
#pragma unroll
    for (int k = 0; k < STAGE_N; k++) {
        const int i = min(t + k * WG, TR * NQ - 1);
        const int row = min(ybase + i / NQ, P1 - 1);
        const int col = min(zbase + 4 * (i % NQ), P2 - 4);
        pre[k] = *(__global const IN_T4 *)(plane_in + row * P2 + col);
    }
}

inline void tile_store(__local float4 *tile, IN_T4 pre[STAGE_N], const int t)
{
#pragma unroll
    for (int k = 0; k < STAGE_N; k++) {
        const int i = t + k * WG;
        if (k + 1 < STAGE_N || i < TR * NQ) {
            const int q = i % NQ;
            tile[(i / NQ) * RS + (q % SPLIT) * PART + q / SPLIT] = convert_float4(pre[k]);
        }
    }
}

/* Input row `r` of the tile (relative to the work-group's first) as WIN floats. */
#define TILE_ROW(dst, tile, r)                                                         \
    {                                                                                  \
        __local const float4 *t_ = (tile) + (l1 * ROWS + (r)) * RS + l0;               \
        _Pragma("unroll") for (int k_ = 0; k_ < NW; k_++) {                            \
            const float4 q_ = t_[(k_ % SPLIT) * PART + k_ / SPLIT];                    \
            dst[4 * k_] = q_.s0;                                                       \
            if (4 * k_ + 1 < WIN) dst[4 * k_ + 1] = q_.s1;                             \
            if (4 * k_ + 2 < WIN) dst[4 * k_ + 2] = q_.s2;                             \
            if (4 * k_ + 3 < WIN) dst[4 * k_ + 3] = q_.s3;                             \
        }                                                                              \
    }
#endif

/* One multiply-add of the input value at z-offset `pos` of input row `r` into output `u` of
 * output row `v`: it exists only when 0 <= pos - u < KZ and 0 <= r - v < KY, which the
 * compiler decides once `r` is unrolled, so no branch survives. */
#define MADV(v, u, pos)                                                              \
    if ((v) < ROWS && r - (v) >= 0 && r - (v) < KY) {                                \
        SUM[(v)][(u)] += raw * filt[foff - (v) * KZ + (pos) - (u)];                  \
    }

#if ROWS == 1
#define MAD(u, pos)                                                      \
    if ((u) < UNROLL && (pos) - (u) >= 0 && (pos) - (u) < KZ) {          \
        SUM[0][(u)] += raw * filt[foff + (pos) - (u)];                   \
    }
#else
#define MAD(u, pos)                                                      \
    if ((u) < UNROLL && (pos) - (u) >= 0 && (pos) - (u) < KZ) {          \
        MADV(0, u, pos) MADV(1, u, pos) MADV(2, u, pos) MADV(3, u, pos)  \
        MADV(4, u, pos) MADV(5, u, pos) MADV(6, u, pos) MADV(7, u, pos)  \
    }
#endif

#define MADS(pos)                                                                      \
    if ((pos) < KZ + UNROLL - 1) {                                                     \
        const float raw = (float)row[(pos)];                                           \
        MAD(0, pos) MAD(1, pos) MAD(2, pos) MAD(3, pos) MAD(4, pos) MAD(5, pos)        \
        MAD(6, pos) MAD(7, pos) MAD(8, pos) MAD(9, pos) MAD(10, pos) MAD(11, pos)      \
        MAD(12, pos) MAD(13, pos) MAD(14, pos) MAD(15, pos) MAD(16, pos) MAD(17, pos)  \
        MAD(18, pos) MAD(19, pos) MAD(20, pos) MAD(21, pos) MAD(22, pos) MAD(23, pos)  \
        MAD(24, pos) MAD(25, pos) MAD(26, pos) MAD(27, pos) MAD(28, pos) MAD(29, pos)  \
        MAD(30, pos) MAD(31, pos)                                                      \
    }

#define MADS8(p)                                                                       \
    MADS(p) MADS(p + 1) MADS(p + 2) MADS(p + 3) MADS(p + 4) MADS(p + 5) MADS(p + 6)    \
    MADS(p + 7)

/* The input row r rows below y: rows past the slab (read only for the last work-items'
 * outputs beyond ny, never stored) read the last row instead. */
#if ROWS > 1
#define ROW_Y(r) min(y + (r), P1 - 1)
#else
#define ROW_Y(r) (y + (r))
#endif

/* Store lane `i` of every unrolled output to the plane of filter f0 + i. */
#define STORE_LANE(i, lane)                                                            \
    if ((i) < NV && (i) < nreal) {                                                     \
        __global float *dst = out + (long)(f0 + (i)) * plane + base;                   \
        for (int v = 0; v < ROWS; v++) {                                               \
            if (y + v < ny) {                                                          \
                for (int u = 0; u < UNROLL; u++) {                                     \
                    if (z0 + u < nz) dst[v * nz + u] = lane(acc[v][u]);                \
                }                                                                      \
            }                                                                          \
        }                                                                              \
    }

#if NV == 1
#define L0(v) (v)
#else
#define L0(v) (v).s0
#define L1(v) (v).s1
#endif
#if NV >= 4
#define L2(v) (v).s2
#define L3(v) (v).s3
#endif
#if NV >= 8
#define L4(v) (v).s4
#define L5(v) (v).s5
#define L6(v) (v).s6
#define L7(v) (v).s7
#endif
#if NV >= 16
#define L8(v) (v).s8
#define L9(v) (v).s9
#define L10(v) (v).sa
#define L11(v) (v).sb
#define L12(v) (v).sc
#define L13(v) (v).sd
#define L14(v) (v).se
#define L15(v) (v).sf
#endif

#if INPUT_LOCAL
__attribute__((reqd_work_group_size(LZ, LY, 1)))
#endif
__kernel void bank_conv(__global const IN_T *restrict in,  /* padded slab (P0, P1, P2) */
                        __global float *restrict out,      /* responses (N, D, NY, NZ) */
                        __global const vecf *restrict filt_g, /* NTAPS flipped filters */
                        const int D, const int ny, const int nz,
                        const int P1, const int P2,
                        const long plane,                  /* D * ny * nz */
                        const int f0,                      /* first filter of this pass */
                        const int nreal)                   /* real filters in this pass */
{
#if FILT_LOCAL
#define FILT_SPACE __local
    __local vecf filt[NTAPS];
    event_t ev = async_work_group_copy(filt, filt_g, NTAPS, 0);
    wait_group_events(1, &ev);
#else
#define FILT_SPACE __global
    __global const vecf *filt = filt_g;
#endif

    const int z0 = (int)get_global_id(0) * UNROLL;
    const int y = (int)get_global_id(1) * ROWS;
    const int x = (int)get_global_id(2);
#if INPUT_LOCAL
    /* Every work-item of the group stages the tile and meets the barriers: those past the
     * edges compute from the tile too and store nothing. */
    if (x >= D) return; /* the whole group: x is the group's */
    const int l0 = (int)get_local_id(0), l1 = (int)get_local_id(1), t = l0 + LZ * l1;
    const int zbase = (int)get_group_id(0) * LZ * UNROLL;
    const int ybase = (int)get_group_id(1) * LY * ROWS;
    __local float4 tiles[INPUT_LOCAL][TILE];
    IN_T4 pre[STAGE_N];
#if INPUT_LOCAL == 2
    tile_load(pre, in, x, ybase, zbase, P1, P2, t);
    tile_store(tiles[0], pre, t);
    barrier(CLK_LOCAL_MEM_FENCE);
#endif
#else
    if (z0 >= nz || y >= ny || x >= D) return;
#endif

    vecf acc[ROWS][UNROLL];
    for (int v = 0; v < ROWS; v++)
        for (int u = 0; u < UNROLL; u++) acc[v][u] = (vecf)(0.0f);

    for (int dx = 0; dx < KX; dx++) {
#if BLOCKED
        vecf part[ROWS][UNROLL];
        for (int v = 0; v < ROWS; v++)
            for (int u = 0; u < UNROLL; u++) part[v][u] = (vecf)(0.0f);
#endif
#if INPUT_LOCAL == 1
        if (dx > 0) barrier(CLK_LOCAL_MEM_FENCE); /* the last plane read by all */
        tile_load(pre, in, x + dx, ybase, zbase, P1, P2, t);
        tile_store(tiles[0], pre, t);
        barrier(CLK_LOCAL_MEM_FENCE);
        __local const float4 *tile = tiles[0];
#elif INPUT_LOCAL
        /* plane dx + 1 into registers now, into the other tile (which plane dx - 1's reads
         * are done with) after this plane's multiply-adds */
        const bool next = dx + 1 < KX;
        if (next) tile_load(pre, in, x + dx + 1, ybase, zbase, P1, P2, t);
        __local const float4 *tile = tiles[dx & 1];
#endif
#if ROLL
        /* win[v] holds input row dy + v: output row v meets filter row dy there. Each
         * coefficient vector is loaded once per work-item and feeds ROWS * UNROLL outputs;
         * each input value is loaded and converted once per plane. */
        float win[ROWS][KZ + UNROLL - 1];
#if INPUT_LOCAL
#pragma unroll
        for (int v = 1; v < ROWS; v++) TILE_ROW(win[v], tile, v - 1)
#else
        __global const IN_T *plane_in = in + (x + dx) * P1 * P2 + z0;
#pragma unroll
        for (int v = 1; v < ROWS; v++) {
            __global const IN_T *row = plane_in + ROW_Y(v - 1) * P2;
#pragma unroll
            for (int p = 0; p < KZ + UNROLL - 1; p++) win[v][p] = (float)row[p];
        }
#endif
        ROW_LOOP
        for (int dy = 0; dy < KY; dy++) {
#pragma unroll
            for (int v = 0; v + 1 < ROWS; v++) {
#pragma unroll
                for (int p = 0; p < KZ + UNROLL - 1; p++) win[v][p] = win[v + 1][p];
            }
#if INPUT_LOCAL
            TILE_ROW(win[ROWS - 1], tile, dy + ROWS - 1)
#else
            __global const IN_T *row = plane_in + ROW_Y(dy + ROWS - 1) * P2;
#pragma unroll
            for (int p = 0; p < KZ + UNROLL - 1; p++) win[ROWS - 1][p] = (float)row[p];
#endif
            FILT_SPACE const vecf *frow = filt + (dx * KY + dy) * KZ;
#pragma unroll
            for (int dz = 0; dz < KZ; dz++) {
                const vecf c = frow[dz];
#pragma unroll
                for (int v = 0; v < ROWS; v++) {
#pragma unroll
                    for (int u = 0; u < UNROLL; u++) SUM[v][u] += win[v][u + dz] * c;
                }
            }
        }
#else
        /* Input row r feeds output row v through filter row r - v; with ROWS > 1 the loop
         * is unrolled so that every (r, v) condition is a constant. */
        ROW_LOOP
        for (int r = 0; r < KY + ROWS - 1; r++) {
#if INPUT_LOCAL
            float row[WIN];
            TILE_ROW(row, tile, r)
#else
            __global const IN_T *row = in + ((x + dx) * P1 + ROW_Y(r)) * P2 + z0;
#endif
            const int foff = (dx * KY + r) * KZ;
            MADS8(0) MADS8(8) MADS8(16) MADS8(24) MADS8(32) MADS8(40) MADS8(48) MADS8(56)
        }
#endif
#if BLOCKED
        for (int v = 0; v < ROWS; v++)
            for (int u = 0; u < UNROLL; u++) acc[v][u] += part[v][u];
#endif
#if INPUT_LOCAL == 2
        if (next) tile_store(tiles[(dx + 1) & 1], pre, t);
        barrier(CLK_LOCAL_MEM_FENCE); /* plane dx + 1 stored, plane dx read by all */
#endif
    }
#if INPUT_LOCAL
    if (z0 >= nz || y >= ny) return;
#endif

    const long base = ((long)x * ny + y) * nz + z0;
    STORE_LANE(0, L0)
#if NV >= 2
    STORE_LANE(1, L1)
#endif
#if NV >= 4
    STORE_LANE(2, L2) STORE_LANE(3, L3)
#endif
#if NV >= 8
    STORE_LANE(4, L4) STORE_LANE(5, L5) STORE_LANE(6, L6) STORE_LANE(7, L7)
#endif
#if NV >= 16
    STORE_LANE(8, L8) STORE_LANE(9, L9) STORE_LANE(10, L10) STORE_LANE(11, L11)
    STORE_LANE(12, L12) STORE_LANE(13, L13) STORE_LANE(14, L14) STORE_LANE(15, L15)
#endif
}
