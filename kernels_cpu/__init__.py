"""Hand-written XLA:CPU kernels (C++ through the XLA FFI), compiled on first use.

`small_matmul`: ``x @ w.T`` for a float32 [out, in] weight and 2-8 rows, the shape of a CPU
decode or speculative-verification step; method folders reach it through `kernels_pallas.dispatch`.
"""
