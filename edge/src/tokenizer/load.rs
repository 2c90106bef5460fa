//! tokenizer.json -> Tokenizer: every field that changes the ids is read, and any form
//! outside the supported set is refused with its name (the edge then serves nothing
//! natively rather than give different ids than the router).

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::bpe::{Bpe, BpeModel, FxMap};
use super::byte_map::{byte_chars, char_bytes, spelled_bytes};
use super::pretok::{
    self, AddedTokenMatcher, Behavior, ByteLevelStep, Pattern, SplitStep, Splitter,
};
use super::{TemplatePiece, Tokenizer};

/// Largest token id accepted: the id -> bytes table has one entry per id up to the
/// largest (vocabularies have at most a few hundred thousand tokens).
const MAX_TOKEN_ID: u64 = 16_000_000;

pub fn from_json(text: &str) -> Result<Tokenizer, String> {
    let root: Value =
        serde_json::from_str(text).map_err(|e| format!("tokenizer.json is not valid JSON: {e}"))?;
    let root = root
        .as_object()
        .ok_or("tokenizer.json is not a JSON object")?;
    for key in ["truncation", "padding"] {
        if !root.get(key).map_or(true, Value::is_null) {
            return Err(format!(
                "{key} {} is not supported (only null)",
                kind(root.get(key))
            ));
        }
    }
    let nfc = match root.get("normalizer") {
        None | Some(Value::Null) => false,
        Some(n) if type_of(n) == "NFC" => true,
        other => {
            return Err(format!(
                "normalizer {} is not supported (only null and NFC)",
                kind(other)
            ))
        }
    };
    check_decoder(root.get("decoder"))?;
    let (splits, byte_level) = pre_tokenizer(root.get("pre_tokenizer"))?;
    let model = root
        .get("model")
        .and_then(Value::as_object)
        .ok_or("tokenizer.json has no model")?;
    let vocab = read_vocab(model)?;
    let added = read_added_tokens(root.get("added_tokens"), &vocab)?;
    let bpe = bpe_model(model, &vocab)?;
    let template = post_processor(root.get("post_processor"))?;
    if let Some(t) = added
        .iter()
        .find(|t| nfc && t.normalized && !nfc_stable(&t.content))
    {
        return Err(format!(
            "added token {:?} is normalized by NFC: not supported",
            t.content
        ));
    }
    let (token_bytes, special) = token_table(&vocab, &added);
    let raw: Vec<(String, u32)> = added
        .iter()
        .filter(|t| !t.normalized)
        .map(|t| (t.content.clone(), t.id))
        .collect();
    let normalized: Vec<(String, u32)> = added
        .iter()
        .filter(|t| t.normalized)
        .map(|t| (t.content.clone(), t.id))
        .collect();
    Ok(Tokenizer {
        added_raw: AddedTokenMatcher::new(&raw),
        added_normalized: AddedTokenMatcher::new(&normalized),
        splits,
        byte_level,
        bpe: Bpe::new(bpe),
        template,
        token_bytes,
        special,
        unassigned: pretok::compile(r"\p{Cn}")?,
        nfc,
    })
}

/// Text that NFC leaves as it is, known without Unicode's normalization tables: chars
/// below U+0300 all have combining class 0, none is a composition exclusion or a
/// singleton, and no two of them compose.
pub fn nfc_stable(text: &str) -> bool {
    text.chars().all(|c| u32::from(c) < 0x300)
}

fn kind(value: Option<&Value>) -> String {
    match value.and_then(|v| v.get("type")).and_then(Value::as_str) {
        Some(t) => format!("{t:?}"),
        None => value.map_or("null".into(), |v| v.to_string().chars().take(60).collect()),
    }
}

fn type_of(value: &Value) -> &str {
    value.get("type").and_then(Value::as_str).unwrap_or("")
}

fn flag(obj: &Value, key: &str, default: bool) -> bool {
    obj.get(key).and_then(Value::as_bool).unwrap_or(default)
}

fn check_decoder(decoder: Option<&Value>) -> Result<(), String> {
    match decoder {
        Some(d) if type_of(d) == "ByteLevel" => Ok(()),
        other => Err(format!(
            "decoder {} is not supported (only ByteLevel)",
            kind(other)
        )),
    }
}

fn pre_tokenizer(value: Option<&Value>) -> Result<(Vec<SplitStep>, ByteLevelStep), String> {
    let unsupported = || {
        format!(
            "pre_tokenizer {} is not supported (only ByteLevel, or a Sequence of Split steps \
             ending in ByteLevel)",
            kind(value)
        )
    };
    let value = value.ok_or_else(unsupported)?;
    let steps: Vec<&Value> = match type_of(value) {
        "ByteLevel" => vec![value],
        "Sequence" => value
            .get("pretokenizers")
            .and_then(Value::as_array)
            .ok_or_else(unsupported)?
            .iter()
            .collect(),
        _ => return Err(unsupported()),
    };
    let Some((last, splits)) = steps.split_last() else {
        return Err(unsupported());
    };
    if type_of(last) != "ByteLevel" {
        return Err(unsupported());
    }
    let splits = splits
        .iter()
        .map(|s| split_step(s))
        .collect::<Result<Vec<_>, _>>()?;
    let regex = if flag(last, "use_regex", true) {
        Some(Splitter::new(pretok::BYTE_LEVEL_REGEX)?)
    } else {
        None
    };
    Ok((
        splits,
        ByteLevelStep {
            add_prefix_space: flag(last, "add_prefix_space", true),
            regex,
        },
    ))
}

