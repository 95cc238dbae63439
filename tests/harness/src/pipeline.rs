//! A pipeline under test (used by the integration suite and by `adchaos`): a real NATS server (and etcd / S3 when asked), a
//! generated catalog, the three services as real processes or in-process,
//! and helpers to publish with the simulator and compare with the truth.

use std::path::PathBuf;
use std::time::Duration;

use crate::{free_port, wait_until, Etcd, NatsOptions, NatsServer, S3Server, ServiceProcess};
use adspend_sim::check::Comparison;
use adspend_sim::{self as sim, Catalog, CatalogSpec, SimConfig, Truth};
use tokio_util::sync::CancellationToken;

pub const BUCKET: &str = "adspend-snapshots";
pub const CATALOG_KEY: &str = "/adspend/catalog";

#[derive(Debug, Default, Clone, Copy)]
pub struct Backends {
    /// Checkpoint records and the catalog in etcd.
    pub etcd: bool,
    /// Snapshots in the S3-compatible server.
    pub s3: bool,
}

pub struct Pipeline {
    // Services first: fields drop in order, and the services' logs (printed
    // on drop after a failure) live in `dir`.
    pub limiter: Option<ServiceProcess>,
    pub aggregator: Option<ServiceProcess>,
    pub pacer: Option<ServiceProcess>,
    pub nats: NatsServer,
    pub etcd: Option<Etcd>,
    pub s3: Option<S3Server>,
    pub dir: tempfile::TempDir,
    pub catalog: Catalog,
    pub catalog_path: PathBuf,
    pub pacer_addr: String,
}

impl Pipeline {
    pub async fn start(backends: Backends, ads: u32) -> Pipeline {
        let catalog = sim::generate_catalog(&CatalogSpec::for_ads(ads), 11).expect("catalog");
        Pipeline::start_with(backends, NatsOptions::default(), catalog).await
    }

