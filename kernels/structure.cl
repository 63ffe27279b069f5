/* A structure tensor's outer smoothing and eigenvalues in two launches, axis 0 first:
 *
 * st_x forms the six products g_a * g_b (a <= b) of the three gradient planes g as it reads
 * them, through the index maps of the padded rows (m0, rows of g), columns (m1) and row
 * positions (m2), -1 meaning cval (the product field extended by the bank's mode), and filters
 * them along axis 0 into C (6, ROWS, PYA, RZ): NX <= ROWS output rows from X0 (a block of the
 * slab's, so that C stays in cache between the two launches; ROWS the same in every launch, so
 * that a row's place in C does not depend on the block's rows), the PY x PZ padded columns
 * (PYA >= PY rows, RZ >= PZ columns: st_yz's last tiles read past them without a bound test). A
 * work-item computes UA consecutive rows of one column of the six, so each value it loads
 * feeds up to UA outputs, and the products are formed once per value read.
 *
 * st_yz: a work-group owns a TY x TZ tile of one row; for CH products at a time (a phase) it
 * filters C's (TY + KY - 1) x (TZ + KZ - 1) tiles along axis 1 into local memory (UB rows a
 * task, read from global memory where the work-group's tasks share them in cache), then along
 * axis 2 (VC outputs a work-item from VC + KZ - 1 values of local memory, read four at a
 * time), two phases' buffers in turn so that one barrier a phase keeps the reads and the
 * writes apart; the
 * eigenvalues of the six smoothed products (kernels/eigen.cl) are its epilogue, and only they
 * are written.
 *
 * Build options (-D): KX, KY, KZ taps (WX, WY, WZ: each axis's factor, flipped, float32 hex)
 * from S0, S1, S2 of the maps' halo; CVAL_MAPS where the maps hold -1 (constant mode); UA;
 * TY, TZ, UY (output rows a work-item in st_yz), UB, VC (a multiple of 4: the loads go four at
 * a time), CH, ZERO_SKIP (a zero background, kernels/bands.cl: st_x computes nothing where
 * the values it reads are zero, marks the bands of C, UA rows, where it computed a value other
 * than zero, and stores no column of zeros where C holds zeros already; st_yz computes nothing
 * over a tile whose bands are all unmarked, skips the pass along axis 2 of a phase whose tile
 * along axis 1 is zero, and the taps of a task's or a row's zero values: they would add exact
 * zeros; the eigenvalues of zero matrices are zero, as EIG_FLAT takes them).
 * The work-group of st_yz is (TZ / VC, TY / UY).
 */

#define N_PROD 6
#ifndef ZERO_SKIP
#define ZERO_SKIP 0
#endif
#define SLIDE(to, w, K, U, i, v)                                                         \
    _Pragma("unroll") for (int u_ = 0; u_ < U; ++u_) {                                   \
        if ((i) - u_ >= 0 && (i) - u_ < K) to[u_] += (w)[(i) - u_] * (v);                \
    }

/* C[k][x][y][z] = sum_j wx[j] P_k[X0 + x + S0 + j][y + S1][z + S2] for the NX output rows
 * from X0, P_k the k-th product of the padded (extended) gradient planes */
