//! Chat templates as programs of pieces (router/edge_template.py derives them from the
//! model's Jinja template and checks them against it; docs/edge.md, "Chat templates").
//!
//! A program says, for the conversations it covers, what the template writes around
//! each message's content:
//!
//!     sep(^, r0) + T_r0(c0) + sep(r0, r1) + T_r1(c1) + ... + T_rn(cn) + end(rn, gen)
//!
//! `sep(previous, role)` exists only for the role pairs the router's template was seen
//! to render (and checked on); a conversation with any other pair, an unknown role or an
//! ending not derived is not covered: `render` returns None and the request is proxied.
//! The rendered text holds the template's special tokens as text:
//! `Tokenizer::encode(&text, false)` gives the router's prompt ids for it (the router
//! encodes the whole text the same way; router/edge_template.py checks this at start).

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::Path;

use serde::Deserialize;

const FORMAT: &str = "kvserve-chat-template";
const VERSION: u64 = 1;
/// The "previous role" of the first message.
const START: &str = "^";

/// One message as a template reads it: openai.rs's `ChatMessage`, the driver's lines.
/// "developer" is taken as "system", as the router does.
pub trait ChatTurn {
    fn role(&self) -> &str;
    fn content(&self) -> &str;
}

impl ChatTurn for crate::openai::ChatMessage {
    fn role(&self) -> &str {
        &self.role
    }
    fn content(&self) -> &str {
        &self.content
    }
}

/// What the template does to a content before writing it: Python's str.strip / lstrip /
/// rstrip with the program's characters (Jinja's `trim` is str.strip, whose whitespace
/// is not Rust's `char::is_whitespace`, so the program names the characters).
#[derive(Debug)]
enum Strip {
    None,
    Both,
    Left,
    Right,
}

#[derive(Debug)]
struct Transform {
    strip: Strip,
    chars: Vec<char>,
}

impl Transform {
    fn apply<'a>(&self, content: &'a str) -> &'a str {
        let strip = |c: char| self.chars.contains(&c);
        match self.strip {
            Strip::None => content,
            Strip::Both => content.trim_matches(strip),
            Strip::Left => content.trim_start_matches(strip),
            Strip::Right => content.trim_end_matches(strip),
        }
    }
}

/// router/edge_template.py's JSON, as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProgramFile {
    format: String,
    version: u64,
    separators: HashMap<String, HashMap<String, String>>,
    endings: HashMap<String, HashMap<String, String>>,
    content: HashMap<String, ContentRule>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ContentRule {
    strip: String,
    chars: String,
}

/// A derived chat template: its roles, and the pieces indexed by role number (previous
/// role `0` is the start, `i + 1` role `i`).
#[derive(Debug)]
pub struct ChatTemplate {
    roles: Vec<String>,
    /// `[previous][role]`: the text before a `role` content after `previous`.
    separators: Vec<Vec<Option<String>>>,
    /// `[last role + 1][add_generation_prompt as usize]`: the text after the last content.
    endings: Vec<[Option<String>; 2]>,
    transforms: Vec<Transform>,
}

impl ChatTemplate {
    /// The program router/edge_template.py `write_template` wrote.
    pub fn from_file(path: &Path) -> Result<ChatTemplate, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading chat template program {}: {e}", path.display()))?;
        ChatTemplate::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn from_json(text: &str) -> Result<ChatTemplate, String> {
        let file: ProgramFile =
            serde_json::from_str(text).map_err(|e| format!("not a chat template program: {e}"))?;
        if file.format != FORMAT || file.version != VERSION {
            return Err(format!(
                "format {:?} version {} is not {FORMAT:?} version {VERSION}",
                file.format, file.version
            ));
        }
        let mut roles: Vec<String> = file.content.keys().cloned().collect();
        roles.sort();
        let transforms = roles
            .iter()
            .map(|r| transform(r, &file.content[r]))
            .collect::<Result<Vec<_>, _>>()?;
        let mut template = ChatTemplate {
            separators: vec![vec![None; roles.len()]; roles.len() + 1],
            endings: vec![[None, None]; roles.len() + 1],
            roles,
            transforms,
        };
        for (previous, after) in &file.separators {
            let p = template.state(previous)?;
            for (role, text) in after {
                let r = template
                    .role_index(role)
                    .ok_or(format!("unknown role {role:?}"))?;
                template.separators[p][r] = Some(text.clone());
            }
        }
        for (last, by_gen) in &file.endings {
            let p = template.state(last)?;
            for (gen, text) in by_gen {
                let g = match gen.as_str() {
                    "false" => 0,
                    "true" => 1,
                    _ => return Err(format!("ending key {gen:?} is not \"true\" or \"false\"")),
                };
                template.endings[p][g] = Some(text.clone());
            }
        }
        Ok(template)
    }

