/* The separable pass tree of a bank in three launches, one per axis, each computing every node
 * of its level from one read of its input: tree_z every root (distinct axis-2 factor) from a
 * row of the padded slab, tree_y every mid (distinct (axis-2, axis-1) pair) from its root's
 * rows, tree_x every response from the mids' rows along axis 0, with the derived features as
 * its epilogue (a response only features read is never written).
 *
 * The tree comes as kernels/fused.cl takes it (volconv/engines/passes.py, `fused_tree`):
 * N_ROOTS rows of axis-2 taps (WZ), N_MIDS rows of axis-1 taps (WY; MID_ROOT their root),
 * N_COMBOS rows of axis-0 taps (WX; COMBO_MID their mid, COMBO_OUT their response; the
 * coefficients folded in), each factor flipped and zero-padded to its axis's window (KX, KY,
 * KZ taps from S0, S1, S2 of the bank's halo), the taps immediate operands after unrolling.
 * ROOT_IN gives each root's input slab (several slabs at IN_STRIDE elements: a structure
 * tensor's six products smoothed as one tree).
 *
 * Intermediates (float): A (N_ROOTS, PX, PY, R), B (N_MIDS, PX, NY, R), PX = DEPTH + KX - 1
 * rows along axis 0, PY = NY + KY - 1 along axis 1, R >= NZ (a multiple of V) along axis 2.
 * Each work-item computes V consecutive outputs along axis 2 (floatV), tree_y UY along axis
 * 1 and tree_x UX along axis 0, so each row it loads feeds up to that many outputs.
 *
 * tree_z_products takes tree_z's place where the inputs are products of three planes formed
 * as they are read (PAIR_A, PAIR_B: each root's two planes).
 *
 * Build options (-D): the tables above, N_OUT responses, V (= EV, kernels/eigen.cl's lanes),
 * UY, UX, IN_T the padded slab's element type, FEATURES the epilogue as in kernels/fused.cl
 * (kernels/eigen.cl's EIG3, MAG2, MAG3, PICK, DIFF of response indices and feature planes).
 */

#define TCAT(a, b) a##b
#define TXCAT(a, b) TCAT(a, b)
#if V == 1
typedef float floatv;
#define VLOAD(p) (*(p))
#define VSTORE(v, p) (*(p) = (v))
#else
typedef TXCAT(float, V) floatv;
#define VLOAD(p) TXCAT(vload, V)(0, p)
#define VSTORE(v, p) TXCAT(vstore, V)(v, 0, p)
#endif


/* root k's V outputs from the V + KZ - 1 values `in` of their row, into A at (x, y, z) */
#define ROOT_OUT(k, in)                                                                 \
    {                                                                                   \
        float a_[V];                                                                    \
        _Pragma("unroll") for (int l = 0; l < V; ++l) {                                 \
            a_[l] = 0.0f;                                                               \
            _Pragma("unroll") for (int j = 0; j < KZ; ++j) a_[l] += wz[(k) * KZ + j] * in[l + j]; \
        }                                                                               \
        VSTORE(VLOAD(a_), dst + (((long)(k) * PX + x) * PY + y) * R + z);               \
    }

/* A[k][x][y][z] = sum_j wz[k][j] in[x + S0][y + S1][z + S2 + j] */
__kernel void tree_z(__global const IN_T *restrict src, /* slabs of (P0, P1, P2) */
                     __global float *restrict dst,      /* A */
                     const int PX, const int PY, const int P1, const int P2, const int R,
                     const long IN_STRIDE)
{
    const int z = (int)get_global_id(0) * V, y = (int)get_global_id(1);
    const int x = (int)get_global_id(2);
    if (z >= R || y >= PY || x >= PX) return;
    const int root_in[N_ROOTS] = {ROOT_IN};
    const int root_first[N_ROOTS] = {ROOT_FIRST}; /* the first root of its input */
    const float wz[N_ROOTS * KZ] = {WZ};
    const long row = ((long)(x + S0) * P1 + y + S1) * P2 + z + S2;
#pragma unroll
    for (int s = 0; s < N_ROOTS; ++s) {
        if (!root_first[s]) continue; /* each input once, before its first root */
        const __global IN_T *p = src + root_in[s] * IN_STRIDE + row;
        float v[V + KZ - 1];
#pragma unroll
        for (int j = 0; j < V + KZ - 1; ++j) v[j] = (float)p[j];
#pragma unroll
        for (int k = s; k < N_ROOTS; ++k) {
            if (root_in[k] == root_in[s]) ROOT_OUT(k, v)
        }
    }
}

