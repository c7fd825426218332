//! `tessera bench transfer --handoff-url`: the gap between a prefill chip staging the
//! last layer of a long prompt's KV and the decode chip's first step for it, measured
//! on a running disaggregated cluster. Requests go one at a time (no queueing in the
//! figure); after each, the decode chip's `last_handoff_gap_s` is read from `/health`
//! (the chips measure it with their wall clocks: P stamps the staging, D's worker the
//! step start).

use serde::Serialize;
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use tessera_vocab::Role;

use super::{LatencySummary, LoadgenError};

#[derive(Debug, Clone, Serialize)]
pub struct HandoffReport {
    pub prompt_tokens: usize,
    pub requests: usize,
    /// P's last layer staged -> D's first step started.
    pub gap: LatencySummary,
    /// Time to the first token, as the client sees it (prefill + hand-off + first step).
    pub ttft: LatencySummary,
    pub decode_chip: String,
}

async fn health(client: &reqwest::Client, url: &str) -> Result<Value, LoadgenError> {
    let r = client.get(format!("{url}/health")).send().await.map_err(|e| LoadgenError::Http(e.to_string()))?;
    r.json::<Value>().await.map_err(|e| LoadgenError::Http(e.to_string()))
}

/// (chip id, hand-offs done so far, last gap) of every decode chip.
fn decode_gaps(h: &Value) -> Vec<(String, u64, Option<f64>)> {
    h["chips"]
        .as_array()
        .map(|chips| {
            chips
                .iter()
                .filter(|c| c["role"].as_str().and_then(|role| role.parse().ok()) == Some(Role::Decode))
                .map(|c| {
                    (
                        c["id"].as_str().unwrap_or("?").to_string(),
                        c["steps"].as_u64().unwrap_or(0),
                        c["last_handoff_gap_s"].as_f64(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Sends `requests` prompts of `prompt_tokens` token ids (valid in any vocabulary of at
/// least 256 tokens) to `url`, one at a time, and reads each hand-off's gap.
pub async fn run(
    url: &str,
    model: Option<String>,
    prompt_tokens: usize,
    requests: usize,
) -> Result<HandoffReport, LoadgenError> {
    let url = url.trim_end_matches('/');
    let client = reqwest::Client::new();
    let model = match model {
        Some(m) => m,
        None => {
            let get = |e: reqwest::Error| LoadgenError::ModelDiscovery { url: url.into(), reason: e.to_string() };
            let models: Value =
                client.get(format!("{url}/v1/models")).send().await.map_err(get)?.json().await.map_err(get)?;
            models["data"][0]["id"]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| LoadgenError::ModelDiscovery { url: url.into(), reason: "it lists no model".into() })?
        }
    };
    let mut gaps = Vec::new();
    let mut ttfts = Vec::new();
    let mut decode_chip = String::new();
    for i in 0..requests {
        let before = decode_gaps(&health(&client, url).await?);
        let prompt: Vec<u32> = (0..prompt_tokens).map(|t| ((t * 31 + i * 7) % 250 + 3) as u32).collect();
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": true});
        let started = Instant::now();
        let r = client
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send()
            .await
            .map_err(|e| LoadgenError::Http(e.to_string()))?;
        let status = r.status();
        let text = r.text().await.map_err(|e| LoadgenError::Http(e.to_string()))?;
        if !status.is_success() {
            return Err(LoadgenError::Http(format!("{status}: {text}")));
        }
        // Two tokens: the first one's latency is close to the whole request's.
        ttfts.push(started.elapsed().as_secs_f64());
        // The decode chip's report reaches /health with its next heartbeat.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let now = decode_gaps(&health(&client, url).await?);
            let changed = now.iter().find(|(id, steps, gap)| {
                gap.is_some() && before.iter().find(|b| &b.0 == id).is_none_or(|b| b.1 != *steps)
            });
            if let Some((id, _, Some(gap))) = changed {
                gaps.push(*gap);
                decode_chip = id.clone();
                break;
            }
            if Instant::now() > deadline {
                return Err(LoadgenError::Http(
                    "no decode chip reported a hand-off: is the cluster disaggregated (a prefill and a decode chip, \
                     prompts of at least [disagg] min_prompt_tokens)?"
                        .into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let summary = |v: &[f64]| LatencySummary::from_seconds(v).ok_or_else(|| LoadgenError::Http("no samples".into()));
    Ok(HandoffReport { prompt_tokens, requests, gap: summary(&gaps)?, ttft: summary(&ttfts)?, decode_chip })
}
