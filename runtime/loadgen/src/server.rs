//! What the server itself counted during a run, from its Prometheus `/metrics` read
//! before and after: prompt tokens each chip computed or reused from its prefix cache,
//! and the seconds each chip spent in forward steps. Only a Tessera gateway serves
//! these; against another server the section is left out. A chip's counters are those
//! of the gateway's process (`tessera up --in-process` puts every host there).

use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// One chip's share of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ChipLoad {
    pub chip: String,
    /// Prompt positions of sequences that started there ...
    pub prompt_tokens: f64,
    /// ... and of those, positions whose KV came from its prefix cache.
    pub reused_tokens: f64,
    /// Seconds of forward steps (model time: paced, for an emulated chip).
    pub busy_s: f64,
}

/// The server's counters over a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ServerCounters {
    pub chips: Vec<ChipLoad>,
}

impl ServerCounters {
    /// Reused over prompt tokens, over every chip (`None` when no prompt was counted).
    pub fn hit_rate(&self) -> Option<f64> {
        let prompt: f64 = self.chips.iter().map(|c| c.prompt_tokens).sum();
        let reused: f64 = self.chips.iter().map(|c| c.reused_tokens).sum();
        (prompt > 0.0).then(|| reused / prompt)
    }

    /// The busiest chip's busy time over the mean of the chips that computed anything
    /// (`None` when none did).
    pub fn busy_imbalance(&self) -> Option<f64> {
        let busy: Vec<f64> = self.chips.iter().map(|c| c.busy_s).filter(|&b| b > 0.0).collect();
        let mean = busy.iter().sum::<f64>() / busy.len().max(1) as f64;
        (mean > 0.0).then(|| busy.iter().copied().fold(0.0, f64::max) / mean)
    }

    /// What changed from `before` to `after`: counters of chips in either.
    fn delta(before: &Scrape, after: &Scrape) -> ServerCounters {
        let chips = after
            .iter()
            .map(|(chip, a)| {
                let b = before.get(chip).copied().unwrap_or_default();
                ChipLoad {
                    chip: chip.clone(),
                    prompt_tokens: (a[0] - b[0]).max(0.0),
                    reused_tokens: (a[1] - b[1]).max(0.0),
                    busy_s: (a[2] - b[2]).max(0.0),
                }
            })
            .collect();
        ServerCounters { chips }
    }
}

/// Per chip: (prompt tokens, reused tokens, step seconds), as counted so far.
type Scrape = BTreeMap<String, [f64; 3]>;

/// The series read from a scrape, by position in [`Scrape`]'s arrays.
const SERIES: [&str; 3] =
    ["tessera_prefix_prompt_tokens_total", "tessera_prefix_reused_tokens_total", "tessera_chip_step_seconds_sum"];

/// The chip counters in a Prometheus text exposition; lines it does not know are
/// skipped.
pub fn parse(text: &str) -> Scrape {
    let mut out = Scrape::new();
    for line in text.lines() {
        let Some((name_labels, value)) = line.rsplit_once(' ') else { continue };
        let Some((name, labels)) = name_labels.split_once('{') else { continue };
        let Some(i) = SERIES.iter().position(|s| *s == name) else { continue };
        let Some(chip) = label(labels, "chip") else { continue };
        let Ok(value) = value.trim().parse::<f64>() else { continue };
        if value.is_finite() {
            out.entry(chip.to_string()).or_default()[i] += value;
        }
    }
    out
}

/// The value of `key` in a label set `a="x",b="y"}`.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let at = labels.find(&format!("{key}=\""))? + key.len() + 2;
    let rest = &labels[at..];
    Some(&rest[..rest.find('"')?])
}

/// Reads the server's chip counters; `None` when it serves no Tessera metrics.
pub async fn scrape(client: &reqwest::Client, base: &str, timeout: Duration) -> Option<Scrape> {
    let response = client.get(format!("{base}/metrics")).timeout(timeout).send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let scrape = parse(&response.text().await.ok()?);
    (!scrape.is_empty()).then_some(scrape)
}

/// The counters of a run between two scrapes.
pub fn between(before: Option<Scrape>, after: Option<Scrape>) -> Option<ServerCounters> {
    Some(ServerCounters::delta(&before.unwrap_or_default(), &after?))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = r#"# TYPE tessera_prefix_prompt_tokens_total counter
tessera_prefix_prompt_tokens_total{chip="a"} 100
tessera_prefix_reused_tokens_total{chip="a"} 20
tessera_chip_step_seconds_sum{chip="a"} 1.5
tessera_chip_step_seconds{chip="a",quantile="0.5"} 0.01
"#;
    const AFTER: &str = r#"tessera_prefix_prompt_tokens_total{chip="a"} 400
tessera_prefix_reused_tokens_total{chip="a"} 170
tessera_chip_step_seconds_sum{chip="a"} 3.5
tessera_prefix_prompt_tokens_total{chip="b"} 200
tessera_prefix_reused_tokens_total{chip="b"} 50
tessera_chip_step_seconds_sum{chip="b"} 1
tessera_kv_blocks_used{chip="b"} 7
garbage line
"#;

    #[test]
    fn a_run_is_the_difference_of_two_scrapes() {
        let counters = between(Some(parse(BEFORE)), Some(parse(AFTER))).expect("after was read");
        let want = vec![
            ChipLoad { chip: "a".into(), prompt_tokens: 300.0, reused_tokens: 150.0, busy_s: 2.0 },
            ChipLoad { chip: "b".into(), prompt_tokens: 200.0, reused_tokens: 50.0, busy_s: 1.0 },
        ];
        assert_eq!(counters.chips, want);
        assert_eq!(counters.hit_rate(), Some(200.0 / 500.0));
        assert_eq!(counters.busy_imbalance(), Some(2.0 / 1.5));
        assert_eq!(between(Some(parse(BEFORE)), None), None, "no scrape after: no section");
        assert!(parse("").is_empty());
    }
}
