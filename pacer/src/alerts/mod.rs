//! Budget alerts: each crossing of a limit's alert threshold within a
//! period announced exactly once on `ALERTS` (`adspend.alerts.<limit id>`),
//! listed on `GET /v1/alerts` and optionally delivered to a webhook.
//!
//! Every pacer watches the spend it holds ([`detect`]): a threshold the
//! current (or previous) period's spend has reached and that no alert
//! covers yet goes through a bounded queue to [`announce`], which compares
//! with the subject's last alert and publishes with a deterministic message
//! id and the expected last subject sequence, so that several pacers, a
//! restarted one, or the same one twice, announce a crossing once
//! (docs/BUDGET-ALERTS.md says why the pacers and not the aggregators). [`recent`]
//! follows the stream for the API and the dashboard and tells [`detect`]
//! what other pacers announced; [`webhook`] delivers from a durable
//! consumer that all pacers share, signed, retried with backoff.

mod announce;
mod detect;
pub(crate) mod recent;
mod retention;
pub mod webhook;

use std::sync::Arc;

use adspend_wire::catalog::Catalog;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch, RwLock};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::pacing::state::SpendState;

pub use recent::Recent;

/// Alerts published (`outcome`: published, covered (already announced),
/// failed (given up for now; detected again on the next pass)).
pub(crate) const ALERTS_ANNOUNCED_TOTAL: &str = "adspend_alerts_announced_total";
/// Webhook deliveries by outcome (delivered, retried, given_up).
pub(crate) const ALERTS_WEBHOOK_TOTAL: &str = "adspend_alerts_webhook_total";
/// Alerts purged from `ALERTS` past `ADSPEND_ALERTS_RETENTION_MS`.
pub(crate) const ALERTS_PURGED_TOTAL: &str = "adspend_alerts_purged_total";

/// The alert metrics' help texts.
pub(crate) const DESCRIPTIONS: &[(&str, &str)] = &[
    (
        ALERTS_ANNOUNCED_TOTAL,
        "Budget alert announcements, by outcome (published, covered, failed).",
    ),
    (
        ALERTS_WEBHOOK_TOTAL,
        "Budget alert webhook deliveries, by outcome (delivered, retried, given_up).",
    ),
    (
        ALERTS_PURGED_TOTAL,
        "Budget alerts purged from ALERTS past their retention (each limit's last stays).",
    ),
];

/// One budget alert, as published on `adspend.alerts.<limit id>` (the
/// CONTRACT's fields, nothing else).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Alert {
    pub(crate) limit_id: String,
    /// As `GET /v1/limits` renders it; `null` for a lifetime limit.
    pub(crate) period_start: Option<String>,
    pub(crate) threshold_percent: u16,
    /// The period's spend when the crossing was seen.
    pub(crate) spend_micros: u64,
    pub(crate) budget_micros: u64,
    pub(crate) at_ms: i64,
}

impl Alert {
    /// The crossing's identity: its JetStream message id and the webhook's
    /// `X-Adspend-Alert-Id`. The same crossing always gets the same id,
    /// whoever sees it and when.
    pub(crate) fn id(&self) -> String {
        alert_id(
            &self.limit_id,
            self.period_start.as_deref(),
            self.threshold_percent,
        )
    }

    /// Whether this alert, already on the stream, means `other` was
    /// announced too: same limit and period, a threshold at least as high
    /// (one announcer publishes a period's thresholds in ascending order).
    pub(crate) fn covers(&self, other: &Alert) -> bool {
        self.limit_id == other.limit_id
            && self.period_start == other.period_start
            && self.threshold_percent >= other.threshold_percent
    }
}

pub(crate) fn alert_id(limit_id: &str, period_start: Option<&str>, threshold: u16) -> String {
    format!(
        "alert/{limit_id}/{}/{threshold}",
        period_start.unwrap_or("lifetime")
    )
}

/// Settings of the alerts.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) stream_replicas: usize,
    pub(crate) webhook: Option<webhook::Target>,
    /// How long alerts stay on `ALERTS` (each limit's last stays).
    pub(crate) retention: std::time::Duration,
}

/// Start detection, announcement, the stream follower and (when set) the
/// webhook on `tasks`; all stop with `shutdown`. The stream is created
/// here, so NATS must be reachable.
pub(crate) async fn start(
    client: async_nats::Client,
    settings: Settings,
    spend: Arc<RwLock<SpendState>>,
    catalog: watch::Receiver<Arc<Catalog>>,
    recent: Recent,
    tasks: &TaskTracker,
    shutdown: CancellationToken,
) -> Result<(), crate::error::Error> {
    adspend_common::telemetry::describe(DESCRIPTIONS, &[]);
    let js = async_nats::jetstream::new(client);
    let stream = adspend_common::nats::ensure_alerts(&js, settings.stream_replicas).await?;
    let marks = detect::Marks::shared();
    let (tx, rx) = mpsc::channel(announce::QUEUE);
    let announcer = announce::Announcer::new(js.clone(), stream.clone(), marks.clone());
    tasks.spawn(announcer.run(rx, shutdown.clone()));
    tasks.spawn(detect::run(
        spend,
        catalog,
        marks.clone(),
        tx,
        shutdown.clone(),
    ));
    tasks.spawn(retention::run(
        stream.clone(),
        settings.retention,
        shutdown.clone(),
    ));
    tasks.spawn(recent::follow(
        stream.clone(),
        recent,
        marks,
        shutdown.clone(),
    ));
    if let Some(target) = settings.webhook {
        let consumer = webhook::consumer(&stream).await?;
        tasks.spawn(webhook::run(consumer, target, shutdown));
    }
    Ok(())
}
