//! The reconcile step, run on every etcd change and every half second:
//! collect partitions whose shard ended, compute this member's assignment,
//! hand over what is assigned elsewhere, stop what is no longer ours, and
//! claim and start what is ours and free.

use std::collections::BTreeSet;
use std::time::Instant;

use crate::checkpoint::record::CheckpointStore;
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use tokio::sync::oneshot;

use super::member::{lease_lost, Kind, Member, Running, Stopping};
use super::{assignment, etcd_err, owner_key, PARTITION_RETRY};
use crate::error::Error;
use crate::shard::{self, Started};
use crate::telemetry::{
    AGGREGATOR_FAILOVER_SECONDS, AGGREGATOR_HANDOVER_SECONDS, AGGREGATOR_OWNED_PARTITIONS,
    AGGREGATOR_REBALANCES_TOTAL,
};

impl Member {
    pub(super) async fn reconcile(&mut self) -> Result<(), Error> {
        self.reap().await?;
        let now = Instant::now();
        self.retry_after.retain(|_, until| *until > now);
        if self.lease.validity.is_revoked() {
            return Err(lease_lost("lease revoked"));
        }
        // Keepalives unanswered: paused, nothing applies here meanwhile.
        let paused = !self.lease.validity.is_valid();
        if paused {
            metrics::gauge!(AGGREGATOR_OWNED_PARTITIONS).set(0.0);
        }
        let members = self.members().await?;
        if !members.contains(&self.ctx.id) {
            return Err(lease_lost("our member key is gone"));
        }
        if paused {
            // Until etcd answers the keeper: nothing to decide now.
            return Ok(());
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
        for (partition, (owner, lease)) in &owners {
            self.last_owner.insert(*partition, (owner.clone(), *lease));
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
                running.shard.abandon();
                running.stopping = Stopping::Abandon;
            } else if !assigned.contains(partition) {
                tracing::info!(partition, "assigned elsewhere; handing over");
                running.shard.hand_over();
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
            // Told before claiming: a member leaving by SIGTERM is off the
            // member list before it lets go, and keeps its lease only until
            // every key it released is claimed, so after our claim its lease
            // may already be revoked.
            let kind = match self.last_owner.get(&partition).cloned() {
                None => Kind::Fresh,
                Some((previous, _)) if previous != self.ctx.id && members.contains(&previous) => {
                    Kind::Handover
                }
                Some((previous, lease))
                    if previous != self.ctx.id && self.lease_alive(lease).await =>
                {
                    Kind::Handover
                }
                Some(_) => Kind::Failover,
            };
            if owner.is_none() {
                if !self.claim(partition).await? {
                    continue;
                }
                adspend_common::failpoint::hit("aggregator.after_claim");
            }
            self.start(partition, kind, since);
        }
        metrics::gauge!(AGGREGATOR_OWNED_PARTITIONS).set(self.running.len() as f64);
        Ok(())
    }

    /// Whether etcd still holds `lease` (a previous owner that released its
    /// key on purpose, not one whose lease expired).
    async fn lease_alive(&self, lease: i64) -> bool {
        let mut etcd = self.ctx.etcd.clone();
        match etcd.lease_time_to_live(lease, None).await {
            Ok(answer) => answer.ttl() > 0,
            Err(_) => false,
        }
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
    pub(super) async fn release(&self, partition: u32) {
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
        let (tx, rx) = oneshot::channel();
        let shard = shard::start(spec, &self.shards, &self.ctx.tasks, Some(tx));
        let started_tx = self.started_tx.clone();
        self.ctx.tasks.spawn(async move {
            if let Ok(started) = rx.await {
                let _ = started_tx.send((partition, started)).await;
            }
        });
        tracing::info!(
            partition,
            kind = kind.as_str(),
            "partition claimed; restoring"
        );
        self.running.insert(
            partition,
            Running {
                shard,
                stopping: Stopping::No,
                kind,
                wanted_since,
            },
        );
    }

    pub(super) fn on_started(&mut self, partition: u32, started: Started) {
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
            .filter(|(_, r)| r.shard.is_finished())
            .map(|(p, _)| *p)
            .collect();
        for partition in finished {
            let Some(running) = self.running.remove(&partition) else {
                continue;
            };
            let result = running.shard.join().await;
            match (result, running.stopping) {
                (Ok(()), Stopping::Handover(asked)) => {
                    self.release(partition).await;
                    metrics::histogram!(AGGREGATOR_HANDOVER_SECONDS, "side" => "release")
                        .record(asked.elapsed().as_secs_f64());
                }
                (Ok(()), _) => {}
                (Err(e @ Error::LeaseLost { .. }), _) => return Err(e),
                (Err(e), _) if e.lost_ownership() => {
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
}

fn format_partitions(partitions: &BTreeSet<u32>) -> String {
    partitions
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}
