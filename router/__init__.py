"""The OpenAI-compatible front end: validation, chat template + tokenization, routing,
relay of prefill/decode events to the client. Layer 3; never imports torch."""
