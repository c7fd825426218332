//! Request traces in Mooncake's published JSONL format — one request per line:
//! `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [..]}`,
//! where `hash_ids` name the prompt's blocks of [`TRACE_BLOCK_TOKENS`] tokens (equal ids,
//! equal content: the trace's prefix reuse) — replayed as prompts whose blocks of words
//! are equal exactly where the ids are, and a generator of such traces with a chosen
//! share of reused blocks.

use crate::{LengthDist, PlannedRequest, SeededRng, WorkloadError, words_of};

/// Tokens per hash id in Mooncake's traces.
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TraceRequest {
    /// Arrival, in milliseconds from the trace's start.
    pub timestamp: f64,
    pub input_length: u32,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
}

/// Parses a JSONL trace; an error names the line and what is wrong with it.
pub fn parse(text: &str) -> Result<Vec<TraceRequest>, WorkloadError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let req: TraceRequest =
            serde_json::from_str(line).map_err(|e| WorkloadError(format!("trace line {}: {e}", i + 1)))?;
        if !(req.timestamp.is_finite() && req.timestamp >= 0.0) {
            return Err(WorkloadError(format!("trace line {}: timestamp {} is not a time", i + 1, req.timestamp)));
        }
        if req.input_length == 0 {
            return Err(WorkloadError(format!("trace line {}: input_length is 0", i + 1)));
        }
        out.push(req);
    }
    if out.is_empty() {
        return Err(WorkloadError("the trace has no requests".into()));
    }
    Ok(out)
}

/// The trace as requests and release times (seconds from the first request's arrival,
/// in trace order, which need not be sorted): each hash id becomes a block of `block_words`
/// words drawn from a stream seeded by the id, so equal ids give equal text; the prompt is
/// cut to `input_length` words (about that many tokens; see `WORDS`).
pub fn replay(trace: &[TraceRequest], block_words: u32) -> (Vec<PlannedRequest>, Vec<f64>) {
    let t0 = trace.iter().map(|r| r.timestamp).fold(f64::INFINITY, f64::min);
    let requests = trace
        .iter()
        .map(|r| {
            let mut words: Vec<String> = Vec::new();
            for &id in &r.hash_ids {
                if words.len() >= r.input_length as usize {
                    break;
                }
                let block = words_of(block_words, &mut SeededRng::new(id.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1));
                words.extend(block.split(' ').map(str::to_owned));
            }
            // Ids cover the prompt in whole blocks; the rest (if the trace has too few)
            // is the request's own.
            let own = r.input_length.saturating_sub(words.len() as u32);
            if own > 0 {
                let mut rng = SeededRng::new(r.timestamp.to_bits() ^ 0x4f57_4e00);
                words.extend(words_of(own, &mut rng).split(' ').map(str::to_owned));
            }
            words.truncate(r.input_length as usize);
            PlannedRequest { prompt: words.join(" "), isl: r.input_length, osl: r.output_length.max(1) }
        })
        .collect();
    let arrivals = trace.iter().map(|r| (r.timestamp - t0) / 1000.0).collect();
    (requests, arrivals)
}

/// A trace of `n` requests arriving as a Poisson process of `rate_rps`, with lengths from
/// `isl` and `osl`, in which up to `reuse` (0..=1) of each prompt's blocks repeat an
/// earlier prompt's: a request picks an earlier one and starts with that share of its
/// blocks (fewer when the earlier prompt is shorter).
pub fn generate(
    n: usize,
    rate_rps: f64,
    isl: LengthDist,
    osl: LengthDist,
    reuse: f64,
    seed: u64,
) -> Result<Vec<TraceRequest>, WorkloadError> {
    if !(0.0..=1.0).contains(&reuse) {
        return Err(WorkloadError(format!("reuse must be within 0..=1, not {reuse}")));
    }
    if !(rate_rps.is_finite() && rate_rps > 0.0) {
        return Err(WorkloadError(format!("rate must be a positive number of requests per second, not {rate_rps}")));
    }
    let mut rng = SeededRng::new(seed);
    let mut next_id = 0u64;
    let mut t_ms = 0.0f64;
    let mut out: Vec<TraceRequest> = Vec::with_capacity(n);
    for _ in 0..n {
        let input_length = isl.sample(&mut rng).max(1);
        let blocks = input_length.div_ceil(TRACE_BLOCK_TOKENS) as usize;
        // Reuse: with probability sqrt(reuse), a prefix of a random earlier request's
        // blocks, sqrt(reuse) of this prompt's long, so that `reuse` of the blocks (on
        // average) are shared; otherwise a prompt of its own, so that prefixes stay
        // many (sharing a prefix always shares its first block: without fresh prompts
        // every request would start like the first).
        let mut hash_ids: Vec<u64> = Vec::with_capacity(blocks);
        let share = reuse.sqrt();
        if !out.is_empty() && rng.unit_open0() <= share {
            let earlier = &out[rng.below(out.len() as u64) as usize];
            let want = ((blocks as f64) * share).round().max(1.0) as usize;
            hash_ids.extend(earlier.hash_ids.iter().take(want.min(earlier.hash_ids.len())));
        }
        while hash_ids.len() < blocks {
            hash_ids.push(next_id);
            next_id += 1;
        }
        // Whole milliseconds, as Mooncake's traces have them.
        let timestamp = t_ms.round();
        out.push(TraceRequest { timestamp, input_length, output_length: osl.sample(&mut rng).max(1), hash_ids });
        t_ms += rng.exponential(rate_rps) * 1000.0;
    }
    Ok(out)
}

