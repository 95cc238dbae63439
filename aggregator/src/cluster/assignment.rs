//! Which live member owns which partition.
//!
//! Every member computes the same answer from the same member list, with no
//! coordinator: rendezvous hashing (each partition ranks the members by a
//! hash of (partition, member) and goes to the best-ranked one with room),
//! capped so that loads differ by at most one. A member joining or leaving
//! moves few partitions beyond those it takes or gives up, because each
//! partition's ranking of the others does not change.

use xxhash_rust::xxh3::xxh3_64;

/// The owner (an index into `members`) of each partition `0..partitions`;
/// `None` for every partition when there are no members. `members` must be
/// sorted and free of duplicates (the order of the input does not change
/// the answer's owners, only their indexes).
pub(crate) fn assign(partitions: u32, members: &[String]) -> Vec<Option<usize>> {
    let n = members.len();
    if n == 0 {
        return vec![None; partitions as usize];
    }
    let floor = partitions as usize / n;
    // This many members carry one partition more than the floor.
    let extra = partitions as usize % n;
    let mut load = vec![0usize; n];
    let mut at_ceiling = 0usize;
    let mut owners = Vec::with_capacity(partitions as usize);
    let mut ranking: Vec<(u64, usize)> = Vec::with_capacity(n);
    for partition in 0..partitions {
        ranking.clear();
        ranking.extend(
            members
                .iter()
                .enumerate()
                .map(|(i, member)| (score(partition, member), i)),
        );
        // Highest score first; ties (astronomically rare) by index.
        ranking.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let owner = ranking
            .iter()
            .map(|&(_, i)| i)
            .find(|&i| load[i] < floor || (load[i] == floor && at_ceiling < extra))
            .expect("capacity is exactly the number of partitions");
        if load[owner] == floor {
            at_ceiling += 1;
        }
        load[owner] += 1;
        owners.push(Some(owner));
    }
    owners
}

/// The partitions `member` owns under `assign`.
pub(crate) fn owned_by(partitions: u32, members: &[String], member: &str) -> Vec<u32> {
    let Some(me) = members.iter().position(|m| m == member) else {
        return Vec::new();
    };
    assign(partitions, members)
        .into_iter()
        .enumerate()
        .filter(|(_, owner)| *owner == Some(me))
        .map(|(p, _)| p as u32)
        .collect()
}

fn score(partition: u32, member: &str) -> u64 {
    let mut key = Vec::with_capacity(4 + member.len());
    key.extend_from_slice(&partition.to_be_bytes());
    key.extend_from_slice(member.as_bytes());
    xxh3_64(&key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn members(names: &[&str]) -> Vec<String> {
        let mut m: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        m.sort();
        m
    }

    fn owners_by_name(partitions: u32, members: &[String]) -> Vec<String> {
        assign(partitions, members)
            .into_iter()
            .map(|o| members[o.unwrap()].clone())
            .collect()
    }

    #[test]
    fn no_members_no_owners() {
        assert_eq!(assign(4, &[]), vec![None; 4]);
        assert!(owned_by(4, &[], "a").is_empty());
    }

    #[test]
    fn sixteen_over_three_is_six_five_five() {
        let m = members(&["aggregator1", "aggregator2", "aggregator3"]);
        let mut loads: Vec<usize> = m.iter().map(|id| owned_by(16, &m, id).len()).collect();
        loads.sort_unstable();
        assert_eq!(loads, vec![5, 5, 6]);
        // A stranger owns nothing.
        assert!(owned_by(16, &m, "aggregator9").is_empty());
    }

    proptest! {
        #[test]
        fn balanced_complete_and_deterministic(
            partitions in 1u32..200,
            names in proptest::collection::btree_set("[a-z0-9]{1,8}", 1..12),
        ) {
            let m: Vec<String> = names.into_iter().collect();
            let owners = assign(partitions, &m);
            prop_assert_eq!(owners.len(), partitions as usize);
            let mut load = vec![0usize; m.len()];
            for owner in &owners {
                load[owner.expect("every partition has an owner")] += 1;
            }
            let (min, max) = (load.iter().min().unwrap(), load.iter().max().unwrap());
            prop_assert!(max - min <= 1, "loads {:?}", load);
            prop_assert_eq!(assign(partitions, &m), owners);
            // Each member's own view agrees with the whole.
            let total: usize = m.iter().map(|id| owned_by(partitions, &m, id).len()).sum();
            prop_assert_eq!(total, partitions as usize);
        }

        #[test]
        fn a_joining_member_moves_few_partitions(
            names in proptest::collection::btree_set("[a-z0-9]{1,8}", 2..8),
            joiner in "[A-Z]{1,8}",
        ) {
            let partitions = 64u32;
            let before: Vec<String> = names.into_iter().collect();
            let mut after = before.clone();
            after.push(joiner.clone());
            after.sort();
            let (old, new) = (owners_by_name(partitions, &before), owners_by_name(partitions, &after));
            let moved_to_joiner = new.iter().filter(|o| **o == joiner).count();
            let moved_between_others = old
                .iter()
                .zip(&new)
                .filter(|(o, n)| o != n && **n != joiner)
                .count();
            // The joiner takes its share; the capping may shuffle a few more.
            prop_assert!(moved_to_joiner >= partitions as usize / after.len());
            prop_assert!(
                moved_between_others <= partitions as usize / 4,
                "{} partitions moved between members that stayed", moved_between_others
            );
        }
    }
}
