//! etcd's database size against its quota. etcd keeps every revision of
//! every key until it is compacted, and once its database file passes its
//! quota (`--quota-backend-bytes`, 2 GiB unless set) it raises a `NOSPACE`
//! alarm and refuses every write: checkpoint records, membership leases and
//! catalog updates stop. Every service that uses etcd reads the maintenance
//! status (`db_size`, and `raft_used_db_size`: what is in use once
//! compaction freed space, before a defragmentation returns it) and the
//! alarms every [`EVERY`], exports them with the quota, and logs a `WARN`
//! when the database passes [`WARN_SHARE`] of the quota (and an `INFO` when
//! it is back under).
//!
//! etcd does not report its quota through its API: the quota is the
//! setting `ADSPEND_ETCD_QUOTA_BYTES`, whose default is etcd's own default.

use std::sync::atomic::Ordering;
use std::time::Duration;

use etcd_client::{AlarmAction, AlarmOptions, AlarmType, Client};

use super::Background;
use crate::telemetry::{
    ETCD_DB_SIZE_BYTES, ETCD_DB_SIZE_IN_USE_BYTES, ETCD_NOSPACE_ALARM, ETCD_QUOTA_BYTES,
};

/// Time between two reads of the status.
const EVERY: Duration = Duration::from_secs(30);

/// Share of the quota past which the database is reported as near it.
const WARN_SHARE: f64 = 0.8;

/// Start reading `client`'s status on a service's `background` (not on a
/// client's own: it may be short-lived), unless a client on the same
/// background already does: every client of a service reaches the same
/// cluster. The reader ends with the background's token.
pub(super) fn watch(client: &Client, background: &Background, quota_bytes: u64) {
    if background._owned.is_some() || background.reading_status.swap(true, Ordering::AcqRel) {
        return;
    }
    let mut client = client.clone();
    let stop = background.stop.clone();
    background.tasks.spawn(async move {
        let mut near = false;
        let mut ticks = tokio::time::interval(EVERY);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = ticks.tick() => read(&mut client, quota_bytes, &mut near).await,
            }
        }
    });
}

/// One reading: the gauges, and a log line when the share crossed
/// [`WARN_SHARE`] either way. A failed read is left for the next tick (the
/// services' own etcd calls say loudly when etcd is away).
async fn read(client: &mut Client, quota_bytes: u64, near: &mut bool) {
    metrics::gauge!(ETCD_QUOTA_BYTES).set(quota_bytes as f64);
    let status = match client.status().await {
        Ok(status) => status,
        Err(e) => return tracing::debug!(error = %e, "etcd status not read"),
    };
    let db_size = status.db_size().max(0) as u64;
    let in_use = status.raft_used_db_size().max(0) as u64;
    metrics::gauge!(ETCD_DB_SIZE_BYTES).set(db_size as f64);
    metrics::gauge!(ETCD_DB_SIZE_IN_USE_BYTES).set(in_use as f64);
    let alarm = AlarmOptions::new();
    if let Ok(alarms) = client
        .alarm(AlarmAction::Get, AlarmType::None, Some(alarm))
        .await
    {
        let nospace = alarms
            .alarms()
            .iter()
            .any(|a| a.alarm() == AlarmType::Nospace);
        metrics::gauge!(ETCD_NOSPACE_ALARM).set(f64::from(u8::from(nospace)));
    }
    let share = db_size as f64 / quota_bytes.max(1) as f64;
    if share >= WARN_SHARE && !*near {
        *near = true;
        tracing::warn!(
            db_size,
            in_use,
            quota_bytes,
            "etcd's database is near its quota: once past it etcd refuses every write \
             (checkpoints included); compact and defragment it (docs/OPERATIONS.md, \"etcd\")"
        );
    } else if share < WARN_SHARE && *near {
        *near = false;
        tracing::info!(
            db_size,
            in_use,
            quota_bytes,
            "etcd's database is back under its quota's warning share"
        );
    }
}
