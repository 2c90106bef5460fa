//! The worker protocol (protocol/messages.py, protocol/sampling.py): the same JSON bytes
//! as msgspec writes for the same values, and the events the workers stream.

use serde::{Deserialize, Serialize};

/// protocol/messages.py PROTOCOL_VERSION.
pub const PROTOCOL_VERSION: i64 = 4;

/// protocol/sampling.py SamplingParams, field for field.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SamplingParams {}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PromptUsage {
    pub prompt_tokens: u64,
    pub gpu_tokens: u64,
    pub pool_tokens: u64,
    pub computed_tokens: u64,
}
