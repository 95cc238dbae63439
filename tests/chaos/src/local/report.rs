//! What a campaign measured, and its rendering for `adchaos` and the README.

use std::collections::BTreeMap;

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub seed: u64,
    pub rounds: usize,
    /// The aggregator's shards, one per writer (`all` with one writer).
    pub shards: Vec<String>,
    /// Faults injected by kind; every one was confirmed to have fired.
    pub faults: BTreeMap<String, u64>,
    pub events_attempted: u64,
    pub events_acknowledged: u64,
    /// Events whose publish outcome the simulator could not know.
    pub events_unknown: u64,
    /// Of those, found in the stream when it was read back.
    pub events_unknown_stored: u64,
    pub duplicates_injected: u64,
    pub dropped_by_id: u64,
    pub skipped_by_seq: u64,
    pub limits_compared: usize,
    pub pacer_mismatches: usize,
    pub aggregator_mismatches: usize,
    pub max_abs_diff: u64,
    pub recovery_ms: Vec<(String, u64)>,
}

use adspend_sim::stats::percentile;

impl Report {
    pub fn render(&self) -> String {
        let mut out = format!(
            "campaign: seed {}, {} rounds, aggregator shards {}\n",
            self.seed,
            self.rounds,
            self.shards.join(", ")
        );
        out += "faults injected (each confirmed fired):\n";
        for (kind, n) in &self.faults {
            out += &format!("  {kind:<36} {n}\n");
        }
        out += &format!(
            "events: attempted {}, acknowledged {}, unknown {} (resolved by reading the stream back: {} stored, {} not)\n",
            self.events_attempted,
            self.events_acknowledged,
            self.events_unknown,
            self.events_unknown_stored,
            self.events_unknown - self.events_unknown_stored.min(self.events_unknown)
        );
        out += &format!(
            "duplicates: injected by the simulator {}; dropped by message id {}; replayed messages skipped by sequence (tuples) {}\n",
            self.duplicates_injected, self.dropped_by_id, self.skipped_by_seq
        );
        out += &format!(
            "per-limit comparison: {} limits; mismatches pacer {} aggregator {}; largest absolute difference {} micros\n",
            self.limits_compared, self.pacer_mismatches, self.aggregator_mismatches, self.max_abs_diff
        );
        let mut all: Vec<u64> = self.recovery_ms.iter().map(|(_, ms)| *ms).collect();
        all.sort_unstable();
        out += &format!(
            "recovery (restart -> caught up), ms: p50 {} p99 {} max {} over {} restarts\n",
            percentile(&all, 50.0),
            percentile(&all, 99.0),
            all.last().copied().unwrap_or(0),
            all.len()
        );
        let mut by_kind: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        for (kind, ms) in &self.recovery_ms {
            by_kind.entry(kind).or_default().push(*ms);
        }
        for (kind, mut v) in by_kind {
            v.sort_unstable();
            out += &format!(
                "  {kind:<36} p50 {:>6} max {:>6}\n",
                percentile(&v, 50.0),
                v.last().copied().unwrap_or(0)
            );
        }
        out
    }
}
