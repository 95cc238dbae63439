//! The report loop of one pacer in a region: reads every region's reports
//! from `REGIONS` and merges them into the [`Book`]; every interval, the
//! one pacer of the region that publishes gives what it can spare and
//! publishes the region's report.
//!
//! Of several pacers of one region only one publishes: each publish
//! expects the last sequence of the region's subject it has read, so a
//! pacer that has missed another's report is refused and becomes a reader;
//! a publisher that reads a report of its region it did not publish steps
//! down too. A reader that has read no report of its region for
//! [`TAKEOVER_AFTER_MS`] publishes (the publisher stopped or is cut off).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use adspend_common::nats::regions::REPORT_PARTS_KEPT_WHOLE;
use adspend_wire::catalog::Catalog;
use adspend_wire::regions::{RegionName, RegionReport};
use async_nats::jetstream::{self, consumer, context::PublishErrorKind};
use futures::StreamExt;
use tokio::sync::{watch, RwLock};
use tokio_util::sync::CancellationToken;

use super::book::{Book, Own};
use super::stream;
use super::{RegionSettings, WithHeld};
use super::{
    REGION_HEARD, REGION_LINK_LAG, REGION_LINK_UP, REGION_REPORTS_TOTAL, REGION_REPORT_AGE_SECONDS,
};
use crate::pacing::state::SpendState;

/// A pacer that has read no report of its own region for this long
/// publishes them itself.
pub(crate) const TAKEOVER_AFTER_MS: i64 = 2_000;
/// The failpoint just before a report is published.
pub(crate) const BEFORE_REGION_REPORT: &str = "pacer.before_region_report";
/// How often the publisher checks the links for stalled sources.
const RESUME_EVERY: Duration = Duration::from_secs(2);
/// Stream sequences of this pacer's own publishes remembered, to tell them
/// from another pacer's of the same region.
const MINE_KEPT: usize = 64;

pub(super) struct Runner {
    pub(super) js: jetstream::Context,
    pub(super) replicas: usize,
    pub(super) settings: RegionSettings,
    pub(super) book: Arc<Mutex<Book>>,
    pub(super) spend: Arc<RwLock<SpendState>>,
    pub(super) catalog: watch::Receiver<Arc<Catalog>>,
    pub(super) held: WithHeld,
    pub(super) shutdown: CancellationToken,
    /// This pacer publishes its region's reports (for [`resume_links`]).
    pub(super) publishing: Arc<AtomicBool>,
    /// A report took more parts than `REGIONS` keeps whole (warned once).
    pub(super) warned_parts: AtomicBool,
}

/// What one pass of the loop knows of the region's subject.
#[derive(Default)]
struct Subject {
    /// Stream sequence of the last message on this region's subject read
    /// or published: what the next publish expects.
    last_seq: u64,
    /// This pacer publishes (it has not been refused since it started to).
    publishing: bool,
    mine: VecDeque<u64>,
}

