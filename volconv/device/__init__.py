"""OpenCL devices: choosing one, its peaks, the one build path and the cache folder."""
