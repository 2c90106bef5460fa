//! `kvserve-edge control --socket PATH`: the control client's test driver. Reads JSON
//! lines, one call of `Control` each, and prints the answers as JSON lines
//! (tests/test_edge_control.py drives it against a real router/edge_control.py).
//!
//!     in:  {"call": "open" | "admit_decode" | "pick" | "ping" | "topology" | "unreachable"
//!           | "bind" | "prefilled" | "broken" | "end", "tag": any, ...Control's arguments}
//!     out: {"tag", "ok": true} | {"tag", "instance": {...}} | {"tag", "error": {...}}
//!          | {"tag", "topology"}; and, as pushed, {"lost": id, "error": {...}}
//!
//! Asks run in their own tasks (answers print as they come, by tag); reports run at
//! once, in input order.

use std::io::{BufRead, Write};
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use tokio::sync::mpsc;

use super::{ApiError, Control, End, Instance, Open, Role, Topology, WireUsage};

/// One line of the driver's input.
#[derive(Deserialize)]
struct Call {
    call: String,
    #[serde(default)]
    tag: serde_json::Value,
    #[serde(default)]
    id: String,
    #[serde(default)]
    prompt: Vec<u32>,
    #[serde(default)]
    max_tokens: u64,
    user: Option<String>,
    session: Option<String>,
    #[serde(default)]
    endpoint: String,
    #[serde(default)]
    tried: Vec<String>,
    #[serde(default)]
    deadline_s: f64,
    #[serde(default)]
    role: String,
    instance: Option<Instance>,
    #[serde(default)]
    message: String,
    #[serde(default)]
    incarnation: String,
    usage: Option<WireUsage>,
    #[serde(default)]
    status: u16,
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    first_token_s: Option<f64>,
    last_token_s: Option<f64>,
    #[serde(default)]
    token_gaps_s: Vec<f64>,
}

fn error_json(e: &ApiError) -> serde_json::Value {
    let headers: serde_json::Map<String, serde_json::Value> = e
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::from(v.clone())))
        .collect();
    serde_json::json!({
        "status": e.status, "message": e.message, "type": e.error_type, "code": e.code,
        "headers": headers,
    })
}

fn emit(v: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn answer_json(
    tag: &serde_json::Value,
    answer: Result<Option<Instance>, ApiError>,
) -> serde_json::Value {
    match answer {
        Ok(Some(inst)) => serde_json::json!({"tag": tag, "instance": inst}),
        Ok(None) => serde_json::json!({"tag": tag, "ok": true}),
        Err(e) => serde_json::json!({"tag": tag, "error": error_json(&e)}),
    }
}

/// Runs one call: asks in their own task (answers print as they come, by `tag`), reports
/// at once, in order.
fn drive(control: &Arc<Control>, c: Call, tasks: &mut Vec<tokio::task::JoinHandle<()>>) {
    let tag = c.tag.clone();
    let control = control.clone();
    match c.call.as_str() {
        "open" | "admit_decode" | "pick" | "ping" => tasks.push(tokio::spawn(async move {
            let answer = match c.call.as_str() {
                "open" => {
                    let open = Open {
                        request_id: &c.id,
                        prompt_token_ids: &c.prompt,
                        max_tokens: c.max_tokens,
                        user: c.user.as_deref(),
                        session: c.session.as_deref(),
                        endpoint: &c.endpoint,
                    };
                    control.open(open).await.map(|_| None)
                }
                "admit_decode" => control
                    .admit_decode(&c.id, &c.tried, c.deadline_s)
                    .await
                    .map(Some),
                "ping" => control.ping().await.map(|_| None),
                _ => {
                    let role = if c.role == "unified" {
                        Role::Unified
                    } else {
                        Role::Prefill
                    };
                    control.pick(&c.id, role, &c.tried).await.map(Some)
                }
            };
            emit(answer_json(&tag, answer));
        })),
        "topology" => {
            let t = match control.topology() {
                Topology::PrefillDecode => "pd",
                Topology::Unified => "unified",
            };
            emit(serde_json::json!({"tag": tag, "topology": t}));
        }
        "end" => {
            let usage = c.usage.as_ref().map(WireUsage::usage);
            let end = End {
                status: c.status,
                prompt_tokens: c.prompt_tokens,
                completion_tokens: c.completion_tokens,
                usage,
                first_token_s: c.first_token_s,
                last_token_s: c.last_token_s,
                token_gaps_s: c.token_gaps_s,
            };
            control.end(&c.id, end);
            emit(serde_json::json!({"tag": tag, "ok": true}));
        }
        "unreachable" | "bind" | "prefilled" | "broken" => {
            let Some(inst) = c.instance.as_ref() else {
                emit(serde_json::json!({"tag": tag, "bad_line": "no instance"}));
                return;
            };
            match c.call.as_str() {
                "unreachable" => control.unreachable(&c.id, inst, &c.message),
                "bind" => control.bind(&c.id, inst, &c.incarnation),
                "broken" => control.broken(&c.id, inst, &c.message, &c.incarnation),
                _ => {
                    let Some(u) = c.usage.as_ref() else {
                        emit(serde_json::json!({"tag": tag, "bad_line": "no usage"}));
                        return;
                    };
                    control.prefilled(&c.id, inst, &u.usage())
                }
            }
            emit(serde_json::json!({"tag": tag, "ok": true}));
        }
        other => {
            emit(serde_json::json!({"tag": tag, "bad_line": format!("unknown call {other:?}")}))
        }
    }
}

/// Runs the driver until stdin ends (and every ask is answered).
pub fn cli(args: &[String]) -> i32 {
    let socket = match args {
        [flag, path] if flag == "--socket" => path.clone(),
        _ => {
            eprintln!("usage: kvserve-edge control --socket PATH");
            return 2;
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvserve-edge control: {e}");
            return 1;
        }
    };
    rt.block_on(async move {
        let control = match Control::connect(Path::new(&socket)).await {
            Ok(c) => c,
            Err(e) => {
                emit(serde_json::json!({"connect_error": e.to_string()}));
                return 1;
            }
        };
        let mut lost = control.lost();
        let pushes = control.clone();
        tokio::spawn(async move {
            while let Ok(id) = lost.recv().await {
                let error = error_json(&pushes.lost_error(&id));
                emit(serde_json::json!({"lost": id, "error": error}));
            }
        });
        let (lines_tx, mut lines) = mpsc::unbounded_channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                match line {
                    Ok(l) => {
                        if lines_tx.send(l).is_err() {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
        });
        let mut tasks = Vec::new();
        while let Some(line) = lines.recv().await {
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<Call>(&line) {
                Ok(call) => drive(&control, call, &mut tasks),
                Err(e) => emit(serde_json::json!({"bad_line": e.to_string()})),
            }
        }
        for t in tasks {
            let _ = t.await;
        }
        0
    })
}
