//! The pacer: aggregator pushes → budget state → answers for bidders.
//!
//! [`input`] hears the NATS side: the sums pushes, folded into
//! [`pacing::SpendState`] (never backwards, fenced owners dropped, silent
//! shards marked stale), and the limiters' per-source reports. [`pacing`]
//! holds that state with each limit's controller and the traffic shape, and
//! turns it and the catalog's budgets into verdicts and decisions; the
//! ticker here advances it every second. [`http`] answers `/v1/limits`,
//! `/v1/decisions`, `/v1/leases`, `/v1/sources` and `/v1/alerts` and serves
//! the dashboard, behind optional bearer tokens, with JSON errors, on
//! listeners guarded against slow clients and greedy addresses.
//! [`leases`] grants spend leases through the ledger all pacers share.
//! [`regions`], with ADSPEND_REGION set, splits each budget among the
//! regions of a deployment and caps this region's grants at its allotment.
//! [`alerts`] announces budget alerts from the held spend, follows them for
//! `/v1/alerts` and delivers them to the optional webhook.

pub mod alerts;
mod config;
mod error;
pub mod http;
mod input;
mod leases;
pub mod pacing;
pub mod regions;
pub(crate) mod telemetry;

use std::net::SocketAddr;
use std::sync::Arc;

use adspend_common::nats;
use adspend_common::service::{self, Context, Service};
use tokio::net::TcpListener;
use tokio::sync::RwLock;
use tokio_util::sync::CancellationToken;

pub use config::{Config, Validated};
pub use error::Error;

use crate::telemetry::{PACER_INPUT_LAG_SECONDS, PACER_STALE_LIMITS, PACER_STALE_SHARDS};

/// The pacer's sockets, bound before it connects to anything (tests bind
/// port 0 and read the port back).
pub struct Listeners {
    /// The API, the dashboard, `/healthz` and `/metrics`.
    pub api: TcpListener,
    /// Only `/healthz` and `/metrics`, when ADSPEND_PACER_OPS_ADDR is set.
    pub ops: Option<TcpListener>,
}

impl Service for Validated {
    const NAME: &'static str = "pacer";
    const HISTOGRAMS: adspend_common::telemetry::Histograms = telemetry::HISTOGRAMS;
    type Config = Config;
    type Listeners = Listeners;
    type Error = Error;

    fn validate(config: Config) -> Result<Self, Error> {
        Ok(config.validate()?)
    }

    fn metrics_addr(&self) -> SocketAddr {
        self.settings.metrics_addr
    }

    async fn bind(&self) -> Result<Listeners, Error> {
        let api = service::bind("pacer API", self.settings.api_addr).await?;
        let ops = match self.settings.ops_addr {
            Some(ops) => Some(service::bind("pacer operations", ops).await?),
            None => None,
        };
        Ok(Listeners { api, ops })
    }

    async fn run(self, listeners: Listeners, context: Context) -> Result<(), Error> {
        run(self, listeners, context).await
    }
}

impl service::Failure for Error {
    fn common(&self) -> Option<&adspend_common::Error> {
        match self {
            Error::Common(e) => Some(e),
            _ => None,
        }
    }
}