    /// The router's prompt text for these messages, or None when the program does not
    /// cover them (no messages, a role it does not know, a role pair or an ending it
    /// was not derived and checked for): the request is then proxied.
    pub fn render<M: ChatTurn>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
    ) -> Option<String> {
        if messages.is_empty() {
            return None;
        }
        let size: usize = messages.iter().map(|m| m.content().len() + 64).sum();
        let mut out = String::with_capacity(size);
        let mut previous = 0;
        for message in messages {
            let role = self.role_index(message.role())?;
            out.push_str(self.separators[previous][role].as_deref()?);
            out.push_str(self.transforms[role].apply(message.content()));
            previous = role + 1;
        }
        out.push_str(self.endings[previous][usize::from(add_generation_prompt)].as_deref()?);
        Some(out)
    }

    fn role_index(&self, role: &str) -> Option<usize> {
        let role = if role == "developer" { "system" } else { role };
        self.roles.iter().position(|r| r == role)
    }

    fn state(&self, previous: &str) -> Result<usize, String> {
        if previous == START {
            return Ok(0);
        }
        self.role_index(previous)
            .map(|r| r + 1)
            .ok_or(format!("unknown role {previous:?}"))
    }
}

fn transform(role: &str, rule: &ContentRule) -> Result<Transform, String> {
    let strip = match rule.strip.as_str() {
        "none" => Strip::None,
        "both" => Strip::Both,
        "left" => Strip::Left,
        "right" => Strip::Right,
        other => return Err(format!("role {role:?}: unknown strip {other:?}")),
    };
    Ok(Transform {
        strip,
        chars: rule.chars.chars().collect(),
    })
}

/// One message of a driver line.
#[derive(Deserialize)]
struct DriverMessage {
    role: String,
    content: String,
}

impl ChatTurn for DriverMessage {
    fn role(&self) -> &str {
        &self.role
    }
    fn content(&self) -> &str {
        &self.content
    }
}

#[derive(Deserialize)]
struct DriverLine {
    messages: Vec<DriverMessage>,
    add_generation_prompt: bool,
}

/// `kvserve-edge chat --template FILE`: test driver. Each stdin line
/// {"messages": [{"role", "content"}...], "add_generation_prompt": bool} gives one stdout
/// line {"text": "..." | null}; a line it cannot read, {"error": "..."}.
pub fn cli(args: &[String]) -> i32 {
    let path = match args {
        [flag, path] if flag == "--template" => path,
        _ => {
            eprintln!("usage: kvserve-edge chat --template FILE");
            return 2;
        }
    };
    let template = match ChatTemplate::from_file(Path::new(path)) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return 1;
        }
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { return 1 };
        let reply = match serde_json::from_str::<DriverLine>(&line) {
            Ok(req) => serde_json::json!({
                "text": template.render(&req.messages, req.add_generation_prompt)
            }),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        };
        if writeln!(out, "{reply}").and_then(|()| out.flush()).is_err() {
            return 1;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROGRAM: &str = r#"{
        "format": "kvserve-chat-template", "version": 1,
        "separators": {
            "^": {"system": "<s>S:", "user": "<s>S:default|U:"},
            "system": {"user": "|U:"},
            "user": {"assistant": "|A:"},
            "assistant": {"user": "</s>|U:"}
        },
        "endings": {"user": {"true": "|A:", "false": "|"}, "assistant": {"false": "</s>"}},
        "content": {
            "system": {"strip": "none", "chars": ""},
            "user": {"strip": "both", "chars": " \n\u3000"},
            "assistant": {"strip": "right", "chars": "\n"}
        }
    }"#;

    fn turns(pairs: &[(&str, &str)]) -> Vec<DriverMessage> {
        pairs
            .iter()
            .map(|(r, c)| DriverMessage {
                role: r.to_string(),
                content: c.to_string(),
            })
            .collect()
    }

    #[test]
    fn renders_pieces_around_transformed_contents() {
        let t = ChatTemplate::from_json(PROGRAM).unwrap();
        let m = turns(&[
            ("developer", " sys "),
            ("user", "\u{3000} hi\n"),
            ("assistant", " yo\n\n"),
        ]);
        assert_eq!(
            t.render(&m, false).as_deref(),
            Some("<s>S: sys |U:hi|A: yo</s>")
        );
        let m = turns(&[("user", "q")]);
        assert_eq!(t.render(&m, true).as_deref(), Some("<s>S:default|U:q|A:"));
    }

    #[test]
    fn uncovered_conversations_are_none() {
        let t = ChatTemplate::from_json(PROGRAM).unwrap();
        assert_eq!(t.render::<DriverMessage>(&[], true), None);
        assert_eq!(t.render(&turns(&[("tool", "x")]), true), None);
        assert_eq!(t.render(&turns(&[("assistant", "x")]), false), None);
        assert_eq!(
            t.render(&turns(&[("user", "a"), ("user", "b")]), true),
            None
        );
        assert_eq!(
            t.render(&turns(&[("user", "a"), ("assistant", "b")]), true),
            None
        );
    }

    #[test]
    fn bad_programs_are_errors() {
        assert!(ChatTemplate::from_json("{}").is_err());
        assert!(
            ChatTemplate::from_json(&PROGRAM.replace("\"version\": 1", "\"version\": 2")).is_err()
        );
        assert!(ChatTemplate::from_json(&PROGRAM.replace("\"right\"", "\"middle\"")).is_err());
        assert!(ChatTemplate::from_json(&PROGRAM.replace("\"^\":", "\"tool\":")).is_err());
        assert!(ChatTemplate::from_json(&PROGRAM.replace("\"true\":", "\"yes\":")).is_err());
    }
}
