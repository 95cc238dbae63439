//! Dead letters: what the limiter writes to `DEADLETTER` for a line it
//! rejects, bounded whatever the line.
//!
//! A dead letter carries at most [`LINE_BYTES`] of its line (and its full
//! length and hash, so it can be matched with the line in `IMPRESSIONS`),
//! and one input message gives at most [`PER_MESSAGE`] of them: the rest
//! of its rejected lines are counted in one summary letter. So a dead
//! letter stays far below any server's max payload (escaped as JSON a byte
//! takes at most 6), and one message's dead letters take a bounded number
//! of publishes, however many lines it holds.

use serde::Serialize;

/// The longest piece of a rejected line a dead letter carries, in bytes.
pub const LINE_BYTES: usize = 4096;
/// The longest reason detail a dead letter carries, in bytes.
pub(crate) const DETAIL_BYTES: usize = 512;
/// Dead letters of one input message, one per rejected line; the lines past
/// these are summed up in one more letter (reason `rejected_lines_summary`).
pub const PER_MESSAGE: u32 = 100;
/// The reason of the summary letter.
pub const SUMMARY_REASON: &str = "rejected_lines_summary";

#[derive(Debug, Serialize)]
pub struct DeadLetter {
    pub reason: &'static str,
    pub detail: String,
    /// The rejected line, lossily decoded as UTF-8, cut to [`LINE_BYTES`].
    pub line: String,
    /// The whole line's length in bytes.
    pub(crate) line_bytes: usize,
    /// The whole line's xxh3-64, hex.
    pub(crate) line_xxh3: String,
    /// `line` is only the line's beginning.
    pub(crate) truncated: bool,
    /// Position in `IMPRESSIONS`: stream sequence and line number (from 0).
    pub(crate) stream_seq: u64,
    pub line_no: u32,
}

impl DeadLetter {
    pub fn new(
        reason: &'static str,
        detail: String,
        line: &[u8],
        stream_seq: u64,
        line_no: u32,
    ) -> Self {
        let kept = &line[..line.len().min(LINE_BYTES)];
        DeadLetter {
            reason,
            detail: cut(detail, DETAIL_BYTES),
            line: cut(String::from_utf8_lossy(kept).into_owned(), LINE_BYTES),
            line_bytes: line.len(),
            line_xxh3: format!("{:016x}", xxhash_rust::xxh3::xxh3_64(line)),
            truncated: kept.len() < line.len(),
            stream_seq,
            line_no,
        }
    }

    /// The letter for the rejected lines of message `stream_seq` past the
    /// first [`PER_MESSAGE`]: how many, from which line on, and why.
    pub(crate) fn summary(
        stream_seq: u64,
        first_line_no: u32,
        lines: u64,
        reasons: &[(&str, u64)],
    ) -> Self {
        let reasons: Vec<String> = reasons.iter().map(|(r, n)| format!("{r} {n}")).collect();
        DeadLetter {
            reason: SUMMARY_REASON,
            detail: cut(
                format!(
                    "{lines} more rejected lines from line {first_line_no} on ({}); \
                     only the first {PER_MESSAGE} of a message are dead-lettered one by one: \
                     read the message from IMPRESSIONS by its sequence",
                    reasons.join(", ")
                ),
                DETAIL_BYTES,
            ),
            line: String::new(),
            line_bytes: 0,
            line_xxh3: String::new(),
            truncated: false,
            stream_seq,
            line_no: first_line_no,
        }
    }

    /// The same rejected line gets the same id, so JetStream drops the copy
    /// when a redelivered input is rejected again.
    pub fn msg_id(&self) -> String {
        if self.reason == SUMMARY_REASON {
            format!("{}-summary", self.stream_seq)
        } else {
            format!("{}-{}", self.stream_seq, self.line_no)
        }
    }
}

/// `text` cut to at most `max` bytes, at a character boundary.
fn cut(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// Counts the rejected lines of one input message past [`PER_MESSAGE`].
#[derive(Debug, Default)]
pub struct Overflow {
    letters: u32,
    first_line_no: Option<u32>,
    lines: u64,
    reasons: Vec<(&'static str, u64)>,
}

impl Overflow {
    /// Whether the next rejected line (number `line_no`, for `reason`) gets
    /// a letter of its own; if not, it is counted here.
    pub fn admit(&mut self, line_no: u32, reason: &'static str) -> bool {
        if self.letters < PER_MESSAGE {
            self.letters += 1;
            return true;
        }
        self.first_line_no.get_or_insert(line_no);
        self.lines += 1;
        match self.reasons.iter_mut().find(|(r, _)| *r == reason) {
            Some((_, n)) => *n += 1,
            None => self.reasons.push((reason, 1)),
        }
        false
    }

    /// The summary letter, if any line was held back.
    pub fn finish(self, stream_seq: u64) -> Option<DeadLetter> {
        let first = self.first_line_no?;
        Some(DeadLetter::summary(
            stream_seq,
            first,
            self.lines,
            &self.reasons,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_line_of_nul_bytes_makes_a_small_letter_that_names_it() {
        let line = vec![0u8; 1_400_000];
        let letter = DeadLetter::new("invalid_json", "x".repeat(10_000), &line, 7, 0);
        let json = serde_json::to_vec(&letter).unwrap();
        assert!(json.len() < 40_000, "{} bytes", json.len());
        assert!(letter.truncated);
        assert_eq!(letter.line_bytes, 1_400_000);
        assert_eq!(letter.line.len(), LINE_BYTES);
        assert_eq!(letter.detail.len(), DETAIL_BYTES);
        assert_eq!(
            letter.line_xxh3,
            format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&line))
        );
    }

    #[test]
    fn lines_are_cut_at_a_character_boundary() {
        // 'é' is two bytes: a cut at an odd byte keeps whole characters.
        let line = "é".repeat(LINE_BYTES);
        let letter = DeadLetter::new("invalid_json", String::new(), line.as_bytes(), 1, 0);
        assert!(letter.line.len() <= LINE_BYTES);
        assert!(letter.line.chars().all(|c| c == 'é'));
        let short = DeadLetter::new("invalid_json", String::new(), b"garbage", 1, 0);
        assert_eq!(
            (short.line.as_str(), short.truncated, short.line_bytes),
            ("garbage", false, 7)
        );
    }

    #[test]
    fn past_the_cap_lines_are_counted_in_one_summary() {
        let mut overflow = Overflow::default();
        let admitted = (0..PER_MESSAGE + 10)
            .filter(|&n| {
                overflow.admit(
                    n,
                    if n % 2 == 0 {
                        "invalid_json"
                    } else {
                        "unknown_ad"
                    },
                )
            })
            .count();
        assert_eq!(admitted, PER_MESSAGE as usize);
        let summary = overflow.finish(42).expect("a summary");
        assert_eq!(summary.reason, SUMMARY_REASON);
        assert_eq!(summary.line_no, PER_MESSAGE);
        assert_eq!(summary.msg_id(), "42-summary");
        assert!(
            summary.detail.contains("10 more rejected lines"),
            "{}",
            summary.detail
        );
        assert!(
            summary.detail.contains("invalid_json 5, unknown_ad 5"),
            "{}",
            summary.detail
        );
        assert!(Overflow::default().finish(1).is_none());
    }
}