__kernel void st_x(__global const float *restrict g, const long G_PLANE,
                   __global float *restrict dst, /* C */
                   __global const int *restrict m0, __global const int *restrict m1,
                   __global const int *restrict m2, const int X0, const int NX, const int ROWS,
                   const int PY, const int PZ, const int NY, const int NZ, const int PYA,
                   const int RZ, const float cval,
                   __global int *restrict live, const int EPOCH, /* ZERO_SKIP's bands */
                   __global uchar *restrict held)
{
    const int z = (int)get_global_id(0), y = (int)get_global_id(1);
    const int x = (int)get_global_id(2) * UA;
    if (z >= PZ || y >= PY || x >= NX) return;
    const float wx[KX] = {WX};
    const int i1 = m1[y + S1], i2 = m2[z + S2];
    const bool column = i1 >= 0 && i2 >= 0;
    const int base = column ? i1 * NZ + i2 : 0, row = NY * NZ; /* within a plane of g */
    const __global float *g0 = g, *g1 = g + G_PLANE, *g2 = g + 2 * G_PLANE;
    const __global int *rows = m0 + X0 + x + S0; /* m0 holds UA rows past the last it maps */
    float acc[N_PROD][UA] = {{0.0f}};
#ifdef CVAL_MAPS
#define INSIDE(i0) (column && (i0) >= 0)
#else
#define INSIDE(i0) true /* the maps hold -1 (cval) in constant mode only */
#endif
#if ZERO_SKIP /* the products are zero where the values read are: acc stays zero */
    uint seen = 0; /* past the sign (-0 is zero) */
#pragma unroll
    for (int i = 0; i < UA + KX - 1; ++i) {
        const int i0 = rows[i];
        const int at = INSIDE(i0) ? i0 * row + base : 0;
        seen |= INSIDE(i0) ? as_uint(g0[at]) | as_uint(g1[at]) | as_uint(g2[at]) : as_uint(cval);
    }
    if ((seen << 1) != 0)
#endif
#pragma unroll
    for (int i = 0; i < UA + KX - 1; ++i) {
        const int i0 = rows[i]; /* past the block's rows: read, never stored */
        const bool inside = INSIDE(i0);
        const int at = inside ? i0 * row + base : 0;
        const float a = g0[at], b = g1[at], c = g2[at];
        const float p[N_PROD] = {inside ? a * a : cval, inside ? b * b : cval,
                                 inside ? c * c : cval, inside ? a * b : cval,
                                 inside ? a * c : cval, inside ? b * c : cval};
#pragma unroll
        for (int k = 0; k < N_PROD; ++k) SLIDE(acc[k], wx, KX, UA, i, p[k])
    }
#if ZERO_SKIP /* rows past NX may mark the band too */
    MARK_COLUMN(acc, N_PROD, UA, live, EPOCH, held, x / UA, y, z, PYA, RZ, x + UA > NX)
#endif
    __global float *d = dst + ((long)x * PYA + y) * RZ + z;
    const long plane = (long)ROWS * PYA * RZ;
#pragma unroll
    for (int k = 0; k < N_PROD; ++k) {
#pragma unroll
        for (int u = 0; u < UA; ++u) {
            if (x + u < NX) d[k * plane + u * PYA * RZ] = acc[k][u];
        }
    }
}

#define LZ (TZ + KZ - 1)                 /* the tile's columns along axis 2 */
#define LW (((VC + KZ - 1) + 3) / 4 * 4) /* a work-item's window along axis 2, in fours */
#define LP (((TZ - VC + LW) + 3) / 4)    /* the local rows' pitch, in fours */
#define ITEMS ((TZ / VC) * (TY / UY))
#ifndef CH
#define CH 1 /* products a phase (1, 2, 3 or 6): one barrier a phase */
#endif
#define NB (CH == N_PROD ? N_PROD : 2 * CH) /* local buffers: two phases' in turn */

