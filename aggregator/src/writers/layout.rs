//! Which shards a single-machine aggregator runs: `ADSPEND_AGGREGATOR_WRITERS`
//! resolved against what the data directory (and etcd's checkpoint records)
//! already hold.
//!
//! A count is taken as given, and a data directory written with another
//! is refused ([`check_layout`]), naming what it holds and the way forward,
//! instead of starting empty shards beside state they would not read.
//! "auto" follows what is there: the data directory's shards, else the
//! shards etcd holds records of (a data directory lost with its records in
//! etcd restores from them), else one writer per core, at most one per
//! partition. So an upgrade, a move to a machine with other cores, or a
//! lost disk never changes a layout under "auto".

use std::collections::BTreeSet;
use std::path::Path;

use adspend_common::env;
use adspend_common::etcd::Background;
use adspend_common::Error as CommonError;

use super::groups;
use crate::config::{Config, Ownership, Writers};
use crate::error::Error;

/// The shards to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Layout {
    /// One shard for every owned partition, in the data dir itself.
    Single,
    /// Several, each in `<data dir>/p<list>/`.
    Shards(Vec<Vec<u32>>),
}

impl Layout {
    pub(crate) fn writers(&self) -> usize {
        match self {
            Layout::Single => 1,
            Layout::Shards(groups) => groups.len(),
        }
    }
}

/// The layout this start runs, and why (for the start's log line).
pub(crate) async fn choose(
    config: &Config,
    owned: &[u32],
    single_name: &str,
    background: &Background,
) -> Result<(Layout, &'static str), Error> {
    let data_dir = config.data_dir();
    let count = match config.writers {
        Writers::Count(n) => n,
        Writers::Auto => {
            let refuse = |reason: String| refused(&config.writers, &data_dir, reason);
            if let Some(layout) = on_disk(&data_dir, owned).map_err(refuse)? {
                return Ok((layout, "as the data directory holds"));
            }
            if !config.etcd.endpoints().is_empty() {
                let client = adspend_common::etcd::connect(&config.etcd, background).await?;
                let names = recorded_shards(client).await?;
                if let Some(layout) = recorded(&names, owned, single_name).map_err(refuse)? {
                    return Ok((layout, "as the checkpoint records in etcd hold"));
                }
            }
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            let n = cores.min(owned.len()).max(1);
            return Ok((fresh(owned, n), "one per core, at most one per partition"));
        }
    };
    let layout = fresh(owned, count as usize);
    let names = match &layout {
        Layout::Single => None,
        Layout::Shards(groups) => Some(names(groups)),
    };
    check_layout(&data_dir, count, names.as_deref())?;
    Ok((layout, "as set"))
}

fn fresh(owned: &[u32], writers: usize) -> Layout {
    if writers <= 1 {
        Layout::Single
    } else {
        Layout::Shards(groups(owned, writers))
    }
}

/// The shard names of `groups` (`p0-2`, `p1-3`).
pub(crate) fn names(groups: &[Vec<u32>]) -> Vec<String> {
    groups
        .iter()
        .map(|g| Ownership::Fixed(g.clone()).shard())
        .collect()
}

/// The partitions a shard's name lists (`p0-2` → 0, 2).
fn partitions_of(name: &str) -> Option<Vec<u32>> {
    let rest = name.strip_prefix('p')?;
    rest.split('-').map(|p| p.parse().ok()).collect()
}

/// `names` as groups, if they split `owned` exactly.
fn cover(names: &[String], owned: &[u32]) -> Result<Layout, String> {
    let groups: Vec<Vec<u32>> = names.iter().filter_map(|n| partitions_of(n)).collect();
    let mut seen = BTreeSet::new();
    let disjoint = groups.iter().flatten().all(|p| seen.insert(*p));
    let wanted: BTreeSet<u32> = owned.iter().copied().collect();
    if groups.len() != names.len() || !disjoint || seen != wanted {
        return Err(format!(
            "the shards {} do not split the partitions {} this aggregator owns",
            names.join(", "),
            owned
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ));
    }
    Ok(Layout::Shards(groups))
}

