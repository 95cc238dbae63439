//! One campaign's rounds: publish, inject a fault while events flow, wait
//! until the restarted part has caught up, and compare the pacer with the
//! truth; at the end, the aggregator's LMDB too.

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use async_nats::jetstream;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio_util::sync::CancellationToken;

use super::shards::{self, Shard};
use super::{all_faults, CampaignConfig, Fault, Report, RoundTimes};
use adspend_harness::limiter_progress::limiter_acked_through;
use adspend_harness::pipeline::{metric_value, metrics_body, try_metric, Pipeline};
use adspend_harness::{free_port, wait_until_ok, ServiceProcess};
use adspend_sim::check::{fetch_limits, Comparison};
use adspend_sim::stream_truth::StreamTruth;
use adspend_sim::{self as sim, SimConfig, Truth};

/// Per-service metrics ports, fixed for the campaign so restarts keep them.
struct Ports {
    limiter: u16,
    aggregator: u16,
}

struct Campaign {
    p: Pipeline,
    /// The aggregator's shards (`ADSPEND_AGGREGATOR_WRITERS`).
    shards: Vec<Shard>,
    writers: String,
    ports: Ports,
    rng: StdRng,
    report: Report,
    truth: Truth,
    /// Set once any publish had an unknown outcome: the truth then comes
    /// from reading the stream back.
    from_stream: bool,
    /// The stream read back so far (read on from where it stopped).
    stream_truth: StreamTruth,
    events: u64,
    rate: f64,
    duplicate_rate: f64,
}

impl Campaign {
    fn spawn(&self, service: &str, armed: Option<String>) -> ServiceProcess {
        let port = match service {
            "limiter" => self.ports.limiter,
            "aggregator" => self.ports.aggregator,
            _ => free_port(),
        };
        let mut env = Vec::new();
        if service == "aggregator" {
            env.push(("ADSPEND_AGGREGATOR_WRITERS", self.writers.as_str()));
        }
        match armed {
            Some(spec) => {
                env.push(("ADSPEND_FAILPOINTS", spec.as_str()));
                // These fire only while a full base is copied or uploaded,
                // which a life otherwise does once per 30 checkpoints (a
                // start extends the recorded chain): bases every fourth
                // checkpoint let the third firing come within seconds.
                if ["aggregator.mid_copy@", "aggregator.mid_upload@"]
                    .iter()
                    .any(|point| spec.starts_with(point))
                {
                    env.push(("ADSPEND_CHECKPOINT_MAX_DELTAS", "3"));
                }
                self.p.spawn_with(service, port, &env)
            }
            None => self.p.spawn_with(service, port, &env),
        }
    }

    fn slot(&mut self, service: &str) -> &mut Option<ServiceProcess> {
        match service {
            "limiter" => &mut self.p.limiter,
            "aggregator" => &mut self.p.aggregator,
            _ => &mut self.p.pacer,
        }
    }

    /// Read the aggregator's duplicate counters before its process goes away.
    async fn scrape_aggregator(&mut self) {
        let port = self.ports.aggregator;
        self.report.dropped_by_id += try_metric(
            port,
            "adspend_aggregator_duplicates_dropped_total{by=\"id\"}",
        )
        .await
        .unwrap_or(0.0) as u64;
        self.report.skipped_by_seq += try_metric(
            port,
            "adspend_aggregator_duplicates_dropped_total{by=\"seq\"}",
        )
        .await
        .unwrap_or(0.0) as u64;
    }

    async fn stream_last(&self, stream: &str) -> anyhow::Result<u64> {
        let js = jetstream::new(self.p.client().await);
        let mut s = js
            .get_stream(stream)
            .await
            .with_context(|| format!("stream {stream}"))?;
        Ok(s.info().await?.state.last_sequence)
    }

    async fn sigkill(&mut self, service: &str) -> anyhow::Result<()> {
        if service == "aggregator" {
            self.scrape_aggregator().await;
        }
        let process = self.slot(service).as_mut().context("service not running")?;
        let status = process.kill();
        // Killed by us, not exited on its own before.
        ensure!(
            status.signal() == Some(9),
            "{service} was not running when killed: {status:?}"
        );
        Ok(())
    }

    async fn stop_cleanly(&mut self, service: &str) -> anyhow::Result<()> {
        if service == "aggregator" {
            self.scrape_aggregator().await;
        }
        let process = self.slot(service).as_mut().context("service not running")?;
        let status = process.terminate(Duration::from_secs(30))?;
        ensure!(
            status.success(),
            "{service} exited {status:?} on SIGTERM:\n{}",
            process.log_tail(20)
        );
        Ok(())
    }