    /// [`Pipeline::start`] with a given NATS configuration and catalog.
    pub async fn start_with(backends: Backends, nats: NatsOptions, catalog: Catalog) -> Pipeline {
        let nats = NatsServer::start_with(nats).await;
        let etcd = if backends.etcd {
            Some(Etcd::start().await)
        } else {
            None
        };
        let s3 = if backends.s3 {
            let s3 = S3Server::start().await;
            s3.create_bucket(BUCKET).await.expect("create bucket");
            Some(s3)
        } else {
            None
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let catalog_path = dir.path().join("catalog.json");
        catalog.save(&catalog_path).expect("save catalog");
        if let Some(etcd) = &etcd {
            let bytes = std::fs::read(&catalog_path).expect("read catalog");
            etcd.put(CATALOG_KEY, &bytes)
                .await
                .expect("catalog into etcd");
        }
        Pipeline {
            nats,
            etcd,
            s3,
            dir,
            catalog,
            catalog_path,
            pacer_addr: format!("127.0.0.1:{}", free_port()),
            limiter: None,
            aggregator: None,
            pacer: None,
        }
    }

    pub fn pacer_url(&self) -> String {
        format!("http://{}", self.pacer_addr)
    }

    pub fn aggregator_dir(&self) -> PathBuf {
        self.dir.path().join("aggregator")
    }

    /// Settings every service reads, as `ADSPEND_*` environment variables.
    pub fn env(&self) -> Vec<(String, String)> {
        let mut env = vec![
            ("ADSPEND_NATS_URL".into(), self.nats.url()),
            ("ADSPEND_PARTITIONS".into(), "4".into()),
            ("ADSPEND_CHECKPOINT_INTERVAL_MS".into(), "500".into()),
            (
                "ADSPEND_DATA_DIR".into(),
                self.aggregator_dir().display().to_string(),
            ),
            ("ADSPEND_PACER_ADDR".into(), self.pacer_addr.clone()),
            // Every test and campaign round lasts well under two minutes; a
            // short window keeps the LMDB small, as a production window
            // bounds it by time and count. A campaign can ask for another
            // (`ADSPEND_DEDUPE_WINDOW_MS=3600000 scripts/chaos.sh`).
            (
                "ADSPEND_DEDUPE_WINDOW_MS".into(),
                std::env::var("ADSPEND_DEDUPE_WINDOW_MS").unwrap_or_else(|_| "120000".into()),
            ),
            // One writer, so the tests read one shard ("all", its LMDB in
            // the data dir itself); the writers' own tests and a campaign
            // ask for more (`ADSPEND_AGGREGATOR_WRITERS=2 scripts/chaos.sh`).
            (
                "ADSPEND_AGGREGATOR_WRITERS".into(),
                std::env::var("ADSPEND_AGGREGATOR_WRITERS").unwrap_or_else(|_| "1".into()),
            ),
            (
                "RUST_LOG".into(),
                "info,adspend_aggregator=debug,adspend_limiter=debug".into(),
            ),
        ];
        match &self.etcd {
            Some(etcd) => {
                env.push(("ADSPEND_ETCD_ENDPOINTS".into(), etcd.endpoints()));
                env.push(("ADSPEND_CATALOG".into(), format!("etcd://{CATALOG_KEY}")));
            }
            None => env.push((
                "ADSPEND_CATALOG".into(),
                self.catalog_path.display().to_string(),
            )),
        }
        if let Some(s3) = &self.s3 {
            env.extend(s3.env());
            env.push((
                "ADSPEND_OBJECT_STORE_URL".into(),
                format!("s3://{BUCKET}/snapshots"),
            ));
        }
        env
    }

    pub fn spawn(&self, service: &str) -> ServiceProcess {
        self.spawn_with(service, free_port(), &[])
    }

    /// Spawn with a known metrics port and extra (overriding) settings.
    pub fn spawn_with(
        &self,
        service: &str,
        metrics_port: u16,
        extra: &[(&str, &str)],
    ) -> ServiceProcess {
        let mut env = self.env();
        env.retain(|(k, _)| !extra.iter().any(|(e, _)| e == k));
        env.push((
            "ADSPEND_METRICS_ADDR".into(),
            format!("127.0.0.1:{metrics_port}"),
        ));
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        // One log per process, so a crashed incarnation's log survives its
        // replacement.
        static SPAWNED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = SPAWNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ServiceProcess::builder(service)
            .envs(env)
            .log_file(self.dir.path().join(format!("{service}-{n}.log")))
            .spawn()
    }

    /// All three services as real processes; returns when the pacer answers.
    pub async fn spawn_all(&mut self) {
        self.aggregator = Some(self.spawn("aggregator"));
        self.limiter = Some(self.spawn("limiter"));
        self.pacer = Some(self.spawn("pacer"));
        self.wait_pacer().await;
    }

    pub async fn wait_pacer(&self) {
        wait_pacer_at(&self.pacer_url())
            .await
            .expect("pacer did not become healthy");
    }

    pub async fn client(&self) -> async_nats::Client {
        async_nats::connect(self.nats.url())
            .await
            .expect("connect to test NATS")
    }

    /// Publish with the simulator and return its truth.
    pub async fn publish(&self, config: &SimConfig) -> Truth {
        let client = self.client().await;
        let truth = sim::run(&client, config, &self.catalog, CancellationToken::new())
            .await
            .expect("simulator run");
        client.flush().await.expect("flush");
        truth
    }

    /// Lifetime spend per limit as the pacer serves it.
    pub async fn lifetimes(&self) -> anyhow::Result<std::collections::BTreeMap<String, u64>> {
        let http = reqwest::Client::builder().no_proxy().build()?;
        let limits = adspend_sim::check::fetch_limits(&http, &self.pacer_url()).await?;
        Ok(limits
            .into_iter()
            .map(|l| (l.limit_id, l.lifetime_spend_micros))
            .collect())
    }

    /// Wait until the pacer equals the truth (or `timeout`), and return the
    /// last comparison.
    pub async fn settle(&self, truth: &Truth, timeout: Duration) -> Comparison {
        let (comparison, _) = adspend_sim::check::wait_for_match(&self.pacer_url(), truth, timeout)
            .await
            .expect("reading the pacer");
        comparison
    }
}

/// Assert exact equality per limit, printing the differences if not.
pub fn assert_exact(comparison: &Comparison, truth: &Truth) {
    let mismatches = comparison.mismatches();
    assert!(
        mismatches.is_empty(),
        "{} of {} limits differ from the truth (largest difference {} micros):\n{}",
        mismatches.len(),
        comparison.rows.len(),
        comparison.max_abs_diff(),
        comparison.render(20)
    );
    assert!(truth.stats.unique_events > 0, "the run published nothing");
    assert!(comparison.total_truth() > 0);
    // The pacer serves every limit of the truth (a row it lacks has period
    // "?"), and nothing else (the truth lists every limit of the catalog).
    let unserved: Vec<&str> = comparison
        .rows
        .iter()
        .filter(|r| r.period == "?")
        .map(|r| r.limit_id.as_str())
        .collect();
    assert!(unserved.is_empty(), "the pacer does not serve {unserved:?}");
    assert_eq!(
        comparison.rows.len(),
        truth.limits.len(),
        "the pacer serves limits the truth does not know"
    );
}

/// A simulator run with duplicates and no bad events.
pub fn sim_config(events: u64, seed: u64) -> SimConfig {
    SimConfig {
        events: Some(events),
        duplicate_rate: 0.1,
        batch: 50,
        seed,
        ..SimConfig::default()
    }
}

/// One series of a service's Prometheus endpoint, by its full text (e.g.
/// `adspend_rejected_total{reason="unknown_ad"}`); 0 when absent.
pub async fn metric(port: u16, series: &str) -> f64 {
    try_metric(port, series).await.expect("metrics endpoint")
}

/// [`metric`], with an error when the endpoint does not answer.
/// Until the pacer at `url` (`http://host:port`) answers `/healthz`, for
/// at most 30 s.
pub async fn wait_pacer_at(url: &str) -> anyhow::Result<()> {
    let url = format!("{url}/healthz");
    wait_until(Duration::from_secs(30), Duration::from_millis(100), || {
        let url = url.clone();
        async move {
            reqwest::get(&url)
                .await
                .is_ok_and(|r| r.status().is_success())
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("pacer at {url} did not become healthy"))
}

pub async fn try_metric(port: u16, series: &str) -> anyhow::Result<f64> {
    Ok(metric_value(&metrics_body(port).await?, series).unwrap_or(0.0))
}

/// A service's whole `/metrics` text, for reading several series at once.
pub async fn metrics_body(port: u16) -> anyhow::Result<String> {
    Ok(reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await?
        .text()
        .await?)
}

/// One value of a Prometheus text exposition, by its full series text
/// (`name` or `name{labels}`); `None` when absent. The series must be
/// followed by a space, so `x` never reads the line of `x_max`.
pub fn metric_value(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|line| {
        line.strip_prefix(series)
            .filter(|rest| rest.starts_with(' '))
            .and_then(|rest| rest.trim().parse().ok())
    })
}