fn split_step(step: &Value) -> Result<SplitStep, String> {
    if type_of(step) != "Split" {
        return Err(format!(
            "pre_tokenizer step {} is not supported (only Split before ByteLevel)",
            kind(Some(step))
        ));
    }
    let pattern = match step.get("pattern") {
        Some(p) if p.get("Regex").and_then(Value::as_str).is_some() => {
            Pattern::Regex(Splitter::new(p["Regex"].as_str().unwrap_or_default())?)
        }
        Some(p) if p.get("String").and_then(Value::as_str).is_some() => {
            Pattern::Literal(p["String"].as_str().unwrap_or_default().to_string())
        }
        other => return Err(format!("Split pattern {other:?} is not supported")),
    };
    let name = step.get("behavior").and_then(Value::as_str).unwrap_or("");
    let behavior =
        Behavior::parse(name).ok_or_else(|| format!("Split behavior {name:?} is not supported"))?;
    Ok(SplitStep {
        pattern,
        behavior,
        invert: flag(step, "invert", false),
    })
}

fn read_vocab(model: &Map<String, Value>) -> Result<HashMap<String, u32>, String> {
    let model_type = model.get("type").and_then(Value::as_str).unwrap_or("BPE");
    if model_type != "BPE" {
        return Err(format!("model {model_type:?} is not supported (only BPE)"));
    }
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or("model.vocab is missing")?;
    vocab
        .iter()
        .map(|(token, id)| {
            let id = id
                .as_u64()
                .filter(|&i| i <= MAX_TOKEN_ID)
                .ok_or_else(|| format!("vocab id of {token:?} is not a token id"))?;
            Ok((token.clone(), id as u32))
        })
        .collect()
}

fn bpe_model(model: &Map<String, Value>, vocab: &HashMap<String, u32>) -> Result<BpeModel, String> {
    match model.get("dropout") {
        None | Some(Value::Null) => {}
        Some(d) if d.as_f64() == Some(0.0) => {}
        Some(d) => return Err(format!("BPE dropout {d} is not supported")),
    }
    for key in ["continuing_subword_prefix", "end_of_word_suffix"] {
        if !model
            .get(key)
            .map_or(true, |v| v.is_null() || v.as_str() == Some(""))
        {
            return Err(format!("BPE {key} is not supported"));
        }
    }
    if model
        .get("byte_fallback")
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        return Err(
            "BPE byte_fallback is not supported (byte-level vocabularies have no use for it)"
                .into(),
        );
    }
    let unk_id = match model.get("unk_token").and_then(Value::as_str) {
        Some(unk) => Some(
            *vocab
                .get(unk)
                .ok_or_else(|| format!("unk_token {unk:?} is not in the vocabulary"))?,
        ),
        None => None,
    };
    let chars = byte_chars();
    let mut byte_ids = [None; 256];
    for (b, c) in chars.iter().enumerate() {
        byte_ids[b] = vocab.get(&c.to_string()).copied();
    }
    let merges = read_merges(model.get("merges"), vocab)?;
    let whole_words = if model
        .get("ignore_merges")
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        let map = char_bytes();
        let mut words = FxMap::default();
        for (token, &id) in vocab {
            if token.chars().all(|c| map.contains_key(&c)) {
                words.insert(spelled_bytes(token, &map).into_boxed_slice(), id);
            }
        }
        Some(words)
    } else {
        None
    };
    Ok(BpeModel {
        byte_ids,
        merges,
        unk_id,
        fuse_unk: model
            .get("fuse_unk")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        whole_words,
    })
}

/// Merges as "left right" strings or [left, right] pairs; rank = position (a repeated
/// pair keeps its last rank, as `tokenizers`' map does).
fn read_merges(
    value: Option<&Value>,
    vocab: &HashMap<String, u32>,
) -> Result<FxMap<(u32, u32), (u32, u32)>, String> {
    let list = value
        .and_then(Value::as_array)
        .ok_or("model.merges is missing")?;
    let mut merges = FxMap::default();
    merges.reserve(list.len());
    let id = |t: &str| {
        vocab
            .get(t)
            .copied()
            .ok_or_else(|| format!("merge token {t:?} is not in the vocabulary"))
    };
    for (rank, merge) in list.iter().enumerate() {
        let (left, right) = match merge {
            Value::String(s) => s
                .split_once(' ')
                .ok_or_else(|| format!("merge {s:?} is not \"left right\""))?,
            Value::Array(pair) if pair.len() == 2 => match (pair[0].as_str(), pair[1].as_str()) {
                (Some(l), Some(r)) => (l, r),
                _ => return Err(format!("merge {merge} is not a pair of strings")),
            },
            _ => return Err(format!("merge {merge} is not a pair of strings")),
        };
        let new_id = id(&format!("{left}{right}"))?;
        merges.insert((id(left)?, id(right)?), (rank as u32, new_id));
    }
    Ok(merges)
}

