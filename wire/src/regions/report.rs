//! [`RegionReport`]: one region's state of every limit it paces, sent to the
//! other regions (JSON, `version` 1).
//!
//! Every field a receiver folds in by maximum (`spend_micros`,
//! `lifetime_spend_micros`, `given`, `received`) only grows within a
//! period, so a report may arrive twice, late, or out of order. The gauges
//! (`leased_micros`, `want_micros`) follow the report with the highest
//! `seq`.
//!
//! Size: a report carries at most [`MAX_REPORT_LIMITS`] limits, each of at
//! most [`MAX_REGIONS`] regions and a limit id of at most
//! [`MAX_ID_LEN`](crate::types::MAX_ID_LEN) bytes, which keeps it under
//! [`MAX_REPORT_BYTES`] (a test checks the worst case), well below NATS's
//! default 1 MB payload. A region with more limits sends several reports
//! with the same `seq` ([`RegionReport::split`]); the receiver needs no
//! reassembly because it merges entry by entry.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::name::RegionName;
use crate::types::{Micros, MAX_ID_LEN};

/// The report format this build writes and the only one it reads.
pub const REPORT_VERSION: u32 = 1;

/// Most limits in one report.
pub const MAX_REPORT_LIMITS: usize = 200;

/// Most regions in one deployment, so most keys in an entry's maps (one
/// fewer: a region gives nothing to itself).
pub const MAX_REGIONS: usize = 16;

/// Largest report accepted, in bytes.
pub const MAX_REPORT_BYTES: usize = 512 * 1024;

/// One region's report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionReport {
    /// Always [`REPORT_VERSION`]; decoding refuses any other.
    pub version: u32,
    pub region: RegionName,
    /// Grows with every report of the region, across restarts too (the
    /// gauges of a region follow its highest `seq`); the parts of one
    /// [`split`](RegionReport::split) share it.
    pub seq: u64,
    /// When the region took this state, unix ms (its clock).
    pub as_of_ms: i64,
    pub limits: Vec<LimitEntry>,
}

/// One limit's state at the reporting region, for its current period.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitEntry {
    pub limit_id: String,
    /// Start of the period these figures belong to, unix ms, as the pacer
    /// computes it (`period_start` of its API, as a number so that order is
    /// plain); [`LIFETIME_PERIOD_START_MS`] for a lifetime limit.
    pub period_start_ms: i64,
    /// The region's own exact spend in the period.
    pub spend_micros: Micros,
    /// The region's own spend ever.
    pub lifetime_spend_micros: Micros,
    /// Granted by the region's pacers and not yet covered by spend (gauge).
    pub leased_micros: Micros,
    /// How much more the region would grant now if its allotment allowed:
    /// its unmet demand (gauge).
    pub want_micros: Micros,
    /// Micros this region has handed to each other region in the period,
    /// cumulative (grow-only).
    #[serde(default)]
    pub given: BTreeMap<RegionName, Micros>,
    /// What this region has credited from each other region's `given` to
    /// it: the giver subtracts it from what it gave to know what is still
    /// in transit, and a restarted giver can tell what was counted.
    #[serde(default)]
    pub received: BTreeMap<RegionName, Micros>,
}

/// `period_start_ms` of a lifetime limit: one period that never ends, and
/// ordered before any dated one.
pub const LIFETIME_PERIOD_START_MS: i64 = i64::MIN;

/// Just the version, read before the rest so that a newer format is refused
/// as such rather than as whatever field it changed.
#[derive(Deserialize)]
struct VersionProbe {
    version: Option<u64>,
}

impl RegionReport {
    pub fn new(region: RegionName, seq: u64, as_of_ms: i64, limits: Vec<LimitEntry>) -> Self {
        RegionReport {
            version: REPORT_VERSION,
            region,
            seq,
            as_of_ms,
            limits,
        }
    }

