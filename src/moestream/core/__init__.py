"""The engine core: a store's model assembled under a budget (loading), its experts calls (engine), the
expert supply (supply), the expert cache with its call order (cache) and policies, reads (reader),
kernels, speculation (prefetch)."""
