/* The separable pass tree with axis 0 first: first_x filters the padded slab along axis 0 by
 * every distinct axis-0 factor (a root) into A; last_yz filters A along axis 1 (every distinct
 * (axis-0, axis-1) pair, a mid) and along axis 2 (every response's terms) through local
 * memory, with the derived features as its epilogue. Only A, the roots over the output rows and
 * the padded columns, goes through global memory: the slab's halo rows along axis 0 are read
 * from the padded slab once, and nothing is computed twice across slabs but A's columns.
 *
 * The tables are kernels/fused.cl's with the axes taken in reverse order
 * (volconv/engines/tree.py): N_ROOTS rows of axis-0 taps (WA, KA taps from SA), N_MIDS rows
 * of axis-1 taps (WB; MID_ROOT their root; KB taps from SB), N_COMBOS rows of axis-2 taps (WC,
 * coefficients folded in; COMBO_MID, COMBO_OUT; KC taps from SC), all flipped and zero-padded
 * to their axis's window, immediate operands after unrolling.
 *
 * first_x: a work-item computes UA consecutive rows (axis 0) of one column of every root, so
 * each value it loads feeds up to UA outputs. A is (N_ROOTS, rows, PY, RZ): PY = NY + KB - 1
 * columns along axis 1, RZ >= NZ + KC - 1 along axis 2.
 *
 * last_yz: a work-group owns a TY x TZ tile of one row (axis 0); it loads every root's
 * (TY + KB - 1) x (TZ + KC - 1) tile of A to local memory, computes every mid on the TY x
 * (TZ + KC - 1) tile (UB rows along axis 1 a work-item, from one load of each value), and
 * each work-item VC consecutive outputs along axis 2 of every response (one load of each
 * value), then the features of those voxels (or the responses).
 *
 * ROOT_IN gives each root's input slab (several: a structure tensor's six products smoothed as
 * one tree); first_x_products takes first_x's place where the inputs are products of three
 * planes formed as they are read (PAIR_A, PAIR_B: each root's two planes).
 *
 * Build options (-D): the tables, N_OUT, UA, TY, TZ, UB, VC, IN_T, FEATURES (as in
 * kernels/fused.cl: kernels/eigen.cl's EIG3, MAG2, MAG3, PICK, DIFF); the work-group is
 * (TZ / VC, TY).
 */

#define LY (TY + KB - 1)
#define LZ (TZ + KC - 1)
#define ITEMS ((TZ / VC) * TY)

/* to[u] += w[t] * v for each of the U outputs u that the value v at position i of their run
 * reaches (tap t = i - u of K) */
#define SLIDE(to, w, K, U, i, v)                                                         \
    _Pragma("unroll") for (int u_ = 0; u_ < U; ++u_) {                                   \
        if ((i) - u_ >= 0 && (i) - u_ < K) to[u_] += (w)[(i) - u_] * (v);                \
    }
#define TAPS(k, i, v) SLIDE(acc[k], wa + (k) * KA, KA, UA, i, v)

/* A[k][x][y][z] = sum_j wa[k][j] in_k[X0 + x + SA + j][y + SB][z + SC] for x < NX, in_k the
 * slab ROOT_IN[k] (IN_STRIDE elements apart) */
