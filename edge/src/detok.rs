//! Worker tokens -> client text with the stop rules: modelinfo/detokenizer.py's
//! RequestOutputText (EOS, stop token ids, stop strings with the held-back text,
//! max_tokens), the same text for the same tokens.

use std::sync::Arc;

use crate::protocol::SamplingParams;
use crate::tokenizer::Tokenizer;

pub struct OutputText {}

impl OutputText {
    pub fn new(
        _tokenizer: Arc<Tokenizer>,
        _params: &SamplingParams,
        _eos_token_ids: &[u32],
        _prompt_token_ids: &[u32],
        _skip_special_tokens: bool,
    ) -> OutputText {
        todo!("detok")
    }

    /// New tokens: (text to send now, the router's finish reason if these tokens end the
    /// request, how many of them count as output).
    pub fn extend(&mut self, _token_ids: &[u32]) -> (String, Option<String>, usize) {
        todo!("detok")
    }

    /// The worker finished for `reason` before the router saw a finish: the held-back text.
    pub fn finish(&mut self, _reason: &str) -> String {
        todo!("detok")
    }

    pub fn num_output_tokens(&self) -> usize {
        todo!("detok")
    }
}

/// `kvserve-edge detok --tokenizer FILE`: test driver (JSON lines).
pub fn cli(_args: &[String]) -> i32 {
    todo!("detok cli")
}
