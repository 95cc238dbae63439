//! Faults injected into a running project: kill, pause, stop, start,
//! network cuts; each returns the container's state so a test can prove
//! its fault happened.

use std::time::Duration;

use anyhow::{bail, ensure};

use super::{Cluster, ContainerState};

impl Cluster {
    /// `docker kill` (SIGKILL); checks the container is no longer running.
    pub async fn kill(&self, service: &str) -> anyhow::Result<ContainerState> {
        let id = self.id(service).await?;
        self.run("docker", &["kill", &id]).await?;
        let state = self.state(service).await?;
        ensure!(
            !state.running,
            "{service} still running after docker kill: {state:?}"
        );
        Ok(state)
    }

    /// `docker pause` (cgroup freezer); checks the container is paused.
    pub async fn pause(&self, service: &str) -> anyhow::Result<ContainerState> {
        let id = self.id(service).await?;
        self.run("docker", &["pause", &id]).await?;
        let state = self.state(service).await?;
        ensure!(
            state.paused,
            "{service} not paused after docker pause: {state:?}"
        );
        Ok(state)
    }

    pub async fn unpause(&self, service: &str) -> anyhow::Result<ContainerState> {
        let id = self.id(service).await?;
        self.run("docker", &["unpause", &id]).await?;
        let state = self.state(service).await?;
        ensure!(
            state.running && !state.paused,
            "{service} not running after docker unpause: {state:?}"
        );
        Ok(state)
    }

    /// `docker-compose stop` (SIGTERM, then SIGKILL after 30 s); checks it
    /// exited and returns its state (exit code 0 = clean shutdown).
    pub async fn stop(&self, service: &str) -> anyhow::Result<ContainerState> {
        self.compose(&["stop", "-t", "30", service]).await?;
        let state = self.state(service).await?;
        ensure!(
            !state.running,
            "{service} still running after stop: {state:?}"
        );
        Ok(state)
    }

    /// `docker restart` (SIGTERM, SIGKILL after 10 s, then start); checks
    /// it runs again and returns its state.
    pub async fn restart(&self, service: &str) -> anyhow::Result<ContainerState> {
        let id = self.id(service).await?;
        self.run("docker", &["restart", "-t", "10", &id]).await?;
        let state = self.state(service).await?;
        ensure!(
            state.running,
            "{service} not running after docker restart: {state:?}"
        );
        Ok(state)
    }

    /// Creates (if needed) and starts a service's container, as `scripts/cluster.sh scale` does.
    pub async fn up(&self, service: &str) -> anyhow::Result<ContainerState> {
        self.compose(&["up", "-d", "--no-recreate", "--no-deps", service])
            .await?;
        let state = self.state(service).await?;
        ensure!(state.running, "{service} not running after up: {state:?}");
        Ok(state)
    }

    /// Detaches a service from one of the compose networks (`data`, `control`).
    pub async fn disconnect(&self, service: &str, network: &str) -> anyhow::Result<ContainerState> {
        let id = self.id(service).await?;
        let net = format!("{}_{network}", self.project);
        self.run("docker", &["network", "disconnect", &net, &id])
            .await?;
        let state = self.state(service).await?;
        ensure!(
            !state.networks.iter().any(|n| n == network),
            "{service} still on {network}: {state:?}"
        );
        Ok(state)
    }

    pub async fn connect(&self, service: &str, network: &str) -> anyhow::Result<ContainerState> {
        let id = self.id(service).await?;
        let net = format!("{}_{network}", self.project);
        // Same DNS name as compose gives it, so the others find it again.
        self.run(
            "docker",
            &["network", "connect", "--alias", service, &net, &id],
        )
        .await?;
        let state = self.state(service).await?;
        ensure!(
            state.networks.iter().any(|n| n == network),
            "{service} not on {network}: {state:?}"
        );
        Ok(state)
    }

    /// Waits until the service's health check passes.
    pub async fn wait_healthy(&self, service: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let id = self.id(service).await?;
            let health = self
                .run(
                    "docker",
                    &[
                        "inspect",
                        "-f",
                        "{{if .State.Health}}{{.State.Health.Status}}{{end}}",
                        &id,
                    ],
                )
                .await?;
            if health.trim() == "healthy" {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "{service} not healthy after {timeout:?} (health: {})",
                    health.trim()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}
