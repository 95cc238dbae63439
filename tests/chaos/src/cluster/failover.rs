//! The failover an operator tries first: while an ad server publishes, one
//! aggregator is killed and, a few seconds later, another paused; how long
//! after the last publish is the pacer exact, and where did the time go
//! ([`Timeline`] of each fault). Run once by the cluster tests and `runs`
//! times by `scripts/cluster.sh failover`, which heals the cluster between
//! runs.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use chrono::Utc;

use super::compose::{pacer, pacer_client, Cluster, AGGREGATORS};
use super::timeline::{Logs, Timeline};
use super::traffic::{settle_exact, Traffic};
use adspend_sim::check::wait_for_match_with;
use adspend_sim::{Catalog, Truth};

/// What to do in one run.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Events per second the simulator publishes.
    pub rate: f64,
    pub seed: u64,
    /// Killed this long after the simulator starts.
    pub kill_after: Duration,
    /// Another member paused this long after the kill.
    pub pause_after: Duration,
    /// Publishing stops this long after the pause.
    pub stop_after: Duration,
}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            rate: 1_500.0,
            seed: 1,
            kill_after: Duration::from_millis(1_500),
            pause_after: Duration::from_secs(3),
            stop_after: Duration::from_secs(2),
        }
    }
}

/// One run's outcome.
#[derive(Debug, Clone)]
pub struct Run {
    pub killed: String,
    pub paused: String,
    /// From the simulator's start to its last acknowledged publish.
    pub publishing: Duration,
    /// From the kill to exact totals.
    pub exact_after_kill: Duration,
    /// From the last publish to exact totals.
    pub exact_after_last_publish: Duration,
    pub kill: Timeline,
    pub pause: Timeline,
    /// The exactness check's summary line.
    pub summary: String,
}

impl Run {
    pub fn render(&self) -> String {
        format!(
            "kill {} then pause {}: published for {:.1}s; exact {:.1}s after the kill, {:.1}s after the last publish\n{}{}{}",
            self.killed,
            self.paused,
            self.publishing.as_secs_f64(),
            self.exact_after_kill.as_secs_f64(),
            self.exact_after_last_publish.as_secs_f64(),
            self.kill.render(),
            self.pause.render(),
            self.summary
        )
    }
}

/// Kills `killed` and then pauses `paused` under traffic, waits until the
/// pacer equals the truth (`truth`, everything acknowledged before, gains
/// this run's), and reads the timelines. Leaves `killed` dead and `paused`
/// paused: [`heal`] brings them back.
pub async fn kill_then_pause(
    cluster: &Cluster,
    catalog: &Catalog,
    plan: &Plan,
    killed: &str,
    paused: &str,
    truth: &mut Truth,
) -> anyhow::Result<Run> {
    let traffic = Traffic::start_on(catalog, "impressions.sim", None, plan.rate, plan.seed).await?;
    let started = Instant::now();
    tokio::time::sleep(plan.kill_after).await;
    let kill_owned = partitions_of(&cluster.owners().await?, killed);
    ensure!(!kill_owned.is_empty(), "{killed} owns no partition");
    let killed_at = Instant::now();
    let state = cluster.kill(killed).await?;
    ensure!(state.exit_code == 137, "{killed} not SIGKILLed: {state:?}");
    // The process's end as Docker recorded it: on a busy machine the
    // `docker kill` command itself can take seconds.
    let kill_at = state
        .finished_at
        .as_deref()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .map_or_else(Utc::now, |t| t.with_timezone(&Utc));
    tokio::time::sleep(plan.pause_after).await;
    // What the paused member owns now, the killed one's share included
    // where it has claimed it already.
    let pause_owned = partitions_of(&cluster.owners().await?, paused);
    let state = cluster.pause(paused).await?;
    ensure!(state.paused, "{paused} not paused: {state:?}");
    // Docker records no time of a pause: once it says paused, it is.
    let pause_at = Utc::now();
    tokio::time::sleep(plan.stop_after).await;
    let acked = traffic.stop().await?;
    let publishing = started.elapsed();
    let last_publish = Instant::now();
    truth.absorb(&acked);
    // Exact as the simulator's acknowledged truth says (nothing failed to
    // publish here), polled from the moment publishing ended; then the full
    // check against IMPRESSIONS read back.
    let access = pacer();
    let http = pacer_client(Duration::from_secs(10));
    if truth.stats.messages_failed == 0 {
        wait_for_match_with(&http, &access.url, truth, Duration::from_secs(180))
            .await
            .context("the pacer against the acknowledged truth")?;
    }
    let exact_instant = Instant::now();
    let exact = Utc::now();
    let (_, summary) = settle_exact(catalog, truth, Duration::from_secs(180)).await?;
    let logs = Logs::read(cluster).await?;
    Ok(Run {
        killed: killed.to_owned(),
        paused: paused.to_owned(),
        publishing,
        exact_after_kill: exact_instant - killed_at,
        exact_after_last_publish: exact_instant - last_publish,
        kill: Timeline::collect(
            &format!("docker kill {killed}"),
            killed,
            kill_at,
            Some(exact),
            &kill_owned,
            &logs,
        ),
        pause: Timeline::collect(
            &format!("docker pause {paused}"),
            paused,
            pause_at,
            Some(exact),
            &pause_owned,
            &logs,
        ),
        summary,
    })
}

/// Brings a run's victims back (`killed` started again, `paused`
/// unpaused) and waits until every member owns partitions again.
pub async fn heal(cluster: &Cluster, killed: &str, paused: &str) -> anyhow::Result<()> {
    cluster.unpause(paused).await?;
    cluster.up(killed).await?;
    let started = Instant::now();
    loop {
        let owners = cluster.owners().await.unwrap_or_default();
        let members = cluster.members().await.unwrap_or_default();
        let settled = AGGREGATORS
            .iter()
            .all(|m| members.iter().any(|x| x == m) && !partitions_of(&owners, m).is_empty())
            && owners.len() == super::observe::PARTITIONS as usize;
        if settled {
            return Ok(());
        }
        ensure!(
            started.elapsed() < Duration::from_secs(120),
            "members {members:?} and owners {owners:?} not back within 120 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn partitions_of(owners: &BTreeMap<u32, String>, member: &str) -> Vec<u32> {
    owners
        .iter()
        .filter(|(_, m)| *m == member)
        .map(|(p, _)| *p)
        .collect()
}
