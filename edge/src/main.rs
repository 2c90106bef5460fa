//! kvserve-edge: the router's native data plane (docs/edge.md).
//!
//!     kvserve-edge serve --config FILE     serve clients (started by router/edge.py)
//!     kvserve-edge tokenize|detok|openai|chat|control ...   test drivers of one module each,
//!                                          reading JSON lines on stdin (tests/test_edge_*.py)

mod chat;
mod config;
mod control;
mod detok;
mod openai;
mod protocol;
mod proxy;
mod relay;
mod serve;
mod tokenizer;
mod worker;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = if args.is_empty() { &[][..] } else { &args[1..] };
    let code = match args.first().map(String::as_str) {
        Some("serve") => serve::main(rest),
        Some("tokenize") => tokenizer::cli(rest),
        Some("detok") => detok::cli(rest),
        Some("openai") => openai::cli(rest),
        Some("chat") => chat::cli(rest),
        Some("control") => control::cli(rest),
        _ => {
            eprintln!("usage: kvserve-edge serve --config FILE | tokenize | detok | openai | chat | control");
            2
        }
    };
    std::process::exit(code);
}