/// The share of all prompt blocks of `trace` whose id appeared in an earlier request:
/// what a cache holding everything would hit (the oracle hit rate).
pub fn oracle_hit_rate(trace: &[TraceRequest]) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let (mut hits, mut total) = (0usize, 0usize);
    for r in trace {
        for id in &r.hash_ids {
            total += 1;
            hits += usize::from(!seen.insert(*id));
        }
    }
    hits as f64 / total.max(1) as f64
}

/// The trace as JSONL.
pub fn to_jsonl(trace: &[TraceRequest]) -> String {
    trace.iter().filter_map(|r| serde_json::to_string(r).ok()).map(|l| l + "\n").collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_lines_parse_and_bad_ones_name_their_line() {
        let text = "{\"timestamp\": 27482, \"input_length\": 6955, \"output_length\": 52, \"hash_ids\": [46, 47, 48]}\n\n\
                    {\"timestamp\": 30535, \"input_length\": 6472, \"output_length\": 26, \"hash_ids\": [46, 47, 49]}\n";
        let trace = parse(text).unwrap();
        assert_eq!(trace.len(), 2);
        assert_eq!(trace[1].hash_ids, vec![46, 47, 49]);
        for (bad, why) in [
            ("{\"timestamp\": 1}", "line 1"),
            ("{\"timestamp\": -1, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": []}", "not a time"),
            ("{\"timestamp\": 1, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}", "input_length is 0"),
            ("", "no requests"),
        ] {
            let e = parse(bad).unwrap_err().0;
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn equal_ids_replay_as_equal_text() {
        let trace = parse(
            "{\"timestamp\": 1000, \"input_length\": 30, \"output_length\": 4, \"hash_ids\": [1, 2]}\n\
             {\"timestamp\": 1500, \"input_length\": 25, \"output_length\": 4, \"hash_ids\": [1, 3]}\n",
        )
        .unwrap();
        let (reqs, arrivals) = replay(&trace, 16);
        assert_eq!(arrivals, vec![0.0, 0.5]);
        let words = |i: usize| reqs[i].prompt.split(' ').map(str::to_owned).collect::<Vec<_>>();
        assert_eq!((words(0).len(), words(1).len()), (30, 25));
        assert_eq!(words(0)[..16], words(1)[..16], "block 1 is the same text");
        assert_ne!(words(0)[16..25], words(1)[16..25], "blocks 2 and 3 are not");
    }

    #[test]
    fn generated_traces_reuse_about_the_asked_share() {
        let isl = LengthDist::Uniform { lo: 2048, hi: 8192 };
        for reuse in [0.0, 0.3, 0.6] {
            let trace = generate(400, 2.0, isl, LengthDist::Fixed(16), reuse, 9).unwrap();
            let hit = oracle_hit_rate(&trace);
            // Shorter earlier prompts share fewer blocks than asked.
            assert!(hit <= reuse + 0.05 && hit >= reuse * 0.6, "reuse {reuse}: oracle hit rate {hit}");
            // Prompts of their own keep prefixes many: about 1 - sqrt(reuse) of them.
            let firsts: std::collections::BTreeSet<u64> = trace.iter().map(|r| r.hash_ids[0]).collect();
            let fresh = 1.0 - reuse.sqrt();
            let share = firsts.len() as f64 / trace.len() as f64;
            assert!((share - fresh).abs() < 0.1, "reuse {reuse}: {share} of prompts start their own prefix");
            assert!(parse(&to_jsonl(&trace)).unwrap() == trace, "a trace round-trips through JSONL");
        }
        assert!(generate(1, 1.0, isl, LengthDist::Fixed(1), 1.5, 0).is_err());
    }
}
