//! The member's etcd lease: granted at join, kept alive by this process,
//! and mirrored into a [`Validity`] deadline that every shard obeys.
//!
//! etcd counts a lease's TTL in whole seconds; the setting in milliseconds
//! is rounded up. Keepalives go out every third of the TTL; each answered
//! one moves the deadline to the time it was sent plus half the TTL, so a
//! process that stops hearing from etcd (partitioned, or paused and
//! resumed) stops applying well before etcd lets another member take over.
//!
//! A lapsed deadline is a pause, not a loss: the partitions wait with
//! nothing committed, and the keeper keeps asking. etcd's answer decides:
//! the lease still alive (an election, a dead endpoint, a slow answer: the
//! owner keys bound to it still stand, so nobody else can own our
//! partitions) moves the deadline on and everything resumes where it
//! stood; the lease gone revokes the deadline and the member rejoins.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::Client;
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::fence::Validity;
use crate::telemetry::LEASE_PAUSES_TOTAL;

#[derive(Debug, Clone)]
pub(crate) struct Lease {
    pub(crate) id: i64,
    pub(crate) ttl: Duration,
    pub(crate) validity: Arc<Validity>,
}

/// Why [`keep_alive`] returned.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum End {
    Cancelled,
    Lost(String),
}

/// etcd's TTL for a setting: whole seconds, rounded up.
pub(crate) fn ttl_seconds(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis().div_ceil(1000)).unwrap_or(i64::MAX)
}

pub(crate) async fn grant(client: &mut Client, ttl: Duration) -> Result<Lease, Error> {
    let sent = Instant::now();
    let granted = client
        .lease_grant(ttl_seconds(ttl), None)
        .await
        .map_err(|e| Error::Common(adspend_common::Error::etcd("lease grant", "")(e)))?;
    let ttl = Duration::from_secs(u64::try_from(granted.ttl()).unwrap_or(0));
    let validity = Validity::new(Duration::ZERO);
    validity.extend_to(sent + ttl / 2);
    Ok(Lease {
        id: granted.id(),
        ttl,
        validity: Arc::new(validity),
    })
}

/// Keep `lease` alive until `cancel`, or until it is lost: etcd says it
/// expired, or no keepalive was answered before the deadline. On loss the
/// deadline is revoked before this returns.
pub(crate) async fn keep_alive(
    mut client: Client,
    lease: &Lease,
    cancel: CancellationToken,
) -> End {
    let interval = (lease.ttl / 3).max(Duration::from_millis(300));
    let mut channel = None;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let lost = |reason: String| {
        lease.validity.revoke();
        End::Lost(reason)
    };
    let mut pause = Pause::default();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return End::Cancelled,
            _ = ticker.tick() => {}
        }
        pause.look(lease);
        if channel.is_none() {
            match tokio::time::timeout(interval, client.lease_keep_alive(lease.id)).await {
                Ok(Ok(pair)) => channel = Some(pair),
                Ok(Err(e)) => {
                    tracing::warn!(lease = lease.id, error = %e, "lease keepalive channel failed");
                    continue;
                }
                Err(_) => {
                    tracing::warn!(lease = lease.id, "lease keepalive channel timed out");
                    continue;
                }
            }
        }
        let Some((keeper, responses)) = channel.as_mut() else {
            continue;
        };
        let sent = Instant::now();
        let exchange = async {
            keeper.keep_alive().await?;
            responses.message().await
        };
        match tokio::time::timeout(interval, exchange).await {
            Ok(Ok(Some(answer))) if answer.ttl() > 0 => {
                // A lapse that began and ended between two ticks still counts.
                pause.look(lease);
                lease.validity.extend_to(sent + lease.ttl / 2);
                pause.answered(lease);
            }
            Ok(Ok(Some(_))) => return lost("etcd reports the lease expired".into()),
            Ok(Err(e)) if is_lease_gone(&e) => {
                return lost(format!("etcd no longer knows the lease: {e}"))
            }
            Ok(Ok(None)) => {
                tracing::warn!(lease = lease.id, "lease keepalive stream ended; reopening");
                channel = None;
            }
            Ok(Err(e)) => {
                tracing::warn!(lease = lease.id, error = %e, "lease keepalive failed; reopening");
                channel = None;
            }
            Err(_) => {
                tracing::warn!(lease = lease.id, "lease keepalive unanswered; reopening");
                channel = None;
            }
        }
    }
}

/// Whether the partitions are paused for want of an answer, and since when.
#[derive(Default)]
struct Pause {
    since: Option<Instant>,
}

impl Pause {
    /// A lapsed deadline starts a pause (counted and logged once).
    fn look(&mut self, lease: &Lease) {
        if self.since.is_none() && !lease.validity.is_valid() && !lease.validity.is_revoked() {
            self.since = Some(Instant::now());
            metrics::counter!(LEASE_PAUSES_TOTAL).increment(1);
            tracing::warn!(
                lease = lease.id,
                "no keepalive answered within {} ms; partitions pause until etcd answers",
                (lease.ttl / 2).as_millis()
            );
        }
    }

    /// etcd answered that the lease lives: a pause ends.
    fn answered(&mut self, lease: &Lease) {
        if let Some(since) = self.since.take() {
            tracing::info!(
                lease = lease.id,
                paused_ms = since.elapsed().as_millis() as u64,
                "etcd confirmed the lease; partitions resume"
            );
        }
    }
}

/// etcd's answer for a lease it has expired or revoked.
fn is_lease_gone(e: &etcd_client::Error) -> bool {
    e.to_string().contains("requested lease not found")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_rounds_up_to_whole_seconds() {
        assert_eq!(ttl_seconds(Duration::from_millis(2_000)), 2);
        assert_eq!(ttl_seconds(Duration::from_millis(2_001)), 3);
        assert_eq!(ttl_seconds(Duration::from_millis(5_000)), 5);
    }
}
