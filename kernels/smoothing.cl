/* The skimage preset's first stage: one scale's Gaussian in mode 'nearest', as scipy's
 * gaussian_filter runs it in 1D passes, built per scale (volconv/engines/smoothing.py):
 *
 *   smooth_z: axis 2 over rows of the input (IN_T), into T;
 *   smooth_y: axis 1 over T, into the ring of rows smoothed along axes 2 and 1 (row r at slot
 *             r % CAP, CAP a power of two), so that a row is smoothed along those axes once
 *             for every slab that reads it;
 *   smooth_x: axis 0 over the ring, into the field (the rows stage 2 reads).
 *
 * Each work-item computes M (smooth_z: MZ) consecutive outputs along its pass's axis and loads
 * each input once for all of them: out[i] = sum_t W[t] in[i - R + t], t = 0 .. 2R (the taps of
 * a Gaussian are symmetric: correlation and convolution agree), borders clamped ('nearest').
 * smooth_z reads its row segment from local memory (skewed: one word per 32, so that
 * work-items MZ words apart fall in distinct banks) and writes through it, coalesced; smooth_y
 * and smooth_x run along the contiguous axis 2 across work-items, their work-groups holding
 * several blocks along the pass's axis (the host's), whose windows overlap in cache.
 *
 * Build options (-D): R the radius, WEIGHTS the 2R + 1 float32 taps, M outputs per work-item
 * of smooth_y, MX of smooth_x (default M), MZ of smooth_z, WG smooth_z's work-group size, IN_T the input's
 * element type; UNROLL_TAPS: the tap loops fully unrolled, so that each tap is a constant of
 * the code (GPUs; PoCL takes seconds to compile that for R = 64, so CPUs run them rolled);
 * TAP_CHUNK: smooth_y's taps in rolled chunks of that many, each chunk unrolled.
 */

__constant float W[2 * R + 1] = {WEIGHTS};

#ifdef UNROLL_TAPS
#define TAP_LOOP _Pragma("unroll")
#else
#define TAP_LOOP _Pragma("unroll 1")
#endif

#define SKEW(j) ((j) + ((j) >> 5))
#define SEG (WG * MZ) /* outputs of a smooth_z work-group's row */
#ifndef LINES
#define LINES 1
#endif
#ifndef MX
#define MX M
#endif

#ifdef TAP_CHUNK
/* smooth_y's taps in chunks of TAP_CHUNK, a rolled loop over the chunks, each unrolled (the
 * code of 2R + 1 taps unrolled whole is long at large R): acc[m] (m < MM) = sum_t W[t]
 * LOAD(t + m), t in order (the same sums as SLIDE's), a window of MM + TAP_CHUNK - 1 inputs in
 * registers; the taps past 2R weigh 0, and LOAD reads rows of T for them (finite: the preset
 * refuses non-finite voxels). */
#define NCHUNK ((2 * R + TAP_CHUNK) / TAP_CHUNK)
__constant float WP[NCHUNK * TAP_CHUNK] = {WEIGHTS};
#define CHUNKED(acc, MM, LOAD)                                                             \
    {                                                                                      \
        float xw_[MM + TAP_CHUNK - 1];                                                     \
        _Pragma("unroll") for (int i_ = 0; i_ < MM - 1; ++i_) xw_[i_] = LOAD(i_);          \
        _Pragma("unroll 1") for (int c_ = 0; c_ < NCHUNK; ++c_)                            \
        {                                                                                  \
            const int t0_ = c_ * TAP_CHUNK;                                                \
            _Pragma("unroll") for (int k_ = 0; k_ < TAP_CHUNK; ++k_) xw_[MM - 1 + k_] =    \
                LOAD(t0_ + MM - 1 + k_);                                                   \
            _Pragma("unroll") for (int k_ = 0; k_ < TAP_CHUNK; ++k_)                       \
            {                                                                              \
                const float w_ = WP[t0_ + k_];                                             \
                _Pragma("unroll") for (int m_ = 0; m_ < MM; ++m_) acc[m_] += w_ * xw_[m_ + k_]; \
            }                                                                              \
            _Pragma("unroll") for (int i_ = 0; i_ < MM - 1; ++i_) xw_[i_] = xw_[i_ + TAP_CHUNK]; \
        }                                                                                  \
    }
#endif

