"""GPU timing scripts for single kernels (run on the device: python3 -m tools.kernel_bench.NAME)."""
