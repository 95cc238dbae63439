//! The aggregator's report of what a shard's dedupe window holds (aggregator
//! → pacer, core NATS, JSON), shown by the pacer's `GET /v1/shards`.
//!
//! It travels under the sums subjects, `adspend.sums.window.<shard>`, so
//! the grants that let an aggregator push sums and a pacer hear them cover
//! it; a shard name has no dot, so it never reads as a shard's own sums
//! subject `adspend.sums.<shard>`.

/// Subject prefix of the reports, one subject per shard.
pub const SUBJECT_PREFIX: &str = "adspend.sums.window";

pub fn subject(shard: &str) -> String {
    format!("{SUBJECT_PREFIX}.{shard}")
}

/// One shard's dedupe window as its writer last saw it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Report {
    pub shard: String,
    /// Stream time between the oldest id held and the newest message
    /// applied, ms: the window a duplicate is caught within. `None` while
    /// the window holds no id.
    pub effective_ms: Option<u64>,
    /// `ADSPEND_DEDUPE_WINDOW_MS`.
    pub configured_ms: u64,
    pub ids: u64,
    /// `ADSPEND_DEDUPE_MAX_IDS`.
    pub max_ids: u64,
    /// Bytes of the in-memory set's tables.
    pub memory_bytes: u64,
    /// Ids evicted by the count bound, before the window's time, since the
    /// shard started here.
    pub evicted_by_count: u64,
    /// When it was sent (unix ms).
    pub at_ms: i64,
}

impl Report {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a dedupe window report serializes")
    }

    pub fn decode(bytes: &[u8]) -> Result<Report, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// Whether the window is shorter than configured because the count
    /// bound cut it (a window still filling after a start is not).
    pub fn cut_by_count(&self) -> bool {
        self.evicted_by_count > 0 && self.effective_ms.is_some_and(|ms| ms < self.configured_ms)
    }
}
