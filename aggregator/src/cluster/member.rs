//! One membership of this process: the lease, the member key, the etcd
//! watches that wake the reconcile loop ([`super::reconcile`]), and leaving
//! (hand every partition over, revoke the lease) or losing the lease (stop
//! every partition at once).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions, PutOptions, WatchOptions};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

use super::{
    etcd_err, lease, member_key, Context, MEMBERS_PREFIX, PARTITIONS_PREFIX, RECONCILE_EVERY,
    REJOIN_BACKOFF,
};
use crate::error::Error;
use crate::shard::{self, Started};
use crate::telemetry::AGGREGATOR_OWNED_PARTITIONS;

pub(super) enum Served {
    Shutdown,
    LeaseLost(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Nobody owned it before.
    Fresh,
    /// Its previous owner is still a member: it released the partition.
    Handover,
    /// Its previous owner's lease is gone.
    Failover,
}

impl Kind {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Kind::Fresh => "fresh",
            Kind::Handover => "handover",
            Kind::Failover => "failover",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Stopping {
    No,
    /// Asked to hand over at this time.
    Handover(Instant),
    Abandon,
}

pub(super) struct Running {
    pub(super) shard: shard::ShardHandle,
    pub(super) stopping: Stopping,
    pub(super) kind: Kind,
    pub(super) wanted_since: Instant,
}

/// One membership: one lease, from join to shutdown or loss.
pub(super) struct Member {
    pub(super) ctx: Arc<Context>,
    pub(super) lease: lease::Lease,
    pub(super) running: BTreeMap<u32, Running>,
    /// The parent of every partition's stop token: the member's shards
    /// are one cancellation tree. Not the shutdown token: shutdown hands
    /// partitions over ([`Member::stop_all`]) rather than abandoning them.
    pub(super) shards: CancellationToken,
    /// Partitions assigned here by the last reconcile.
    pub(super) assigned: BTreeSet<u32>,
    /// When each assigned partition not yet applying here was first assigned.
    pub(super) wanted_since: HashMap<u32, Instant>,
    /// The last owner seen for each partition.
    pub(super) last_owner: HashMap<u32, (String, i64)>,
    /// Partitions not to claim again before the given time.
    pub(super) retry_after: HashMap<u32, Instant>,
    pub(super) started_tx: mpsc::Sender<(u32, Started)>,
    pub(super) started_rx: mpsc::Receiver<(u32, Started)>,
}

/// How long a leaving member waits for the others to claim what it released.
const LEAVE_WAIT: Duration = Duration::from_secs(5);

/// A lease lost shows up as this error from the reconcile step.
pub(super) fn lease_lost(reason: impl Into<String>) -> Error {
    Error::LeaseLost {
        shard: reason.into(),
    }
}

impl Member {
    pub(super) fn new(ctx: Arc<Context>, lease: lease::Lease) -> Self {
        let (started_tx, started_rx) = mpsc::channel(64);
        Member {
            ctx,
            lease,
            running: BTreeMap::new(),
            // Not a child of the service's shutdown: on SIGTERM the
            // partitions are handed over one by one (`leave`), not cut.
            shards: CancellationToken::new(),
            assigned: BTreeSet::new(),
            wanted_since: HashMap::new(),
            last_owner: HashMap::new(),
            retry_after: HashMap::new(),
            started_tx,
            started_rx,
        }
    }

