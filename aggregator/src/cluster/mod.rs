//! Cluster mode: partitions owned through etcd, moved between aggregators.
//!
//! Each aggregator is a member: it holds a lease ([`lease`]) and the key
//! `/adspend/members/<id>` bound to it. Every member reads the member list
//! and computes the same balanced assignment ([`assignment`]). A partition
//! is owned through `/adspend/partitions/<p>/owner`, created only if absent
//! and bound to the owner's lease, and each owned partition runs as a shard
//! of its own ([`crate::shard`], state under `<data dir>/p<p>`, checkpoint
//! record and owner epoch under `/adspend/shards/p<p>/`).
//!
//! - A member that joins takes its share by graceful handover: the old owner
//!   sees the partition assigned elsewhere, stops reading, records a last
//!   checkpoint and deletes its owner key; the new owner, waiting for that
//!   key to go, claims it, takes a new owner epoch and restores from that
//!   checkpoint.
//! - A member whose lease expires loses its keys; the survivors see the new
//!   member list, claim its partitions, restore them from the object store
//!   and replay from their last checkpoints.
//! - The lease is not mutual exclusion: every checkpoint record and every
//!   push carries the partition's owner epoch, and a member stops applying
//!   once its keepalives have gone unanswered for half the TTL.
//!
//! [`run`] joins and rejoins; `member` is one membership (lease, member key,
//! watches, leaving); `reconcile` is the step that moves partitions.

pub(crate) mod assignment;
pub(crate) mod lease;
mod member;
mod reconcile;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::snapshot_store::SnapshotStore;
use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, ShardSettings};
use crate::error::Error;
use crate::telemetry::AGGREGATOR_LEASES_LOST_TOTAL;
use member::{Member, Served};

pub(crate) const MEMBERS_PREFIX: &str = "/adspend/members/";
pub(crate) const PARTITIONS_PREFIX: &str = "/adspend/partitions/";
/// The partition count every member must agree on.
pub(crate) const PARTITION_COUNT_KEY: &str = "/adspend/config/partitions";
/// Reconcile at least this often; etcd watches wake it sooner.
pub(super) const RECONCILE_EVERY: Duration = Duration::from_millis(500);
pub(super) const REJOIN_BACKOFF: Duration = Duration::from_secs(1);
/// How long start-up retries passing etcd errors before giving up.
const START_RETRY: Duration = Duration::from_secs(30);
/// A partition that stopped on a passing failure is claimed again after this.
pub(super) const PARTITION_RETRY: Duration = Duration::from_secs(2);

pub(crate) fn member_key(id: &str) -> String {
    format!("{MEMBERS_PREFIX}{id}")
}

pub(crate) fn owner_key(partition: u32) -> String {
    format!("{PARTITIONS_PREFIX}{partition}/owner")
}

pub(super) fn etcd_err(op: &'static str, key: &str) -> impl FnOnce(etcd_client::Error) -> Error {
    let etcd = adspend_common::Error::etcd(op, key);
    move |e| Error::Common(etcd(e))
}

/// What every member of this process shares.
pub(super) struct Context {
    pub(super) id: String,
    pub(super) partitions: u32,
    pub(super) data_dir: PathBuf,
    pub(super) settings: ShardSettings,
    pub(super) snapshots: SnapshotStore,
    pub(super) nats: async_nats::Client,
    pub(super) etcd: Client,
    pub(super) ttl: Duration,
    /// The process's tracked tasks: partition shards and the lease
    /// keeper and watches, all ended by shutdown.
    pub(super) tasks: TaskTracker,
}