#ifdef PAIR_A
/* tree_z of products formed as they are read: root k filters g_a * g_b (a = PAIR_A[k], b =
 * PAIR_B[k]) of the three float planes g (G_PLANE elements apart), read through the index
 * maps of the padded rows (m0, this slab's rows of g), columns (m1) and row positions (m2), -1
 * meaning cval: a structure tensor's products, extended by the mode, never written. */
__kernel void tree_z_products(__global const float *restrict g, const long G_PLANE,
                              __global float *restrict dst, /* A */
                              __global const int *restrict m0, __global const int *restrict m1,
                              __global const int *restrict m2, const int PX, const int PY,
                              const int NY, const int NZ, const int R, const float cval)
{
    const int z = (int)get_global_id(0) * V, y = (int)get_global_id(1);
    const int x = (int)get_global_id(2);
    if (z >= R || y >= PY || x >= PX) return;
    const int pair_a[N_ROOTS] = {PAIR_A};
    const int pair_b[N_ROOTS] = {PAIR_B};
    const float wz[N_ROOTS * KZ] = {WZ};
    const int i0 = m0[x + S0], i1 = m1[y + S1];
    float v[3][V + KZ - 1];
    bool inside[V + KZ - 1];
#pragma unroll
    for (int j = 0; j < V + KZ - 1; ++j) {
        const int i2 = m2[z + S2 + j];
        inside[j] = i0 >= 0 && i1 >= 0 && i2 >= 0;
        const long at = inside[j] ? ((long)i0 * NY + i1) * NZ + i2 : 0;
#pragma unroll
        for (int c = 0; c < 3; ++c) v[c][j] = g[c * G_PLANE + at];
    }
#pragma unroll
    for (int k = 0; k < N_ROOTS; ++k) {
        float p[V + KZ - 1];
#pragma unroll
        for (int j = 0; j < V + KZ - 1; ++j)
            p[j] = inside[j] ? v[pair_a[k]][j] * v[pair_b[k]][j] : cval;
        ROOT_OUT(k, p)
    }
}
#endif

/* B[m][x][y][z] = sum_j wy[m][j] A[root(m)][x][y + j][z] */
__kernel void tree_y(__global const float *restrict src, /* A */
                     __global float *restrict dst,       /* B */
                     const int PX, const int PY, const int NY, const int R)
{
    const int z = (int)get_global_id(0) * V, y = (int)get_global_id(1) * UY;
    const int x = (int)get_global_id(2);
    if (z >= R || y >= NY || x >= PX) return;
    const int mid_root[N_MIDS] = {MID_ROOT};
    const float wy[N_MIDS * KY] = {WY};
#pragma unroll
    for (int r = 0; r < N_ROOTS; ++r) {
        floatv acc[N_MIDS][UY];
#pragma unroll
        for (int m = 0; m < N_MIDS; ++m) {
#pragma unroll
            for (int u = 0; u < UY; ++u) acc[m][u] = 0.0f;
        }
        const __global float *p = src + (((long)r * PX + x) * PY) * R + z;
#pragma unroll
        for (int i = 0; i < UY + KY - 1; ++i) {
            const floatv a = VLOAD(p + (long)min(y + i, PY - 1) * R); /* past PY: unused */
#pragma unroll
            for (int m = 0; m < N_MIDS; ++m) {
                if (mid_root[m] != r) continue;
#pragma unroll
                for (int u = 0; u < UY; ++u) {
                    if (i - u >= 0 && i - u < KY) acc[m][u] += wy[m * KY + i - u] * a;
                }
            }
        }
#pragma unroll
        for (int m = 0; m < N_MIDS; ++m) {
            if (mid_root[m] != r) continue;
#pragma unroll
            for (int u = 0; u < UY; ++u) {
                if (y + u < NY) VSTORE(acc[m][u], dst + (((long)m * PX + x) * NY + y + u) * R + z);
            }
        }
    }
}

