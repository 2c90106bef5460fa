//! The response bodies of one choice, byte for byte router/openai_format.py's (without
//! logprobs and tools), router/choices.py's error event and router/errors.py's error body.

use super::Endpoint;
use crate::protocol::json::{write_str, write_u64};
use crate::protocol::PromptUsage;

pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// A request's token counts (router/openai_format.py usage_dict's inputs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub details: Option<PromptUsage>,
}

impl Usage {
    /// usage_dict: the counts, and the prefill's split when known.
    fn write_json(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"prompt_tokens\":");
        write_u64(out, self.prompt_tokens);
        out.extend_from_slice(b",\"completion_tokens\":");
        write_u64(out, self.completion_tokens);
        out.extend_from_slice(b",\"total_tokens\":");
        write_u64(
            out,
            self.prompt_tokens.saturating_add(self.completion_tokens),
        );
        if let Some(d) = &self.details {
            out.extend_from_slice(b",\"prompt_tokens_details\":{\"cached_tokens\":");
            write_u64(out, d.gpu_tokens.saturating_add(d.pool_tokens));
            out.extend_from_slice(b",\"gpu_tokens\":");
            write_u64(out, d.gpu_tokens);
            out.extend_from_slice(b",\"pool_tokens\":");
            write_u64(out, d.pool_tokens);
            out.extend_from_slice(b",\"computed_tokens\":");
            write_u64(out, d.computed_tokens);
            out.push(b'}');
        }
        out.push(b'}');
    }
}

/// One choice's response bodies (router/openai_format.py ChatFormatter /
/// CompletionFormatter without logprobs and tools); the call sequence is in the header.
pub struct Formatter {
    endpoint: Endpoint,
    /// `{"id":..,"object":..,"created":..,"model":..,"choices":[` of a chunk.
    chunk_head: Vec<u8>,
    /// What follows a chunk's choices: `]}` or, with include_usage, `],"usage":null}`.
    chunk_tail: &'static [u8],
    include_usage: bool,
    request_id: String,
    created: u64,
    model: String,
    /// Whether a chat stream's role chunk went out.
    started: bool,
}

impl Formatter {
    pub fn new(
        endpoint: Endpoint,
        request_id: &str,
        created: u64,
        model: &str,
        include_usage: bool,
    ) -> Formatter {
        let mut f = Formatter {
            endpoint,
            chunk_head: Vec::new(),
            chunk_tail: if include_usage {
                b"],\"usage\":null}\n\n"
            } else {
                b"]}\n\n"
            },
            include_usage,
            request_id: request_id.to_string(),
            created,
            model: model.to_string(),
            started: false,
        };
        let mut head = b"data: ".to_vec();
        f.envelope_head(&mut head, f.object_chunk());
        f.chunk_head = head;
        f
    }

