/* The separable pass tree of a small bank in one kernel: no intermediate volume touches global
 * memory, the padded slab is read once (plus each chunk's halo along axis 0) and each response
 * is written once.
 *
 * volconv/engines/separable.py gives the tree as tables: N_ROOTS distinct axis-2 factors (wz), N_MIDS
 * distinct (axis-2, axis-1) pairs (wy; MID_ROOT their root) and N_COMBOS distinct (response,
 * mid) pairs (wx; COMBO_MID their mid, COMBO_OUT their response), whose axis-0 taps are the sum
 * over the response's terms through that mid of coef * factor. The taps come as build options
 * too, so that after unrolling each is an immediate operand of its multiply-add (no loads of
 * weights in the loop; each bank builds its own binary, cached). Every factor is flipped
 * (convolution = correlation with the flipped kernel) and zero-padded to its axis's window of
 * the bank's halo (K taps from S), so each filter keeps its own extent exactly.
 *
 * A work-group owns a TY x TZ tile of output columns (axes 1, 2) and CX output rows along axis
 * 0, and walks the padded slab's planes along axis 0; for each plane:
 *   1. the (TY + KY - 1) x (TZ + KZ - 1) input tile goes to local memory, as float (each
 *      work-item loads its elements of the next plane meanwhile, so their latency hides);
 *   2. every root filters it along axis 2, into local memory;
 *   3. each work-item filters its column along axis 1 for every mid, in registers;
 *   4. each combo adds its mid's value times each axis-0 tap into the partial sums of the KX
 *      output rows the plane reaches; the oldest row is then complete: it is stored and the
 *      window moves on by one row.
 * The loops over the tables are unrolled, so every table index is a constant and the partial
 * sums (N_OUT x KX) stay in registers.
 *
 * Derived features are the epilogue: where a row is complete, the features read the responses
 * from the partial sums (kernels/eigen.cl, which the host builds in front of this file) and
 * write only their outputs to `feat`; a response only features read is not written (unless
 * the host asks for every response, N_STORED < 0 at run time: a slab whose source holds NaN
 * or Inf, whose features the host computes).
 *
 * ZERO_SKIP (a zero background): a plane whose input tile is zero adds exact zeros (its roots
 * and mids are zero; NaN and Inf are not zero), so its steps 2-4 are skipped.
 *
 * Build options (-D): KX, KY, KZ window taps; TY, TZ the tile; CX output rows per work-group;
 * N_ROOTS, N_MIDS, N_COMBOS, N_OUT the table sizes; MID_ROOT, COMBO_MID, COMBO_OUT the tables
 * (comma-separated indices); WZ (N_ROOTS x KZ), WY (N_MIDS x KY), WX (N_COMBOS x KX) the taps
 * (comma-separated float literals, row-major); IN_T the padded slab's element type; FEATURES
 * the epilogue, a sequence of kernels/eigen.cl's EIG3(six responses, plane), MAG2(two,
 * plane), MAG3(three, plane), PICK(one, plane), DIFF(two, plane) (response indices, feature
 * output planes).
 */

/* without features (the host defines none) the store is the plain loop: no test per output;
 * with them, kernels/eigen.cl's epilogue macros read and write through these */
#define RESP(f) acc[f][0]
#define FEAT_STORE(o, v) feat[(long)(o) * DEPTH * plane_size + at] = (v);

#ifndef ZERO_SKIP
#define ZERO_SKIP 0
#endif
#define TILE_Y (TY + KY - 1)
#define TILE_Z (TZ + KZ - 1)
#define LOADS ((TILE_Y * TILE_Z + TY * TZ - 1) / (TY * TZ)) /* tile elements per work-item */

