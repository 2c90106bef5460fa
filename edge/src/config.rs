//! The edge's configuration: one JSON file written by the Python router that starts it
//! (router/edge.py), read once at start. The cluster secret is not in it: it comes from
//! the environment (`KVSERVE_CLUSTER_SECRET`), as every kvserve process gets it.

use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct EdgeConfig {
    /// Where clients connect: router.host / router.port of cluster.yaml.
    pub listen_host: String,
    pub listen_port: u16,
    /// The Python router's internal HTTP listener (loopback): every request the edge does
    /// not serve natively is proxied there unchanged.
    pub python_url: String,
    /// The control plane's Unix socket (router/edge_control.py).
    pub control_socket: PathBuf,
    /// The model's tokenizer in Hugging Face's tokenizer.json form.
    pub tokenizer_path: PathBuf,
    /// The chat template as a program of pieces (router/edge_template.py); None: chat
    /// requests are proxied.
    #[serde(default)]
    pub chat_template_path: Option<PathBuf>,
    /// Names a request's `model` may carry (the first is the one answered with).
    pub served_model_names: Vec<String>,
    pub eos_token_ids: Vec<u32>,
    pub max_model_len: usize,
    /// router.api_key: clients must send `Authorization: Bearer <key>`.
    #[serde(default)]
    pub api_key: Option<String>,
    /// Headers naming a client's session, in order of preference (lower case).
    #[serde(default)]
    pub session_headers: Vec<String>,
    pub request_timeout_s: f64,
    pub max_body_bytes: usize,
    /// Tokio worker threads (0: one per core).
    #[serde(default)]
    pub worker_threads: usize,
}

impl EdgeConfig {
    pub fn load(path: &Path) -> Result<EdgeConfig, String> {
        let raw = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_slice(&raw).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// KVSERVE_CLUSTER_SECRET, sent as `authorization: Bearer` on every worker call.
    pub fn cluster_secret() -> Option<String> {
        std::env::var("KVSERVE_CLUSTER_SECRET").ok().filter(|s| !s.is_empty())
    }
}
