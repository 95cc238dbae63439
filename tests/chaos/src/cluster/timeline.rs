//! Where a failover's seconds go: per partition, when each stage between the
//! fault and exact totals happened, read from the services' own log lines
//! (their UTC timestamps; the containers share the host's clock) and, for
//! exact totals, from what the caller saw itself.
//!
//! The stages, in order: the victim's lease lost (the first survivor's
//! member list without it: etcd deleted its key and the watch told), the new
//! owner's assignment naming the partition, its claim of the owner key, the
//! shard restored and running, the first `SPEND` messages applied, the
//! first push of the new owner epoch taken by pacer1, and the pacer equal to
//! the truth.

use std::collections::BTreeMap;
use std::fmt::Write;

use chrono::{DateTime, Utc};

use super::compose::{Cluster, AGGREGATORS};

/// The member the campaign scales up to.
const SCALED: &str = "aggregator4";

/// The stages of one partition's failover, in order.
pub const STAGES: [&str; 7] = [
    "lease lost",
    "assigned",
    "claimed",
    "restored",
    "applied",
    "pacer took",
    "exact",
];

/// One failover: the fault, and per partition the time of each stage.
#[derive(Debug, Clone)]
pub struct Timeline {
    pub what: String,
    pub fault_at: DateTime<Utc>,
    /// Partition → stage (index into [`STAGES`]) → when.
    pub partitions: BTreeMap<u32, [Option<DateTime<Utc>>; 7]>,
}

/// Log lines of the aggregators (by member) and pacer1, read once per report.
pub struct Logs {
    aggregators: Vec<(String, String)>,
    pacer: String,
}

impl Logs {
    pub async fn read(cluster: &Cluster) -> anyhow::Result<Logs> {
        let mut aggregators = Vec::new();
        for member in AGGREGATORS {
            aggregators.push((member.to_owned(), cluster.logs(member, 20_000).await?));
        }
        // The campaign's fourth member, where it was started.
        aggregators.push((
            SCALED.to_owned(),
            cluster.logs(SCALED, 20_000).await.unwrap_or_default(),
        ));
        Ok(Logs {
            aggregators,
            pacer: cluster.logs("pacer1", 20_000).await?,
        })
    }
}

impl Timeline {
    /// The stages of `victim`'s `partitions` after `fault_at`, from `logs`,
    /// with the moment the caller saw exact totals.
    pub fn collect(
        what: &str,
        victim: &str,
        fault_at: DateTime<Utc>,
        exact: Option<DateTime<Utc>>,
        partitions: &[u32],
        logs: &Logs,
    ) -> Timeline {
        // What the others logged: the victim's own lines (a paused member
        // wakes and logs late) tell nothing of its takeover.
        let survivors = || {
            logs.aggregators
                .iter()
                .filter(|(member, _)| member != victim)
                .flat_map(|(_, log)| log.lines())
        };
        let lease_lost = survivors()
            .filter(|l| l.contains("assignment changed") && !listed(l, "members", victim))
            .filter_map(timestamp)
            .filter(|t| *t >= fault_at)
            .min();
        let after_lease = lease_lost.unwrap_or(fault_at);
        let mut out = BTreeMap::new();
        for &p in partitions {
            let field = format!("partition={p} ");
            let shard = format!("shard=\"p{p}\"");
            let aggregators = survivors;
            let first = |lines: &mut dyn Iterator<Item = &str>, matches: &dyn Fn(&str) -> bool| {
                lines
                    .filter(|l| matches(l))
                    .filter_map(timestamp)
                    .filter(|t| *t >= after_lease)
                    .min()
            };
            let stages = [
                lease_lost,
                first(&mut aggregators(), &|l| {
                    l.contains("assignment changed") && listed(l, "partitions", &p.to_string())
                }),
                first(&mut aggregators(), &|l| {
                    l.contains("partition claimed") && l.contains(&field)
                }),
                first(&mut aggregators(), &|l| {
                    l.contains("partition running") && l.contains(&field)
                }),
                first(&mut aggregators(), &|l| {
                    l.contains("first SPEND messages applied") && l.contains(&shard)
                }),
                first(&mut logs.pacer.lines(), &|l| {
                    l.contains("new owner epoch") && l.contains(&shard)
                }),
                exact,
            ];
            out.insert(p, stages);
        }
        Timeline {
            what: what.to_owned(),
            fault_at,
            partitions: out,
        }
    }

