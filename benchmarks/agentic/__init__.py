"""The agentic benchmark: agent traces (read or generated), closed-loop replay against an
OpenAI-compatible server, and the report (reuse by source against the trace ceiling).

    trace.py      data model, the JSONL format we accept, the ceiling counter
    synthetic.py  seeded sessions with the published shape, scalable down
    replay.py     closed-loop replayer (token-id prompts, ignore_eos, streamed usage)
    report.py     report.json, requests.jsonl, PNG plots
    cli.py        `kvserve bench agentic` / `python -m benchmarks.agentic`
    study.py      the scaled-down CPU study of docs/benchmarks.md
"""
