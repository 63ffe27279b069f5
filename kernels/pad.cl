/* Boundary extension on the device: gathers a slab of source rows into the padded slab that
 * the filtering kernels read, converting the element type once here rather than in the hot
 * loop.
 *
 * Each axis has an index map computed by the host (volconv/engines/boundary.py) with scipy.ndimage's
 * rules for reflect, mirror, nearest and wrap; an entry of -1 means "outside: use cval"
 * (constant mode, and the alignment tail that no stored output reads). The source rows are
 * addressed through strides, so they may sit in the file's own layout (an x-fastest NIfTI
 * uploaded as it is): the transpose to the padded slab's C order happens here, for free.
 *
 * On CPUs (build option ROWS) a work-item fills a whole padded row: the nz samples inside the
 * volume along axis 2, from lo2 on, are a plain copy of a source row (vectorised), only the
 * border goes through m2; a work-item per element costs a CPU more than the copy. lo2 and nz
 * are arguments, not build options: one program serves every volume's shape.
 *
 * Build options (-D): SRC_T the source element type, DST_T the padded element type; ROWS for
 * the row kernel (launched over (1, P1, P0)); PAD_TILE and PAD_ROWS for pad_tiles (GPUs).
 */
__kernel void pad(__global const SRC_T *restrict src,  /* source rows, strided */
                  __global DST_T *restrict dst,        /* (P0, P1, P2) padded slab */
                  __global const int *restrict m0,     /* P0 entries: source row or -1 */
                  __global const int *restrict m1,     /* P1 entries into [0, S1) or -1 */
                  __global const int *restrict m2,     /* P2 entries into [0, S2) or -1 */
                  const int P0, const int P1, const int P2,
                  const long s0, const long s1, const long s2,  /* element strides of src */
                  const float cval,
                  const int lo2, const int nz)  /* the row kernel's: the halo, the volume's NZ */
{
#ifdef ROWS
    const int p1 = (int)get_global_id(1);
    const int p0 = (int)get_global_id(2);
    if (p1 >= P1 || p0 >= P0) return;
    const int i0 = m0[p0], i1 = m1[p1];
    __global DST_T *d = dst + ((long)p0 * P1 + p1) * P2;
    if (i0 < 0 || i1 < 0) {
        for (int p2 = 0; p2 < P2; ++p2) d[p2] = (DST_T)cval;
        return;
    }
    const __global SRC_T *s = src + i0 * s0 + i1 * s1;
    for (int p2 = 0; p2 < lo2; ++p2) d[p2] = m2[p2] < 0 ? (DST_T)cval : (DST_T)s[m2[p2] * s2];
    if (s2 == 1) {
        for (int k = 0; k < nz; ++k) d[lo2 + k] = (DST_T)s[k];
    } else {
        for (int k = 0; k < nz; ++k) d[lo2 + k] = (DST_T)s[k * s2];
    }
    for (int p2 = lo2 + nz; p2 < P2; ++p2)
        d[p2] = m2[p2] < 0 ? (DST_T)cval : (DST_T)s[m2[p2] * s2];
#else
    const int p2 = (int)get_global_id(0);
    const int p1 = (int)get_global_id(1);
    const int p0 = (int)get_global_id(2);
    if (p2 >= P2 || p1 >= P1 || p0 >= P0) return;
    const int i0 = m0[p0], i1 = m1[p1], i2 = m2[p2];
    const long at = ((long)p0 * P1 + p1) * P2 + p2;
    if (i0 < 0 || i1 < 0 || i2 < 0) {
        dst[at] = (DST_T)cval;
    } else {
        dst[at] = (DST_T)src[i0 * s0 + i1 * s1 + i2 * s2];
    }
#endif
}

#ifdef PAD_TILE
/* pad_tiles: pad for sources whose fastest axis is axis 0 (s0 == 1: NIfTI's x-fastest
 * layout) on GPUs, where pad's work-items along axis 2 would each read a memory sector of their
 * own (their elements s2 apart). A work-group moves a PAD_TILE x PAD_TILE tile of (axis 2,
 * axis 0) at one padded row p1 through local memory, reading along axis 0 and writing along
 * axis 2, both coalesced. Launched over (ceil(P2 / PAD_TILE) PAD_TILE, P1 PAD_ROWS,
 * ceil(P0 / PAD_TILE)) in work-groups of (PAD_TILE, PAD_ROWS, 1). */
__kernel __attribute__((reqd_work_group_size(PAD_TILE, PAD_ROWS, 1)))
void pad_tiles(__global const SRC_T *restrict src, __global DST_T *restrict dst,
               __global const int *restrict m0, __global const int *restrict m1,
               __global const int *restrict m2, const int P0, const int P1, const int P2,
               const long s0, const long s1, const long s2, const float cval,
               const int lo2, const int nz) /* pad's arguments; lo2 and nz unused */
{
    __local DST_T tile[PAD_TILE][PAD_TILE + 1]; /* [p2][p0], its rows an odd pitch apart */
    const int tx = (int)get_local_id(0), ty = (int)get_local_id(1);
    const int b2 = (int)get_group_id(0) * PAD_TILE, b0 = (int)get_group_id(2) * PAD_TILE;
    const int p1 = (int)get_group_id(1);
    const int i1 = m1[p1];
    const int p0 = b0 + tx, i0 = p0 < P0 ? m0[p0] : -1;
    for (int r = ty; r < PAD_TILE; r += PAD_ROWS) {
        const int p2 = b2 + r;
        const int i2 = p2 < P2 ? m2[p2] : -1;
        tile[r][tx] = i0 < 0 || i1 < 0 || i2 < 0 ? (DST_T)cval
                                                 : (DST_T)src[i0 * s0 + i1 * s1 + i2 * s2];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const int p2 = b2 + tx;
    for (int r = ty; r < PAD_TILE; r += PAD_ROWS) {
        const int q0 = b0 + r;
        if (q0 < P0 && p2 < P2) dst[((long)q0 * P1 + p1) * P2 + p2] = tile[tx][r];
    }
}
#endif