    fn object_chunk(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        }
    }

    fn object_full(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completion => "text_completion",
        }
    }

    /// ResponseFormatter.envelope up to the choices' opening bracket.
    fn envelope_head(&self, out: &mut Vec<u8>, object: &str) {
        out.extend_from_slice(b"{\"id\":");
        write_str(out, &self.request_id);
        out.extend_from_slice(b",\"object\":");
        write_str(out, object);
        out.extend_from_slice(b",\"created\":");
        write_u64(out, self.created);
        out.extend_from_slice(b",\"model\":");
        write_str(out, &self.model);
        out.extend_from_slice(b",\"choices\":[");
    }

    /// One delta's SSE bytes ("data: {...}\n\n"), empty when there is nothing to send yet
    /// (no text, no finish). A chat stream's first call puts the role chunk in front.
    pub fn chunk(&mut self, text: &str, finish_reason: Option<&str>) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.chunk_head.len() + text.len() + 96);
        if self.endpoint == Endpoint::Chat && !self.started {
            self.started = true;
            out.extend_from_slice(&self.chunk_head);
            out.extend_from_slice(
                b"{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}",
            );
            out.extend_from_slice(self.chunk_tail);
        }
        if text.is_empty() && finish_reason.is_none() {
            return out;
        }
        out.extend_from_slice(&self.chunk_head);
        match self.endpoint {
            Endpoint::Chat => {
                out.extend_from_slice(b"{\"index\":0,\"delta\":{");
                if !text.is_empty() {
                    out.extend_from_slice(b"\"content\":");
                    write_str(&mut out, text);
                }
                out.push(b'}');
            }
            Endpoint::Completion => {
                out.extend_from_slice(b"{\"index\":0,\"text\":");
                write_str(&mut out, text);
            }
        }
        out.extend_from_slice(b",\"logprobs\":null,\"finish_reason\":");
        write_opt_str(&mut out, finish_reason);
        out.push(b'}');
        out.extend_from_slice(self.chunk_tail);
        out
    }

    /// The last chunk with `"choices": []` and the usage (stream_options.include_usage).
    pub fn usage_chunk(&self, usage: &Usage) -> Vec<u8> {
        let mut out = b"data: ".to_vec();
        self.envelope_head(&mut out, self.object_chunk());
        out.extend_from_slice(b"],\"usage\":");
        usage.write_json(&mut out);
        out.extend_from_slice(b"}\n\n");
        out
    }

    /// What follows the chunk that carried the finish reason: the usage chunk when the
    /// request asked for it, then DONE.
    pub fn stream_end(&self, usage: &Usage) -> Vec<u8> {
        let mut out = if self.include_usage {
            self.usage_chunk(usage)
        } else {
            Vec::new()
        };
        out.extend_from_slice(DONE);
        out
    }

    /// The whole (non-streamed) body.
    pub fn full(&self, text: &str, finish_reason: &str, usage: &Usage) -> Vec<u8> {
        let mut out = Vec::with_capacity(text.len() + 320);
        self.envelope_head(&mut out, self.object_full());
        match self.endpoint {
            Endpoint::Chat => {
                out.extend_from_slice(
                    b"{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":",
                );
                write_str(&mut out, text);
                out.extend_from_slice(b",\"refusal\":null}");
            }
            Endpoint::Completion => {
                out.extend_from_slice(b"{\"index\":0,\"text\":");
                write_str(&mut out, text);
            }
        }
        out.extend_from_slice(b",\"logprobs\":null,\"finish_reason\":");
        write_str(&mut out, finish_reason);
        out.extend_from_slice(b"}],\"usage\":");
        usage.write_json(&mut out);
        out.push(b'}');
        out
    }
}

fn write_opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => write_str(out, s),
        None => out.extend_from_slice(b"null"),
    }
}

/// router/errors.py APIError.encode(): {"error": {"message", "type", "param", "code"}}.
pub fn error_body(
    message: &str,
    error_type: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(message.len() + 96);
    out.extend_from_slice(b"{\"error\":{\"message\":");
    write_str(&mut out, message);
    out.extend_from_slice(b",\"type\":");
    write_str(&mut out, error_type);
    out.extend_from_slice(b",\"param\":");
    write_opt_str(&mut out, param);
    out.extend_from_slice(b",\"code\":");
    write_opt_str(&mut out, code);
    out.extend_from_slice(b"}}");
    out
}

/// router/choices.py error_event: a failure after a stream's status went out, as one SSE
/// event, then DONE.
pub fn error_event(message: &str, error_type: &str, code: Option<&str>) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    out.extend_from_slice(&error_body(message, error_type, None, code));
    out.extend_from_slice(b"\n\n");
    out.extend_from_slice(DONE);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::{new_request_id, Endpoint};

    #[test]
    fn chat_stream_starts_with_the_role() {
        let mut f = Formatter::new(Endpoint::Chat, "chatcmpl-1", 7, "m", false);
        let first = String::from_utf8(f.chunk("", None)).unwrap();
        assert_eq!(first, "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
        assert!(f.chunk("", None).is_empty());
        assert!(new_request_id(Endpoint::Chat).starts_with("chatcmpl-"));
        assert_ne!(
            new_request_id(Endpoint::Completion),
            new_request_id(Endpoint::Completion)
        );
    }
}
