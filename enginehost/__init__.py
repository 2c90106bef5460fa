"""Hosts an LLMEngine behind HTTP inside a worker process: the engine thread bridged to
asyncio, per-request output streams, and the endpoints every worker serves (/health,
/status, /abort, /metrics). Prefill and decode instances build on it (layer between them
and engine/)."""