    /// Stages no partition reached (every stage must show in a failover).
    pub fn missing(&self) -> Vec<String> {
        let mut missing = Vec::new();
        for (p, stages) in &self.partitions {
            for (name, at) in STAGES.iter().zip(stages) {
                if at.is_none() {
                    missing.push(format!("p{p} {name}"));
                }
            }
        }
        missing
    }

    /// Seconds from the fault to `stage` of the slowest partition.
    pub fn slowest(&self, stage: usize) -> Option<f64> {
        self.partitions
            .values()
            .filter_map(|s| s[stage])
            .map(|t| self.secs(t))
            .max_by(f64::total_cmp)
    }

    fn secs(&self, at: DateTime<Utc>) -> f64 {
        (at - self.fault_at).num_milliseconds() as f64 / 1000.0
    }

    /// A table: one row per partition, seconds after the fault per stage.
    pub fn render(&self) -> String {
        let mut out = format!(
            "timeline of {} at {} (seconds after it)\n",
            self.what,
            self.fault_at.format("%H:%M:%S%.3f")
        );
        let _ = write!(out, "{:>5}", "part");
        for name in STAGES {
            let _ = write!(out, " {name:>10}");
        }
        out.push('\n');
        for (p, stages) in &self.partitions {
            let _ = write!(out, "{:>5}", format!("p{p}"));
            for at in stages {
                match at {
                    Some(t) => {
                        let _ = write!(out, " {:>10.2}", self.secs(*t));
                    }
                    None => {
                        let _ = write!(out, " {:>10}", "-");
                    }
                }
            }
            out.push('\n');
        }
        out
    }
}

/// The UTC timestamp a service's log line starts with (after compose's
/// `service_1  | ` prefix).
fn timestamp(line: &str) -> Option<DateTime<Utc>> {
    let line = line.split_once(" | ").map_or(line, |(_, rest)| rest);
    let token = line.split_whitespace().next()?;
    DateTime::parse_from_rfc3339(token)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// Whether the list field `name` of a log line (`partitions="1,4,9"`)
/// holds `item`.
fn listed(line: &str, name: &str, item: &str) -> bool {
    let Some((_, rest)) = line.split_once(&format!(" {name}=")) else {
        return false;
    };
    let list = rest
        .trim_start_matches('"')
        .split(['"', ' '])
        .next()
        .unwrap_or_default();
    list.split(',').any(|i| i == item)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_come_from_the_first_line_after_the_fault() {
        let fault: DateTime<Utc> = "2026-11-28T06:00:10Z".parse().unwrap();
        let logs = Logs {
            aggregators: vec![(
                "a".into(),
                [
                    "adspendtest_aggregator1_1  | 2026-11-28T06:00:01.000000Z  INFO assignment changed member=\"a\" members=\"a,b,c\" partitions=\"1,4\"",
                    "adspendtest_aggregator1_1  | 2026-11-28T06:00:15.400000Z  INFO assignment changed member=\"a\" members=\"a,c\" partitions=\"1,4\"",
                    "adspendtest_aggregator1_1  | 2026-11-28T06:00:15.500000Z  INFO assignment changed member=\"a\" members=\"a,c\" partitions=\"1,4,9\"",
                    "adspendtest_aggregator1_1  | 2026-11-28T06:00:15.600000Z  INFO partition claimed; restoring partition=9 kind=\"failover\"",
                    "adspendtest_aggregator1_1  | 2026-11-28T06:00:15.900000Z  INFO partition running partition=9 kind=\"failover\" start=\"cold\"",
                    "adspendtest_aggregator1_1  | 2026-11-28T06:00:16.000000Z  INFO first SPEND messages applied shard=\"p9\" seq=77",
                ]
                .join("\n"),
            )],
            pacer: "adspendtest_pacer1_1  | 2026-11-28T06:00:16.100000Z  INFO shard's pushes from a new owner epoch shard=\"p9\" epoch=4 previous_epoch=3".into(),
        };
        let exact = "2026-11-28T06:00:17Z".parse().ok();
        let t = Timeline::collect("kill b", "b", fault, exact, &[9, 1], &logs);
        let secs: Vec<Option<f64>> = t.partitions[&9]
            .iter()
            .map(|s| s.map(|s| t.secs(s)))
            .collect();
        assert_eq!(secs, [5.4, 5.5, 5.6, 5.9, 6.0, 6.1, 7.0].map(Some).to_vec());
        // p1 stayed where it was: assigned again, nothing else.
        assert_eq!(
            t.missing(),
            ["p1 claimed", "p1 restored", "p1 applied", "p1 pacer took"]
        );
        assert!(t.render().contains("p9"));
    }
}
