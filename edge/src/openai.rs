//! The OpenAI bodies: which requests the edge serves natively (`parse`), and the
//! responses, byte for byte what router/openai_format.py writes for the same values.

/// `kvserve-edge openai`: test driver (JSON lines).
pub fn cli(_args: &[String]) -> i32 {
    todo!("openai cli")
}
