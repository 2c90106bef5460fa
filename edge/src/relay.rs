//! One request's run over its workers (router/relay.py's RequestRun and unified.py's
//! UnifiedRun), with the control plane deciding where it goes.
