//! The campaign's summary: faults by kind, how long each kind kept
//! partitions from applying and checkpointing, the pacer's freshness
//! meanwhile, stalls, invariant violations and the final comparison.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

use super::watch::WindowResult;
use crate::cluster::timeline::Timeline;
use adspend_sim::stats::percentile;

/// One fault as it went.
#[derive(Debug, Clone)]
pub struct FaultRecord {
    pub kind: String,
    pub what: String,
    pub window: WindowResult,
    /// From healing until every partition applied and checkpointed again.
    pub recovered: Duration,
    pub stalled: bool,
    /// For an aggregator killed or paused: where its failover's time went.
    pub timelines: Vec<Timeline>,
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    pub seed: u64,
    pub faults: Vec<FaultRecord>,
    /// Draws skipped because the cluster's shape did not allow them.
    pub skipped: u64,
    pub violations: Vec<String>,
    /// Log lines of calls NATS refused a service for lack of permission.
    pub permission_violations: Vec<String>,
    /// etcd reads answered from behind a revision already read (etcd's
    /// defect, not adspend's: reported, not counted as violations).
    pub etcd_stale_reads: Vec<String>,
    pub samples: u64,
    pub limits: usize,
    pub mismatches: usize,
    pub total_micros: u64,
    pub events_sent: u64,
    pub publishes_failed: u64,
    pub settled: Duration,
}

impl Report {
    pub fn stalls(&self) -> usize {
        self.faults.iter().filter(|f| f.stalled).count()
    }

    /// Nothing differs, stalled, broke an invariant or was refused.
    pub fn clean(&self) -> bool {
        self.mismatches == 0
            && self.stalls() == 0
            && self.violations.is_empty()
            && self.permission_violations.is_empty()
    }

    /// The table and the closing line `chaos: N faults, M mismatches, …`.
    pub fn render(&self) -> String {
        let mut by_kind: BTreeMap<&str, Vec<&FaultRecord>> = BTreeMap::new();
        for f in &self.faults {
            by_kind.entry(&f.kind).or_default().push(f);
        }
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<40} {:>3}  {:>20}  {:>20}  {:>20}  {:>6}",
            "fault kind",
            "n",
            "apply gap s p50/p99/max",
            "ckpt gap s p50/p99/max",
            "lag s p50/p99/max",
            "stalls"
        );
        for (kind, faults) in &by_kind {
            let secs = |f: &dyn Fn(&FaultRecord) -> u64| {
                let mut v: Vec<u64> = faults.iter().map(|r| f(r)).collect();
                v.sort_unstable();
                format!(
                    "{:.1}/{:.1}/{:.1}",
                    percentile(&v, 50.0) as f64 / 1000.0,
                    percentile(&v, 99.0) as f64 / 1000.0,
                    v.last().copied().unwrap_or(0) as f64 / 1000.0
                )
            };
            let _ = writeln!(
                out,
                "{:<40} {:>3}  {:>20}  {:>20}  {:>20}  {:>6}",
                kind,
                faults.len(),
                secs(&|r| r.window.apply_gap.as_millis() as u64),
                secs(&|r| r.window.checkpoint_gap.as_millis() as u64),
                secs(&|r| r.window.max_lag_ms.max(0) as u64),
                faults.iter().filter(|r| r.stalled).count()
            );
        }
        let mut gaps: Vec<u64> = self
            .faults
            .iter()
            .map(|r| r.window.apply_gap.as_millis() as u64)
            .collect();
        gaps.sort_unstable();
        let _ = writeln!(
            out,
            "all faults: apply gap p50 {:.1}s p99 {:.1}s max {:.1}s; {} draws skipped (shape)",
            percentile(&gaps, 50.0) as f64 / 1000.0,
            percentile(&gaps, 99.0) as f64 / 1000.0,
            gaps.last().copied().unwrap_or(0) as f64 / 1000.0,
            self.skipped
        );
        let _ = writeln!(
            out,
            "invariants over {} samples: {} violations",
            self.samples,
            self.violations.len()
        );
        for v in self.violations.iter().take(20) {
            let _ = writeln!(out, "  violation: {v}");
        }
        let _ = writeln!(
            out,
            "NATS permission violations in the services' and NATS's logs: {}",
            self.permission_violations.len()
        );
        for v in self.permission_violations.iter().take(10) {
            let _ = writeln!(out, "  refused: {v}");
        }
        if !self.etcd_stale_reads.is_empty() {
            let _ = writeln!(
                out,
                "etcd stale reads (a member behind, etcd-io/etcd#20418; not checked): {}",
                self.etcd_stale_reads.len()
            );
            for r in self.etcd_stale_reads.iter().take(5) {
                let _ = writeln!(out, "  stale read: {r}");
            }
        }
        let _ = writeln!(
            out,
            "final: {} limits compared with IMPRESSIONS read back, total {} micros; {} events sent, {} publishes failed (read back); settled in {:.1}s",
            self.limits,
            self.total_micros,
            self.events_sent,
            self.publishes_failed,
            self.settled.as_secs_f64()
        );
        let _ = write!(
            out,
            "chaos: {} faults, {} mismatches, {} stalls, {} violations, {} permission violations (seed {})",
            self.faults.len(),
            self.mismatches,
            self.stalls(),
            self.violations.len(),
            self.permission_violations.len(),
            self.seed
        );
        out
    }
}
