//! What the NATS users tests share: each role's credentials, connections as a role, refusal checks, and forged pushes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use adspend_common::config::NatsArgs;
use adspend_harness::{free_port, wait_until, workspace_root, NatsOptions, NatsServer};
use adspend_wire::codec::encode_sums;
use adspend_wire::types::{SumEntry, SumsUpdate, LIFETIME_BUCKET};

use crate::support::Pipeline;

pub(super) const ROLES: [&str; 5] = ["adserver", "limiter", "aggregator", "pacer", "auditor"];

/// What scripts/nats-auth.sh generated for one test.
pub(super) struct Auth {
    pub(super) dir: tempfile::TempDir,
    /// The server's settings: the generated secrets, then deploy/nats-auth.conf.
    pub(super) server_config: String,
    /// Role → its password.
    pub(super) passwords: BTreeMap<String, String>,
}

impl Auth {
    pub(super) fn generate() -> Auth {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = workspace_root();
        let output = Command::new("bash")
            .arg(root.join("scripts/nats-auth.sh"))
            .arg(dir.path())
            .output()
            .expect("run scripts/nats-auth.sh");
        assert!(
            output.status.success(),
            "scripts/nats-auth.sh failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let read = |path: &Path| {
            std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        };
        let server_config = format!(
            "{}\n{}",
            read(&dir.path().join("secrets.conf")),
            read(&root.join("deploy/nats-auth.conf"))
        );
        let mut passwords = BTreeMap::new();
        for role in ROLES {
            let env = read(&dir.path().join(format!("{role}.env")));
            let password = env
                .lines()
                .find_map(|l| l.strip_prefix("ADSPEND_NATS_PASSWORD="))
                .unwrap_or_else(|| panic!("{role}.env has no ADSPEND_NATS_PASSWORD"));
            passwords.insert(role.to_string(), password.to_string());
        }
        Auth {
            dir,
            server_config,
            passwords,
        }
    }

    pub(super) fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    pub(super) fn nats_options(&self) -> NatsOptions {
        NatsOptions {
            extra_config: self.server_config.clone(),
            ..NatsOptions::default()
        }
    }

    /// A service's settings, as an operator would give them.
    pub(super) fn env(&self, role: &str) -> Vec<(&'static str, String)> {
        vec![
            ("ADSPEND_NATS_USER", role.to_string()),
            ("ADSPEND_NATS_PASSWORD", self.passwords[role].clone()),
            ("ADSPEND_NATS_TLS_CA", self.ca().display().to_string()),
        ]
    }

    pub(super) fn args(&self, url: &str, role: &str) -> NatsArgs {
        NatsArgs {
            nats_user: Some(role.to_string()),
            nats_password: Some(self.passwords[role].clone()),
            nats_tls_ca: Some(self.ca()),
            ..NatsArgs::plain(url)
        }
    }
}

/// A client through the services' own connect path, with the server's error
/// messages (permission violations) collected.
pub(super) async fn connect(
    args: &NatsArgs,
) -> Result<(async_nats::Client, Arc<Mutex<Vec<String>>>), async_nats::ConnectError> {
    let errors = Arc::new(Mutex::new(Vec::new()));
    let sink = errors.clone();
    let options = adspend_common::nats::options(args)
        .expect("valid settings")
        .connection_timeout(Duration::from_secs(5))
        .event_callback(move |event| {
            let sink = sink.clone();
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    sink.lock().unwrap().push(e.to_string().to_lowercase());
                }
            }
        });
    let client = options.connect(args.nats_url.as_str()).await?;
    Ok((client, errors))
}

/// Waits until the server has reported a permissions violation for a
/// publish to `subject` on this connection.
pub(super) async fn refused(errors: &Arc<Mutex<Vec<String>>>, subject: &str) -> bool {
    let needle = format!("permissions violation for publish to \"{subject}\"").to_lowercase();
    wait_until(Duration::from_secs(5), Duration::from_millis(20), || {
        let found = errors.lock().unwrap().iter().any(|e| e.contains(&needle));
        async move { found }
    })
    .await
    .is_ok()
}

/// Whether the server has reported a permissions violation for a
/// subscription to `subject` on this connection (within 5 s).
pub(super) async fn subscription_refused(errors: &Arc<Mutex<Vec<String>>>, subject: &str) -> bool {
    let needle = format!("permissions violation for subscription to \"{subject}\"").to_lowercase();
    wait_until(Duration::from_secs(5), Duration::from_millis(20), || {
        let found = errors.lock().unwrap().iter().any(|e| e.contains(&needle));
        async move { found }
    })
    .await
    .is_ok()
}

pub(super) fn spawn_as(
    p: &Pipeline,
    auth: &Auth,
    service: &str,
) -> adspend_harness::ServiceProcess {
    let env = auth.env(service);
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    p.spawn_with(service, free_port(), &extra)
}

/// The limiter has created IMPRESSIONS (the ad server may not look, so ask
/// the monitoring endpoint). Its consumers come with the first input: one per
/// source under fair scheduling.
pub(super) async fn wait_limiter_consumer(nats: &NatsServer) {
    let url = format!(
        "{}/jsz?accounts=true&streams=true&consumers=true",
        nats.monitor_url()
    );
    wait_until(Duration::from_secs(30), Duration::from_millis(100), || {
        let url = url.clone();
        async move {
            match reqwest::get(&url).await {
                Ok(r) => r.text().await.is_ok_and(|body| {
                    // Indented JSON: compare without the whitespace.
                    let body: String = body.split_whitespace().collect();
                    body.contains("\"name\":\"IMPRESSIONS\"")
                }),
                Err(_) => false,
            }
        }
    })
    .await
    .expect("the limiter did not create IMPRESSIONS");
}

pub(super) fn forged_push(limit: &str, lifetime_micros: u64) -> Vec<u8> {
    encode_sums(&SumsUpdate {
        shard: "forged".into(),
        epoch: u64::MAX / 2,
        seq: u64::MAX / 2,
        push_seq: 1,
        full: true,
        watermark_ms: 0,
        source_ms: 0,
        entries: vec![SumEntry {
            limit: limit.to_string(),
            bucket: LIFETIME_BUCKET,
            bucket_micros: lifetime_micros,
            lifetime_micros,
            lifetime_events: 1_000_000,
        }],
    })
}

/// A push of no sums from a shard of its own: it changes no limit, and the
/// pacer lists the shard once it has applied it.
pub(super) fn barrier_push() -> Vec<u8> {
    encode_sums(&SumsUpdate {
        shard: "barrier".into(),
        epoch: 1,
        seq: 0,
        push_seq: 1,
        full: false,
        watermark_ms: 0,
        source_ms: 0,
        entries: Vec::new(),
    })
}
