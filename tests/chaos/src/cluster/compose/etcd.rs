//! The control plane as etcd holds it, read with `etcdctl` inside an etcd
//! container (whose environment carries the CA and the admin client
//! certificate: etcd accepts nothing else).

use std::collections::BTreeMap;

use anyhow::{ensure, Context};
use base64::{engine::general_purpose::STANDARD as BASE64, Engine};
use serde_json::Value;

use super::Cluster;

/// One read of a key prefix, with where etcd answered it from.
pub struct EtcdRead {
    /// The store revision the answering member was at.
    pub revision: i64,
    /// The answering member's id.
    pub member: u64,
    pub values: BTreeMap<String, String>,
}

impl Cluster {
    /// `etcdctl ARGS` inside the first etcd container that answers.
    pub async fn etcdctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut last = anyhow::anyhow!("no etcd container is running");
        for etcd in ["etcd1", "etcd2", "etcd3"] {
            // A stopped or paused container refuses the exec at once.
            let id = self.id(etcd).await?;
            let mut full = vec!["exec", id.as_str(), "etcdctl", "--command-timeout=3s"];
            full.extend_from_slice(args);
            match self.run("docker", &full).await {
                Ok(out) => return Ok(out),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// `etcdctl ARGS` in etcd1 with `env` overriding its settings (an empty
    /// value unsets one: `ETCDCTL_CERT=` drops the client certificate), to
    /// show what etcd does with clients that lack something.
    pub async fn etcdctl_as(&self, env: &[(&str, &str)], args: &[&str]) -> anyhow::Result<String> {
        let id = self.id("etcd1").await?;
        let env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let mut full = vec!["exec"];
        for pair in &env {
            full.extend(["-e", pair.as_str()]);
        }
        full.extend([
            id.as_str(),
            "etcdctl",
            "--dial-timeout=3s",
            "--command-timeout=3s",
        ]);
        full.extend_from_slice(args);
        self.run("docker", &full).await
    }

    /// Every key under `prefix` with its value, and the revision the member
    /// answered at with its id: a member that a pause left behind answers
    /// linearizable reads from an older revision (etcd 3.4,
    /// etcd-io/etcd#20418), which an observer must tell apart from a value
    /// written back.
    pub async fn etcd_prefix_at(&self, prefix: &str) -> anyhow::Result<EtcdRead> {
        let out = self
            .etcdctl(&["get", "--prefix", prefix, "-w", "json"])
            .await?;
        let json: Value = serde_json::from_str(&out).context("etcdctl get -w json")?;
        let header = &json["header"];
        let text = |v: &Value| -> anyhow::Result<String> {
            let bytes = BASE64.decode(v.as_str().unwrap_or_default())?;
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        };
        let mut values = BTreeMap::new();
        for kv in json["kvs"].as_array().into_iter().flatten() {
            values.insert(text(&kv["key"])?, text(&kv["value"])?);
        }
        Ok(EtcdRead {
            revision: header["revision"]
                .as_i64()
                .context("no revision in the answer")?,
            member: header["member_id"].as_u64().unwrap_or_default(),
            values,
        })
    }

    /// Every key under `prefix` with its (single-line) value.
    pub async fn etcd_prefix(&self, prefix: &str) -> anyhow::Result<BTreeMap<String, String>> {
        let out = self.etcdctl(&["get", "--prefix", prefix]).await?;
        let lines: Vec<&str> = out.lines().collect();
        ensure!(
            lines.len().is_multiple_of(2),
            "etcdctl get --prefix {prefix}: odd output (multi-line value?)"
        );
        Ok(lines
            .chunks(2)
            .map(|kv| (kv[0].to_owned(), kv[1].to_owned()))
            .collect())
    }

    /// Partition → owning member id, from `/adspend/partitions/<p>/owner`.
    pub async fn owners(&self) -> anyhow::Result<BTreeMap<u32, String>> {
        let mut owners = BTreeMap::new();
        for (key, value) in self.etcd_prefix("/adspend/partitions/").await? {
            if let Some(p) = key
                .strip_prefix("/adspend/partitions/")
                .and_then(|k| k.strip_suffix("/owner"))
            {
                owners.insert(p.parse().context("partition number")?, value);
            }
        }
        Ok(owners)
    }

    /// Live members, from `/adspend/members/<id>`.
    pub async fn members(&self) -> anyhow::Result<Vec<String>> {
        Ok(self
            .etcd_prefix("/adspend/members/")
            .await?
            .keys()
            .filter_map(|k| k.strip_prefix("/adspend/members/").map(str::to_owned))
            .collect())
    }

    /// Partition → (epoch, seq) of its checkpoint record in etcd.
    pub async fn checkpoints(&self) -> anyhow::Result<BTreeMap<u32, (u64, u64)>> {
        let mut records = BTreeMap::new();
        for (key, value) in self.etcd_prefix("/adspend/shards/").await? {
            let Some(p) = key
                .strip_prefix("/adspend/shards/p")
                .and_then(|k| k.strip_suffix("/checkpoint"))
            else {
                continue;
            };
            let record: Value = serde_json::from_str(&value)
                .with_context(|| format!("checkpoint record {key}: {value}"))?;
            let field = |name: &str| {
                record[name]
                    .as_u64()
                    .with_context(|| format!("{key} has no {name}: {value}"))
            };
            records.insert(p.parse()?, (field("epoch")?, field("seq")?));
        }
        Ok(records)
    }

    /// `etcdctl put KEY` with the value on stdin (a catalog is too long for
    /// an argument), in the first etcd container that takes it.
    pub async fn etcdctl_put(&self, key: &str, value: &str) -> anyhow::Result<()> {
        use tokio::io::AsyncWriteExt;
        let mut last = anyhow::anyhow!("no etcd container is running");
        for etcd in ["etcd1", "etcd2", "etcd3"] {
            let id = self.id(etcd).await?;
            let mut child = tokio::process::Command::new("docker")
                .args([
                    "exec",
                    "-i",
                    &id,
                    "etcdctl",
                    "--command-timeout=5s",
                    "put",
                    key,
                ])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .context("docker exec etcdctl put")?;
            let mut stdin = child.stdin.take().context("stdin")?;
            stdin.write_all(value.as_bytes()).await?;
            drop(stdin);
            let output = child.wait_with_output().await?;
            if output.status.success() {
                return Ok(());
            }
            last = anyhow::anyhow!(
                "etcdctl put {key} in {etcd}: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Err(last)
    }

    /// The compose service of etcd's current leader (`etcd2`).
    pub async fn etcd_leader(&self) -> anyhow::Result<String> {
        let out = self
            .etcdctl(&["endpoint", "status", "--cluster", "-w", "json"])
            .await?;
        let statuses: Value = serde_json::from_str(&out).context("endpoint status json")?;
        let statuses = statuses
            .as_array()
            .context("endpoint status: not an array")?;
        let leader = statuses
            .iter()
            .find_map(|s| s["Status"]["leader"].as_u64())
            .context("endpoint status names no leader")?;
        let endpoint = statuses
            .iter()
            .find(|s| s["Status"]["header"]["member_id"].as_u64() == Some(leader))
            .and_then(|s| s["Endpoint"].as_str())
            .context("the leader's endpoint is not among the answers")?;
        // `https://etcd2:2379` -> `etcd2`
        let host = endpoint
            .split_once("://")
            .map_or(endpoint, |(_, rest)| rest);
        Ok(host.split(':').next().unwrap_or(host).to_owned())
    }
}
