"""The expert supply: a layer's experts made ready in memory under a byte budget (the cache and its
policies, the reader, reads ahead of need, the device tier)."""
