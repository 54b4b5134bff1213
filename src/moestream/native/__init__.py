"""The compiled kernels: their C++ source and its build, below everything that uses them (conversion's
import passes, the engine's kernels), so each imports them directly."""
