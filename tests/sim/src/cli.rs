//! The `adsim` command line's settings, kept in the library (as the
//! services keep their `Config`) so that the binary stays a thin shell.

use std::path::PathBuf;
use std::time::Duration;

use adspend_common::config::NatsArgs;
use anyhow::Context;
use clap::{Args, ValueEnum};

use super::{
    BadKind, CatalogSpec, CostDistribution, EventTime, InputFormat, LeaseMode, LoopConfig,
    LoopProgress, Progress, ServeMode, SimConfig, Stats,
};

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
    #[command(flatten)]
    pub nats_auth: NatsAuthArgs,
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
    /// Payload format: ndjson, or binary (docs/INPUT.md; no bad events).
    #[arg(long, env = "ADSIM_FORMAT", default_value = "ndjson")]
    pub format: InputFormat,
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

/// How `adsim serve`'s ad servers ask the pacer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// POST /v1/decisions for the requested ads; serve a servable ad with
    /// probability equal to its multiplier.
    Decisions,
    /// Lease spend ahead (POST /v1/leases), at most two live leases per ad
    /// and server; serve only what a lease can pay for before its expiry,
    /// with the lease_id on every impression.
    Leases,
}

/// `adsim serve`: ad servers that ask the pacer before they serve.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// NATS server(s) to publish to.
    #[arg(long, env = "ADSIM_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    #[command(flatten)]
    pub nats_auth: NatsAuthArgs,
    /// The pacer API the servers ask (POST /v1/decisions or /v1/leases).
    #[arg(long, env = "ADSIM_PACER_URL", default_value = "http://127.0.0.1:8080")]
    pub pacer_url: String,
    /// Bearer token of the pacer's decide scope, if it requires one.
    #[arg(long, env = "ADSIM_PACER_TOKEN", hide_env_values = true)]
    pub pacer_token: Option<String>,
    /// Catalog to draw ads from (see `adsim catalog`).
    #[arg(long, env = "ADSIM_CATALOG", default_value = "catalog.json")]
    pub catalog: PathBuf,
    /// Where to write the truth of the acknowledged impressions.
    #[arg(long, env = "ADSIM_TRUTH_OUT", default_value = "truth.json")]
    pub truth_out: PathBuf,
    /// Simulated ad servers, each asking on its own.
    #[arg(long, env = "ADSIM_SERVERS", default_value_t = 4)]
    pub servers: usize,
    /// Wall-clock length of one simulated day (night trough, morning bump,
    /// evening peak).
    #[arg(long, env = "ADSIM_DAY", default_value = "60s", value_parser = super::parse_duration)]
    pub day: Duration,
    /// How long to run [default: one day].
    #[arg(long, env = "ADSIM_DURATION", value_parser = super::parse_duration)]
    pub duration: Option<Duration>,
    /// Ad requests per second, all servers together, at the evening peak.
    #[arg(long, env = "ADSIM_PEAK_RATE", default_value_t = 2000.0)]
    pub peak_rate: f64,
    /// Ads per POST /v1/decisions; in lease mode, the most ads one
    /// POST /v1/leases asks for (a server makes at most one a tick).
    #[arg(long, env = "ADSIM_DECISION_BATCH", default_value_t = 100)]
    pub decision_batch: usize,
    /// How the servers ask the pacer: decisions or leases.
    #[arg(long, env = "ADSIM_MODE", value_enum, default_value = "decisions")]
    pub mode: ModeArg,
    /// Leases: the ttl_ms each lease is asked for (1000..=600000).
    #[arg(long, env = "ADSIM_LEASE_TTL_MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(1_000..=600_000))]
    pub lease_ttl_ms: u64,
    /// Leases: serve nothing under a lease once the server's clock is
    /// within this many ms of its expires_at_ms (at most half the ttl).
    #[arg(long, env = "ADSIM_LEASE_MARGIN_MS", default_value_t = 1_000)]
    pub lease_margin_ms: u64,
    /// Leases: each ask covers the ad's expected spend (its request rate
    /// times the mean cost seen) over this share of a lease's life (ttl
    /// less the margin), and at least one impression at the highest cost.
    #[arg(long, env = "ADSIM_LEASE_ASK_SHARE", default_value_t = 0.5)]
    pub lease_ask_share: f64,
    /// Leases: release each lease let go with something left
    /// (POST /v1/leases/release, saying what was served under it), so the
    /// pacers free the rest at once; false leaves it held until expiry plus
    /// the pacers' grace.
    #[arg(long, env = "ADSIM_LEASE_RELEASE", default_value_t = true, action = clap::ArgAction::Set)]
    pub lease_release: bool,
    /// Hold each served impression back this long before publishing it
    /// (a slow path from ad server to stream; its ts stays the serving time).
    #[arg(long, env = "ADSIM_PUBLISH_DELAY", default_value = "0s", value_parser = super::parse_duration)]
    pub publish_delay: Duration,
    /// Zipf exponent of ad popularity; 0 = uniform.
    #[arg(long, env = "ADSIM_ZIPF", default_value_t = 1.0)]
    pub zipf: f64,
    /// Cost in micros: MIN..=MAX, log-uniform:MIN..=MAX or a fixed N.
    #[arg(long, env = "ADSIM_COST", default_value = "100..=5000000")]
    pub cost: CostDistribution,
    /// Impressions per published message.
    #[arg(long, env = "ADSIM_BATCH", default_value_t = 100)]
    pub batch: usize,
    #[arg(long, env = "ADSIM_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Subject to publish to, under `impressions.`.
    #[arg(long, env = "ADSIM_SUBJECT", default_value = "impressions.loop")]
    pub subject: String,
    /// Impression id prefix; random by default so runs never share ids.
    #[arg(long, env = "ADSIM_RUN_ID")]
    pub run_id: Option<String>,
}

