//! Event generation: good impressions, verbatim duplicates and bad lines,
//! written straight into the outgoing NDJSON payload (or binary batch:
//! [`format`]).

mod format;
pub use format::InputFormat;
use format::{put_i64, put_u64};

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};

use super::catalog::MAX_ID_BYTES;
use super::parse_duration;
use super::truth::CatalogIndex;

/// The kinds of bad input the pipeline must dead-letter, named by the
/// `reason` the pipeline reports for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BadKind {
    InvalidJson,
    MissingField,
    NegativeCost,
    FractionalCost,
    IdTooLong,
    UnknownAd,
    /// The largest integer the contract's syntax allows: above the limiter's
    /// ceiling, and two of them would overflow a u64 sum.
    CostTooLarge,
}

impl BadKind {
    pub const ALL: [BadKind; 7] = [
        BadKind::InvalidJson,
        BadKind::MissingField,
        BadKind::NegativeCost,
        BadKind::FractionalCost,
        BadKind::IdTooLong,
        BadKind::UnknownAd,
        BadKind::CostTooLarge,
    ];

    pub fn reason(self) -> &'static str {
        match self {
            BadKind::InvalidJson => "invalid_json",
            BadKind::MissingField => "missing_field",
            BadKind::NegativeCost => "negative_cost",
            BadKind::FractionalCost => "fractional_cost",
            BadKind::IdTooLong => "id_too_long",
            BadKind::UnknownAd => "unknown_ad",
            BadKind::CostTooLarge => "cost_too_large",
        }
    }
}

impl fmt::Display for BadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}

impl FromStr for BadKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        BadKind::ALL
            .into_iter()
            .find(|kind| kind.reason() == s)
            .ok_or_else(|| {
                let known: Vec<_> = BadKind::ALL.iter().map(|k| k.reason()).collect();
                format!(
                    "unknown bad-event kind {s:?}, expected one of {}",
                    known.join(", ")
                )
            })
    }
}

/// Cost of one impression, integer micros, both bounds inclusive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CostDistribution {
    Uniform {
        min: u64,
        max: u64,
    },
    /// Many cheap impressions, few expensive ones; `min` must be ≥ 1.
    LogUniform {
        min: u64,
        max: u64,
    },
}

impl CostDistribution {
    pub(crate) fn validate(&self) -> Result<(), String> {
        match *self {
            CostDistribution::Uniform { min, max } if min > max => {
                Err(format!("cost range {min}..={max} is empty"))
            }
            CostDistribution::LogUniform { min, max } if min == 0 || min > max => Err(format!(
                "log-uniform cost range {min}..={max} must satisfy 1 <= min <= max"
            )),
            _ => Ok(()),
        }
    }

    fn sample(&self, rng: &mut SmallRng) -> u64 {
        match *self {
            CostDistribution::Uniform { min, max } => rng.random_range(min..=max),
            CostDistribution::LogUniform { min, max } => {
                let (lo, hi) = ((min as f64).ln(), (max as f64).ln());
                let cost = rng.random_range(lo..=hi).exp().round() as u64;
                cost.clamp(min, max)
            }
        }
    }
}

/// `MIN..=MAX` (uniform), `uniform:MIN..=MAX`, `log-uniform:MIN..=MAX` or a
/// single fixed cost `N`.
impl FromStr for CostDistribution {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, range) = s.split_once(':').unwrap_or(("uniform", s));
        let number = |n: &str| {
            n.trim()
                .replace('_', "")
                .parse::<u64>()
                .map_err(|e| format!("bad cost {n:?} in {s:?}: {e}"))
        };
        let (min, max) = match range.split_once("..=") {
            Some((min, max)) => (number(min)?, number(max)?),
            None => {
                let fixed = number(range)?;
                (fixed, fixed)
            }
        };
        let cost = match kind {
            "uniform" => CostDistribution::Uniform { min, max },
            "log-uniform" => CostDistribution::LogUniform { min, max },
            other => return Err(format!("unknown cost distribution {other:?} in {s:?}")),
        };
        cost.validate()?;
        Ok(cost)
    }
}

