"""OpenCL devices: choosing one, its peaks, the one build path and the cache folder."""

import os

# PoCL's worker threads each pinned to a core unless the user says otherwise (PoCL reads it as
# its CPU device starts, after this import): a worker the OS moves loses the cache its
# work-group's private arrays live in (kernels/columns.cl's ring of mids); see
# benchmarks/results/pocl-features-grad2.json.
os.environ.setdefault("POCL_AFFINITY", "1")
