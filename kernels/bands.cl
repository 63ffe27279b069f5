/* A zero background's bands, for the two launches of a tree whose first writes an intermediate
 * volume (kernels/tree_yz.cl's A, kernels/structure.cl's C) and whose second filters its tiles:
 * with ZERO_SKIP the first marks with its launch's epoch each band (BAND_X rows: the rows of a
 * work-item; BAND_Y x BAND_Z columns of a row of NY x NZ) where it computed a value other than zero
 * (NaN and Inf are not zero), and the second skips a tile whose bands are all unmarked: the
 * intermediate is zero there, so are the tile's responses, and so is every feature of zero
 * responses (eigenvalues, magnitudes, picks, differences). volconv/engines/features.py builds
 * this file in front of the kernels (`ZERO_BANDS` its BAND_Y, BAND_Z); each launch marks with a
 * new epoch, so the bands are never cleared.
 *
 * The first launch also stores no column of zeros where its intermediate already holds zeros:
 * each column of UA rows (a work-item's) has a byte, held, set where the intermediate may hold
 * a value other than zero there (every column, as allocated); the second launch reads it as
 * ever.
 */

/* the band of band row xb (rows [xb * BAND_X, ...)) holding column (y, z) */
#define BAND_AT(xb, y, z, ny, nz)                                                             \
    (((xb) * (((ny) + BAND_Y - 1) / BAND_Y) + (y) / BAND_Y) * (((nz) + BAND_Z - 1) / BAND_Z) + \
     (z) / BAND_Z)

/* Whether a band of band row xb over rows [y0, y1) and columns [z0, z1) is marked with epoch:
 * every work-item of the group calls it (two barriers; marked: the group's flag). */
inline bool bands_marked(__global const int *live, const int epoch, const int xb, const int y0,
                         const int y1, const int z0, const int z1, const int ny, const int nz,
                         __local int *marked, const int lid, const int items)
{
    if (lid == 0) *marked = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    const int by = y0 / BAND_Y, bz = z0 / BAND_Z;
    const int nby = (y1 - 1) / BAND_Y - by + 1, nbz = (z1 - 1) / BAND_Z - bz + 1;
    for (int t = lid; t < nby * nbz; t += items) {
        if (live[BAND_AT(xb, (by + t / nbz) * BAND_Y, (bz + t % nbz) * BAND_Z, ny, nz)] == epoch)
            *marked = 1; /* a benign race: every writer writes 1 */
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    return *marked != 0;
}

/* The first launch's bookkeeping for a work-item's K x U values acc at column (y, z) of row
 * block xb (of ny x nz columns): its band marked with epoch where a value is not zero (past the
 * sign: -0 is zero); its held byte kept, where tail says that rows past its block (not stored)
 * keep what they held; and a return where the values are zero and the column holds zeros
 * already (nothing to store). */
#define MARK_COLUMN(acc, K, U, live, epoch, held, xb, y, z, ny, nz, tail)                       \
    {                                                                                         \
        uint bits_ = 0;                                                                       \
        _Pragma("unroll") for (int k_ = 0; k_ < (K); ++k_) {                                  \
            _Pragma("unroll") for (int u_ = 0; u_ < (U); ++u_) bits_ |= as_uint(acc[k_][u_]) << 1; \
        }                                                                                     \
        if (bits_ != 0) live[BAND_AT(xb, y, z, ny, nz)] = epoch;                              \
        const long at_ = ((long)(xb) * (ny) + (y)) * (nz) + (z);                               \
        const bool held_ = held[at_];                                                         \
        held[at_] = bits_ != 0 || (held_ && (tail));                                          \
        if (bits_ == 0 && !held_) return;                                                     \
    }