pub struct AddedToken {
    pub id: u32,
    pub content: String,
    pub normalized: bool,
    pub special: bool,
}

/// Added tokens with the ids `tokenizers` gives them when it loads the file (it ignores
/// the stored ids): a token in the vocabulary has the vocabulary's id, any other the next
/// id after the vocabulary's size and the added ids so far.
fn read_added_tokens(
    value: Option<&Value>,
    vocab: &HashMap<String, u32>,
) -> Result<Vec<AddedToken>, String> {
    let Some(list) = value.and_then(Value::as_array) else {
        return Ok(Vec::new());
    };
    let vocab_len = vocab.len() as u32;
    let mut tokens: Vec<AddedToken> = Vec::with_capacity(list.len());
    for t in list {
        let content = t
            .get("content")
            .and_then(Value::as_str)
            .ok_or("added token without content")?;
        for key in ["single_word", "lstrip", "rstrip"] {
            if flag(t, key, false) {
                return Err(format!("added token {content:?} has {key}: not supported"));
            }
        }
        if content.is_empty() || tokens.iter().any(|o| o.content == content) {
            continue;
        }
        let id = vocab.get(content).copied().unwrap_or_else(|| {
            match tokens.iter().map(|t| t.id).max() {
                Some(max) if max >= vocab_len => max + 1,
                _ => vocab_len,
            }
        });
        let special = flag(t, "special", false);
        tokens.push(AddedToken {
            id,
            content: content.to_string(),
            normalized: flag(t, "normalized", !special),
            special,
        });
    }
    Ok(tokens)
}

/// The template add_special_tokens applies: `[Sequence]` wrapped by each
/// TemplateProcessing in turn.
fn post_processor(value: Option<&Value>) -> Result<Vec<TemplatePiece>, String> {
    let mut template = vec![TemplatePiece::Sequence];
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(template);
    };
    let steps: Vec<&Value> = match type_of(value) {
        "Sequence" => value
            .get("processors")
            .and_then(Value::as_array)
            .map(|a| a.iter().collect())
            .unwrap_or_default(),
        _ => vec![value],
    };
    for step in steps {
        match type_of(step) {
            "ByteLevel" => {}
            "TemplateProcessing" => template = apply_template(step, template)?,
            _ => {
                return Err(format!(
                    "post_processor {} is not supported (only ByteLevel, TemplateProcessing)",
                    kind(Some(step))
                ))
            }
        }
    }
    Ok(template)
}

fn apply_template(step: &Value, inner: Vec<TemplatePiece>) -> Result<Vec<TemplatePiece>, String> {
    let single = step
        .get("single")
        .and_then(Value::as_array)
        .ok_or("TemplateProcessing without single")?;
    let specials = step.get("special_tokens").and_then(Value::as_object);
    let mut out = Vec::new();
    for piece in single {
        if let Some(seq) = piece.get("Sequence") {
            if seq.get("id").and_then(Value::as_str) != Some("A") {
                return Err(format!(
                    "TemplateProcessing single piece {piece} is not supported"
                ));
            }
            out.extend(inner.iter().cloned());
        } else if let Some(name) = piece
            .get("SpecialToken")
            .and_then(|s| s.get("id"))
            .and_then(Value::as_str)
        {
            let ids = specials
                .and_then(|m| m.get(name))
                .and_then(|s| s.get("ids"))
                .and_then(Value::as_array)
                .ok_or_else(|| format!("TemplateProcessing special token {name:?} has no ids"))?;
            let ids = ids
                .iter()
                .map(|i| {
                    i.as_u64()
                        .filter(|&i| i < u64::from(u32::MAX))
                        .map(|i| i as u32)
                })
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| format!("TemplateProcessing special token {name:?} has a bad id"))?;
            out.push(TemplatePiece::Ids(ids));
        } else {
            return Err(format!(
                "TemplateProcessing single piece {piece} is not supported"
            ));
        }
    }
    Ok(out)
}

/// id -> bytes and id -> special for every id below the largest one + 1.
fn token_table(
    vocab: &HashMap<String, u32>,
    added: &[AddedToken],
) -> (Vec<Option<Box<[u8]>>>, Vec<bool>) {
    let size = vocab
        .values()
        .chain(added.iter().map(|t| &t.id))
        .map(|&i| i as usize + 1)
        .max()
        .unwrap_or(0);
    let map = char_bytes();
    let mut table: Vec<Option<Box<[u8]>>> = vec![None; size];
    for (token, &id) in vocab {
        table[id as usize] = Some(spelled_bytes(token, &map).into_boxed_slice());
    }
    let mut special = vec![false; size];
    for t in added {
        table[t.id as usize] = Some(spelled_bytes(&t.content, &map).into_boxed_slice());
        special[t.id as usize] = t.special;
    }
    (table, special)
}