__kernel void first_x(__global const IN_T *restrict src, /* slabs of (P0, P1, P2) */
                      __global float *restrict dst,      /* A */
                      const int X0, const int NX, const int PY, const int PZ, const int P1,
                      const int P2, const int RZ, const long IN_STRIDE)
{
    const int z = (int)get_global_id(0), y = (int)get_global_id(1);
    const int x = (int)get_global_id(2) * UA;
    if (z >= PZ || y >= PY || x >= NX) return;
    const int root_in[N_ROOTS] = {ROOT_IN};
    const int root_first[N_ROOTS] = {ROOT_FIRST}; /* the first root of its input */
    const float wa[N_ROOTS * KA] = {WA};
    const long plane = (long)P1 * P2;
    const __global IN_T *p = src + (long)(X0 + x + SA) * plane + (long)(y + SB) * P2 + z + SC;
    float acc[N_ROOTS][UA] = {{0.0f}};
    const int last = NX - x + KA - 2; /* the last row this work-item's outputs read */
    #pragma unroll
    for (int i = 0; i < UA + KA - 1; ++i) {
#pragma unroll
        for (int s = 0; s < N_ROOTS; ++s) {
            if (!root_first[s]) continue; /* each input once, before its first root */
            const float v = (float)p[root_in[s] * IN_STRIDE + min(i, last) * plane];
#pragma unroll
            for (int k = s; k < N_ROOTS; ++k) {
                if (root_in[k] == root_in[s]) TAPS(k, i, v)
            }
        }
    }
#pragma unroll
    for (int k = 0; k < N_ROOTS; ++k) {
#pragma unroll
        for (int u = 0; u < UA; ++u) {
            if (x + u < NX) dst[(((long)k * NX + x + u) * PY + y) * RZ + z] = acc[k][u];
        }
    }
}

#ifdef PAIR_A
/* first_x of products formed as they are read: root k filters g_a * g_b (a = PAIR_A[k], b =
 * PAIR_B[k]) of the three float planes g (G_PLANE elements apart) through the index maps of
 * the padded rows (m0: rows of g), columns (m1) and row positions (m2), -1 meaning cval */
__kernel void first_x_products(__global const float *restrict g, const long G_PLANE,
                               __global float *restrict dst, /* A */
                               __global const int *restrict m0,
                               __global const int *restrict m1,
                               __global const int *restrict m2, const int X0, const int NX,
                               const int PY, const int PZ, const int NY, const int NZ,
                               const int RZ, const float cval)
{
    const int z = (int)get_global_id(0), y = (int)get_global_id(1);
    const int x = (int)get_global_id(2) * UA;
    if (z >= PZ || y >= PY || x >= NX) return;
    const int pair_a[N_ROOTS] = {PAIR_A};
    const int pair_b[N_ROOTS] = {PAIR_B};
    const float wa[N_ROOTS * KA] = {WA};
    const int i1 = m1[y + SB], i2 = m2[z + SC];
    float acc[N_ROOTS][UA] = {{0.0f}};
    const int last = NX - x + KA - 2;
    #pragma unroll
    for (int i = 0; i < UA + KA - 1; ++i) {
        const int i0 = m0[X0 + x + SA + min(i, last)];
        const bool inside = i0 >= 0 && i1 >= 0 && i2 >= 0;
        const long at = inside ? ((long)i0 * NY + i1) * NZ + i2 : 0;
        float v[3];
#pragma unroll
        for (int c = 0; c < 3; ++c) v[c] = g[c * G_PLANE + at];
#pragma unroll
        for (int k = 0; k < N_ROOTS; ++k) {
            const float p = inside ? v[pair_a[k]] * v[pair_b[k]] : cval;
            TAPS(k, i, p)
        }
    }
#pragma unroll
    for (int k = 0; k < N_ROOTS; ++k) {
#pragma unroll
        for (int u = 0; u < UA; ++u) {
            if (x + u < NX) dst[(((long)k * NX + x + u) * PY + y) * RZ + z] = acc[k][u];
        }
    }
}
#endif

#define RESP(f) acc[f][l] /* kernels/eigen.cl's epilogue macros, a voxel at a time */
#define FEAT_STORE(o, v) feat[(long)(o) * plane + at] = (v);

