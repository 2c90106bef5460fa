//! Calls to the workers: /decode, /prefill and /generate NDJSON streams, /abort.
