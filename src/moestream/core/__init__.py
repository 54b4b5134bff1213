"""The engine core: a store's model assembled under a budget (loading), its experts calls (engine,
scheduler), the expert cache and its policies, reads (reader), kernels, speculation (prefetch)."""