__kernel __attribute__((reqd_work_group_size(TZ / VC, TY, 1)))
void last_yz(__global const float *restrict src, /* A of rows [X0, X0 + NX) */
             __global float *restrict out,       /* (N_OUT, DEPTH, NY, NZ) */
             __global float *restrict feat,      /* (planes, DEPTH, NY, NZ) */
             const int X0, const int NX, const int DEPTH, const int NY, const int NZ,
             const int PY, const int RZ,
             const int N_STORED) /* responses written: the first N_STORED; < 0: every one */
{
#ifdef ONE_ROOT /* a root at a time through one tile: larger tiles fit local memory */
#define N_TILES 1
#define TILE(k) 0
#else
#define N_TILES N_ROOTS
#define TILE(k) (k)
#endif
    __local float la[N_TILES][LY][LZ];
    __local float lm[N_MIDS][TY][LZ];
    const int mid_root[N_MIDS] = {MID_ROOT};
    const int combo_mid[N_COMBOS] = {COMBO_MID};
    const int combo_out[N_COMBOS] = {COMBO_OUT};
    const float wb[N_MIDS * KB] = {WB};
    const float wc[N_COMBOS * KC] = {WC};
    const int lid = (int)get_local_id(1) * (TZ / VC) + (int)get_local_id(0);
    const int z0 = (int)get_group_id(0) * TZ, y0 = (int)get_group_id(1) * TY;
    const int x = (int)get_group_id(2);
#pragma unroll
    for (int k0 = 0; k0 < N_ROOTS; k0 += N_TILES) {
        if (k0 > 0) barrier(CLK_LOCAL_MEM_FENCE); /* the last root's tile is read */
        /* 1. the roots' tiles (past A's columns: only outputs never stored read them) */
        for (int i = lid; i < N_TILES * LY * LZ; i += ITEMS) {
            const int k = i / (LY * LZ), r = i / LZ % LY, c = i % LZ;
            const int y = min(y0 + r, PY - 1), z = min(z0 + c, RZ - 1);
            la[k][r][c] = src[(((long)(k0 + k) * NX + x) * PY + y) * RZ + z];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        /* 2. their mids on TY x LZ, UB rows a task */
        for (int t = lid; t < (TY / UB) * LZ; t += ITEMS) {
            const int r0 = t / LZ * UB, c = t % LZ;
#pragma unroll
            for (int k = 0; k < N_ROOTS; ++k) {
                if (k < k0 || k >= k0 + N_TILES) continue;
                float m[N_MIDS][UB] = {{0.0f}};
                #pragma unroll
                for (int j = 0; j < UB + KB - 1; ++j) {
                    const float v = la[TILE(k)][r0 + j][c];
#pragma unroll
                    for (int i = 0; i < N_MIDS; ++i) {
                        if (mid_root[i] != k) continue;
                        SLIDE(m[i], wb + i * KB, KB, UB, j, v)
                    }
                }
#pragma unroll
                for (int i = 0; i < N_MIDS; ++i) {
                    if (mid_root[i] != k) continue;
#pragma unroll
                    for (int u = 0; u < UB; ++u) lm[i][r0 + u][c] = m[i][u];
                }
            }
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    /* 3. every response along axis 2, VC outputs a work-item */
    const int ty = (int)get_local_id(1), c0 = (int)get_local_id(0) * VC;
    float acc[N_OUT][VC] = {{0.0f}};
#pragma unroll
    for (int i = 0; i < N_MIDS; ++i) {
#pragma unroll
        for (int j = 0; j < VC + KC - 1; ++j) {
            const float v = lm[i][ty][c0 + j];
#pragma unroll
            for (int c = 0; c < N_COMBOS; ++c) {
                if (combo_mid[c] != i) continue;
                SLIDE(acc[combo_out[c]], wc + c * KC, KC, VC, j, v)
            }
        }
    }
    const int y = y0 + ty;
    if (y >= NY) return;
    const long plane = (long)DEPTH * NY * NZ;
#pragma unroll
    for (int l = 0; l < VC; ++l) {
        const int z = z0 + c0 + l;
        if (z >= NZ) break;
        const long at = ((long)(X0 + x) * NY + y) * NZ + z;
#pragma unroll
        for (int f = 0; f < N_OUT; ++f) {
            if (N_STORED < 0 || f < N_STORED) out[f * plane + at] = acc[f][l];
        }
#ifdef FEATURES
        if (N_STORED >= 0) {
            FEATURES
        }
#endif
    }
}
