"""The unified instance: one engine process that prefills and decodes, with the pool."""
