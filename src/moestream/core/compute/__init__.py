"""Compute: the kernels (the registry, the fused modules, the compiled C++ and its build), the dense
layers' quantized linears, attention, and the int4 repacking the kernels read."""