impl Runner {
    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Run until shutdown; a failed pass is logged and started again.
    pub(super) async fn run(self) {
        let started_ms = adspend_common::now_ms();
        loop {
            match self.pass(started_ms).await {
                Ok(()) => return,
                Err(e) => tracing::warn!(error = %e, "region reports interrupted; retrying"),
            }
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    async fn pass(&self, started_ms: i64) -> Result<(), String> {
        let own = &self.settings.region;
        let peers: Vec<RegionName> = self
            .settings
            .regions
            .iter()
            .filter(|r| *r != own)
            .cloned()
            .collect();
        let mut stream = stream::ensure(&self.js, own, &peers, self.replicas)
            .await
            .map_err(|e| e.to_string())?;
        let last = stream
            .info()
            .await
            .map_err(|e| format!("stream {} info: {e}", stream::REGIONS_STREAM))?
            .state
            .last_sequence;
        let consumer = stream
            .create_consumer(consumer::pull::OrderedConfig {
                // No filter: the stream holds only region reports, and
                // those sourced from peers are outside its own subjects.
                deliver_policy: consumer::DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("region reports consumer: {e}"))?;
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| format!("region reports consumer: {e}"))?;
        let own_subject = stream::report_subject(own);
        let mut subject = Subject::default();
        let mut caught_up = last == 0;
        if caught_up {
            self.book().set_ready();
        }
        let mut tick = tokio::time::interval(self.settings.report_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return Ok(()),
                message = messages.next() => {
                    let Some(message) = message else {
                        return Err("region reports consumer ended".into());
                    };
                    let message = message.map_err(|e| format!("region reports consumer: {e}"))?;
                    let seq = message
                        .info()
                        .map_err(|e| format!("region report info: {e}"))?
                        .stream_sequence;
                    if message.subject.as_str() == own_subject {
                        subject.last_seq = subject.last_seq.max(seq);
                        if subject.publishing && !subject.mine.contains(&seq) {
                            tracing::info!(seq, "another pacer of this region publishes its reports; this one reads");
                            subject.publishing = false;
                        }
                    }
                    self.read(message.subject.as_str(), &message.payload);
                    if !caught_up && seq >= last {
                        caught_up = true;
                        self.book().set_ready();
                        tracing::info!(seq, "region reports read up to where they were at start");
                    }
                }
                _ = tick.tick() => {
                    let catalog = self.catalog.borrow().clone();
                    self.book().follow_catalog(&catalog, chrono::Utc::now());
                    self.export_metrics(started_ms);
                    if caught_up {
                        self.report(&own_subject, &mut subject).await?;
                    }
                    self.book().end_interval();
                    self.publishing.store(subject.publishing, Ordering::Relaxed);
                }
            }
        }
    }

    /// Merges one message of the stream, if it is a report of the region
    /// its subject names.
    fn read(&self, subject: &str, payload: &[u8]) {
        let report = match RegionReport::decode(payload) {
            Ok(report) => report,
            Err(e) => {
                tracing::warn!(subject, error = %e, "unreadable region report skipped");
                return;
            }
        };
        if stream::report_subject(&report.region) != subject {
            tracing::warn!(subject, region = %report.region, "region report on another region's subject skipped");
            return;
        }
        self.book().merge(&report);
    }

    /// Publishes this region's report if this pacer is its publisher, or
    /// nobody has published one for [`TAKEOVER_AFTER_MS`].
    async fn report(&self, own_subject: &str, subject: &mut Subject) -> Result<(), String> {
        let now_ms = adspend_common::now_ms();
        let silent = self
            .book()
            .last_heard()
            .get(&self.settings.region)
            .is_none_or(|last| now_ms - last.as_of_ms > TAKEOVER_AFTER_MS);
        if !subject.publishing && !silent {
            return Ok(());
        }
        let (seq, entries) = self.next_report().await;
        let parts = RegionReport::split(&self.settings.region, seq, now_ms, entries);
        if parts.len() > REPORT_PARTS_KEPT_WHOLE && !self.warned_parts.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                parts = parts.len(),
                kept_whole = REPORT_PARTS_KEPT_WHOLE,
                "this region's report takes more parts than REGIONS keeps two whole rounds of: \
                 a pacer restarting may not find all of its own counters (docs/REGIONS.md)"
            );
        }
        adspend_common::failpoint::hit(BEFORE_REGION_REPORT);
        let mut expected = subject.last_seq;
        for part in parts {
            let publish = jetstream::message::PublishMessage::build()
                .payload(part.encode().into())
                .expected_last_subject_sequence(expected);
            let acked = match self.js.send_publish(own_subject.to_string(), publish).await {
                Ok(ack) => ack.await,
                Err(e) => Err(e),
            };
            match acked {
                Ok(ack) => {
                    expected = ack.sequence;
                    subject.mine.push_back(ack.sequence);
                    if subject.mine.len() > MINE_KEPT {
                        subject.mine.pop_front();
                    }
                }
                Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {
                    if subject.publishing {
                        tracing::info!(
                            seq,
                            "another pacer of this region published first; this one reads"
                        );
                    }
                    subject.publishing = false;
                    return Ok(());
                }
                Err(e) => return Err(format!("publish region report: {e}")),
            }
        }
        if !subject.publishing {
            tracing::info!(seq, region = %self.settings.region, "this pacer publishes its region's reports");
        }
        subject.publishing = true;
        subject.last_seq = subject.last_seq.max(expected);
        metrics::counter!(REGION_REPORTS_TOTAL).increment(1);
        Ok(())
    }

    /// Gives what can be spared and takes the next report's entries, with
    /// the spend, the lease ledger and the book locked together (the same
    /// order as the lease committer's: spend, ledger, book).
    async fn next_report(&self) -> (u64, Vec<adspend_wire::regions::LimitEntry>) {
        let catalog = self.catalog.borrow().clone();
        let now = chrono::Utc::now();
        let spend = self.spend.read().await;
        let mut next = None;
        (self.held)(&mut |held| {
            let mut book = self.book();
            book.follow_catalog(&catalog, now);
            let own: HashMap<Arc<str>, Own> = catalog
                .limits_after(None)
                .iter()
                .map(|limit| {
                    let sums = spend.limits.get(&*limit.id);
                    let figures = Own {
                        spend: crate::pacing::period_spend(limit, sums, now),
                        lifetime_spend: sums.map_or(0, |s| s.lifetime_micros),
                        leased: held(&limit.id),
                    };
                    (limit.id.clone(), figures)
                })
                .collect();
            next = Some(book.next_report(&catalog, &own));
        });
        next.unwrap_or_default()
    }

    fn export_metrics(&self, started_ms: i64) {
        let now_ms = adspend_common::now_ms();
        let unheard_ms = self.settings.unheard_after.as_millis() as i64;
        let book = self.book();
        for region in &self.settings.regions {
            let as_of_ms = book
                .last_heard()
                .get(region)
                .map_or(started_ms, |l| l.as_of_ms);
            let age_ms = (now_ms - as_of_ms).max(0);
            let label = region.to_string();
            metrics::gauge!(REGION_REPORT_AGE_SECONDS, "region" => label.clone())
                .set(age_ms as f64 / 1000.0);
            let heard = book.last_heard().contains_key(region) && age_ms <= unheard_ms;
            metrics::gauge!(REGION_HEARD, "region" => label).set(f64::from(u8::from(heard)));
        }
    }
}