/// What the data directory holds, if anything.
fn on_disk(data_dir: &Path, owned: &[u32]) -> Result<Option<Layout>, String> {
    let single = data_dir.join("lmdb").is_dir();
    let shards = shard_dirs(data_dir);
    match (single, shards.is_empty()) {
        (false, true) => Ok(None),
        (true, true) => Ok(Some(Layout::Single)),
        (true, false) => Err(format!(
            "the data directory holds one shard for all its partitions and the shards {}",
            shards.join(", ")
        )),
        (false, false) => cover(&shards, owned).map(Some),
    }
}

/// What etcd holds records of, among the shards that could be this
/// aggregator's: the one-writer shard (`single_name`) or shards whose
/// partitions are all owned here.
fn recorded(names: &[String], owned: &[u32], single_name: &str) -> Result<Option<Layout>, String> {
    if names.iter().any(|n| n == single_name) {
        return Ok(Some(Layout::Single));
    }
    let wanted: BTreeSet<u32> = owned.iter().copied().collect();
    let mine: Vec<String> = names
        .iter()
        .filter(|n| partitions_of(n).is_some_and(|ps| ps.iter().all(|p| wanted.contains(p))))
        .cloned()
        .collect();
    if mine.is_empty() {
        return Ok(None);
    }
    cover(&mine, owned).map(Some)
}