    /// Run `service` with `point` armed until it aborts there; confirm it fired.
    async fn fire(&mut self, service: &str, point: &str, nth: u32) -> anyhow::Result<()> {
        let mut armed = self.spawn(service, Some(format!("{point}@{nth}")));
        let status = armed
            .wait_for_exit(Duration::from_secs(45))
            .await
            .with_context(|| format!("{point} did not fire within 45s:\n{}", armed.log_tail(60)))?;
        let log = armed.log_tail(400);
        ensure!(
            log.contains(&format!("FAILPOINT FIRED: {point}")) && status.signal() == Some(6),
            "{service} ended without firing {point} ({status:?}):\n{}",
            armed.log_tail(20)
        );
        Ok(())
    }

    /// Inject `fault`; returns (what to time, when the restart happened).
    async fn inject(&mut self, fault: Fault) -> anyhow::Result<(Recovery, Instant)> {
        match fault {
            Fault::KillAggregator | Fault::KillLimiter | Fault::KillPacer => {
                let service = match fault {
                    Fault::KillAggregator => "aggregator",
                    Fault::KillLimiter => "limiter",
                    _ => "pacer",
                };
                let before = if service == "pacer" {
                    self.pacer_total().await.unwrap_or(0)
                } else {
                    0
                };
                self.sigkill(service).await?;
                let process = self.spawn(service, None);
                *self.slot(service) = Some(process);
                let at = Instant::now();
                Ok((self.recovery_target(service, before).await?, at))
            }
            Fault::Point(point) => {
                let service = if point.starts_with("limiter") {
                    "limiter"
                } else {
                    "aggregator"
                };
                if point == "aggregator.during_restore" {
                    // Only a cold restore from a recorded checkpoint downloads:
                    // have one, then lose the local state.
                    wait_until_ok(
                        Duration::from_secs(30),
                        Duration::from_millis(100),
                        || async {
                            ensure!(
                                self.checkpoint_id().await? > 0,
                                "no checkpoint recorded yet"
                            );
                            Ok(())
                        },
                    )
                    .await?;
                    self.sigkill("aggregator").await?;
                    for shard in &self.shards {
                        let lmdb = shard.dir(&self.p.aggregator_dir()).join("lmdb");
                        std::fs::remove_dir_all(&lmdb)
                            .with_context(|| format!("wiping {}", lmdb.display()))?;
                    }
                    self.p.aggregator = None;
                    self.fire(service, point, 1).await?;
                } else {
                    self.stop_cleanly(service).await?;
                    *self.slot(service) = None;
                    let nth = self.rng.random_range(1..=3);
                    self.fire(service, point, nth).await?;
                }
                let process = self.spawn(service, None);
                *self.slot(service) = Some(process);
                let at = Instant::now();
                Ok((self.recovery_target(service, 0).await?, at))
            }
            Fault::KillNats => {
                self.p.nats.kill();
                tokio::time::sleep(Duration::from_millis(self.rng.random_range(200..1500))).await;
                self.p.nats.restart().await;
                let at = Instant::now();
                Ok((self.recovery_target("nats", 0).await?, at))
            }
            Fault::KillEtcd => {
                let etcd = self
                    .p
                    .etcd
                    .as_mut()
                    .context("the campaign needs etcd for this fault")?;
                etcd.kill();
                tokio::time::sleep(Duration::from_millis(self.rng.random_range(200..1500))).await;
                etcd.restart().await;
                let at = Instant::now();
                Ok((self.recovery_target("etcd", 0).await?, at))
            }
        }
    }

    /// The services' recent log lines, for a failure report.
    fn logs(&self) -> String {
        let mut out = String::from("recent service logs:\n");
        for (name, process) in [
            ("limiter", &self.p.limiter),
            ("aggregator", &self.p.aggregator),
            ("pacer", &self.p.pacer),
        ] {
            if let Some(process) = process {
                out += &format!("---- {name} ----\n{}\n", process.log_tail(25));
            }
        }
        out
    }

    async fn pacer_total(&self) -> anyhow::Result<u64> {
        let limits = fetch_limits(&reqwest::Client::new(), &self.p.pacer_url()).await?;
        Ok(limits.iter().map(|l| l.lifetime_spend_micros).sum())
    }

    /// The oldest of the shards' last recorded checkpoints (0: one has none).
    async fn checkpoint_id(&self) -> anyhow::Result<u64> {
        let mut oldest = u64::MAX;
        for shard in &self.shards {
            let bytes = match &self.p.etcd {
                Some(etcd) => {
                    etcd.get(&format!("/adspend/shards/{}/checkpoint", shard.name))
                        .await?
                }
                None => std::fs::read(
                    shard
                        .dir(&self.p.aggregator_dir())
                        .join("checkpoint/checkpoint.json"),
                )
                .ok(),
            };
            let Some(bytes) = bytes else { return Ok(0) };
            let record: serde_json::Value = serde_json::from_slice(&bytes)?;
            oldest = oldest.min(record["checkpoint_id"].as_u64().unwrap_or(0));
        }
        Ok(oldest)
    }

