"""skyrl-precisions: precisions (bf16, fp8, mxfp8, int4).

Each feature is one module here with its own ``skyrl`` entry point.
"""