/// Join, serve, and rejoin after a lost lease, until `shutdown`.
pub(crate) async fn run(
    config: &Config,
    id: String,
    snapshots: SnapshotStore,
    nats: async_nats::Client,
    shutdown: CancellationToken,
    tasks: TaskTracker,
) -> Result<(), Error> {
    // The prober of etcd's endpoints lives as long as this member: past
    // shutdown, while the partitions are handed over under the lease.
    let member_ends = CancellationToken::new();
    let _member_ended = member_ends.clone().drop_guard();
    let background = adspend_common::etcd::Background::on(&tasks, member_ends);
    let mut etcd = adspend_common::etcd::connect(&config.etcd, &background).await?;
    // A passing etcd error at start-up (a member restarting, a name not
    // resolvable yet) is retried for a while; a lasting one stops here.
    let started = std::time::Instant::now();
    while let Err(e) = agree_on_partition_count(&mut etcd, &id, config.partitions.partitions).await
    {
        if !e.is_retryable() || started.elapsed() > START_RETRY {
            return Err(e);
        }
        tracing::warn!(error = %e, "reading the partition count failed; retrying");
        tokio::time::sleep(REJOIN_BACKOFF).await;
    }
    // At zero from the start, so an alert on their increase sees the first one.
    metrics::counter!(AGGREGATOR_LEASES_LOST_TOTAL).increment(0);
    metrics::counter!(crate::telemetry::LEASE_PAUSES_TOTAL).increment(0);
    let context = Arc::new(Context {
        id,
        partitions: config.partitions.partitions,
        data_dir: config.data_dir(),
        settings: config.shard_settings(),
        snapshots,
        nats,
        etcd,
        ttl: config.lease_ttl(),
        tasks,
    });
    let mut first = true;
    loop {
        let mut etcd = context.etcd.clone();
        let joined = match lease::grant(&mut etcd, context.ttl).await {
            Ok(lease) => {
                first = false;
                Member::new(context.clone(), lease)
                    .serve(shutdown.clone())
                    .await
            }
            // At start-up an etcd that stays unusable is a configuration
            // problem; a passing error is retried like later ones.
            Err(e) if first && (!e.is_retryable() || started.elapsed() > START_RETRY) => {
                return Err(e)
            }
            Err(e) => Err(e),
        };
        let served = match joined {
            Ok(served) => served,
            // An outage, including an etcd that stalls past the new lease's
            // TTL between the grant and the member key's put ("lease not
            // found"), is a reason to rejoin with a fresh lease, not to stop
            // the aggregator.
            Err(e) if e.is_retryable() => {
                tracing::warn!(member = context.id, error = %e, "rejoining the cluster failed; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(REJOIN_BACKOFF) => continue,
                }
            }
            Err(e) => return Err(e),
        };
        match served {
            Served::Shutdown => {
                tracing::info!(member = context.id, "left the cluster");
                return Ok(());
            }
            Served::LeaseLost(reason) => {
                metrics::counter!(AGGREGATOR_LEASES_LOST_TOTAL).increment(1);
                tracing::warn!(
                    member = context.id,
                    reason,
                    "membership lease lost; partitions stopped, rejoining"
                );
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(REJOIN_BACKOFF) => {}
                }
            }
        }
    }
}

/// Record the partition count on first use; refuse a member that differs
/// (its partitions would not be the others').
async fn agree_on_partition_count(
    etcd: &mut Client,
    id: &str,
    partitions: u32,
) -> Result<(), Error> {
    let txn = Txn::new()
        .when(vec![Compare::create_revision(
            PARTITION_COUNT_KEY,
            CompareOp::Equal,
            0,
        )])
        .and_then(vec![TxnOp::put(
            PARTITION_COUNT_KEY,
            partitions.to_string(),
            None,
        )])
        .or_else(vec![TxnOp::get(PARTITION_COUNT_KEY, None)]);
    let response = etcd
        .txn(txn)
        .await
        .map_err(etcd_err("txn", PARTITION_COUNT_KEY))?;
    if response.succeeded() {
        return Ok(());
    }
    let recorded = adspend_common::etcd::txn_got_value(&response).unwrap_or_default();
    if recorded.trim() == partitions.to_string() {
        Ok(())
    } else {
        Err(Error::Membership {
            id: id.to_string(),
            reason: format!(
                "the cluster has {recorded} partitions ({PARTITION_COUNT_KEY}) but ADSPEND_PARTITIONS={partitions}"
            ),
        })
    }
}
