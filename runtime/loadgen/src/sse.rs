//! Incremental server-sent-events parser: feed it the body's bytes as they arrive, split
//! anywhere (inside a line, a `\r\n`, or a UTF-8 character), and it hands back each
//! event's `data` once the event's closing blank line has arrived.

/// Parser state: the bytes of the unfinished line and the data lines of the unfinished event.
#[derive(Default, Debug)]
pub struct SseParser {
    line: Vec<u8>,
    data: Option<String>,
    /// The previous chunk ended in `\r`: a `\n` starting the next one belongs to it.
    after_cr: bool,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Consumes `bytes`; returns the data of every event completed by them, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut events = Vec::new();
        for &b in bytes {
            if std::mem::take(&mut self.after_cr) && b == b'\n' {
                continue;
            }
            match b {
                b'\r' | b'\n' => {
                    self.after_cr = b == b'\r';
                    let line = std::mem::take(&mut self.line);
                    self.end_line(&line, &mut events);
                }
                _ => self.line.push(b),
            }
        }
        events
    }

    /// End of body: an event still waiting for its blank line is handed back rather than
    /// lost (the spec drops it; servers that omit the last blank line are common enough).
    pub fn finish(&mut self) -> Option<String> {
        let line = std::mem::take(&mut self.line);
        let mut events = Vec::new();
        self.end_line(&line, &mut events);
        self.data.take().or_else(|| events.pop())
    }

    fn end_line(&mut self, line: &[u8], events: &mut Vec<String>) {
        if line.is_empty() {
            events.extend(self.data.take());
            return;
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line.as_ref(), ""),
        };
        // Comments (empty field name), `event`, `id` and `retry` carry nothing we measure.
        if field == "data" {
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = ": keep-alive\r\n\r\n\
        data: {\"t\":\"h\u{e9}llo\"}\r\n\r\n\
        event: message\nid: 3\ndata: line one\ndata:line two\n\n\
        data: [DONE]\n\n";

    fn expected() -> Vec<String> {
        vec!["{\"t\":\"h\u{e9}llo\"}".to_string(), "line one\nline two".to_string(), "[DONE]".to_string()]
    }

    #[test]
    fn whole_stream_at_once() {
        let mut p = SseParser::new();
        assert_eq!(p.push(STREAM.as_bytes()), expected());
        assert_eq!(p.finish(), None);
    }

    #[test]
    fn every_split_point_gives_the_same_events() {
        let bytes = STREAM.as_bytes();
        for cut in 0..=bytes.len() {
            let mut p = SseParser::new();
            let mut got = p.push(&bytes[..cut]);
            got.extend(p.push(&bytes[cut..]));
            assert_eq!(got, expected(), "split at byte {cut}");
        }
    }

    #[test]
    fn byte_at_a_time() {
        let mut p = SseParser::new();
        let got: Vec<String> = STREAM.as_bytes().iter().flat_map(|b| p.push(std::slice::from_ref(b))).collect();
        assert_eq!(got, expected());
    }

    #[test]
    fn event_is_only_dispatched_on_its_blank_line() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: a\n").is_empty());
        assert_eq!(p.push(b"\n"), vec!["a".to_string()]);
        assert!(p.push(b"data: [DONE]").is_empty());
        assert_eq!(p.finish(), Some("[DONE]".to_string()));
    }

    #[test]
    fn a_lone_cr_ends_a_line() {
        let mut p = SseParser::new();
        assert_eq!(p.push(b"data: x\r\rdata: y\r"), vec!["x".to_string()]);
        // That `\n` completes the `\r\n` begun above; the blank line is still to come.
        assert!(p.push(b"\n").is_empty());
        assert_eq!(p.push(b"\r\n"), vec!["y".to_string()]);
    }
}
