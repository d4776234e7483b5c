"""Parallel layout (PP x TP x DP) and the CPU shims megatron-core needs without CUDA."""
