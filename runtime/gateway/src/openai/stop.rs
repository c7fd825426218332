//! Stop strings over a stream of decoded text.
//!
//! Invariant: text is released only once no stop string can begin inside it, so neither a
//! stop string nor anything after it ever reaches the client, however the text is chunked.
//! Generation ends at the first stop string to *complete* (a stream cannot wait to see whether
//! a longer one that began earlier will complete too — vLLM behaves the same); among those
//! completing at the same point, the longest (earliest-starting) wins. The output is therefore
//! a function of the text alone, not of how it was split into chunks.

/// Holds back decoded text that might be the start of a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released: it ends with a prefix of some stop string.
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are dropped (they would match everywhere).
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self { stops, held: String::new(), stopped: false }
    }

    /// Feeds newly decoded text; returns the text that is now safe to emit (holding back any
    /// suffix that could start a stop string) and whether a stop string was hit. Once a stop
    /// string was hit, further text is dropped and `true` returned again.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.held.push_str(text);
        if let Some(start) = self.first_completed_stop() {
            self.held.truncate(start);
            self.stopped = true;
            return (std::mem::take(&mut self.held), true);
        }
        let keep = self.longest_partial_stop();
        let tail = self.held.split_off(self.held.len() - keep);
        (std::mem::replace(&mut self.held, tail), false)
    }

    /// Releases the held-back text at the end of generation (nothing if a stop string was hit).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Start of the stop string that ends first in `held`, the longest one on a tie.
    fn first_completed_stop(&self) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|stop| self.held.find(stop.as_str()).map(|start| (start + stop.len(), start)))
            .min()
            .map(|(_, start)| start)
    }

    /// Length in bytes of the longest suffix of `held` that is a proper prefix of a stop string.
    /// Prefixes are cut at char boundaries of the stop string, so the suffix starts at a char
    /// boundary of `held` as well (a UTF-8 lead byte never matches a continuation byte).
    fn longest_partial_stop(&self) -> usize {
        let held = self.held.as_bytes();
        self.stops
            .iter()
            .filter_map(|stop| {
                (1..stop.len().min(held.len() + 1))
                    .rev()
                    .find(|&k| stop.is_char_boundary(k) && held.ends_with(&stop.as_bytes()[..k]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn run(stops: &[&str], chunks: &[&str]) -> (Vec<(String, bool)>, String) {
        let mut matcher = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let pushed = chunks.iter().map(|c| matcher.push(c)).collect();
        (pushed, matcher.finish())
    }

    fn out(s: &str, stopped: bool) -> (String, bool) {
        (s.to_owned(), stopped)
    }

    #[test]
    fn table() {
        // (stops, chunks, what each push returns, what finish returns)
        type Case = (&'static [&'static str], &'static [&'static str], Vec<(String, bool)>, &'static str);
        let cases: Vec<Case> = vec![
            (&[], &["ab", "c"], vec![out("ab", false), out("c", false)], ""),
            (&["END"], &["hello E", "N", "D tail"], vec![out("hello ", false), out("", false), out("", true)], ""),
            (&["END"], &["hello E", "x"], vec![out("hello ", false), out("Ex", false)], ""),
            (&["END"], &["ab EN"], vec![out("ab ", false)], "EN"),
            (&["\n\n"], &["a\n", "\nb"], vec![out("a", false), out("", true)], ""),
            (&["x"], &["abxcd", "more"], vec![out("ab", true), out("", true)], ""),
            // "c" completes before "abcd" could: the stream stops at "c".
            (&["abcd", "c"], &["ab", "cd"], vec![out("", false), out("ab", true)], ""),
            // Same end, longest wins.
            (&["bc", "c"], &["abc"], vec![out("a", true)], ""),
            (&["日本"], &["こんにち日", "本語"], vec![out("こんにち", false), out("", true)], ""),
            (&["é!"], &["café", "?"], vec![out("caf", false), out("é?", false)], ""),
        ];
        for (stops, chunks, pushed, finish) in cases {
            assert_eq!(run(stops, chunks), (pushed, finish.to_owned()), "{stops:?} {chunks:?}");
        }
    }

    /// The reference: the text up to the stop string that ends first (longest on a tie).
    fn reference(text: &str, stops: &[String]) -> String {
        for (end, _) in text.char_indices().skip(1).chain([(text.len(), ' ')]) {
            let prefix = &text[..end];
            if let Some(stop) = stops.iter().filter(|s| prefix.ends_with(s.as_str())).max_by_key(|s| s.len()) {
                return prefix[..end - stop.len()].to_owned();
            }
        }
        text.to_owned()
    }

    fn small_string(max: usize) -> impl Strategy<Value = String> {
        proptest::collection::vec(prop::sample::select(vec!['a', 'b', 'é', '日', '🦀']), 0..max)
            .prop_map(|chars| chars.into_iter().collect())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]
        #[test]
        fn emitted_text_is_the_text_before_the_first_stop(
            text in small_string(40),
            random_stops in proptest::collection::vec(small_string(5), 0..3),
            picks in proptest::collection::vec((0usize..64, 1usize..6), 0..3),
            inner in (1usize..5, 1usize..3),
            cuts in proptest::collection::vec(0usize..64, 0..12),
        ) {
            // Substrings of the text as stops too, so that stops hit, overlap and nest often.
            let chars: Vec<char> = text.chars().collect();
            let mut stops = random_stops;
            for (start, len) in picks {
                if !chars.is_empty() {
                    let start = start % chars.len();
                    stops.push(chars[start..(start + len).min(chars.len())].iter().collect());
                }
            }
            // A stop nested inside another one, past its start: the shorter one completes first.
            if let Some(outer) = stops.last().filter(|s| s.chars().count() > 1).cloned() {
                let outer: Vec<char> = outer.chars().collect();
                let start = 1 + inner.0 % (outer.len() - 1);
                stops.push(outer[start..(start + inner.1).min(outer.len())].iter().collect());
            }
            // Chunk boundaries at random char boundaries of `text`.
            let boundaries: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
            let mut cuts: Vec<usize> = cuts.iter().map(|c| boundaries[c % boundaries.len()]).collect();
            cuts.extend([0, text.len()]);
            cuts.sort_unstable();
            cuts.dedup();

            let mut matcher = StopMatcher::new(stops.clone());
            let mut emitted = String::new();
            let mut stopped = false;
            for window in cuts.windows(2) {
                let (text, hit) = matcher.push(&text[window[0]..window[1]]);
                prop_assert!(!stopped || text.is_empty(), "text emitted after the stop");
                emitted.push_str(&text);
                stopped |= hit;
            }
            emitted.push_str(&matcher.finish());

            let nonempty: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
            let expected = reference(&text, &nonempty);
            prop_assert_eq!(stopped, nonempty.iter().any(|s| text.contains(s.as_str())));
            prop_assert_eq!(emitted, expected);
        }
    }
}