/// Exports the state of each peer's link (its source in `REGIONS`) and,
/// while this pacer publishes its region's reports, makes the links to
/// peers that stalled (a cut of more than 10 s, a peer's server restarted)
/// again at once rather than after JetStream's retry backoff
/// (docs/REGIONS.md, "Topology"). Apart from the report loop: probing a
/// peer that does not answer takes a second, which must not delay reports.
pub(super) async fn resume_links(
    js: jetstream::Context,
    publishing: Arc<AtomicBool>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(RESUME_EVERY) => {}
        }
        let mut regions = match js.get_stream(stream::REGIONS_STREAM).await {
            Ok(regions) => regions,
            Err(e) => {
                tracing::warn!(error = %e, "region links not checked");
                continue;
            }
        };
        match stream::regions_sources(&mut regions).await {
            Ok(sources) => {
                for source in &sources {
                    let label = source.region.to_string();
                    metrics::gauge!(REGION_LINK_UP, "region" => label.clone())
                        .set(f64::from(u8::from(source.is_linked())));
                    metrics::gauge!(REGION_LINK_LAG, "region" => label).set(source.lag as f64);
                }
            }
            Err(e) => tracing::warn!(error = %e, "region links not read"),
        }
        if !publishing.load(Ordering::Relaxed) {
            continue;
        }
        match stream::resume_stalled_sources(&js, &mut regions).await {
            Ok(resumed) if !resumed.is_empty() => {
                let resumed: Vec<&str> = resumed.iter().map(|r| r.as_str()).collect();
                tracing::info!(peers = ?resumed, "stalled region links made again");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "region links not checked"),
        }
    }
}