    /// Splits a region's state into reports of at most
    /// [`MAX_REPORT_LIMITS`] limits each, all with the same `seq`. No limits
    /// still gives one (empty) report: it says the region is alive.
    pub fn split(
        region: &RegionName,
        seq: u64,
        as_of_ms: i64,
        limits: Vec<LimitEntry>,
    ) -> Vec<Self> {
        if limits.is_empty() {
            return vec![RegionReport::new(region.clone(), seq, as_of_ms, limits)];
        }
        let mut parts = Vec::with_capacity(limits.len().div_ceil(MAX_REPORT_LIMITS));
        let mut rest = limits.into_iter().peekable();
        while rest.peek().is_some() {
            let part: Vec<LimitEntry> = rest.by_ref().take(MAX_REPORT_LIMITS).collect();
            parts.push(RegionReport::new(region.clone(), seq, as_of_ms, part));
        }
        parts
    }

    pub fn encode(&self) -> Vec<u8> {
        // Strings, integers and maps with string keys: serializing cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes a report, refusing another version and what no region sends:
    /// more than the size bounds, a negative time, a bad or repeated limit
    /// id, a region giving to or receiving from itself.
    pub fn decode(payload: &[u8]) -> Result<RegionReport, crate::Error> {
        let refuse = |reason: String| crate::Error::Decode {
            what: "region report",
            reason,
        };
        if payload.len() > MAX_REPORT_BYTES {
            return Err(refuse(format!(
                "{} bytes, more than the {MAX_REPORT_BYTES} allowed",
                payload.len()
            )));
        }
        let probe: VersionProbe =
            serde_json::from_slice(payload).map_err(|e| refuse(e.to_string()))?;
        match probe.version {
            Some(v) if v == u64::from(REPORT_VERSION) => {}
            Some(v) => {
                return Err(refuse(format!(
                    "version {v} is not supported (this build reads version {REPORT_VERSION})"
                )))
            }
            None => return Err(refuse("no version field".into())),
        }
        let report: RegionReport =
            serde_json::from_slice(payload).map_err(|e| refuse(e.to_string()))?;
        report.check().map_err(refuse)?;
        Ok(report)
    }

    fn check(&self) -> Result<(), String> {
        if self.as_of_ms < 0 {
            return Err(format!("negative as_of_ms {}", self.as_of_ms));
        }
        if self.limits.len() > MAX_REPORT_LIMITS {
            return Err(format!(
                "{} limits, more than the {MAX_REPORT_LIMITS} allowed",
                self.limits.len()
            ));
        }
        let mut seen = BTreeSet::new();
        for entry in &self.limits {
            let id = &entry.limit_id;
            if id.is_empty() || id.len() > MAX_ID_LEN {
                return Err(format!("limit id of {} bytes (1..={MAX_ID_LEN})", id.len()));
            }
            if !seen.insert(id.as_str()) {
                return Err(format!("limit {id:?} twice"));
            }
            for (map, name) in [(&entry.given, "given"), (&entry.received, "received")] {
                if map.len() >= MAX_REGIONS {
                    return Err(format!(
                        "limit {id:?}: {name} names {} regions (at most {})",
                        map.len(),
                        MAX_REGIONS - 1
                    ));
                }
                if map.contains_key(&self.region) {
                    return Err(format!(
                        "limit {id:?}: {name} names the reporting region itself"
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> RegionName {
        RegionName::new(s).unwrap()
    }

    fn entry(id: &str) -> LimitEntry {
        LimitEntry {
            limit_id: id.into(),
            period_start_ms: 1_764_288_000_000,
            spend_micros: 10,
            lifetime_spend_micros: 30,
            leased_micros: 5,
            want_micros: 7,
            given: BTreeMap::from([(name("west"), 100)]),
            received: BTreeMap::from([(name("south"), 40)]),
        }
    }

    fn report() -> RegionReport {
        RegionReport::new(
            name("east"),
            3,
            1_764_288_001_000,
            vec![entry("c1"), entry("c2")],
        )
    }

    #[test]
    fn round_trips_with_version_1() {
        let good = report();
        let bytes = good.encode();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(
            text.starts_with(r#"{"version":1,"region":"east","seq":3"#),
            "{text}"
        );
        assert!(text.contains(r#""given":{"west":100}"#), "{text}");
        assert_eq!(RegionReport::decode(&bytes).unwrap(), good);
    }

    #[test]
    fn refuses_other_versions_by_name() {
        let mut v2 = report();
        v2.version = 2;
        let err = RegionReport::decode(&v2.encode()).unwrap_err().to_string();
        assert!(err.contains("version 2 is not supported"), "{err}");
        // Refused for its version even when the rest is not a v1 shape.
        let err = RegionReport::decode(br#"{"version":2,"limits":"new"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("version 2"), "{err}");
        let err = RegionReport::decode(br#"{"region":"east"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no version"), "{err}");
        assert!(RegionReport::decode(br#"{"version":0}"#).is_err());
    }

    #[test]
    fn refuses_what_no_region_sends() {
        type Spoil = fn(&mut RegionReport);
        let cases: Vec<(Spoil, &str)> = vec![
            (|r| r.as_of_ms = -1, "negative as_of_ms"),
            (|r| r.limits[1].limit_id = "c1".into(), "twice"),
            (|r| r.limits[0].limit_id.clear(), "limit id of 0 bytes"),
            (
                |r| r.limits[0].limit_id = "x".repeat(65),
                "limit id of 65 bytes",
            ),
            (
                |r| {
                    r.limits[0].given.insert(name("east"), 1);
                },
                "given names the reporting region",
            ),
            (
                |r| {
                    r.limits[0].received.insert(name("east"), 1);
                },
                "received names the reporting region",
            ),
            (
                |r| {
                    r.limits = (0..=MAX_REPORT_LIMITS)
                        .map(|i| entry(&i.to_string()))
                        .collect()
                },
                "201 limits",
            ),
            (
                |r| {
                    r.limits[0].given = (0..MAX_REGIONS)
                        .map(|i| (name(&format!("r{i}")), 1))
                        .collect()
                },
                "given names 16 regions",
            ),
        ];
        for (spoil, why) in cases {
            let mut bad = report();
            spoil(&mut bad);
            let err = RegionReport::decode(&bad.encode()).unwrap_err().to_string();
            assert!(err.contains(why), "{why}: {err}");
        }
        let err = RegionReport::decode(
            br#"{"version":1,"region":"East","seq":1,"as_of_ms":0,"limits":[]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("[a-z0-9-]"), "{err}");
        assert!(RegionReport::decode(&vec![b' '; MAX_REPORT_BYTES + 1]).is_err());
    }

    #[test]
    fn the_largest_report_fits_the_byte_bound() {
        let others: Vec<RegionName> = (0..MAX_REGIONS - 1)
            .map(|i| name(&format!("{i:0>32}")))
            .collect();
        let widest = |i: usize| LimitEntry {
            limit_id: format!("{i:x>64}"),
            period_start_ms: i64::MIN,
            spend_micros: u64::MAX,
            lifetime_spend_micros: u64::MAX,
            leased_micros: u64::MAX,
            want_micros: u64::MAX,
            given: others.iter().map(|o| (o.clone(), u64::MAX)).collect(),
            received: others.iter().map(|o| (o.clone(), u64::MAX)).collect(),
        };
        let largest = RegionReport::new(
            name(&"r".repeat(32)),
            u64::MAX,
            i64::MAX,
            (0..MAX_REPORT_LIMITS).map(widest).collect(),
        );
        let bytes = largest.encode();
        assert!(bytes.len() <= MAX_REPORT_BYTES, "{} bytes", bytes.len());
        assert_eq!(RegionReport::decode(&bytes).unwrap(), largest);
    }

    #[test]
    fn split_keeps_every_limit_once_under_one_seq() {
        let east = name("east");
        let limits: Vec<LimitEntry> = (0..2 * MAX_REPORT_LIMITS + 1)
            .map(|i| entry(&i.to_string()))
            .collect();
        let parts = RegionReport::split(&east, 9, 5, limits.clone());
        assert_eq!(
            parts.iter().map(|p| p.limits.len()).collect::<Vec<_>>(),
            [200, 200, 1]
        );
        assert!(parts
            .iter()
            .all(|p| p.seq == 9 && p.region == east && p.version == 1));
        let back: Vec<LimitEntry> = parts.into_iter().flat_map(|p| p.limits).collect();
        assert_eq!(back, limits);

        let empty = RegionReport::split(&east, 10, 5, Vec::new());
        assert_eq!(empty.len(), 1);
        assert!(empty[0].limits.is_empty());
    }
}
