//! One docker-compose project of deploy/docker-compose.yml, with faults.
//!
//! Here: starting and removing the project, containers and their state.
//! `faults` kills, pauses, stops, restarts and cuts off services; `etcd`
//! reads the control plane through `etcdctl` in an etcd container;
//! `metrics` reads the services' Prometheus text; `secrets` reads the
//! credentials `scripts/cluster.sh` generated for the host's clients.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{ensure, Context};
use serde_json::Value;

use adspend_harness::workspace_root;
use adspend_sim::Catalog;

mod etcd;
mod faults;
mod metrics;
mod secrets;

pub use metrics::{metric_sum, metric_value};
pub use secrets::{nats_args, pacer, pacer_client, PacerAccess, SECRETS_DIR};

/// The compose project the tests run (the hand-run cluster is `adspend`, so
/// `scripts/cluster.sh down` of one never removes the other's volumes).
pub const PROJECT: &str = "adspendtest";
/// The aggregators the compose file starts by default.
pub const AGGREGATORS: [&str; 3] = ["aggregator1", "aggregator2", "aggregator3"];
const ALL_SERVICES: [&str; 16] = [
    "nats1",
    "nats2",
    "nats3",
    "etcd1",
    "etcd2",
    "etcd3",
    "s3",
    "limiter1",
    "limiter2",
    "aggregator1",
    "aggregator2",
    "aggregator3",
    "aggregator4",
    "pacer1",
    "pacer2",
    "prometheus",
];
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// What `docker inspect` says about a service's container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerState {
    /// created, running, paused, restarting, exited, dead
    pub status: String,
    pub running: bool,
    pub paused: bool,
    pub exit_code: i64,
    /// When its process last ended (RFC 3339, as Docker records it): a
    /// kill's moment, whatever the `docker` command's own delay.
    pub finished_at: Option<String>,
    /// Compose network names (`data`, `control`) the container is attached to.
    pub networks: Vec<String>,
    /// Its address on the `data` network, reachable from the host.
    pub data_ip: Option<String>,
}

/// A running project. Dropping it removes containers, networks and volumes,
/// after printing the services' last log lines if the test is panicking.
pub struct Cluster {
    root: PathBuf,
    /// The compose project: [`PROJECT`] for a test's own, or a running one.
    project: String,
    /// Started here: removed on drop. An attached project is left running.
    owned: bool,
    /// Holds the catalog file the project was started with.
    _dir: tempfile::TempDir,
    http: reqwest::Client,
    ids: std::sync::Mutex<std::collections::HashMap<String, String>>,
}

impl Cluster {
    /// Starts the project with `catalog` in etcd through `scripts/cluster.sh
    /// start`; returns when pacer1 answers on 127.0.0.1:8080 and every
    /// service is healthy. A project left over from an interrupted run is
    /// removed first.
    pub async fn start(catalog: &Catalog) -> anyhow::Result<Cluster> {
        Self::start_json(&serde_json::to_value(catalog)?).await
    }

    /// [`Cluster::start`] with a catalog document as JSON (for fields the
    /// simulator's catalog does not carry, such as `alerts`).
    pub async fn start_json(catalog: &Value) -> anyhow::Result<Cluster> {
        let dir = tempfile::tempdir().context("tempdir")?;
        let catalog_path = dir.path().join("catalog.json");
        std::fs::write(&catalog_path, serde_json::to_vec_pretty(catalog)?)
            .context("writing the catalog")?;
        let cluster = Cluster {
            root: workspace_root(),
            project: PROJECT.to_owned(),
            owned: true,
            _dir: dir,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()?,
            ids: Default::default(),
        };
        cluster.down().await?;
        eprintln!("cluster: starting project {}", cluster.project);
        let status = tokio::process::Command::new("bash")
            .arg(cluster.root.join("scripts/cluster.sh"))
            .arg("start")
            .arg(&catalog_path)
            .env("ADSPEND_CLUSTER_PROJECT", &cluster.project)
            .status()
            .await
            .context("running scripts/cluster.sh start")?;
        ensure!(
            status.success(),
            "scripts/cluster.sh start failed ({status}); are the images built (bash scripts/cluster.sh images)?"
        );
        Ok(cluster)
    }

    /// A project someone else started (`scripts/cluster.sh up`), left
    /// running when this is dropped.
    pub fn attach(project: &str) -> anyhow::Result<Cluster> {
        Ok(Cluster {
            root: workspace_root(),
            project: project.to_owned(),
            owned: false,
            _dir: tempfile::tempdir().context("tempdir")?,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()?,
            ids: Default::default(),
        })
    }