    pub(super) async fn serve(mut self, shutdown: CancellationToken) -> Result<Served, Error> {
        self.join().await?;
        // Roots, not children of `shutdown`: the lease must be kept alive
        // while a shutdown hands the partitions over; both end below, on
        // every way out of this function.
        let lost = CancellationToken::new();
        let background = CancellationToken::new();
        let lost_reason = {
            let (etcd, lease, lost, stop) = (
                self.ctx.etcd.clone(),
                self.lease.clone(),
                lost.clone(),
                background.clone(),
            );
            self.ctx.tasks.spawn(async move {
                let end = lease::keep_alive(etcd, &lease, stop).await;
                lost.cancel();
                end
            })
        };
        let changed = Arc::new(Notify::new());
        for prefix in [MEMBERS_PREFIX, PARTITIONS_PREFIX] {
            self.ctx.tasks.spawn(watch_prefix(
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
                    Err(Error::Common(adspend_common::Error::Timeout {
                        what: "etcd reconcile of /adspend/".into(),
                        after: self.ctx.ttl / 2,
                    }))
                }) {
                Ok(()) => {}
                Err(Error::LeaseLost { shard }) => break Ok(Served::LeaseLost(shard)),
                Err(e) if e.is_retryable() => {
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
                // Nothing applies from here on, whatever is still winding down.
                metrics::gauge!(AGGREGATOR_OWNED_PARTITIONS).set(0.0);
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
        adspend_common::failpoint::hit("aggregator.before_join");
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

    pub(super) async fn members(&self) -> Result<Vec<String>, Error> {
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
    pub(super) async fn owners(&self) -> Result<BTreeMap<u32, (String, i64)>, Error> {
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

    pub(super) fn holds(&self, owner: Option<&(String, i64)>) -> bool {
        owner.is_some_and(|(id, lease)| *id == self.ctx.id && *lease == self.lease.id)
    }

    /// Stop every partition (after a last checkpoint each if `hand_over`)
    /// and wait for them; returns those that stopped cleanly.
    pub(super) async fn stop_all(&mut self, hand_over: bool) -> Vec<u32> {
        for running in self.running.values() {
            if hand_over {
                running.shard.hand_over();
            } else {
                running.shard.abandon();
            }
        }
        let mut clean = Vec::new();
        for (partition, running) in std::mem::take(&mut self.running) {
            match running.shard.join().await {
                Ok(()) => clean.push(partition),
                Err(e) => {
                    tracing::warn!(partition, error = %e, "partition stopped with an error")
                }
            }
        }
        clean
    }

    /// Shutdown: leave the member list (the others' assignment now gives
    /// them our partitions), hand every partition over with a last
    /// checkpoint, release each owner key while our lease still lives (so
    /// the receivers count a handover and restore from that checkpoint),
    /// give them a moment to claim, then revoke the lease.
    async fn leave(&mut self) {
        if !self.lease.validity.is_valid() {
            // Paused, etcd unheard: no last checkpoint can be recorded, so
            // the next owner replays from the recorded one.
            self.lease.validity.revoke();
            self.stop_all(false).await;
            return;
        }
        // Off the member list first, so the others' assignment gives them
        // our partitions; the lease (and the owner keys) stay until the
        // last checkpoints are recorded and the keys released.
        let key = member_key(&self.ctx.id);
        let mut etcd = self.ctx.etcd.clone();
        if let Err(e) = etcd.delete(key.as_str(), None).await {
            tracing::warn!(error = %e, "deleting our member key failed; the others take over when the lease goes");
        }
        let handed = self.stop_all(true).await;
        for partition in &handed {
            self.release(*partition).await;
        }
        if !handed.is_empty() {
            self.wait_claimed(&handed).await;
        }
        let mut etcd = self.ctx.etcd.clone();
        if let Err(e) = etcd.lease_revoke(self.lease.id).await {
            tracing::warn!(error = %e, "revoking the lease failed; the others take over when it expires");
        }
    }

    /// Until another member owns each of `partitions`, or [`LEAVE_WAIT`].
    async fn wait_claimed(&self, partitions: &[u32]) {
        let started = Instant::now();
        while started.elapsed() < LEAVE_WAIT {
            match self.owners().await {
                Ok(owners) => {
                    let waiting = partitions
                        .iter()
                        .filter(|p| owners.get(p).is_none_or(|(id, _)| *id == self.ctx.id))
                        .count();
                    if waiting == 0 {
                        tracing::info!(
                            partitions = partitions.len(),
                            took_ms = started.elapsed().as_millis() as u64,
                            "every partition handed over"
                        );
                        return;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "reading the owners while leaving failed"),
            }
            tokio::time::sleep(RECONCILE_EVERY / 5).await;
        }
        tracing::warn!("not every partition was claimed within {LEAVE_WAIT:?}; leaving anyway");
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