/* the eigenvalues of the six products smoothed along axes 1 and 2 at [X0 + x][y][z] */
__kernel __attribute__((reqd_work_group_size(TZ / VC, TY / UY, 1)))
void st_yz(__global const float *restrict src, /* C of rows [X0, X0 + NX) */
           __global float *restrict feat,      /* (3, DEPTH, NY, NZ) */
           const int X0, const int NX, const int ROWS, const int DEPTH, const int NY,
           const int NZ, const int PYA, const int RZ,
           __global const int *restrict live, const int EPOCH) /* ZERO_SKIP's bands */
{
    __local float4 lm[NB][TY][LP];
    const float wy[KY] = {WY};
    const float wz[KZ] = {WZ};
    const int lx = (int)get_local_id(0), ly = (int)get_local_id(1);
    const int lid = ly * (TZ / VC) + lx;
    const int z0 = (int)get_group_id(0) * TZ, y0 = (int)get_group_id(1) * TY;
    const int x = (int)get_group_id(2);
    const long plane = (long)DEPTH * NY * NZ;
    __local int marked; /* ZERO_SKIP: a band the tile reads is marked */
    __local int phases[N_PROD / CH]; /* ZERO_SKIP: a phase's tile along axis 1 is not zero */
#if ZERO_SKIP /* the tile reads C's rows [y0, y0 + TY + KY - 1), columns [z0, z0 + LZ) */
    const bool tile = bands_marked(live, EPOCH, x / UA, y0, min(y0 + TY + KY - 1, PYA), z0,
                                   min(z0 + LZ, RZ), PYA, RZ, &marked, lid, ITEMS);
    if (lid < N_PROD / CH) phases[lid] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
#else
    const bool tile = true;
#endif
    float acc[N_PROD][UY][VC];
#pragma unroll
    for (int k0 = 0; k0 < N_PROD; k0 += CH) {
        const int b0 = k0 / CH % 2 * CH; /* this phase's first buffer */
        /* 1. along axis 1: the tile's TY rows of LZ columns of CH products, UB rows a task */
        const int tasks = tile ? CH * (TY / UB) * LZ : 0; /* none where C is zero */
        for (int t = lid; t < tasks; t += ITEMS) {
            const int ch = t / ((TY / UB) * LZ), r0 = t / LZ % (TY / UB) * UB, c = t % LZ;
            const __global float *p =
                src + ((long)(k0 + ch) * ROWS + x) * PYA * RZ + (y0 + r0) * RZ + z0 + c;
            float m[UB];
#pragma unroll
            for (int u = 0; u < UB; ++u) m[u] = 0.0f;
            float v[UB + KY - 1]; /* past PY or PZ: never stored outputs read them */
            uint seen = 0;
#pragma unroll
            for (int j = 0; j < UB + KY - 1; ++j) {
                v[j] = p[j * RZ];
                seen |= as_uint(v[j]);
            }
            if (!ZERO_SKIP || (seen << 1) != 0) { /* zero values add nothing */
#pragma unroll
                for (int j = 0; j < UB + KY - 1; ++j) SLIDE(m, wy, KY, UB, j, v[j])
            }
            __local float (*mid)[LP * 4] = (__local float (*)[LP * 4])lm[b0 + ch];
            bool nonzero = false;
#pragma unroll
            for (int u = 0; u < UB; ++u) {
                mid[r0 + u][c] = m[u];
                nonzero |= m[u] != 0.0f;
            }
#if ZERO_SKIP
            if (nonzero) phases[k0 / CH] = 1; /* a benign race: every writer writes 1 */
#endif
        }
        barrier(CLK_LOCAL_MEM_FENCE); /* (also: the other buffers' reads are done) */
#if ZERO_SKIP
        const bool work = phases[k0 / CH]; /* the same in every work-item */
#else
        const bool work = tile;
#endif
        /* 2. along axis 2: VC outputs of UY rows a work-item, each product of the phase */
#pragma unroll
        for (int ch = 0; ch < CH; ++ch) {
#pragma unroll
            for (int r = 0; r < UY; ++r) {
#pragma unroll
                for (int l = 0; l < VC; ++l) acc[k0 + ch][r][l] = 0.0f;
                if (!work) continue; /* zero along axis 1: zero along axis 2 */
                float w[LW];
                const __local float4 *q = lm[b0 + ch][ly * UY + r] + lx * VC / 4;
                uint seen = 0;
#pragma unroll
                for (int j = 0; j < LW / 4; ++j) {
                    const float4 t = q[j];
                    vstore4(t, j, w);
                    seen |= as_uint(t.x) | as_uint(t.y) | as_uint(t.z) | as_uint(t.w);
                }
                if (ZERO_SKIP && (seen << 1) == 0) continue; /* zero values add nothing */
#pragma unroll
                for (int j = 0; j < VC + KZ - 1; ++j)
                    SLIDE(acc[k0 + ch][r], wz, KZ, VC, j, w[j])
            }
        }
    }
#pragma unroll
    for (int r = 0; r < UY; ++r) {
        const int y = y0 + ly * UY + r;
        if (y >= NY) break;
#pragma unroll
        for (int l = 0; l < VC; ++l) {
            const int z = z0 + lx * VC + l;
            if (z >= NZ) break;
            float l0, l1, l2;
#ifdef NO_EIGEN /* the first three entries instead: the epilogue's cost, for timing only */
            l0 = acc[0][r][l], l1 = acc[1][r][l] + acc[3][r][l] + acc[4][r][l];
            l2 = acc[2][r][l] + acc[5][r][l];
#else
            eigen_sym3(acc[0][r][l], acc[1][r][l], acc[2][r][l], acc[3][r][l], acc[4][r][l],
                       acc[5][r][l], &l0, &l1, &l2);
#endif
            const long at = ((long)(X0 + x) * NY + y) * NZ + z;
            feat[at] = l0;
            feat[plane + at] = l1;
            feat[2 * plane + at] = l2;
        }
    }
}
