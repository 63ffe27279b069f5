"""The engines that convolve a slab on an OpenCL device, and the conversions around them."""