    /// Each shard's last `SPEND` sequence of its partitions.
    async fn spend_last(&self) -> anyhow::Result<Vec<u64>> {
        let js = jetstream::new(self.p.client().await);
        let stream = js.get_stream("SPEND").await.context("stream SPEND")?;
        let mut last = Vec::with_capacity(self.shards.len());
        for shard in &self.shards {
            last.push(shard.last_seq(&stream).await?);
        }
        Ok(last)
    }

    /// What "caught up" means after restarting `what`, captured at restart.
    async fn recovery_target(&self, what: &str, pacer_before: u64) -> anyhow::Result<Recovery> {
        Ok(match what {
            "aggregator" => Recovery::Applied(self.spend_last().await?),
            "limiter" => Recovery::Acked(self.stream_last("IMPRESSIONS").await?),
            "pacer" => Recovery::PacerTotal(pacer_before),
            "nats" => Recovery::Both(
                self.stream_last("IMPRESSIONS").await?,
                self.spend_last().await?,
            ),
            _ => Recovery::Checkpoint(self.checkpoint_id().await?),
        })
    }

    async fn reached(&self, target: Recovery) -> anyhow::Result<bool> {
        let limiter_acked =
            |last: u64| async move { limiter_acked_through(&self.p.client().await, last).await };
        let applied = |targets: Vec<u64>| async move {
            let body = metrics_body(self.ports.aggregator).await?;
            anyhow::Ok(self.shards.iter().zip(targets).all(|(shard, seq)| {
                let series = format!(
                    "adspend_aggregator_last_applied_seq{{shard=\"{}\"}}",
                    shard.name
                );
                metric_value(&body, &series).unwrap_or(0.0) >= seq as f64
            }))
        };
        Ok(match target {
            Recovery::Applied(seq) => applied(seq).await?,
            Recovery::Acked(seq) => limiter_acked(seq).await?,
            Recovery::PacerTotal(before) => self.pacer_total().await? >= before,
            Recovery::Both(imp, spend) => limiter_acked(imp).await? && applied(spend).await?,
            Recovery::Checkpoint(id) => self.checkpoint_id().await? > id,
        })
    }

    async fn round(&mut self, index: usize, fault: Fault) -> anyhow::Result<RoundTimes> {
        let started = Instant::now();
        let ms = |since: Instant| since.elapsed().as_millis() as u64;
        let mut times = RoundTimes::default();
        let config = SimConfig {
            events: Some(self.events),
            rate: self.rate,
            duplicate_rate: self.duplicate_rate,
            batch: 20,
            seed: self
                .report
                .seed
                .wrapping_mul(1_000)
                .wrapping_add(index as u64),
            run_id: Some(format!("s{}r{index}", self.report.seed)),
            ack_timeout: Duration::from_secs(3),
            ..SimConfig::default()
        };
        let client = self.p.client().await;
        let catalog = self.p.catalog.clone();
        let publisher = tokio::spawn(async move {
            sim::run(&client, &config, &catalog, CancellationToken::new()).await
        });
        let window_ms = (self.events as f64 / self.rate * 1000.0) as u64;
        tokio::time::sleep(Duration::from_millis(
            self.rng.random_range(200..(window_ms * 6 / 10).max(300)),
        ))
        .await;
        times.before = ms(started);
        let injecting = Instant::now();
        let (target, restarted) = self
            .inject(fault)
            .await
            .with_context(|| format!("injecting {}", fault.name()))?;
        times.inject = restarted.saturating_duration_since(injecting).as_millis() as u64;
        *self.report.faults.entry(fault.name()).or_default() += 1;
        let recovered = wait_until_ok(
            Duration::from_secs(120),
            Duration::from_millis(50),
            || async {
                ensure!(
                    self.reached(target.clone()).await.unwrap_or(false),
                    "not caught up"
                );
                Ok(restarted.elapsed())
            },
        )
        .await
        .with_context(|| format!("not caught up within 120s after {}", fault.name()))?;
        self.report
            .recovery_ms
            .push((fault.name(), recovered.as_millis() as u64));
        times.recover = recovered.as_millis() as u64;

        let waiting = Instant::now();
        let round_truth = publisher.await.context("publisher task")??;
        times.publisher = ms(waiting);
        let reading = Instant::now();
        let stats = &round_truth.stats;
        self.report.events_attempted += stats.events_sent;
        self.report.events_acknowledged += stats.events_acked;
        self.report.duplicates_injected += stats.duplicates_sent;
        if stats.messages_failed > 0 {
            self.from_stream = true;
            self.report.events_unknown += stats.events_sent - stats.events_acked;
        }
        self.truth.absorb(&round_truth);
        let truth = if self.from_stream {
            let client = self.p.client().await;
            self.stream_truth.catch_up(&client).await?
        } else {
            self.truth.clone()
        };
        times.truth = ms(reading);
        let settling = Instant::now();
        let comparison = self.p.settle(&truth, Duration::from_secs(120)).await;
        times.settle = ms(settling);
        if !comparison.mismatches().is_empty() {
            bail!(
                "round {index} ({}), seed {}: pacer differs from the truth:\n{}",
                fault.name(),
                self.report.seed,
                comparison.render(10)
            );
        }
        times.total = ms(started);
        Ok(times)
    }
}