/// Where event timestamps fall.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventTime {
    /// The wall clock when the message is built.
    Now,
    /// Uniformly over the given span before now, so that some events belong
    /// to the previous local day of some limits.
    Last(Duration),
    /// Uniformly in `[start_ms, end_ms)`, unix milliseconds.
    Range { start_ms: i64, end_ms: i64 },
}

/// `now`, `last:<duration>` (e.g. `last:36h`) or `range:<from>..<to>` with
/// RFC 3339 times or unix milliseconds.
impl FromStr for EventTime {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "now" {
            return Ok(EventTime::Now);
        }
        if let Some(span) = s.strip_prefix("last:") {
            return Ok(EventTime::Last(parse_duration(span)?));
        }
        if let Some(range) = s.strip_prefix("range:") {
            let (from, to) = range
                .split_once("..")
                .ok_or_else(|| format!("event time range {range:?} must be <from>..<to>"))?;
            let instant = |t: &str| {
                t.parse::<i64>().or_else(|_| {
                    chrono::DateTime::parse_from_rfc3339(t)
                        .map(|t| t.timestamp_millis())
                        .map_err(|e| format!("bad time {t:?} in {s:?}: {e}"))
                })
            };
            let (start_ms, end_ms) = (instant(from)?, instant(to)?);
            if start_ms >= end_ms {
                return Err(format!("event time range {s:?} is empty"));
            }
            return Ok(EventTime::Range { start_ms, end_ms });
        }
        Err(format!(
            "event time {s:?} must be `now`, `last:<duration>` or `range:<from>..<to>`"
        ))
    }
}

/// A good impression the truth may have to book when its message is
/// acknowledged; `seq` names it (its id is `<run id>-<seq>`).
#[derive(Debug, Clone, Copy)]
pub struct GoodEvent {
    pub seq: u64,
    pub ad: u32,
    pub cost: u64,
    pub ts: i64,
}

/// What went into one message, kept until JetStream answers for it.
#[derive(Debug, Default)]
pub struct Batch {
    pub good: Vec<GoodEvent>,
    pub bad: [u32; BadKind::ALL.len()],
    pub duplicates: u32,
    pub events: u32,
}

impl Batch {
    pub fn clear(&mut self) {
        self.good.clear();
        self.bad = [0; BadKind::ALL.len()];
        self.duplicates = 0;
        self.events = 0;
    }
}

/// How many earlier impressions a duplicate is drawn from.
const RECENT: usize = 4096;

#[derive(Debug)]
pub struct GeneratorConfig {
    pub seed: u64,
    pub zipf_exponent: f64,
    pub cost: CostDistribution,
    pub duplicate_rate: f64,
    pub bad_rate: f64,
    pub bad_kinds: Vec<BadKind>,
    pub event_time: EventTime,
}

pub struct Generator {
    index: Arc<CatalogIndex>,
    config: GeneratorConfig,
    rng: SmallRng,
    zipf: Zipf<f64>,
    /// Popularity rank → ad, shuffled so the hottest ads are not simply the
    /// first ones of the catalog (which share an ad set).
    rank_to_ad: Vec<u32>,
    /// `<run id>-`, the prefix of every impression id of the run.
    id_prefix: Box<[u8]>,
    next_seq: u64,
    next_bad: u64,
    recent: Vec<GoodEvent>,
    recent_next: usize,
    /// NDJSON unless [`Generator::with_format`] says otherwise.
    format: InputFormat,
    scratch: Vec<u8>,
}