/* the epilogue's stores: a plane's V lanes at `at`, the row's tail lane by lane */
#define PUT(base, v)                                                        \
    {                                                                       \
        __global float *q_ = (base) + at;                                   \
        if (z + V <= NZ) {                                                  \
            VSTORE(v, q_);                                                  \
        } else {                                                            \
            float t_[V];                                                    \
            VSTORE(v, t_);                                                  \
            for (int l_ = 0; l_ < NZ - z; ++l_) q_[l_] = t_[l_];            \
        }                                                                   \
    }
#define RESP(f) acc[f][u] /* kernels/eigen.cl's epilogue macros, V lanes (EV = V) */
#define FEAT_STORE(o, v) PUT(feat + (long)(o) * plane, v)

/* response f at [x][y][z] = sum over its combos c of sum_j wx[c][j] B[mid(c)][x + j][y][z];
 * then the features (or, N_STORED < 0, every response and no feature) */
__kernel void tree_x(__global const float *restrict src, /* B */
                     __global float *restrict out,       /* (N_OUT, DEPTH, NY, NZ) */
                     __global float *restrict feat,      /* (planes, DEPTH, NY, NZ) */
                     const int DEPTH, const int PX, const int NY, const int NZ, const int R,
                     const int N_STORED) /* responses written: the first N_STORED; < 0: all */
{
    const int z = (int)get_global_id(0) * V, y = (int)get_global_id(1);
    const int x = (int)get_global_id(2) * UX;
    if (z >= NZ || y >= NY || x >= DEPTH) return;
    const int combo_mid[N_COMBOS] = {COMBO_MID};
    const int combo_out[N_COMBOS] = {COMBO_OUT};
    const float wx[N_COMBOS * KX] = {WX};
    floatv acc[N_OUT][UX];
#pragma unroll
    for (int f = 0; f < N_OUT; ++f) {
#pragma unroll
        for (int u = 0; u < UX; ++u) acc[f][u] = 0.0f;
    }
    const long stride = (long)NY * R;
#pragma unroll
    for (int m = 0; m < N_MIDS; ++m) {
        const __global float *p = src + (((long)m * PX) * NY + y) * R + z;
#pragma unroll
        for (int i = 0; i < UX + KX - 1; ++i) {
            const floatv b = VLOAD(p + min(x + i, PX - 1) * stride); /* past PX: unused */
#pragma unroll
            for (int c = 0; c < N_COMBOS; ++c) {
                if (combo_mid[c] != m) continue;
#pragma unroll
                for (int u = 0; u < UX; ++u) {
                    if (i - u >= 0 && i - u < KX) acc[combo_out[c]][u] += wx[c * KX + i - u] * b;
                }
            }
        }
    }
    const long plane = (long)DEPTH * NY * NZ;
#pragma unroll
    for (int u = 0; u < UX; ++u) {
        if (x + u >= DEPTH) break;
        const long at = ((long)(x + u) * NY + y) * NZ + z;
#pragma unroll
        for (int f = 0; f < N_OUT; ++f) {
            if (N_STORED < 0 || f < N_STORED) PUT(out + f * plane, acc[f][u])
        }
#ifdef FEATURES
        if (N_STORED >= 0) {
            FEATURES
        }
#endif
    }
}
