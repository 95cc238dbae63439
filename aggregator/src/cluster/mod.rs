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

pub mod assignment;
pub mod lease;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use adspend_common::checkpoint::CheckpointStore;
use adspend_common::snapshot_store::SnapshotStore;
use adspend_common::telemetry::{
    AGGREGATOR_FAILOVER_SECONDS, AGGREGATOR_HANDOVER_SECONDS, AGGREGATOR_LEASES_LOST_TOTAL,
    AGGREGATOR_OWNED_PARTITIONS, AGGREGATOR_REBALANCES_TOTAL,
};
use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::error::Error;
use crate::shard::{self, Started};

pub const MEMBERS_PREFIX: &str = "/adspend/members/";
pub const PARTITIONS_PREFIX: &str = "/adspend/partitions/";
/// The partition count every member must agree on.
pub const PARTITION_COUNT_KEY: &str = "/adspend/config/partitions";
/// Reconcile at least this often; etcd watches wake it sooner.
const RECONCILE_EVERY: Duration = Duration::from_millis(500);
const REJOIN_BACKOFF: Duration = Duration::from_secs(1);
/// A partition that stopped on a passing failure is claimed again after this.
const PARTITION_RETRY: Duration = Duration::from_secs(2);

pub fn member_key(id: &str) -> String {
    format!("{MEMBERS_PREFIX}{id}")
}

pub fn owner_key(partition: u32) -> String {
    format!("{PARTITIONS_PREFIX}{partition}/owner")
}

fn etcd_err(op: &'static str, key: &str) -> impl FnOnce(etcd_client::Error) -> Error {
    let key = key.to_string();
    move |e| {
        Error::Common(adspend_common::Error::Etcd {
            op,
            key,
            reason: e.to_string(),
        })
    }
}

/// What every member of this process shares.
struct Context {
    id: String,
    partitions: u32,
    data_dir: PathBuf,
    settings: shard::Settings,
    snapshots: SnapshotStore,
    nats: async_nats::Client,
    etcd: Client,
    ttl: Duration,
}

