//! The aggregator's shards as a campaign sees them: one ("all", in the data
//! dir itself) with one writer, else `ADSPEND_AGGREGATOR_WRITERS` shards
//! dealt round robin (`p0-2`, `p1-3` for 4 partitions and 2), each with its
//! own LMDB, checkpoint record and applied sequence.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};

use super::aggregator_totals;

/// One shard: its name and partitions.
#[derive(Clone, Debug)]
pub(crate) struct Shard {
    pub(crate) name: String,
    pub(crate) partitions: Vec<u32>,
}

/// The shards an aggregator over `partitions` partitions runs with
/// `writers` (`"auto"`: one per core, at most one per partition, as the
/// aggregator chooses on an empty data directory).
pub(crate) fn layout(partitions: u32, writers: &str) -> anyhow::Result<Vec<Shard>> {
    let count = match writers.trim() {
        "auto" => std::thread::available_parallelism()
            .map_or(1, usize::from)
            .min(partitions as usize),
        n => n
            .parse::<usize>()
            .with_context(|| format!("ADSPEND_AGGREGATOR_WRITERS={n:?}"))?,
    }
    .max(1);
    if count == 1 {
        return Ok(vec![Shard {
            name: "all".into(),
            partitions: (0..partitions).collect(),
        }]);
    }
    let mut groups = vec![Vec::new(); count];
    for partition in 0..partitions {
        groups[partition as usize % count].push(partition);
    }
    Ok(groups
        .into_iter()
        .filter(|g| !g.is_empty())
        .map(|partitions| Shard {
            name: format!(
                "p{}",
                partitions
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join("-")
            ),
            partitions,
        })
        .collect())
}

impl Shard {
    /// The shard's directory under the aggregator's data dir.
    pub(crate) fn dir(&self, data_dir: &Path) -> PathBuf {
        if self.name == "all" {
            data_dir.to_path_buf()
        } else {
            data_dir.join(&self.name)
        }
    }

    /// The last `SPEND` sequence of its partitions (0: none yet).
    pub(crate) async fn last_seq(&self, stream: &Stream) -> anyhow::Result<u64> {
        let mut last = 0;
        for partition in &self.partitions {
            let subject = adspend_common::nats::spend_subject(*partition);
            match stream.get_last_raw_message_by_subject(&subject).await {
                Ok(message) => last = last.max(message.sequence),
                Err(e) if matches!(e.kind(), LastRawMessageErrorKind::NoMessageFound) => {}
                Err(e) => return Err(e).with_context(|| format!("last message on {subject}")),
            }
        }
        Ok(last)
    }
}

/// Lifetime sums over every shard's LMDB (the aggregator must be stopped).
pub(crate) fn totals(shards: &[Shard], data_dir: &Path) -> anyhow::Result<BTreeMap<String, u64>> {
    let mut all = BTreeMap::new();
    for shard in shards {
        for (limit, micros) in aggregator_totals(&shard.dir(data_dir).join("lmdb"))? {
            *all.entry(limit).or_insert(0) += micros;
        }
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_follow_the_writers_setting() {
        let one = layout(4, "1").unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].name, "all");
        let two = layout(4, "2").unwrap();
        let names: Vec<&str> = two.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["p0-2", "p1-3"]);
        assert_eq!(two[1].partitions, [1, 3]);
        assert_eq!(layout(2, "8").unwrap().len(), 2);
        assert!(layout(4, "many").is_err());
    }
}