/// The shards etcd holds checkpoint records of.
async fn recorded_shards(mut client: etcd_client::Client) -> Result<Vec<String>, Error> {
    const PREFIX: &str = "/adspend/shards/";
    let response = client
        .get(
            PREFIX,
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await
        .map_err(CommonError::etcd("get", PREFIX))?;
    let mut names: Vec<String> = response
        .kvs()
        .iter()
        .filter_map(|kv| kv.key_str().ok())
        .filter_map(|key| key.strip_prefix(PREFIX)?.strip_suffix("/checkpoint"))
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

/// The shard directories in `data_dir` (`p…/` holding an `lmdb/`).
fn shard_dirs(data_dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(data_dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .flatten()
        .filter(|e| e.path().join("lmdb").is_dir())
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|name| {
            name.strip_prefix('p').is_some_and(|rest| {
                !rest.is_empty() && rest.chars().all(|c| c.is_ascii_digit() || c == '-')
            })
        })
        .collect();
    names.sort();
    names
}

fn refused(writers: &Writers, data_dir: &Path, found: String) -> Error {
    Error::Common(CommonError::Config {
        name: env::AGGREGATOR_WRITERS,
        value: writers.to_string(),
        reason: format!(
            "{found} (in {}). Set the number of writers the shards were written with, \
             or move the data directory aside (see docs/OPERATIONS.md, \"Upgrading\")",
            data_dir.display()
        ),
    })
}

/// Refuse a data directory written with another number of writers:
/// `expected` are the shard names this start makes (`None`: one shard in
/// the data dir itself).
pub(crate) fn check_layout(
    data_dir: &Path,
    writers: u32,
    expected: Option<&[String]>,
) -> Result<(), Error> {
    let single = data_dir.join("lmdb").is_dir();
    let shards = shard_dirs(data_dir);
    let found = match (single, shards.is_empty()) {
        (false, true) => return Ok(()),
        (true, true) => "one shard for all its partitions (written with 1 writer)".to_string(),
        (false, false) => format!("the shards {}", shards.join(", ")),
        (true, false) => format!(
            "one shard for all its partitions and the shards {}",
            shards.join(", ")
        ),
    };
    let refuse = match expected {
        None => !shards.is_empty(),
        Some(names) => single || shards.iter().any(|s| !names.contains(s)),
    };
    if !refuse {
        return Ok(());
    }
    let asked = match expected {
        None => "one shard in the data dir itself".to_string(),
        Some(names) => format!("the shards {}", names.join(", ")),
    };
    Err(Error::Common(CommonError::Config {
        name: env::AGGREGATOR_WRITERS,
        value: writers.to_string(),
        reason: format!(
            "the data directory {} holds {found}, and this setting makes {asked}. \
             Start with the setting it was written with (or \"auto\", which follows it), \
             or move the directory aside: \
             the new shards then restore from their own checkpoints if they have any, \
             else replay SPEND from its first sequence (exact while SPEND holds all of it; \
             otherwise each stops naming the gap, see docs/RECOVERY.md)",
            data_dir.display()
        ),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_dir_written_with_other_writers_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let two = vec!["p0-2".to_string(), "p1-3".to_string()];
        // Empty: anything goes.
        assert!(check_layout(dir.path(), 1, None).is_ok());
        assert!(check_layout(dir.path(), 2, Some(&two)).is_ok());

        std::fs::create_dir_all(dir.path().join("lmdb")).unwrap();
        assert!(check_layout(dir.path(), 1, None).is_ok());
        let e = check_layout(dir.path(), 2, Some(&two)).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("ADSPEND_AGGREGATOR_WRITERS") && text.contains("one shard for all"),
            "{text}"
        );
        assert_eq!(adspend_common::service::Failure::exit_code(&e), 64);

        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("p0-2/lmdb")).unwrap();
        std::fs::create_dir_all(dir.path().join("p1-3/lmdb")).unwrap();
        assert!(check_layout(dir.path(), 2, Some(&two)).is_ok());
        let e = check_layout(dir.path(), 1, None).unwrap_err();
        assert!(e.to_string().contains("p0-2, p1-3"), "{e}");
        let four: Vec<String> = ["p0", "p1", "p2", "p3"].map(String::from).to_vec();
        assert!(check_layout(dir.path(), 4, Some(&four)).is_err());
        // What is not a shard's directory does not count.
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("snapshots/x")).unwrap();
        std::fs::create_dir_all(dir.path().join("checkpoint")).unwrap();
        assert!(check_layout(dir.path(), 2, Some(&two)).is_ok());
    }

    fn strings(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn auto_follows_the_data_directory() {
        let owned = [0, 1, 2, 3];
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(on_disk(dir.path(), &owned), Ok(None));
        std::fs::create_dir_all(dir.path().join("lmdb")).unwrap();
        assert_eq!(on_disk(dir.path(), &owned), Ok(Some(Layout::Single)));

        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("p0-2/lmdb")).unwrap();
        std::fs::create_dir_all(dir.path().join("p1-3/lmdb")).unwrap();
        assert_eq!(
            on_disk(dir.path(), &owned),
            Ok(Some(Layout::Shards(vec![vec![0, 2], vec![1, 3]])))
        );
        // Shards that do not split what is owned: refused, named.
        let e = on_disk(dir.path(), &[0, 1, 2, 3, 4, 5]).unwrap_err();
        assert!(e.contains("p0-2, p1-3") && e.contains("0,1,2,3,4,5"), "{e}");
        std::fs::create_dir_all(dir.path().join("lmdb")).unwrap();
        assert!(on_disk(dir.path(), &owned).is_err());
    }

    #[test]
    fn auto_follows_the_records_in_etcd() {
        let owned = [0, 1, 2, 3];
        assert_eq!(recorded(&[], &owned, "all"), Ok(None));
        assert_eq!(
            recorded(&strings(&["all", "p0-2"]), &owned, "all"),
            Ok(Some(Layout::Single))
        );
        // Cluster mode's one shard per partition, continued here.
        assert_eq!(
            recorded(&strings(&["p0", "p1", "p2", "p3"]), &owned, "all"),
            Ok(Some(Layout::Shards(vec![
                vec![0],
                vec![1],
                vec![2],
                vec![3]
            ])))
        );
        // Another aggregator's shards (partitions 4 and 5) are not ours.
        assert_eq!(recorded(&strings(&["p4-5"]), &owned, "p0-1-2-3"), Ok(None));
        assert_eq!(
            recorded(&strings(&["p0-2", "p1-3", "p4-5"]), &owned, "p0-1-2-3"),
            Ok(Some(Layout::Shards(vec![vec![0, 2], vec![1, 3]])))
        );
        // Half of ours recorded: refused rather than guessed.
        assert!(recorded(&strings(&["p0-2"]), &owned, "all").is_err());
        assert!(recorded(&strings(&["p0-2", "p2"]), &owned, "all").is_err());
    }

    #[test]
    fn a_fresh_layout_deals_partitions_to_writers() {
        assert_eq!(fresh(&[0, 1, 2, 3], 1), Layout::Single);
        assert_eq!(
            fresh(&[0, 1, 2, 3], 2),
            Layout::Shards(vec![vec![0, 2], vec![1, 3]])
        );
        assert_eq!(names(&[vec![0, 2], vec![1, 3]]), ["p0-2", "p1-3"]);
        assert_eq!(partitions_of("p10-3"), Some(vec![10, 3]));
        assert_eq!(partitions_of("all"), None);
        assert_eq!(partitions_of("p"), None);
    }
}