/// Join, serve, and rejoin after a lost lease, until `shutdown`.
pub async fn run(
    config: &Config,
    snapshots: SnapshotStore,
    nats: async_nats::Client,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let id = config.member_id()?;
    let mut etcd = adspend_common::etcd::connect(&config.etcd.endpoints()).await?;
    agree_on_partition_count(&mut etcd, &id, config.partitions.partitions).await?;
    let context = Arc::new(Context {
        id,
        partitions: config.partitions.partitions,
        data_dir: config.data_dir(),
        settings: config.shard_settings(),
        snapshots,
        nats,
        etcd,
        ttl: config.lease_ttl(),
    });
    let mut first = true;
    loop {
        let mut etcd = context.etcd.clone();
        let lease = match lease::grant(&mut etcd, context.ttl).await {
            Ok(lease) => lease,
            // At start-up an unusable etcd is a configuration problem.
            Err(e) if first => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "rejoining the cluster failed; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(REJOIN_BACKOFF) => continue,
                }
            }
        };
        first = false;
        let member = Member::new(context.clone(), lease);
        match member.serve(shutdown.clone()).await? {
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
    let recorded = response
        .op_responses()
        .into_iter()
        .find_map(|op| match op {
            etcd_client::TxnOpResponse::Get(get) => get
                .kvs()
                .first()
                .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
            _ => None,
        })
        .unwrap_or_default();
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

enum Served {
    Shutdown,
    LeaseLost(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Nobody owned it before.
    Fresh,
    /// Its previous owner is still a member: it released the partition.
    Handover,
    /// Its previous owner's lease is gone.
    Failover,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Fresh => "fresh",
            Kind::Handover => "handover",
            Kind::Failover => "failover",
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Stopping {
    No,
    /// Asked to hand over at this time.
    Handover(Instant),
    Abandon,
}

struct Running {
    stop: shard::Stop,
    task: JoinHandle<Result<(), Error>>,
    stopping: Stopping,
    kind: Kind,
    wanted_since: Instant,
}

/// One membership: one lease, from join to shutdown or loss.
struct Member {
    ctx: Arc<Context>,
    lease: lease::Lease,
    running: BTreeMap<u32, Running>,
    /// Partitions assigned here by the last reconcile.
    assigned: BTreeSet<u32>,
    /// When each assigned partition not yet applying here was first assigned.
    wanted_since: HashMap<u32, Instant>,
    /// The last owner seen for each partition.
    last_owner: HashMap<u32, String>,
    /// Partitions not to claim again before the given time.
    retry_after: HashMap<u32, Instant>,
    started_tx: mpsc::Sender<(u32, Started)>,
    started_rx: mpsc::Receiver<(u32, Started)>,
}

/// A lease lost shows up as this error from the reconcile step.
fn lease_lost(reason: impl Into<String>) -> Error {
    Error::LeaseLost {
        shard: reason.into(),
    }
}

impl Member {
    fn new(ctx: Arc<Context>, lease: lease::Lease) -> Self {
        let (started_tx, started_rx) = mpsc::channel(64);
        Member {
            ctx,
            lease,
            running: BTreeMap::new(),
            assigned: BTreeSet::new(),
            wanted_since: HashMap::new(),
            last_owner: HashMap::new(),
            retry_after: HashMap::new(),
            started_tx,
            started_rx,
        }
    }

    async fn serve(mut self, shutdown: CancellationToken) -> Result<Served, Error> {
        self.join().await?;
        let lost = CancellationToken::new();
        let background = CancellationToken::new();
        let lost_reason = {
            let (etcd, lease, lost, stop) = (
                self.ctx.etcd.clone(),
                self.lease.clone(),
                lost.clone(),
                background.clone(),
            );
            tokio::spawn(async move {
                let end = lease::keep_alive(etcd, &lease, stop).await;
                lost.cancel();
                end
            })
        };
        let changed = Arc::new(Notify::new());
        for prefix in [MEMBERS_PREFIX, PARTITIONS_PREFIX] {
            tokio::spawn(watch_prefix(
                self.ctx.etcd.clone(),
                prefix,
                changed.clone(),
                background.clone(),
            ));
        }
        let mut ticker = tokio::time::interval(RECONCILE_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let outcome = loop {
            tokio::select! {
                _ = shutdown.cancelled() => break Ok(Served::Shutdown),
                _ = lost.cancelled() => break Ok(Served::LeaseLost(String::new())),
                Some((partition, started)) = self.started_rx.recv() => {
                    self.on_started(partition, started);
                    continue;
                }
                _ = changed.notified() => {}
                _ = ticker.tick() => {}
            }
            // Bounded, so a hanging etcd call cannot keep the loop from
            // noticing a lost lease; every step is safe to cut short.
            match tokio::time::timeout(self.ctx.ttl / 2, self.reconcile())
                .await
                .unwrap_or_else(|_| {
                    Err(Error::Common(adspend_common::Error::Etcd {
                        op: "reconcile",
                        key: "/adspend/".into(),
                        reason: "timed out".into(),
                    }))
                }) {
                Ok(()) => {}
                Err(Error::LeaseLost { shard }) => break Ok(Served::LeaseLost(shard)),
                Err(e @ Error::Common(adspend_common::Error::Etcd { .. })) => {
                    tracing::warn!(error = %e, "reconcile failed; retrying");
                }
                Err(e) => break Err(e),
            }
        };
        let outcome = match outcome {
            Ok(Served::Shutdown) => {
                self.leave().await;
                Ok(Served::Shutdown)
            }
            Ok(Served::LeaseLost(reason)) => {
                self.lease.validity.revoke();
                self.stop_all(false).await;
                background.cancel();
                let reason = match lost_reason.await {
                    Ok(lease::End::Lost(why)) => why,
                    _ if reason.is_empty() => "lease lost".into(),
                    _ => reason,
                };
                Ok(Served::LeaseLost(reason))
            }
            Err(e) => {
                self.stop_all(false).await;
                Err(e)
            }
        };
        background.cancel();
        metrics::gauge!(AGGREGATOR_OWNED_PARTITIONS).set(0.0);
        outcome
    }

    /// Put our member key under our lease. A previous incarnation of this id
    /// (a restart within the TTL) is told apart by its lease and revoked, so
    /// its partitions come back without waiting for it to expire.
    async fn join(&mut self) -> Result<(), Error> {
        let key = member_key(&self.ctx.id);
        let mut etcd = self.ctx.etcd.clone();
        let previous = etcd
            .get(key.as_str(), None)
            .await
            .map_err(etcd_err("get", &key))?;
        if let Some(kv) = previous.kvs().first() {
            if kv.lease() != 0 && kv.lease() != self.lease.id {
                tracing::warn!(
                    member = self.ctx.id,
                    previous_lease = kv.lease(),
                    "a previous incarnation of this member id still holds a lease; revoking it \
                     (two live aggregators must never share an id)"
                );
                if let Err(e) = etcd.lease_revoke(kv.lease()).await {
                    tracing::warn!(error = %e, "revoking the previous lease failed; it will expire");
                }
            }
        }
        let value = serde_json::json!({
            "id": self.ctx.id,
            "lease": self.lease.id,
            "joined_ms": adspend_common::now_ms(),
        })
        .to_string();
        etcd.put(
            key.as_str(),
            value,
            Some(PutOptions::new().with_lease(self.lease.id)),
        )
        .await
        .map_err(etcd_err("put", &key))?;
        tracing::info!(
            member = self.ctx.id,
            lease = self.lease.id,
            ttl_ms = self.lease.ttl.as_millis() as u64,
            "joined the cluster"
        );
        Ok(())
    }

    async fn members(&self) -> Result<Vec<String>, Error> {
        let mut etcd = self.ctx.etcd.clone();
        let response = etcd
            .get(MEMBERS_PREFIX, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(etcd_err("get", MEMBERS_PREFIX))?;
        let mut members: Vec<String> = response
            .kvs()
            .iter()
            .filter_map(|kv| kv.key_str().ok())
            .filter_map(|key| key.strip_prefix(MEMBERS_PREFIX))
            .filter(|id| !id.is_empty() && !id.contains('/'))
            .map(str::to_string)
            .collect();
        members.sort();
        members.dedup();
        Ok(members)
    }

    /// partition → (owner id, owner's lease)
    async fn owners(&self) -> Result<BTreeMap<u32, (String, i64)>, Error> {
        let mut etcd = self.ctx.etcd.clone();
        let response = etcd
            .get(PARTITIONS_PREFIX, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(etcd_err("get", PARTITIONS_PREFIX))?;
        let mut owners = BTreeMap::new();
        for kv in response.kvs() {
            let partition = kv
                .key_str()
                .ok()
                .and_then(|k| k.strip_prefix(PARTITIONS_PREFIX))
                .and_then(|k| k.strip_suffix("/owner"))
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(partition) = partition {
                let owner = String::from_utf8_lossy(kv.value()).into_owned();
                owners.insert(partition, (owner, kv.lease()));
            }
        }
        Ok(owners)
    }

    fn holds(&self, owner: Option<&(String, i64)>) -> bool {
        owner.is_some_and(|(id, lease)| *id == self.ctx.id && *lease == self.lease.id)
    }

    async fn reconcile(&mut self) -> Result<(), Error> {
        self.reap().await?;
        let now = Instant::now();
        self.retry_after.retain(|_, until| *until > now);
        if !self.lease.validity.is_valid() {
            return Err(lease_lost("keepalives unanswered"));
        }
        let members = self.members().await?;
        if !members.contains(&self.ctx.id) {
            return Err(lease_lost("our member key is gone"));
        }
        let owners = self.owners().await?;
        let assigned: BTreeSet<u32> =
            assignment::owned_by(self.ctx.partitions, &members, &self.ctx.id)
                .into_iter()
                .collect();
        if assigned != self.assigned {
            metrics::counter!(AGGREGATOR_REBALANCES_TOTAL).increment(1);
            tracing::info!(
                member = self.ctx.id,
                members = members.join(","),
                partitions = format_partitions(&assigned),
                "assignment changed"
            );
            self.assigned = assigned.clone();
            self.wanted_since.retain(|p, _| assigned.contains(p));
        }
        for (partition, (owner, _)) in &owners {
            self.last_owner.insert(*partition, owner.clone());
        }

        // Let go of what is no longer ours.
        for (partition, running) in self.running.iter_mut() {
            if !matches!(running.stopping, Stopping::No) {
                continue;
            }
            let owner = owners.get(partition);
            let held =
                owner.is_some_and(|(id, lease)| *id == self.ctx.id && *lease == self.lease.id);
            if !held {
                tracing::warn!(
                    partition,
                    owner = owner.map_or("none", |o| o.0.as_str()),
                    "owner key is no longer ours; stopping the partition"
                );
                running.stop.abandon();
                running.stopping = Stopping::Abandon;
            } else if !assigned.contains(partition) {
                tracing::info!(partition, "assigned elsewhere; handing over");
                running.stop.hand_over();
                running.stopping = Stopping::Handover(Instant::now());
            }
        }
        // Owner keys we hold for partitions we neither run nor are assigned:
        // a release that failed or was cut short. Let them go now.
        for (partition, owner) in &owners {
            if self.holds(Some(owner))
                && !self.running.contains_key(partition)
                && !assigned.contains(partition)
            {
                self.release(*partition).await;
            }
        }

        // Take what is ours and free.
        for &partition in &assigned {
            if self.running.contains_key(&partition)
                || self
                    .retry_after
                    .get(&partition)
                    .is_some_and(|t| Instant::now() < *t)
            {
                continue;
            }
            let since = *self
                .wanted_since
                .entry(partition)
                .or_insert_with(Instant::now);
            let owner = owners.get(&partition);
            if owner.is_some() && !self.holds(owner) {
                continue; // the previous owner is still letting go
            }
            if owner.is_none() && !self.claim(partition).await? {
                continue;
            }
            let kind = match self.last_owner.get(&partition) {
                None => Kind::Fresh,
                Some(previous) if *previous != self.ctx.id && members.contains(previous) => {
                    Kind::Handover
                }
                Some(_) => Kind::Failover,
            };
            self.start(partition, kind, since);
        }
        metrics::gauge!(AGGREGATOR_OWNED_PARTITIONS).set(self.running.len() as f64);
        Ok(())
    }

    /// Create the owner key, bound to our lease, if nobody holds it.
    async fn claim(&self, partition: u32) -> Result<bool, Error> {
        let key = owner_key(partition);
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                key.as_str(),
                CompareOp::Equal,
                0,
            )])
            .and_then(vec![TxnOp::put(
                key.as_str(),
                self.ctx.id.clone(),
                Some(PutOptions::new().with_lease(self.lease.id)),
            )]);
        let mut etcd = self.ctx.etcd.clone();
        let response = etcd.txn(txn).await.map_err(etcd_err("txn", &key))?;
        Ok(response.succeeded())
    }

    /// Delete our owner key (only if it is still ours, under this lease).
    async fn release(&self, partition: u32) {
        let key = owner_key(partition);
        let txn = Txn::new()
            .when(vec![
                Compare::value(key.as_str(), CompareOp::Equal, self.ctx.id.clone()),
                Compare::lease(key.as_str(), CompareOp::Equal, self.lease.id),
            ])
            .and_then(vec![TxnOp::delete(key.as_str(), None)]);
        let mut etcd = self.ctx.etcd.clone();
        match etcd.txn(txn).await {
            Ok(_) => tracing::info!(partition, "partition released"),
            // The next reconcile finds the key still ours and tries again.
            Err(e) => tracing::warn!(partition, error = %e, "releasing the partition failed"),
        }
    }

    fn start(&mut self, partition: u32, kind: Kind, wanted_since: Instant) {
        let name = format!("p{partition}");
        let spec = shard::Spec {
            name: name.clone(),
            partitions: Some(vec![partition]),
            data_dir: self.ctx.data_dir.join(&name),
            records: CheckpointStore::etcd(self.ctx.etcd.clone(), &name),
            snapshots: self.ctx.snapshots.clone(),
            client: self.ctx.nats.clone(),
            settings: self.ctx.settings.clone(),
            lease: Some(self.lease.validity.clone()),
        };
        let stop = shard::Stop::new(CancellationToken::new());
        let started_tx = self.started_tx.clone();
        let run_stop = stop.clone();
        let task = tokio::spawn(async move {
            let (tx, rx) = oneshot::channel();
            let run = shard::run(spec, run_stop, Some(tx));
            tokio::pin!(run);
            tokio::select! {
                result = &mut run => return result,
                started = rx => {
                    if let Ok(started) = started {
                        let _ = started_tx.send((partition, started)).await;
                    }
                }
            }
            run.await
        });
        tracing::info!(
            partition,
            kind = kind.as_str(),
            "partition claimed; restoring"
        );
        self.running.insert(
            partition,
            Running {
                stop,
                task,
                stopping: Stopping::No,
                kind,
                wanted_since,
            },
        );
    }

    fn on_started(&mut self, partition: u32, started: Started) {
        let Some(running) = self.running.get(&partition) else {
            return;
        };
        self.wanted_since.remove(&partition);
        let took = running.wanted_since.elapsed();
        match running.kind {
            Kind::Handover => metrics::histogram!(AGGREGATOR_HANDOVER_SECONDS, "side" => "take")
                .record(took.as_secs_f64()),
            Kind::Failover => {
                metrics::histogram!(AGGREGATOR_FAILOVER_SECONDS).record(took.as_secs_f64())
            }
            Kind::Fresh => {}
        }
        tracing::info!(
            partition,
            kind = running.kind.as_str(),
            start = started.start.as_str(),
            epoch = started.epoch,
            last_applied_seq = started.last_applied_seq,
            took_ms = took.as_millis() as u64,
            "partition running"
        );
    }

    /// Collect partitions whose shard has ended.
    async fn reap(&mut self) -> Result<(), Error> {
        let finished: Vec<u32> = self
            .running
            .iter()
            .filter(|(_, r)| r.task.is_finished())
            .map(|(p, _)| *p)
            .collect();
        for partition in finished {
            let Some(running) = self.running.remove(&partition) else {
                continue;
            };
            let result = running
                .task
                .await
                .unwrap_or_else(|e| Err(Error::Task("shard", e.to_string())));
            match (result, running.stopping) {
                (Ok(()), Stopping::Handover(asked)) => {
                    self.release(partition).await;
                    metrics::histogram!(AGGREGATOR_HANDOVER_SECONDS, "side" => "release")
                        .record(asked.elapsed().as_secs_f64());
                }
                (Ok(()), _) => {}
                (Err(e @ Error::LeaseLost { .. }), _) => return Err(e),
                (Err(Error::Common(e @ adspend_common::Error::Fenced { .. })), _) => {
                    // A newer owner epoch exists: this partition is not ours.
                    tracing::warn!(partition, error = %e, "partition fenced; letting go");
                    self.release(partition).await;
                }
                (Err(e), _) if e.is_fatal() => return Err(e),
                (Err(e), stopping) => {
                    // Its next owner (maybe us again) restores from the last
                    // recorded checkpoint and replays: nothing is lost.
                    tracing::warn!(partition, error = %e, "partition stopped; releasing it, retrying later");
                    self.release(partition).await;
                    if matches!(stopping, Stopping::No) {
                        self.retry_after
                            .insert(partition, Instant::now() + PARTITION_RETRY);
                    }
                }
            }
        }
        Ok(())
    }

    /// Stop every partition (after a last checkpoint each if `hand_over`)
    /// and wait for them.
    async fn stop_all(&mut self, hand_over: bool) {
        for running in self.running.values() {
            if hand_over {
                running.stop.hand_over();
            } else {
                running.stop.abandon();
            }
        }
        for (partition, running) in std::mem::take(&mut self.running) {
            match running.task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(partition, error = %e, "partition stopped with an error")
                }
                Err(e) => tracing::warn!(partition, error = %e, "partition task failed"),
            }
        }
    }

    /// Shutdown: hand every partition over, then revoke the lease, which
    /// deletes our member and owner keys at once so the others take over
    /// without waiting for the TTL.
    async fn leave(&mut self) {
        self.stop_all(true).await;
        let mut etcd = self.ctx.etcd.clone();
        if let Err(e) = etcd.lease_revoke(self.lease.id).await {
            tracing::warn!(error = %e, "revoking the lease failed; the others take over when it expires");
        }
    }
}

/// Wake `changed` on every change under `prefix`, re-watching after errors.
async fn watch_prefix(
    mut etcd: Client,
    prefix: &'static str,
    changed: Arc<Notify>,
    cancel: CancellationToken,
) {
    loop {
        let watch = etcd.watch(prefix, Some(WatchOptions::new().with_prefix()));
        let stream = tokio::select! {
            _ = cancel.cancelled() => return,
            stream = watch => stream,
        };
        if let Ok(mut stream) = stream {
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    message = stream.message() => match message {
                        Ok(Some(_)) => changed.notify_one(),
                        _ => break,
                    }
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(REJOIN_BACKOFF) => {}
        }
    }
}

fn format_partitions(partitions: &BTreeSet<u32>) -> String {
    partitions
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}