__kernel __attribute__((reqd_work_group_size(TZ, TY, 1)))
void fused(__global const IN_T *restrict src,  /* (P0, P1, P2) padded slab */
           __global float *restrict out,       /* (N_OUT, DEPTH, NY, NZ) */
           __global float *restrict feat,      /* feature outputs, (planes, DEPTH, NY, NZ) */
           const int DEPTH, const int NY, const int NZ, const int P1, const int P2,
           const int S0, const int S1, const int S2,
           const int N_STORED) /* responses written: the first N_STORED; < 0: every one */
{
    /* two of each, alternating by plane: a plane's tile is written while the last plane's
     * rows are still read, so one barrier fewer per plane */
    __local float tile[2][TILE_Y][TILE_Z];
    __local float rows[2][N_ROOTS][TILE_Y][TZ];
    __local int live[2]; /* ZERO_SKIP: a value of the plane's tile is not zero */
    const int mid_root[N_MIDS] = {MID_ROOT};
    const int combo_mid[N_COMBOS] = {COMBO_MID};
    const int combo_out[N_COMBOS] = {COMBO_OUT};
    const float wz[N_ROOTS * KZ] = {WZ};
    const float wy[N_MIDS * KY] = {WY};
    const float wx[N_COMBOS * KX] = {WX}; /* coefficients folded in */

    const int tz = (int)get_local_id(0), ty = (int)get_local_id(1);
    const int z0 = (int)get_group_id(0) * TZ, y0 = (int)get_group_id(1) * TY;
    const int x0 = (int)get_group_id(2) * CX;
    const int lid = ty * TZ + tz;
    const int y = y0 + ty, z = z0 + tz;
    const bool stored = y < NY && z < NZ;
    const int planes = min(CX, DEPTH - x0) + KX - 1;
    const long plane_size = (long)NY * NZ;

    /* this work-item's elements of the input tile: offsets in a plane, or -1 where the tile
     * reaches past the slab (at its far edges: only outputs never stored read them) */
    long at[LOADS];
#pragma unroll
    for (int l = 0; l < LOADS; ++l) {
        const int i = lid + l * TY * TZ, r = i / TILE_Z, c = i % TILE_Z;
        const bool inside = i < TILE_Y * TILE_Z && y0 + S1 + r < P1 && z0 + S2 + c < P2;
        at[l] = inside ? (long)(y0 + S1 + r) * P2 + z0 + S2 + c : -1;
    }
    const __global IN_T *in = src + (long)(x0 + S0) * P1 * P2;
    float next[LOADS]; /* the next plane's elements, loaded while this plane is computed */
#pragma unroll
    for (int l = 0; l < LOADS; ++l) next[l] = at[l] < 0 ? 0.0f : (float)in[at[l]];

    float acc[N_OUT][KX]; /* acc[f][i]: response f at output row p - (KX - 1) + i */
#pragma unroll
    for (int f = 0; f < N_OUT; ++f) {
#pragma unroll
        for (int i = 0; i < KX; ++i) acc[f][i] = 0.0f;
    }

#if ZERO_SKIP
    if (lid < 2) live[lid] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
#endif
    for (int p = 0; p < planes; ++p) {
        const int b = p & 1;
        __local float *t = &tile[b][0][0];
#pragma unroll
        for (int l = 0; l < LOADS; ++l) {
            const int i = lid + l * TY * TZ;
            if (i < TILE_Y * TILE_Z) t[i] = next[l];
        }
#if ZERO_SKIP
        uint bits = 0; /* past the sign: -0 is zero */
#pragma unroll
        for (int l = 0; l < LOADS; ++l) bits |= as_uint(next[l]) << 1; /* 0 past the tile */
        if (bits != 0) live[b] = 1; /* a benign race: every writer writes 1 */
#endif
        if (p + 1 < planes) {
            in += (long)P1 * P2;
#pragma unroll
            for (int l = 0; l < LOADS; ++l) next[l] = at[l] < 0 ? 0.0f : (float)in[at[l]];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#if ZERO_SKIP
        const bool work = live[b]; /* the same in every work-item */
#else
        const bool work = true;
#endif
        for (int i = lid; work && i < TILE_Y * TZ; i += TY * TZ) {
            const int r = i / TZ, c = i % TZ;
            float a[N_ROOTS];
#pragma unroll
            for (int k = 0; k < N_ROOTS; ++k) a[k] = 0.0f;
#pragma unroll
            for (int j = 0; j < KZ; ++j) {
                const float v = tile[b][r][c + j];
#pragma unroll
                for (int k = 0; k < N_ROOTS; ++k) a[k] += wz[k * KZ + j] * v;
            }
#pragma unroll
            for (int k = 0; k < N_ROOTS; ++k) rows[b][k][r][c] = a[k];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#if ZERO_SKIP
        if (lid == 0) live[b] = 0; /* read by all before the barrier above; next set at p + 2 */
#endif
        if (work) {
            float m[N_MIDS];
#pragma unroll
            for (int k = 0; k < N_MIDS; ++k) {
                m[k] = 0.0f;
#pragma unroll
                for (int j = 0; j < KY; ++j)
                    m[k] += wy[k * KY + j] * rows[b][mid_root[k]][ty + j][tz];
            }
#pragma unroll
            for (int c = 0; c < N_COMBOS; ++c) {
#pragma unroll
                for (int i = 0; i < KX; ++i)
                    acc[combo_out[c]][i] += wx[c * KX + KX - 1 - i] * m[combo_mid[c]];
            }
        }
        if (p >= KX - 1 && stored) {
            const long at = ((long)(x0 + p - (KX - 1)) * NY + y) * NZ + z;
#ifdef FEATURES
#pragma unroll
            for (int f = 0; f < N_OUT; ++f) {
                if (N_STORED < 0 || f < N_STORED) out[f * DEPTH * plane_size + at] = acc[f][0];
            }
            if (N_STORED >= 0) {
                FEATURES
            }
#else
#pragma unroll
            for (int f = 0; f < N_OUT; ++f) out[f * DEPTH * plane_size + at] = acc[f][0];
#endif
        }
#pragma unroll
        for (int f = 0; f < N_OUT; ++f) {
#pragma unroll
            for (int i = 0; i < KX - 1; ++i) acc[f][i] = acc[f][i + 1];
            acc[f][KX - 1] = 0.0f;
        }
    }
}
