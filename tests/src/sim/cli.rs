//! The `adsim` command line's settings, kept in the library (as the
//! services keep their `Config`) so that the binary stays a thin shell.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{BadKind, CatalogSpec, CostDistribution, EventTime, Progress, SimConfig, Stats};

/// `adsim catalog`.
#[derive(Debug, Args)]
pub struct CatalogArgs {
    /// Output file.
    #[arg(long, env = "ADSIM_CATALOG_OUT", default_value = "catalog.json")]
    pub out: PathBuf,
    /// Number of ads; the other levels default to a shape derived from it.
    #[arg(long, env = "ADSIM_ADS", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub ads: u32,
    /// Number of ad sets [default: ads / 5].
    #[arg(long, env = "ADSIM_ADSETS")]
    pub adsets: Option<u32>,
    /// Number of campaigns [default: ad sets / 4].
    #[arg(long, env = "ADSIM_CAMPAIGNS")]
    pub campaigns: Option<u32>,
    /// Number of accounts [default: campaigns / 5].
    #[arg(long, env = "ADSIM_ACCOUNTS")]
    pub accounts: Option<u32>,
    /// Seed of every random choice: one seed, one catalog.
    #[arg(long, env = "ADSIM_SEED", default_value_t = 1)]
    pub seed: u64,
}

/// `adsim run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// NATS server(s) to publish to.
    #[arg(long, env = "ADSIM_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// Catalog to draw ads from (see `adsim catalog`).
    #[arg(long, env = "ADSIM_CATALOG", default_value = "catalog.json")]
    pub catalog: PathBuf,
    /// Where to write the truth of the acknowledged events.
    #[arg(long, env = "ADSIM_TRUTH_OUT", default_value = "truth.json")]
    pub truth_out: PathBuf,
    /// Events to send, duplicates and bad ones included; 0 = no limit.
    #[arg(long, env = "ADSIM_EVENTS", default_value_t = 10_000)]
    pub events: u64,
    /// Stop after this long (e.g. 30s, 5m), if the events are not all sent.
    #[arg(long, env = "ADSIM_DURATION", value_parser = super::parse_duration)]
    pub duration: Option<Duration>,
    /// Target events per second; 0 = as fast as possible.
    #[arg(long, env = "ADSIM_RATE", default_value_t = 0.0)]
    pub rate: f64,
    /// Zipf exponent of ad popularity; 0 = uniform.
    #[arg(long, env = "ADSIM_ZIPF", default_value_t = 1.0)]
    pub zipf: f64,
    /// Cost in micros: MIN..=MAX, log-uniform:MIN..=MAX or a fixed N.
    #[arg(long, env = "ADSIM_COST", default_value = "100..=5000000")]
    pub cost: CostDistribution,
    /// Share of events that re-send an earlier impression verbatim.
    #[arg(long, env = "ADSIM_DUPLICATE_RATE", default_value_t = 0.0)]
    pub duplicate_rate: f64,
    /// Share of events that are bad lines.
    #[arg(long, env = "ADSIM_BAD_RATE", default_value_t = 0.0)]
    pub bad_rate: f64,
    /// Comma-separated bad-event kinds to mix.
    #[arg(
        long,
        env = "ADSIM_BAD_KINDS",
        value_delimiter = ',',
        default_value = "invalid_json,missing_field,negative_cost,fractional_cost,id_too_long,unknown_ad"
    )]
    pub bad_kinds: Vec<BadKind>,
    /// Events per message, as NDJSON; 1 = one JSON object per message.
    #[arg(long, env = "ADSIM_BATCH", default_value_t = 100)]
    pub batch: usize,
    /// Event timestamps: now, last:<duration> or range:<from>..<to>.
    #[arg(long, env = "ADSIM_EVENT_TIME", default_value = "now")]
    pub event_time: EventTime,
    /// Seed of every random choice of the events (not of the run id).
    #[arg(long, env = "ADSIM_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Subject to publish to, under `impressions.`.
    #[arg(long, env = "ADSIM_SUBJECT", default_value = "impressions.sim")]
    pub subject: String,
    /// Impression id prefix; random by default so runs never share ids.
    #[arg(long, env = "ADSIM_RUN_ID")]
    pub run_id: Option<String>,
    /// Messages awaiting their JetStream ack, at most.
    #[arg(long, env = "ADSIM_IN_FLIGHT", default_value_t = 256)]
    pub in_flight: usize,
}

impl CatalogArgs {
    pub fn spec(&self) -> CatalogSpec {
        let shape = CatalogSpec::for_ads(self.ads);
        CatalogSpec {
            accounts: self.accounts.unwrap_or(shape.accounts),
            campaigns: self.campaigns.unwrap_or(shape.campaigns),
            adsets: self.adsets.unwrap_or(shape.adsets),
            ads: self.ads,
        }
    }
}

impl RunArgs {
    pub fn sim_config(&self) -> SimConfig {
        SimConfig {
            subject: self.subject.clone(),
            events: (self.events > 0).then_some(self.events),
            duration: self.duration,
            rate: self.rate,
            zipf_exponent: self.zipf,
            cost: self.cost,
            duplicate_rate: self.duplicate_rate,
            bad_rate: self.bad_rate,
            bad_kinds: self.bad_kinds.clone(),
            batch: self.batch,
            event_time: self.event_time,
            seed: self.seed,
            run_id: self.run_id.clone(),
            in_flight: self.in_flight,
            ..SimConfig::default()
        }
    }
}

/// The once-a-second line `adsim run` prints.
pub fn progress_line(p: &Progress) -> String {
    format!(
        "{:6.1}s {} events sent ({:.0}/s), {} acks pending, {} failed",
        p.elapsed.as_secs_f64(),
        p.events_sent,
        p.recent_rate,
        p.acks_pending,
        p.messages_failed
    )
}

/// The final line of `adsim run`.
pub fn summary_line(s: &Stats) -> String {
    let bad: u64 = s.bad_events_sent.values().sum();
    format!(
        "{} events ({} unique acked, {} duplicates, {} bad) in {:.2}s = {:.0} events/s; \
         messages {} published, {} acked, {} failed",
        s.events_sent,
        s.unique_events,
        s.duplicates_sent,
        bad,
        s.elapsed_ms as f64 / 1000.0,
        s.events_per_sec,
        s.messages_published,
        s.messages_acked,
        s.messages_failed,
    )
}
