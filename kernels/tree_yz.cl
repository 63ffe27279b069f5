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
 * each value it loads feeds up to UA outputs. A is (N_ROOTS, ROWS, PY, RZ): ROWS >= NX rows a
 * block (the same in every launch: a row's place in A does not depend on the block's rows),
 * PY = NY + KB - 1 columns along axis 1, RZ >= NZ + KC - 1 along axis 2.
 *
 * last_yz: a work-group owns a TY x TZ tile of one row (axis 0) and takes the roots one at a
 * time: it loads the root's (TY + KB - 1) x (TZ + KC - 1) tile of A to local memory; then, MG
 * of the root's mids at a time, computes them on the TY x (TZ + KC - 1) tile (UB rows along
 * axis 1 a work-item, from one load of each value), and each work-item adds the combos
 * through them into its VC consecutive outputs along axis 2 of every response (one load of
 * each value); then the features of those voxels (or the responses).
 *
 * ROOT_IN gives each root's input slab (several: a structure tensor's six products smoothed as
 * one tree); first_x_products takes first_x's place where the inputs are products of three
 * planes formed as they are read (PAIR_A, PAIR_B: each root's two planes).
 *
 * Build options (-D): the tables (MID_SLOT: each mid's place among its root's mids,
 * ROOT_MIDS: each root's count, MAXM the most), N_OUT, UA, TY, TZ, UB, VC, MG, PM, TL,
 * PREFETCH, ROUNDS, LBUF, IN_T, FEATURES (as in kernels/fused.cl: kernels/eigen.cl's EIG3,
 * MAG2, MAG3, PICK, DIFF), ZERO_SKIP; last_yz's work-group is ITEMS = TY x TZ / VC work-items
 * along axis 0.
 *
 * ZERO_SKIP (a zero background, kernels/bands.cl): first_x marks the bands of A (UA rows) where
 * it computed a value other than zero, and stores no column of zeros where A holds zeros
 * already; last_yz writes zeros over a tile whose bands are all unmarked (FEATURE_PLANES: its
 * feature planes) and returns (the whole group).
 */

#define LY (TY + KB - 1)
#define LZ (TZ + KC - 1)
#define ITEMS ((TZ / VC) * TY)
#ifndef TL
#define TL 1
#endif
#ifndef PREFETCH
#define PREFETCH 0
#endif
#ifndef MG
#define MG MAXM
#endif
#ifndef ROUNDS
#define ROUNDS 1
#endif
#ifndef ZERO_SKIP
#define ZERO_SKIP 0
#endif
#if ZERO_SKIP /* first_x's band and held byte of column (y, z); rows past NX may mark it too */
#define MARK_ROWS \
    MARK_COLUMN(acc, N_ROOTS, UA, live, EPOCH, held, x / UA, y, z, PY, RZ, x + UA > NX)
#else
#define MARK_ROWS
#endif

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
                      const int X0, const int NX, const int ROWS, const int PY, const int PZ,
                      const int P1, const int P2, const int RZ, const long IN_STRIDE,
                      __global int *restrict live, const int EPOCH, /* ZERO_SKIP's bands */
                      __global uchar *restrict held)
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
#define FIRST_ROWS(ROW)                                                                    \
    _Pragma("unroll") for (int i = 0; i < UA + KA - 1; ++i) {                              \
        _Pragma("unroll") for (int s = 0; s < N_ROOTS; ++s) {                              \
            if (!root_first[s]) continue; /* each input once, before its first root */     \
            const float v = (float)p[root_in[s] * IN_STRIDE + (ROW) * plane];              \
            _Pragma("unroll") for (int k = s; k < N_ROOTS; ++k) {                          \
                if (root_in[k] == root_in[s]) TAPS(k, i, v)                                \
            }                                                                              \
        }                                                                                  \
    }
    if (x + UA <= NX) { /* every row inside the slab: no clamp (all but the last rows) */
        FIRST_ROWS(i)
    } else {
        FIRST_ROWS(min(i, last))
    }
#undef FIRST_ROWS
    MARK_ROWS /* (ZERO_SKIP: returns where the values are zero and A holds zeros) */
#pragma unroll
    for (int k = 0; k < N_ROOTS; ++k) {
#pragma unroll
        for (int u = 0; u < UA; ++u) {
            if (x + u < NX) dst[(((long)k * ROWS + x + u) * PY + y) * RZ + z] = acc[k][u];
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
                               const int ROWS, const int PY, const int PZ, const int NY,
                               const int NZ, const int RZ, const float cval,
                               __global int *restrict live, const int EPOCH,
                               __global uchar *restrict held)
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
    MARK_ROWS /* (ZERO_SKIP: returns where the values are zero and A holds zeros) */
#pragma unroll
    for (int k = 0; k < N_ROOTS; ++k) {
#pragma unroll
        for (int u = 0; u < UA; ++u) {
            if (x + u < NX) dst[(((long)k * ROWS + x + u) * PY + y) * RZ + z] = acc[k][u];
        }
    }
}
#endif

/* kernels/eigen.cl's epilogue macros, a voxel at a time: its responses staged in lbuf */
#define RESP(f) lbuf[((f) * TY + sy) * SP + q]
#define FEAT_STORE(o, v) feat[(long)(o) * plane + at] = (v);
#define SV (VC / ROUNDS) /* outputs of a work-item staged a round */
#define SW (TZ / ROUNDS) /* voxels of a staged row */
#define SP (SW + 1)      /* its pitch */

/* last_yz, a root at a time: its tile of A (LY x LZ) to local memory; MG of its mids at a time
 * along axis 1 on TY x LZ, UB rows a task (la[r0 + j][c], lanes along c), then every combo
 * through them along axis 2 into the responses' partial sums, VC outputs a work-item from
 * one load of each value. lm's rows are PM >= LZ apart, PM odd: the work-items of a warp (32 on
 * NVIDIA) take TL rows by 32 / TL runs of VC (TL = VC), so their loads lm[s][ty][c0 + j]
 * fall in 32 distinct banks. With PREFETCH the next root's tile is loaded to registers
 * while this root's combos are computed. The features' epilogue then takes the responses
 * through local memory in ROUNDS rounds (LBUF floats hold a round's). */
#define NL ((LY * LZ + ITEMS - 1) / ITEMS) /* tile elements a work-item loads */
#define IN_STEP(i) (mid_root[i] == k && mid_slot[i] >= g0 && mid_slot[i] < g0 + MG)
#define TILE_AT(i) (min(y0 + (i) / LZ, PY - 1) * RZ + min(z0 + (i) % LZ, RZ - 1))

/* One root of last_yz, k a literal at each call (ROOT_STEPS): the tables fold to constants
 * before the loops over mids and combos unroll, so that each root's code holds only its own
 * mids and combos (a loop over the roots, left rolled by the compiler, computed every mid under
 * a select in every step). */
inline __attribute__((always_inline)) void root_step(
    const int k, __local float *la, __local float *lm, float acc[N_OUT][VC], float pre[NL],
    const __global float *a, const long root_size, const int lid, const int ty, const int c0,
    const int y0, const int z0, const int PY, const int RZ)
{
    const int mid_root[N_MIDS] = {MID_ROOT};
    const int mid_slot[N_MIDS] = {MID_SLOT}; /* its place among its root's mids */
    const int root_mids[N_ROOTS] = {ROOT_MIDS}; /* the mids of each root */
    const int combo_mid[N_COMBOS] = {COMBO_MID};
    const int combo_out[N_COMBOS] = {COMBO_OUT};
    const float wb[N_MIDS * KB] = {WB};
    const float wc[N_COMBOS * KC] = {WC};
    /* 1. the root's tile (past A's columns: only outputs never stored read them); the
     * last root's is no longer read (the barrier before its last combos) */
#if PREFETCH
    if (k == 0) {
#pragma unroll
        for (int l = 0; l < NL; ++l) {
            const int i = lid + l * ITEMS;
            if (i < LY * LZ) la[i] = pre[l];
        }
    }
#else
    for (int i = lid; i < LY * LZ; i += ITEMS) la[i] = a[k * root_size + TILE_AT(i)];
#endif
    /* its mids MG at a time (slots [g0, g0 + MG) of the root's) */
#pragma unroll
    for (int g0 = 0; g0 < MAXM; g0 += MG) {
        if (g0 >= root_mids[k]) break;
        const bool last = g0 + MG >= root_mids[k];
        barrier(CLK_LOCAL_MEM_FENCE); /* and the mids before are read */
        /* 2. the mids on TY x LZ, UB rows a task */
        for (int t = lid; t < (TY / UB) * LZ; t += ITEMS) {
            const int r0 = t / LZ * UB, c = t % LZ;
            float m[MG][UB] = {{0.0f}};
#pragma unroll
            for (int j = 0; j < UB + KB - 1; ++j) {
                const float v = la[(r0 + j) * LZ + c];
#pragma unroll
                for (int i = 0; i < N_MIDS; ++i) {
                    if (IN_STEP(i)) SLIDE(m[mid_slot[i] - g0], wb + i * KB, KB, UB, j, v)
                }
            }
#pragma unroll
            for (int i = 0; i < N_MIDS; ++i) {
                if (!IN_STEP(i)) continue;
                __local float *to = lm + ((mid_slot[i] - g0) * TY + r0) * PM + c;
#pragma unroll
                for (int u = 0; u < UB; ++u) to[u * PM] = m[mid_slot[i] - g0][u];
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#if PREFETCH
        if (last && k + 1 < N_ROOTS) {
#pragma unroll
            for (int l = 0; l < NL; ++l) {
                const int i = lid + l * ITEMS;
                pre[l] = i < LY * LZ ? a[(k + 1) * root_size + TILE_AT(i)] : 0.0f;
            }
        }
#endif
        /* 3. the combos through them along axis 2, VC outputs a work-item */
#pragma unroll
        for (int i = 0; i < N_MIDS; ++i) {
            if (!IN_STEP(i)) continue;
            const __local float *row = lm + ((mid_slot[i] - g0) * TY + ty) * PM + c0;
#pragma unroll
            for (int j = 0; j < VC + KC - 1; ++j) {
                const float v = row[j];
#pragma unroll
                for (int c = 0; c < N_COMBOS; ++c) {
                    if (combo_mid[c] != i) continue;
                    SLIDE(acc[combo_out[c]], wc + c * KC, KC, VC, j, v)
                }
            }
        }
#if PREFETCH
        if (last && k + 1 < N_ROOTS) { /* the root's tile is no longer read */
#pragma unroll
            for (int l = 0; l < NL; ++l) {
                const int i = lid + l * ITEMS;
                if (i < LY * LZ) la[i] = pre[l];
            }
        }
#endif
    }
}

#define ROOT_STEP(k) root_step(k, la, lm, acc, pre, a, root_size, lid, ty, c0, y0, z0, PY, RZ);
#define STEPS_1 ROOT_STEP(0)
#define STEPS_2 STEPS_1 ROOT_STEP(1)
#define STEPS_3 STEPS_2 ROOT_STEP(2)
#define STEPS_4 STEPS_3 ROOT_STEP(3)
#define STEPS_5 STEPS_4 ROOT_STEP(4)
#define STEPS_6 STEPS_5 ROOT_STEP(5)
#define STEPS_7 STEPS_6 ROOT_STEP(6)
#define STEPS_8 STEPS_7 ROOT_STEP(7)
#define STEPS_9 STEPS_8 ROOT_STEP(8)
#define STEPS_10 STEPS_9 ROOT_STEP(9)
#define STEPS_11 STEPS_10 ROOT_STEP(10)
#define STEPS_12 STEPS_11 ROOT_STEP(11)
#define STEPS_13 STEPS_12 ROOT_STEP(12)
#define STEPS_14 STEPS_13 ROOT_STEP(13)
#define STEPS_15 STEPS_14 ROOT_STEP(14)
#define STEPS_16 STEPS_15 ROOT_STEP(15)
#define STEPS_17 STEPS_16 ROOT_STEP(16)
#define STEPS_18 STEPS_17 ROOT_STEP(17)
#define STEPS_19 STEPS_18 ROOT_STEP(18)
#define STEPS_20 STEPS_19 ROOT_STEP(19)
#define STEPS_21 STEPS_20 ROOT_STEP(20)
#define STEPS_22 STEPS_21 ROOT_STEP(21)
#define STEPS_23 STEPS_22 ROOT_STEP(22)
#define STEPS_24 STEPS_23 ROOT_STEP(23)
#define TCAT(a, b) a##b
#define XTCAT(a, b) TCAT(a, b)
#if N_ROOTS > 24
#error "last_yz: at most 24 roots (volconv.plan.trees.xfirst_fits)"
#endif

__kernel __attribute__((reqd_work_group_size(ITEMS, 1, 1)))
void last_yz(__global const float *restrict src, /* A of rows [X0, X0 + NX) */
             __global float *restrict out,       /* (N_OUT, DEPTH, NY, NZ) */
             __global float *restrict feat,      /* (planes, DEPTH, NY, NZ) */
             const int X0, const int NX, const int ROWS, const int DEPTH, const int NY,
             const int NZ,
             const int PY, const int RZ,
             const int N_STORED, /* responses written: the first N_STORED; < 0: every one */
             __global const int *restrict live, const int EPOCH) /* ZERO_SKIP's bands */
{
    __local float lbuf[LBUF]; /* a root's tile and MG mids; then the staged responses */
    __local float *la = lbuf, *lm = lbuf + LY * LZ;
    __local int marked; /* ZERO_SKIP: a band the tile reads is marked */
    const int lid = (int)get_local_id(0);
    const int z0 = (int)get_group_id(0) * TZ, y0 = (int)get_group_id(1) * TY;
    const int x = (int)get_group_id(2);
    const long root_size = (long)ROWS * PY * RZ;
    const __global float *a = src + (long)x * PY * RZ;
#if TL > 1
    const int lane = lid & 31, w = lid >> 5;
    const int ty = (w % (TY / TL)) * TL + lane % TL;
    const int c0 = ((w / (TY / TL)) * (32 / TL) + lane / TL) * VC;
#else
    const int ty = lid / (TZ / VC), c0 = lid % (TZ / VC) * VC;
#endif
    float acc[N_OUT][VC] = {{0.0f}};
    float pre[NL]; /* PREFETCH: the next root's tile */
#if PREFETCH
#pragma unroll
    for (int l = 0; l < NL; ++l) {
        const int i = lid + l * ITEMS;
        pre[l] = i < LY * LZ ? a[TILE_AT(i)] : 0.0f;
    }
#endif
#if ZERO_SKIP /* the tile reads A's rows [y0, y0 + LY) and columns [z0, z0 + LZ), clamped (its
              * first root's tile already on its way: the check's latency hidden) */
    if (!bands_marked(live, EPOCH, x / UA, y0, min(y0 + LY, PY), z0, min(z0 + LZ, RZ), PY, RZ,
                      &marked, lid, ITEMS)) { /* A is zero there: zero responses and features */
        const long plane = (long)DEPTH * NY * NZ;
        for (int v = lid; v < TY * TZ; v += ITEMS) {
            const int yy = y0 + v / TZ, zz = z0 + v % TZ;
            if (yy >= NY || zz >= NZ) continue;
            const long at = ((long)(X0 + x) * NY + yy) * NZ + zz;
            for (int f = 0; f < N_OUT; ++f) {
                if (N_STORED < 0 || f < N_STORED) out[f * plane + at] = 0.0f;
            }
            for (int o = 0; o < FEATURE_PLANES && N_STORED >= 0; ++o) feat[o * plane + at] = 0.0f;
        }
        return; /* the whole group */
    }
#endif
    XTCAT(STEPS_, N_ROOTS)
    const int y = y0 + ty;
    const long plane = (long)DEPTH * NY * NZ;
    if (y < NY && N_STORED != 0) {
#pragma unroll
        for (int l = 0; l < VC; ++l) {
            const long at = ((long)(X0 + x) * NY + y) * NZ + z0 + c0 + l;
            if (z0 + c0 + l >= NZ) break;
#pragma unroll
            for (int f = 0; f < N_OUT; ++f) {
                if (N_STORED < 0 || f < N_STORED) out[f * plane + at] = acc[f][l];
            }
        }
    }
#ifdef FEATURES
    /* the features: the responses staged through local memory, SV of each work-item's
     * outputs a round, then voxel by voxel by consecutive work-items (one copy of the
     * epilogue's code, few registers held, stores along axis 2) */
    barrier(CLK_LOCAL_MEM_FENCE); /* the last mids are read */
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        if (r > 0) barrier(CLK_LOCAL_MEM_FENCE); /* the last round's are read */
#pragma unroll
        for (int f = 0; f < N_OUT; ++f) {
#pragma unroll
            for (int l = 0; l < SV; ++l) lbuf[(f * TY + ty) * SP + c0 / ROUNDS + l] = acc[f][r * SV + l];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (N_STORED >= 0) {
#pragma unroll 1
            for (int v = lid; v < TY * SW; v += ITEMS) {
                const int sy = v / SW, q = v % SW;
                const int yy = y0 + sy, zz = z0 + q / SV * VC + r * SV + q % SV;
                if (yy < NY && zz < NZ) {
                    const long at = ((long)(X0 + x) * NY + yy) * NZ + zz;
                    FEATURES
                }
            }
        }
    }
#endif
}
