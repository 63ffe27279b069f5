/* For scripts/sass_counts.py only: the two OpenCL built-ins bank_conv.cl calls, for clang's
 * OpenCL front end on NVPTX, which has no built-in library (the NVIDIA driver brings its own).
 * Never built by volconv. */
static inline size_t offline_global_id(uint d) {
    if (d == 0)
        return __nvvm_read_ptx_sreg_ctaid_x() * __nvvm_read_ptx_sreg_ntid_x() +
               __nvvm_read_ptx_sreg_tid_x();
    if (d == 1)
        return __nvvm_read_ptx_sreg_ctaid_y() * __nvvm_read_ptx_sreg_ntid_y() +
               __nvvm_read_ptx_sreg_tid_y();
    return __nvvm_read_ptx_sreg_ctaid_z() * __nvvm_read_ptx_sreg_ntid_z() +
           __nvvm_read_ptx_sreg_tid_z();
}

static inline int offline_min(int a, int b) { return a < b ? a : b; }