/* acc[m] += W[j - m] v for the outputs m < mm whose window holds input j */
#define SLIDE(acc, j, v, mm)                              \
    _Pragma("unroll") for (int m_ = 0; m_ < (mm); ++m_)   \
    {                                                     \
        const int t_ = (j) - m_;                          \
        if (t_ >= 0 && t_ <= 2 * R) acc[m_] += W[t_] * (v); \
    }

/* rows S0 + r of src (NY, NZ each) into rows r of T, along axis 2; LINES rows of axis 1 a
 * work-group */
__kernel __attribute__((reqd_work_group_size(WG, LINES, 1))) void
smooth_z(__global const IN_T *restrict src, const int S0, const int NY, const int NZ,
         __global float *restrict T)
{
    __local float lines[LINES][SKEW(SEG + 2 * R) + 1];
    __local float *line = lines[get_local_id(1)];
    const int lid = (int)get_local_id(0), z0 = (int)get_group_id(0) * SEG;
    const int y = min((int)get_global_id(1), NY - 1), r = (int)get_global_id(2);
    const int own = (int)get_global_id(1) < NY; /* a row of axis 1 (past NY: the last, unwritten) */
    const long at = ((long)r * NY + y) * NZ, from = ((long)(S0 + r) * NY + y) * NZ;
    for (int j = lid; j < SEG + 2 * R; j += WG)
        line[SKEW(j)] = (float)src[from + clamp(z0 - R + j, 0, NZ - 1)];
    barrier(CLK_LOCAL_MEM_FENCE);
    float acc[MZ];
#pragma unroll
    for (int m = 0; m < MZ; ++m) acc[m] = 0.0f;
    const int base = lid * MZ;
    TAP_LOOP
    for (int j = 0; j < MZ + 2 * R; ++j) {
        const float v = line[SKEW(base + j)];
        SLIDE(acc, j, v, MZ)
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
    for (int m = 0; m < MZ; ++m) line[SKEW(base + m)] = acc[m];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int j = lid; own && j < SEG && z0 + j < NZ; j += WG) T[at + z0 + j] = line[SKEW(j)];
}

/* rows n of T along axis 1 into the ring: T's row r is the volume's row R0 + r */
__kernel void smooth_y(__global const float *restrict T, const int R0, const int NY,
                       const int NZ, const int CAP, __global float *restrict ring)
{
    const int z = (int)get_global_id(0), y0 = (int)get_global_id(1) * M;
    const int r = (int)get_global_id(2);
    if (z >= NZ || y0 >= NY) return;
    __global const float *t = T + (long)r * NY * NZ + z;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
#ifdef TAP_CHUNK
#define LOAD_Y(j) t[(long)clamp(y0 - R + min((j), M + 2 * R - 1), 0, NY - 1) * NZ]
    CHUNKED(acc, M, LOAD_Y)
#else
    TAP_LOOP
    for (int j = 0; j < M + 2 * R; ++j) {
        const float v = t[(long)clamp(y0 - R + j, 0, NY - 1) * NZ];
        SLIDE(acc, j, v, M)
    }
#endif
    __global float *out = ring + ((long)((R0 + r) & (CAP - 1)) * NY + y0) * NZ + z;
#pragma unroll
    for (int m = 0; m < M; ++m)
        if (y0 + m < NY) out[(long)m * NZ] = acc[m];
}

/* the field's rows G0 .. G0 + NG - 1 along axis 0 from the ring (rows of the volume's N0),
 * into G from float F */
__kernel void smooth_x(__global const float *restrict ring, const int CAP, const int G0,
                       const int NG, const int N0, const int NY, const int NZ,
                       __global float *restrict G_all, const long F)
{
    __global float *G = G_all + F;
    const int z = (int)get_global_id(0), y = (int)get_global_id(1);
    const int g0 = (int)get_global_id(2) * MX;
    if (z >= NZ || g0 >= NG) return;
    const long plane = (long)NY * NZ, at = (long)y * NZ + z;
    float acc[MX];
#pragma unroll
    for (int m = 0; m < MX; ++m) acc[m] = 0.0f;
    TAP_LOOP
    for (int j = 0; j < MX + 2 * R; ++j) {
        const int row = clamp(G0 + g0 - R + j, 0, N0 - 1);
        const float v = ring[(row & (CAP - 1)) * plane + at];
        SLIDE(acc, j, v, MX)
    }
#pragma unroll
    for (int m = 0; m < MX; ++m)
        if (g0 + m < NG) G[(g0 + m) * plane + at] = acc[m];
}
