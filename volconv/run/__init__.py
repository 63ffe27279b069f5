"""Running jobs: inputs, planning, streaming slab by slab, resume, batches over devices."""
