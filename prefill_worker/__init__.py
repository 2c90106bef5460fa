"""A prefill instance: computes prompts (restoring cached prefixes), samples the first
token, and hands the prompt's KV to the decode instance the router chose."""
