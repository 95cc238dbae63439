//! How much of what this limiter published to `SPEND` the aggregators have
//! not applied yet: the fair scheduler's view of the queue *behind* it.
//!
//! Fair rounds alone cannot keep a source's spend fresh when the limiter is
//! faster than the aggregators: a flooding source's tuples then pile up in
//! `SPEND`, which the aggregators apply in stream order, and every other
//! source's tuples wait behind them however fairly the limiter chose. So the
//! limiter counts, per partition, the tuples it published (stream sequence
//! from each publish acknowledgement) that no aggregator has reported as
//! applied (`adspend.progress.<shard>`, [`Progress`], sent by each shard on
//! every push tick and every 10 ms it moved). The bound is a window: sources
//! with a backlog may together take only what is left of it (bound minus
//! that count, in payload bytes at the bytes per tuple seen so far), and
//! nothing once it is spent, while the other sources go through (see
//! `fair::drr`); the flooding source goes on at the rate the aggregators
//! apply.
//!
//! The window itself follows the others' delay. While a backlog is under the
//! window, each round notes when the oldest input message of the *other*
//! sources in it was stored in `IMPRESSIONS`, and the SPEND messages of the
//! round carry that time; when a report shows them applied, that is how
//! long the others' spend took from the stream to the sums. While it (or
//! the age of the oldest tuple still unapplied) is over a target, the window
//! halves, at most once per half target; while it is under half the target,
//! the window grows by a quarter, up to the bound. A backlog thus drains as
//! fast as it can without the others' spend taking longer than about the
//! target, whatever the machine: on shared cores a backlog drained at full
//! speed slows everything else, not only the queue in `SPEND`.
//!
//! Only this limiter's own tuples are counted, and only once some aggregator
//! has reported: without reports (an aggregator that does not send them, or
//! none running yet) nothing is held back. Reports are at most once; a lost
//! one is replaced by the next, and a stale count only holds an offender a
//! little longer, never loses or repeats anything (the input stays in
//! `IMPRESSIONS` until it is pulled).

mod backlog;

use std::sync::{Arc, Mutex};

use std::sync::atomic::{AtomicU64, Ordering};

use adspend_common::nats::{Progress, PROGRESS_SUBJECT_PREFIX};
use adspend_common::now_ms;
use futures::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::Error;
use crate::telemetry::{LIMITER_DOWNSTREAM_QUEUED_TUPLES, LIMITER_DOWNSTREAM_WINDOW_TUPLES};
use backlog::Backlog;
pub use backlog::Window;

/// The backlog shared between the publish path, the reports' subscriber
/// and the scheduler.
#[derive(Clone)]
pub struct Downstream {
    backlog: Arc<Mutex<Backlog>>,
    changed: Arc<Notify>,
    /// Payload bytes of the chunks handed out and not yet published (being
    /// mapped, or waiting their turn): the scheduler's window counts them
    /// as spent, so several chunks in flight do not overshoot it.
    in_flight_bytes: Arc<AtomicU64>,
    /// The window's bound: tuples this limiter may have published and not
    /// yet applied before backlogs wait; 0 turns it off.
    bound: u64,
}

impl Downstream {
    pub fn new(partitions: u32, window: Window) -> Self {
        Downstream {
            backlog: Arc::new(Mutex::new(Backlog::new(partitions, window))),
            changed: Arc::new(Notify::new()),
            in_flight_bytes: Arc::default(),
            bound: window.bound,
        }
    }

    /// Follow the aggregators' reports until `cancel`, from a task on `tasks`.
    pub(crate) async fn follow(
        &self,
        client: &async_nats::Client,
        tasks: &TaskTracker,
        cancel: CancellationToken,
    ) -> Result<(), Error> {
        let subject = format!("{PROGRESS_SUBJECT_PREFIX}.>");
        let mut reports =
            client
                .subscribe(subject.clone())
                .await
                .map_err(|e| Error::Subscribe {
                    subject,
                    source: Box::new(e),
                })?;
        let this = self.clone();
        tasks.spawn(async move {
            loop {
                let message = tokio::select! {
                    _ = cancel.cancelled() => return,
                    m = reports.next() => m,
                };
                let Some(message) = message else { return };
                match Progress::decode(&message.payload) {
                    Ok(progress) => {
                        this.backlog
                            .lock()
                            .expect("backlog lock")
                            .progress(&progress, now_ms());
                        this.changed.notify_waiters();
                    }
                    Err(e) => tracing::debug!(
                        subject = %message.subject,
                        error = %e,
                        "progress report not understood; ignored"
                    ),
                }
            }
        });
        Ok(())
    }

    /// A chunk of `bytes` of input was handed out to be mapped.
    pub(crate) fn dispatched(&self, bytes: u64) {
        self.in_flight_bytes.fetch_add(bytes, Ordering::AcqRel);
    }

    /// A chunk handed out is done with (published, given up, or failed).
    pub(crate) fn completed(&self, bytes: u64) {
        let _ = self
            .in_flight_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(bytes))
            });
    }

    /// Payload bytes handed out and not yet published.
    pub(crate) fn in_flight_bytes(&self) -> u64 {
        self.in_flight_bytes.load(Ordering::Acquire)
    }

    pub(crate) fn published(&self, partition: u32, seq: u64, tuples: u64) {
        if self.bound == 0 {
            return;
        }
        self.backlog
            .lock()
            .expect("backlog lock")
            .published(partition, seq, tuples, now_ms());
    }

    /// What is left of the window, in tuples, and the tuples published
    /// since the start (for the scheduler's bytes per tuple); `None` when
    /// there is no window (turned off, or no aggregator has reported).
    pub(crate) fn window(&self) -> Option<(u64, u64)> {
        let backlog = self.backlog.lock().expect("backlog lock");
        metrics::gauge!(LIMITER_DOWNSTREAM_QUEUED_TUPLES).set(backlog.queued() as f64);
        metrics::gauge!(LIMITER_DOWNSTREAM_WINDOW_TUPLES).set(backlog.limit() as f64);
        (self.bound > 0 && backlog.heard()).then(|| {
            (
                backlog.limit().saturating_sub(backlog.queued()),
                backlog.total(),
            )
        })
    }

    /// A round begins; see [`Backlog::round`].
    pub(crate) fn round(&self, backlog: bool, others_since: Option<i64>) {
        if self.bound == 0 {
            return;
        }
        self.backlog
            .lock()
            .expect("backlog lock")
            .round(backlog, others_since, now_ms());
    }

    /// Resolves at the next report.
    pub(crate) async fn changed(&self) {
        self.changed.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::backlog::all;
    use super::*;

    #[test]
    fn the_window_needs_a_report_and_a_bound() {
        let d = Downstream::new(
            1,
            Window {
                bound: 1_000,
                target: None,
            },
        );
        d.published(0, 1, 300);
        assert_eq!(d.window(), None, "no aggregator has reported yet");
        d.backlog.lock().unwrap().progress(&all(0), now_ms());
        assert_eq!(d.window(), Some((700, 300)));
        d.published(0, 2, 900);
        assert_eq!(d.window(), Some((0, 1_200)), "spent, not negative");
        d.backlog.lock().unwrap().progress(&all(1), now_ms());
        assert_eq!(d.window(), Some((100, 1_200)));
        let off = Downstream::new(1, Window::OFF);
        off.published(0, 1, 500);
        off.backlog.lock().unwrap().progress(&all(0), now_ms());
        assert_eq!(off.window(), None, "a bound of 0 turns it off");
    }
}