#[derive(Clone, Debug)]
enum Recovery {
    /// Each aggregator shard applied through this `SPEND` sequence.
    Applied(Vec<u64>),
    /// Limiter acknowledged input through this `IMPRESSIONS` sequence.
    Acked(u64),
    /// Pacer total back to at least this.
    PacerTotal(u64),
    Both(u64, Vec<u64>),
    /// A checkpoint newer than this id recorded.
    Checkpoint(u64),
}

/// Run a campaign; `on_round` sees each finished round's index, fault and
/// where its time went.
pub async fn run(
    config: CampaignConfig,
    mut on_round: impl FnMut(usize, Fault, RoundTimes),
) -> anyhow::Result<Report> {
    let mut p = Pipeline::start(config.backends, config.ads).await;
    let partitions: u32 = p
        .env()
        .into_iter()
        .find(|(k, _)| k == "ADSPEND_PARTITIONS")
        .context("the pipeline's partitions")?
        .1
        .parse()?;
    let shards = shards::layout(partitions, &config.writers)?;
    let ports = Ports {
        limiter: free_port(),
        aggregator: free_port(),
    };
    let writers = [("ADSPEND_AGGREGATOR_WRITERS", config.writers.as_str())];
    p.aggregator = Some(p.spawn_with("aggregator", ports.aggregator, &writers));
    p.limiter = Some(p.spawn_with("limiter", ports.limiter, &[]));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let stream_truth = StreamTruth::new(&p.catalog)?;
    let shard_names = shards.iter().map(|s| s.name.clone()).collect();
    let mut campaign = Campaign {
        p,
        shards,
        writers: config.writers.clone(),
        ports,
        rng: StdRng::seed_from_u64(config.seed),
        report: Report {
            seed: config.seed,
            shards: shard_names,
            ..Report::default()
        },
        truth: Truth::default(),
        from_stream: false,
        stream_truth,
        events: config.events_per_round,
        rate: config.rate,
        duplicate_rate: config.duplicate_rate,
    };
    let kinds = all_faults();
    let usable: Vec<Fault> = kinds
        .iter()
        .copied()
        .filter(|f| *f != Fault::KillEtcd || config.backends.etcd)
        .filter(|f| config.only.is_empty() || config.only.iter().any(|o| f.name().contains(o)))
        .collect();
    ensure!(
        !usable.is_empty(),
        "no fault's name contains any of {:?}",
        config.only
    );
    for index in 0..config.rounds {
        let fault = if config.walk_all_first && index < usable.len() {
            usable[index]
        } else {
            usable[campaign.rng.random_range(0..usable.len())]
        };
        let times = match campaign.round(index, fault).await {
            Ok(times) => times,
            Err(e) => return Err(e.context(campaign.logs())),
        };
        campaign.report.rounds += 1;
        on_round(index, fault, times);
    }
    finish(&mut campaign).await?;
    Ok(campaign.report)
}

/// Final check: the stream's truth against the pacer and the aggregator's LMDB.
async fn finish(c: &mut Campaign) -> anyhow::Result<()> {
    let client = c.p.client().await;
    let stream_truth = c.stream_truth.catch_up(&client).await?;
    let comparison: Comparison = c.p.settle(&stream_truth, Duration::from_secs(120)).await;
    c.scrape_aggregator().await;
    c.stop_cleanly("aggregator").await?;
    let totals = shards::totals(&c.shards, &c.p.aggregator_dir())?;
    let acked: u64 = c.report.events_acknowledged;
    c.report.events_unknown_stored = stream_truth.stats.events_acked.saturating_sub(acked);
    c.report.limits_compared = comparison.rows.len();
    c.report.pacer_mismatches = comparison.mismatches().len();
    let mut max_diff = comparison.max_abs_diff();
    let mut aggregator_mismatches = 0;
    for (limit, truth) in &stream_truth.limits {
        let held = totals.get(limit).copied().unwrap_or(0);
        if held != truth.lifetime_micros {
            aggregator_mismatches += 1;
            max_diff = max_diff.max(held.abs_diff(truth.lifetime_micros));
        }
    }
    c.report.aggregator_mismatches = aggregator_mismatches;
    c.report.max_abs_diff = max_diff;
    Ok(())
}