    async fn run(&self, program: &str, args: &[&str]) -> anyhow::Result<String> {
        let output = tokio::time::timeout(
            COMMAND_TIMEOUT,
            tokio::process::Command::new(program)
                .args(args)
                .current_dir(&self.root)
                .kill_on_drop(true)
                .output(),
        )
        .await
        .with_context(|| format!("{program} {} timed out", args.join(" ")))?
        .with_context(|| format!("running {program}"))?;
        ensure!(
            output.status.success(),
            "{program} {} failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    fn compose_args<'a>(&'a self, args: &[&'a str]) -> Vec<&'a str> {
        let mut all = vec![
            "-f",
            "deploy/docker-compose.yml",
            "-p",
            &self.project,
            "--profile",
            "scale",
        ];
        all.extend_from_slice(args);
        all
    }

    pub async fn compose(&self, args: &[&str]) -> anyhow::Result<String> {
        self.run("docker-compose", &self.compose_args(args)).await
    }

    /// The container id of a service (its only container). Cached: a
    /// container keeps its id through kill, stop and start, and each
    /// docker-compose call costs a Python start-up.
    pub async fn id(&self, service: &str) -> anyhow::Result<String> {
        if let Some(id) = self.ids.lock().unwrap().get(service) {
            return Ok(id.clone());
        }
        let out = self.compose(&["ps", "-q", service]).await?;
        let id = out
            .lines()
            .next()
            .map(str::to_owned)
            .with_context(|| format!("service {service} has no container"))?;
        self.ids
            .lock()
            .unwrap()
            .insert(service.to_owned(), id.clone());
        Ok(id)
    }

    pub async fn state(&self, service: &str) -> anyhow::Result<ContainerState> {
        let id = self.id(service).await?;
        let out = self.run("docker", &["inspect", &id]).await?;
        let inspect: Value = serde_json::from_str(&out).context("docker inspect output")?;
        let c = &inspect[0];
        let state = &c["State"];
        let prefix = format!("{}_", self.project);
        let networks = c["NetworkSettings"]["Networks"]
            .as_object()
            .map(|n| n.iter().collect::<Vec<_>>())
            .unwrap_or_default();
        Ok(ContainerState {
            status: state["Status"].as_str().unwrap_or("?").to_owned(),
            running: state["Running"].as_bool().unwrap_or(false),
            paused: state["Paused"].as_bool().unwrap_or(false),
            exit_code: state["ExitCode"].as_i64().unwrap_or(-1),
            finished_at: state["FinishedAt"]
                .as_str()
                .filter(|t| !t.starts_with("0001"))
                .map(str::to_owned),
            networks: networks
                .iter()
                .map(|(name, _)| name.strip_prefix(&prefix).unwrap_or(name).to_owned())
                .collect(),
            data_ip: networks
                .iter()
                .find(|(name, _)| name.strip_prefix(&prefix) == Some("data"))
                .and_then(|(_, n)| n["IPAddress"].as_str())
                .filter(|ip| !ip.is_empty())
                .map(str::to_owned),
        })
    }

    async fn remove_volumes(&self) -> anyhow::Result<()> {
        let label = format!("label=com.docker.compose.project={}", self.project);
        let volumes = self
            .run("docker", &["volume", "ls", "-q", "--filter", &label])
            .await?;
        let volumes: Vec<&str> = volumes.lines().collect();
        if !volumes.is_empty() {
            let mut args = vec!["volume", "rm"];
            args.extend(volumes);
            self.run("docker", &args).await?;
        }
        Ok(())
    }

    /// The last `tail` lines of a service's log.
    pub async fn logs(&self, service: &str, tail: u32) -> anyhow::Result<String> {
        let tail = tail.to_string();
        self.compose(&["logs", "--no-color", "--tail", &tail, service])
            .await
    }

    /// Every log line, of NATS or of a service, that tells of a call a
    /// service or the auditor made and NATS refused for lack of permission
    /// (a missing grant in deploy/nats-auth.conf). Refusals of the ad server
    /// and of clients without credentials are the tests' own probes.
    pub async fn permission_violations(&self) -> anyhow::Result<Vec<String>> {
        const ROLES: [&str; 4] = ["limiter", "aggregator", "pacer", "auditor"];
        let mut found = Vec::new();
        for service in ALL_SERVICES {
            if service.starts_with("etcd") || service == "s3" || service == "prometheus" {
                continue;
            }
            // A service never started (aggregator4) has no log.
            let Ok(log) = self.compose(&["logs", "--no-color", service]).await else {
                continue;
            };
            found.extend(
                log.lines()
                    .filter(|l| {
                        let nats_refused = l.contains("Violation")
                            && ROLES.iter().any(|r| l.contains(&format!("/user:{r}\"")));
                        let service_refused = l.contains("Permissions Violation")
                            || l.contains("NATS permission denied");
                        nats_refused || service_refused
                    })
                    .map(str::to_owned),
            );
        }
        Ok(found)
    }

    /// Removes the project's containers, networks and volumes. Docker now
    /// and then still counts a just-removed container as a network endpoint
    /// ("has active endpoints"): retried.
    pub async fn down(&self) -> anyhow::Result<()> {
        let mut attempt = 1;
        loop {
            match self
                .compose(&["down", "-v", "--remove-orphans", "--timeout", "5"])
                .await
            {
                Ok(_) => return Ok(()),
                // Containers are gone by then; the network stays for the next
                // project to reuse, but its volumes must not.
                Err(e) if format!("{e:#}").contains("active endpoints") => {
                    eprintln!("cluster: {e:#}; removing the volumes by label, keeping the network");
                    return self.remove_volumes().await;
                }
                Err(e) if attempt < 5 => {
                    eprintln!("cluster: down failed (attempt {attempt}), retrying: {e:#}");
                    attempt += 1;
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let compose = |args: &[&str]| {
            std::process::Command::new("docker-compose")
                .args(self.compose_args(args))
                .current_dir(&self.root)
                .status()
        };
        if std::thread::panicking() {
            eprintln!("cluster: the test failed; the services' last log lines follow");
            let mut args = vec!["logs", "--no-color", "--tail", "40"];
            args.extend_from_slice(&ALL_SERVICES);
            let _ = compose(&args);
        }
        eprintln!("cluster: removing project {}", self.project);
        // Drop may run inside the test's runtime: down() runs on a thread
        // with a runtime of its own.
        let result = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?
                        .block_on(self.down())
                })
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("down panicked")))
        });
        if let Err(e) = result {
            eprintln!("cluster: removing project {} failed: {e:#}", self.project);
        }
    }
}