impl Generator {
    pub fn new(
        index: Arc<CatalogIndex>,
        config: GeneratorConfig,
        run_id: &str,
    ) -> Result<Self, String> {
        if index.ad_ids.is_empty() {
            return Err("the catalog has no ads".to_owned());
        }
        let mut rng = SmallRng::seed_from_u64(config.seed);
        let zipf = Zipf::new(index.ad_ids.len() as f64, config.zipf_exponent)
            .map_err(|e| format!("bad Zipf exponent {}: {e}", config.zipf_exponent))?;
        let mut rank_to_ad: Vec<u32> = (0..index.ad_ids.len() as u32).collect();
        rank_to_ad.shuffle(&mut rng);
        Ok(Self {
            index,
            config,
            rng,
            zipf,
            rank_to_ad,
            id_prefix: format!("{run_id}-").into_bytes().into_boxed_slice(),
            next_seq: 0,
            next_bad: 0,
            recent: Vec::with_capacity(RECENT),
            recent_next: 0,
            format: InputFormat::Ndjson,
            scratch: Vec::new(),
        })
    }

    /// Appends `events` events to `out` as NDJSON (no trailing newline) and
    /// notes in `batch` what they were.
    pub fn write_message(
        &mut self,
        events: usize,
        now_ms: i64,
        out: &mut BytesMut,
        batch: &mut Batch,
    ) {
        self.start_message(out);
        for i in 0..events {
            if i > 0 && self.format == InputFormat::Ndjson {
                out.put_u8(b'\n');
            }
            if self.config.bad_rate > 0.0 && self.rng.random_bool(self.config.bad_rate) {
                let kind =
                    self.config.bad_kinds[self.rng.random_range(0..self.config.bad_kinds.len())];
                self.write_bad(kind, now_ms, out);
                batch.bad[kind as usize] += 1;
            } else if !self.recent.is_empty()
                && self.config.duplicate_rate > 0.0
                && self.rng.random_bool(self.config.duplicate_rate)
            {
                let event = self.recent[self.rng.random_range(0..self.recent.len())];
                self.write_good(&event, out);
                batch.good.push(event);
                batch.duplicates += 1;
            } else {
                let event = GoodEvent {
                    seq: self.next_seq,
                    ad: self.sample_ad(),
                    cost: self.config.cost.sample(&mut self.rng),
                    ts: self.sample_ts(now_ms),
                };
                self.next_seq += 1;
                self.write_good(&event, out);
                batch.good.push(event);
                if self.recent.len() < RECENT {
                    self.recent.push(event);
                } else {
                    self.recent[self.recent_next] = event;
                    self.recent_next = (self.recent_next + 1) % RECENT;
                }
            }
            batch.events += 1;
        }
    }

    fn sample_ad(&mut self) -> u32 {
        let rank = self.zipf.sample(&mut self.rng) as usize;
        self.rank_to_ad[rank.clamp(1, self.rank_to_ad.len()) - 1]
    }

    fn sample_ts(&mut self, now_ms: i64) -> i64 {
        match self.config.event_time {
            EventTime::Now => now_ms,
            EventTime::Last(span) => {
                let span = i64::try_from(span.as_millis()).unwrap_or(i64::MAX).max(1);
                now_ms.saturating_sub(self.rng.random_range(0..span))
            }
            EventTime::Range { start_ms, end_ms } => self.rng.random_range(start_ms..end_ms),
        }
    }

    fn write_good(&mut self, event: &GoodEvent, out: &mut BytesMut) {
        if self.format == InputFormat::Binary {
            return self.write_good_binary(event, out);
        }
        out.put_slice(b"{\"id\":\"");
        out.put_slice(&self.id_prefix);
        put_u64(out, event.seq);
        out.put_slice(b"\",\"ad_id\":");
        out.put_slice(self.index.ad_json[event.ad as usize].as_bytes());
        out.put_slice(b",\"cost_micros\":");
        put_u64(out, event.cost);
        out.put_slice(b",\"ts\":");
        put_i64(out, event.ts);
        out.put_u8(b'}');
    }