impl ServeArgs {
    pub fn loop_config(&self) -> LoopConfig {
        LoopConfig {
            pacer_url: self.pacer_url.trim_end_matches('/').to_owned(),
            pacer_token: self.pacer_token.clone(),
            servers: self.servers,
            day: self.day,
            duration: self.duration.unwrap_or(self.day),
            peak_rate: self.peak_rate,
            decision_batch: self.decision_batch,
            mode: self.serve_mode(),
            zipf_exponent: self.zipf,
            cost: self.cost,
            publish_delay: self.publish_delay,
            batch: self.batch,
            subject: self.subject.clone(),
            seed: self.seed,
            run_id: self.run_id.clone(),
            // As `adsim run`: the ad servers' user may not create streams.
            create_stream: self.nats_auth.user.is_none(),
            ..LoopConfig::default()
        }
    }

    pub fn serve_mode(&self) -> ServeMode {
        match self.mode {
            ModeArg::Decisions => ServeMode::Decisions,
            ModeArg::Leases => {
                let mut mode = LeaseMode::with_ttl(Duration::from_millis(self.lease_ttl_ms));
                mode.policy.margin = Duration::from_millis(self.lease_margin_ms);
                mode.policy.ask_share = self.lease_ask_share;
                mode.release = self.lease_release;
                ServeMode::Leases(mode)
            }
        }
    }
}

/// The line `adsim serve` prints every few seconds.
pub fn loop_line(p: &LoopProgress) -> String {
    let asked = p.servable + p.not_servable;
    let l = &p.leases;
    let calls = if matches!(p.mode, ServeMode::Leases(_)) {
        format!(
            "{} lease calls ({} failed), {} leases asked, {} granted, {} zero, {:.2} of {:.2} \
             asked granted, {} released, {} requests refused for lack of a lease",
            l.calls,
            l.errors,
            l.asked,
            l.granted,
            l.zero,
            l.micros_granted as f64 / 1e6,
            l.micros_asked as f64 / 1e6,
            l.released,
            l.refused
        )
    } else {
        format!(
            "{} decision calls ({} failed), {} of {} ads servable",
            p.decision_calls, p.decision_errors, p.servable, asked
        )
    };
    format!(
        "{:6.1}s day {:04.1}h: {} requests, {calls}, {} served ({:.2} spent), {} acked",
        p.elapsed.as_secs_f64(),
        p.hour,
        p.requests,
        p.served,
        p.served_micros as f64 / 1e6,
        p.acked
    )
}

/// The final line of `adsim serve`.
pub fn loop_summary(p: &LoopProgress) -> String {
    let l = &p.leases;
    let refused = match p.mode {
        ServeMode::Decisions => format!(
            "{} refused by the pacer, {} decision calls failed",
            p.not_servable, p.decision_errors
        ),
        ServeMode::Leases(_) => format!(
            "{} refused for lack of a lease; {} lease calls ({} failed), {} leases asked, \
             {} granted, {} granted nothing, {:.2} of {:.2} asked granted, {} released in {} calls",
            l.refused,
            l.calls,
            l.errors,
            l.asked,
            l.granted,
            l.zero,
            l.micros_granted as f64 / 1e6,
            l.micros_asked as f64 / 1e6,
            l.released,
            l.release_calls
        ),
    };
    format!(
        "{} requests, {} served for {:.2}, {refused}",
        p.requests,
        p.served,
        p.served_micros as f64 / 1e6
    )
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
            format: self.format,
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

/// NATS credentials and TLS for a secured server (the compose cluster, or
/// deploy/nats-auth.conf), read from the same `ADSPEND_NATS_*` variables as
/// the services', so a role's env file from `scripts/cluster.sh` or
/// `scripts/nats-auth.sh` (`adserver.env`) works as is.
#[derive(Args)]
pub struct NatsAuthArgs {
    /// NATS user (the ad servers' role); needs ADSPEND_NATS_PASSWORD.
    #[arg(long = "nats-user", env = "ADSPEND_NATS_USER")]
    pub user: Option<String>,
    /// Password of the NATS user. Never printed.
    #[arg(
        long = "nats-password",
        env = "ADSPEND_NATS_PASSWORD",
        hide_env_values = true
    )]
    pub password: Option<String>,
    /// PEM CA of the server's certificate; set: TLS is required.
    #[arg(long = "nats-tls-ca", env = "ADSPEND_NATS_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

impl NatsAuthArgs {
    /// Connects to `url` (comma-separated servers) as the services do:
    /// user and password, the user's own inbox prefix, TLS when a CA is set.
    pub async fn connect(&self, url: &str) -> anyhow::Result<async_nats::Client> {
        let nats = NatsArgs {
            nats_user: self.user.clone(),
            nats_password: self.password.clone(),
            nats_tls_ca: self.tls_ca.clone(),
            ..NatsArgs::plain(url)
        };
        let options = adspend_common::nats::options(&nats)?.name("adsim");
        options
            .connect(url)
            .await
            .with_context(|| format!("connecting to NATS at {url}"))
    }
}

/// Written by hand so that the password is never printed.
impl std::fmt::Debug for NatsAuthArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAuthArgs")
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("tls_ca", &self.tls_ca)
            .finish()
    }
}
