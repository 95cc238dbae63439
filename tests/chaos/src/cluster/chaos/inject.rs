//! Turning a drawn fault into containers, injecting it, healing it: each
//! step confirmed by `docker inspect` before it counts.

use std::time::Duration;

use anyhow::{bail, Context};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use serde_json::Value;

use super::plan::{Action, Target, Template, Verb, SCALED};
use crate::cluster::compose::Cluster;

const AGGREGATORS: [&str; 4] = ["aggregator1", "aggregator2", "aggregator3", SCALED];
const NATS: [&str; 3] = ["nats1", "nats2", "nats3"];
const ETCD: [&str; 3] = ["etcd1", "etcd2", "etcd3"];
/// How long a healed container may take to pass its health check.
const HEALTHY_WITHIN: Duration = Duration::from_secs(90);

/// NATS's JetStream leaders, read from a node's monitoring port.
#[derive(Debug, Clone)]
pub struct NatsLeaders {
    pub meta: String,
    /// Stream name → the server leading it.
    pub streams: Vec<(String, String)>,
}

impl Cluster {
    /// The meta leader and stream leaders, as the first node that answers
    /// on its monitoring port (8222, on the data network) reports them.
    pub async fn nats_leaders(&self) -> anyhow::Result<NatsLeaders> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(3))
            .build()?;
        let mut last = anyhow::anyhow!("no NATS node is running");
        for node in NATS {
            let Ok(state) = self.state(node).await else {
                continue;
            };
            let (true, false, Some(ip)) = (state.running, state.paused, state.data_ip) else {
                continue;
            };
            let url = format!("http://{ip}:8222/jsz?accounts=true&streams=true");
            match fetch_leaders(&http, &url).await {
                Ok(leaders) => return Ok(leaders),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Running (not paused) services among `candidates`.
    async fn running(&self, candidates: &[&str]) -> Vec<String> {
        let mut up = Vec::new();
        for service in candidates {
            if let Ok(state) = self.state(service).await {
                if state.running && !state.paused {
                    up.push((*service).to_owned());
                }
            }
        }
        up
    }
}

async fn fetch_leaders(http: &reqwest::Client, url: &str) -> anyhow::Result<NatsLeaders> {
    let doc: Value = http.get(url).send().await?.json().await?;
    let meta = doc["meta_cluster"]["leader"]
        .as_str()
        .filter(|l| !l.is_empty())
        .with_context(|| format!("{url}: no meta leader"))?
        .to_owned();
    let mut streams = Vec::new();
    for account in doc["account_details"].as_array().into_iter().flatten() {
        for stream in account["stream_detail"].as_array().into_iter().flatten() {
            if let (Some(name), Some(leader)) = (
                stream["name"].as_str(),
                stream["cluster"]["leader"].as_str(),
            ) {
                streams.push((name.to_owned(), leader.to_owned()));
            }
        }
    }
    Ok(NatsLeaders { meta, streams })
}

/// The containers a template hits now; `None` when it cannot be drawn in
/// the cluster's present shape (too few aggregators, a leader unknown).
pub(super) async fn resolve(
    cluster: &Cluster,
    template: &Template,
    rng: &mut StdRng,
) -> anyhow::Result<Option<Vec<Action>>> {
    let pairs: Vec<(Verb, Target)> = match template {
        Template::ScaleUp => return Ok(Some(vec![Action::ScaleUp])),
        Template::ScaleDown => return Ok(Some(vec![Action::ScaleDown])),
        Template::One(v, t) => vec![(*v, *t)],
        Template::Two(a, b) => vec![*a, *b],
    };
    let mut actions: Vec<Action> = Vec::new();
    for (verb, target) in pairs {
        let Some(service) = pick(cluster, target, rng).await? else {
            return Ok(None);
        };
        if actions.iter().any(|a| a.target() == service) {
            return Ok(None);
        }
        actions.push(match verb {
            Verb::Kill => Action::Kill(service),
            Verb::Pause => Action::Pause(service),
            Verb::Restart => Action::Restart(service),
            Verb::CutControl => Action::Cut(service, "control"),
            Verb::CutData => Action::Cut(service, "data"),
        });
    }
    Ok(Some(actions))
}

async fn pick(
    cluster: &Cluster,
    target: Target,
    rng: &mut StdRng,
) -> anyhow::Result<Option<String>> {
    let any = |names: Vec<String>, rng: &mut StdRng| names.choose(rng).cloned();
    Ok(match target {
        Target::Aggregator => {
            // At least one aggregator stays to take the partitions over.
            let up = cluster.running(&AGGREGATORS).await;
            if up.len() < 2 {
                None
            } else {
                any(up, rng)
            }
        }
        Target::Limiter => any(cluster.running(&["limiter1", "limiter2"]).await, rng),
        Target::Pacer => any(cluster.running(&["pacer1", "pacer2"]).await, rng),
        Target::Nats => any(cluster.running(&NATS).await, rng),
        Target::Etcd => any(cluster.running(&ETCD).await, rng),
        Target::S3 => Some("s3".to_owned()),
        Target::EtcdLeader => Some(cluster.etcd_leader().await?),
        Target::NatsMetaLeader => Some(cluster.nats_leaders().await?.meta),
        Target::NatsStreamLeader(stream) => cluster
            .nats_leaders()
            .await?
            .streams
            .into_iter()
            .find(|(name, _)| name == stream)
            .map(|(_, leader)| leader),
    })
}

/// Injects one action; the container's state proves it happened.
pub(super) async fn inject(cluster: &Cluster, action: &Action) -> anyhow::Result<()> {
    match action {
        Action::Kill(s) => cluster.kill(s).await.map(drop),
        Action::Pause(s) => cluster.pause(s).await.map(drop),
        Action::Restart(s) => cluster.restart(s).await.map(drop),
        Action::Cut(s, net) => cluster.disconnect(s, net).await.map(drop),
        Action::ScaleUp => cluster.up(SCALED).await.map(drop),
        Action::ScaleDown => {
            let state = cluster.stop(SCALED).await?;
            if state.exit_code != 0 {
                bail!(
                    "{SCALED} exited with {} after SIGTERM: not a clean handover",
                    state.exit_code
                );
            }
            Ok(())
        }
    }
}

/// Undoes one action and waits for the container's health check.
pub(super) async fn heal(cluster: &Cluster, action: &Action) -> anyhow::Result<()> {
    let service = match action {
        Action::Kill(s) => {
            cluster.up(s).await?;
            s
        }
        Action::Pause(s) => {
            cluster.unpause(s).await?;
            s
        }
        Action::Cut(s, net) => {
            cluster.connect(s, net).await?;
            s
        }
        Action::Restart(s) => s,
        Action::ScaleUp => SCALED,
        Action::ScaleDown => return Ok(()),
    };
    cluster.wait_healthy(service, HEALTHY_WITHIN).await
}

/// Whether aggregator4 runs (scaling goes the other way from there).
pub(super) async fn scaled_up(cluster: &Cluster) -> bool {
    cluster
        .state(SCALED)
        .await
        .is_ok_and(|s| s.running || s.paused)
}
