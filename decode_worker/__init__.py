"""A decode instance: admits handed-off requests into landing space, scatters their KV
into its pages, and decodes them with continuous batching, streaming tokens back."""