/// Serve on `listeners` until `context.shutdown`.
pub async fn run(
    validated: Validated,
    listeners: Listeners,
    context: Context,
) -> Result<(), Error> {
    let Validated {
        config,
        settings,
        catalog: source,
    } = validated;
    let Context { shutdown, tasks } = context;
    adspend_common::telemetry::describe(telemetry::DESCRIPTIONS, telemetry::HISTOGRAMS);
    let addr = listeners.api.local_addr().unwrap_or(settings.api_addr);
    let catalog = source.clone().watch(shutdown.clone(), &tasks).await?;
    let client = nats::connect(&config.nats, "adspend-pacer").await?;
    let pushes = input::ingest::subscribe(&client).await?;
    let source_reports = input::sources::subscribe(&client).await?;
    let reports = Arc::new(std::sync::Mutex::new(
        input::sources::SourceReports::default(),
    ));
    tasks.spawn(input::sources::run(
        source_reports,
        reports.clone(),
        shutdown.clone(),
    ));
    let spend = Arc::new(RwLock::new(pacing::SpendState {
        stale_after_ms: config.stale_after_ms as i64,
        listening_since_ms: Some(adspend_common::now_ms()),
        algorithm: config.algorithm,
        ..pacing::SpendState::default()
    }));
    let regions = settings.regions.as_ref().map(regions::Regions::new);
    let leases = leases::start(
        client.clone(),
        config.streams.replicas(),
        config.lease_grace_ms as i64,
        leases::Inputs {
            spend: spend.clone(),
            catalog: catalog.clone(),
            regions: regions.clone(),
        },
        &tasks,
        shutdown.clone(),
    )
    .await;
    if let (Some(book), Some(region_settings)) = (&regions, &settings.regions) {
        let start = regions::Start {
            client: client.clone(),
            replicas: config.streams.replicas(),
            settings: region_settings.clone(),
            spend: spend.clone(),
            catalog: catalog.clone(),
            held: {
                let leases = leases.clone();
                Box::new(move |read| {
                    let ledger = leases.ledger();
                    read(&|limit| ledger.held(limit));
                })
            },
        };
        regions::start(book, start, &tasks, shutdown.clone()).await?;
    }
    tasks.spawn(input::ingest::run(
        client.clone(),
        pushes,
        spend.clone(),
        catalog.clone(),
        Some(leases.clone()),
        shutdown.clone(),
    ));
    let alerts = alerts::Recent::default();
    alerts::start(
        client.clone(),
        settings.alerts.clone(),
        spend.clone(),
        catalog.clone(),
        alerts.clone(),
        &tasks,
        shutdown.clone(),
    )
    .await?;
    tasks.spawn(ticker(
        spend.clone(),
        reports.clone(),
        catalog.clone(),
        leases.clone(),
        shutdown.clone(),
    ));
    let scope = |scope| {
        if settings.auth.required(scope) {
            "token"
        } else {
            "open"
        }
    };
    tracing::info!(
        addr = %addr,
        https = ?settings.tls.as_ref().map(|https| &https.cert),
        ops_addr = ?listeners.ops.as_ref().and_then(|l| l.local_addr().ok()),
        catalog = source.describe(),
        read = scope(http::auth::Scope::Read),
        decide = scope(http::auth::Scope::Decide),
        max_connections = settings.http.max_connections,
        max_connections_per_addr = settings.http.max_connections_per_addr,
        max_decision_ids = settings.max_decision_ids,
        request_timeout_ms = settings.http.request_timeout.as_millis() as u64,
        "pacer serving"
    );
    if let Some(listener) = listeners.ops {
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            let served = http::serve(listener, http::ops_router(), settings.http, None, shutdown);
            if let Err(e) = served.await {
                tracing::warn!(error = %e, "operations listener failed");
            }
        });
    }
    let app = http::router(
        http::AppState {
            catalog,
            spend,
            sources: reports,
            alerts,
            max_decision_ids: settings.max_decision_ids,
            leases: Some(leases),
            regions,
        },
        settings.auth.clone(),
    );
    let tls = settings.tls.as_ref().map(|https| https.acceptor.clone());
    let result = http::serve(listeners.api, app, settings.http, tls, shutdown.clone())
        .await
        .map_err(Error::Serve);
    // The ingest, the ticker and the operations listener stop with the API.
    shutdown.cancel();
    tracing::info!("pacer stopped");
    result
}

const TICK: std::time::Duration = std::time::Duration::from_secs(1);
/// A history point every this many ticks.
const HISTORY_EVERY: u64 = 10;

/// Advance the controllers every second; decay the traffic shape hourly.
async fn ticker(
    spend: Arc<RwLock<pacing::SpendState>>,
    reports: Arc<std::sync::Mutex<input::sources::SourceReports>>,
    catalog: tokio::sync::watch::Receiver<Arc<adspend_wire::catalog::Catalog>>,
    leases: leases::Leases,
    shutdown: CancellationToken,
) {
    let gains = pacing::controller::Gains::default();
    let mut interval = tokio::time::interval(TICK);
    let mut ticks: u64 = 0;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = interval.tick() => {}
        }
        ticks += 1;
        let catalog = catalog.borrow().clone();
        let input_lag_ms = reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .input_lag_ms(adspend_common::now_ms());
        let mut state = spend.write().await;
        state.set_input_lag(input_lag_ms);
        let record = ticks % HISTORY_EVERY == 1;
        pacing::tick(
            &mut state,
            &catalog,
            chrono::Utc::now(),
            TICK.as_secs_f64() / 60.0,
            record,
            &gains,
        );
        if ticks.is_multiple_of(3600) {
            state.shape.decay(0.96);
        }
        let now = chrono::Utc::now();
        let stale_shards = state.mark_stale_shards(now.timestamp_millis());
        let stale_limits = pacing::stale_limits(&state, &catalog, now);
        // Leases retire once every shard has caught up past their expiry
        // plus the grace.
        let caught_up_ms = state.shards.values().map(|s| s.watermark_ms).min();
        drop(state);
        if let Some(caught_up_ms) = caught_up_ms {
            leases.retire(caught_up_ms);
        }
        metrics::gauge!(PACER_STALE_SHARDS).set(stale_shards as f64);
        metrics::gauge!(PACER_STALE_LIMITS).set(stale_limits as f64);
        metrics::gauge!(PACER_INPUT_LAG_SECONDS).set(input_lag_ms as f64 / 1000.0);
    }
}