    /// Writes one line with exactly one defect, of the given kind. Bad lines
    /// have ids of their own (`<run id>-x<n>`), never a good impression's.
    fn write_bad(&mut self, kind: BadKind, now_ms: i64, out: &mut BytesMut) {
        let n = self.next_bad;
        self.next_bad += 1;
        let ad = self.sample_ad();
        let ad = self.index.ad_json[ad as usize].clone();
        let cost = self.config.cost.sample(&mut self.rng).max(1);
        let ts = self.sample_ts(now_ms);
        let mut id = Vec::with_capacity(MAX_ID_BYTES + 32);
        id.extend_from_slice(&self.id_prefix);
        id.push(b'x');
        id.extend_from_slice(n.to_string().as_bytes());
        match kind {
            BadKind::InvalidJson => match self.rng.random_range(0..3) {
                0 => {
                    // Cut off mid-object, as a truncated write would be.
                    put_fields(out, &id, &ad, None, None);
                    out.truncate(out.len() - 1);
                    out.put_slice(b",\"cost_micros\":");
                }
                1 => {
                    out.put_slice(b"not json ");
                    out.put_slice(&id);
                }
                _ => {
                    // A missing comma between two fields.
                    out.put_slice(b"{\"id\":\"");
                    out.put_slice(&id);
                    out.put_slice(b"\" \"ad_id\":");
                    out.put_slice(ad.as_bytes());
                    out.put_slice(b",\"cost_micros\":");
                    put_u64(out, cost);
                    out.put_slice(b",\"ts\":");
                    put_i64(out, ts);
                    out.put_u8(b'}');
                }
            },
            BadKind::MissingField => {
                let missing = self.rng.random_range(0..4);
                out.put_u8(b'{');
                let mut fields: Vec<Vec<u8>> = Vec::with_capacity(4);
                fields.push([b"\"id\":\"", &id[..], b"\""].concat());
                fields.push([b"\"ad_id\":", ad.as_bytes()].concat());
                fields.push(format!("\"cost_micros\":{cost}").into_bytes());
                fields.push(format!("\"ts\":{ts}").into_bytes());
                fields.remove(missing);
                out.put_slice(&fields.join(&b","[..]));
                out.put_u8(b'}');
            }
            BadKind::NegativeCost => {
                put_fields(out, &id, &ad, Some(format!("-{cost}").as_bytes()), Some(ts));
            }
            BadKind::FractionalCost => {
                put_fields(
                    out,
                    &id,
                    &ad,
                    Some(format!("{cost}.5").as_bytes()),
                    Some(ts),
                );
            }
            BadKind::CostTooLarge => {
                put_fields(
                    out,
                    &id,
                    &ad,
                    Some(u64::MAX.to_string().as_bytes()),
                    Some(ts),
                );
            }
            BadKind::IdTooLong => {
                let len = self.rng.random_range(MAX_ID_BYTES + 1..=MAX_ID_BYTES + 32);
                id.push(b'-');
                id.resize(len.max(id.len()), b'z');
                put_fields(out, &id, &ad, Some(cost.to_string().as_bytes()), Some(ts));
            }
            BadKind::UnknownAd => {
                let mut unknown = format!("no-such-ad-{n}");
                while self.index.ad_by_id.contains_key(&unknown) {
                    unknown.push('x');
                }
                let unknown = format!("\"{unknown}\"").into_boxed_str();
                put_fields(
                    out,
                    &id,
                    &unknown,
                    Some(cost.to_string().as_bytes()),
                    Some(ts),
                );
            }
        }
    }
}

/// `{"id":…,"ad_id":…[,"cost_micros":…][,"ts":…]}` with the cost given as raw
/// JSON text, so that bad values can be written too.
fn put_fields(out: &mut BytesMut, id: &[u8], ad_json: &str, cost: Option<&[u8]>, ts: Option<i64>) {
    out.put_slice(b"{\"id\":\"");
    out.put_slice(id);
    out.put_slice(b"\",\"ad_id\":");
    out.put_slice(ad_json.as_bytes());
    if let Some(cost) = cost {
        out.put_slice(b",\"cost_micros\":");
        out.put_slice(cost);
    }
    if let Some(ts) = ts {
        out.put_slice(b",\"ts\":");
        put_i64(out, ts);
    }
    out.put_u8(b'}');
}
