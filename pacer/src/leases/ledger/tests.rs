use super::*;

fn grant(ad: &str, limits: &[&str], micros: u64, expires_at_ms: i64) -> Grant {
    Grant {
        ad_id: ad.into(),
        limits: limits.iter().map(|l| l.to_string()).collect(),
        micros,
        expires_at_ms,
    }
}

fn batch(grants: Vec<Grant>) -> Batch {
    Batch {
        pacer: "p".into(),
        at_ms: 0,
        grants,
        releases: Vec::new(),
    }
}

fn release(id: LeaseId, served_micros: u64) -> Batch {
    Batch {
        releases: vec![Release {
            lease_id: id.encode(),
            served_micros,
        }],
        ..Batch::default()
    }
}

#[test]
fn a_release_frees_what_was_not_served_and_holds_what_is_not_reported() {
    let mut ledger = Ledger::default();
    let g = grant("ad-1", &["s", "c"], 1_000, 30_000);
    ledger.fold(
        1,
        &batch(vec![g.clone(), grant("ad-2", &["c"], 500, 30_000)]),
    );
    let id = Batch::lease_id(1, 0, &g);
    ledger.report(id, 100, 0);
    ledger.settle(i64::MAX);
    // Served 300 of the 1,000: 100 reported, 200 still in flight.
    ledger.fold(2, &release(id, 300));
    assert_eq!((ledger.held("s"), ledger.held("c")), (200, 700));
    assert_eq!(
        ledger.released(),
        Released {
            leases: 1,
            micros: 700
        }
    );
    // The first release counts: a later one frees nothing more and
    // takes nothing back.
    ledger.fold(3, &release(id, 900));
    ledger.fold(4, &release(id, 10));
    assert_eq!(ledger.held("c"), 700);
    assert_eq!(ledger.released().leases, 1);
    // The rest reported: it holds nothing, and reports beyond what was
    // served change nothing.
    ledger.report(id, 300, 0);
    ledger.settle(i64::MAX);
    assert_eq!((ledger.held("s"), ledger.held("c")), (0, 500));
    ledger.report(id, 1_200, 0);
    ledger.settle(i64::MAX);
    assert_eq!((ledger.held("s"), ledger.held("c")), (0, 500));
    // Still live (and counted) until expiry plus the grace.
    assert_eq!(ledger.held_by("s").leases, 1);
    let retired = ledger.retire(90_000, 60_000);
    assert_eq!((retired.leases, retired.unused_micros), (2, 500));
    assert_eq!(ledger.held_by("c"), Held::default());
}

#[test]
fn a_release_of_a_lease_not_live_changes_nothing() {
    let mut ledger = Ledger::default();
    let g = grant("ad-1", &["c"], 1_000, 10_000);
    ledger.fold(1, &batch(vec![g.clone()]));
    let id = Batch::lease_id(1, 0, &g);
    ledger.fold(2, &release(Batch::lease_id(1, 5, &g), 0));
    let mut bad = release(id, 0);
    bad.releases[0].lease_id = "not-a-lease".into();
    ledger.fold(3, &bad);
    assert_eq!(ledger.held("c"), 1_000);
    ledger.retire(i64::MAX, 0);
    ledger.fold(4, &release(id, 0));
    assert_eq!(ledger.released(), Released::default());
    assert_eq!(ledger.held("c"), 0);
}

#[test]
fn a_commit_without_releases_reads_as_before_and_writes_as_before() {
    let old = br#"{"pacer":"p","at_ms":5,"grants":[]}"#;
    let read: Batch = serde_json::from_slice(old).unwrap();
    assert!(read.releases.is_empty());
    assert_eq!(serde_json::to_vec(&read).unwrap(), old.to_vec());
}

#[test]
fn a_grant_holds_its_limits_until_covered() {
    let mut ledger = Ledger::default();
    ledger.fold(
        1,
        &batch(vec![
            grant("ad-1", &["s", "c"], 1_000, 30_000),
            grant("ad-2", &["c"], 500, 30_000),
            grant("ad-3", &["c"], 0, 30_000),
        ]),
    );
    assert_eq!((ledger.held("s"), ledger.held("c")), (1_000, 1_500));
    assert_eq!(ledger.live(), 2, "a grant of nothing is not kept");
    let first = Batch::lease_id(1, 0, &grant("", &[], 0, 30_000));
    ledger.report(first, 400, 0);
    ledger.settle(i64::MAX);
    assert_eq!((ledger.held("s"), ledger.held("c")), (600, 1_100));
    // A push that is not newer changes nothing.
    ledger.report(first, 300, 0);
    ledger.settle(i64::MAX);
    assert_eq!(ledger.held("c"), 1_100);
    // Beyond the grant: it holds nothing, and no more is freed.
    ledger.report(first, 1_700, 0);
    ledger.settle(i64::MAX);
    assert_eq!((ledger.held("s"), ledger.held("c")), (0, 500));
    assert_eq!(ledger.lease(&first).map(|l| l.reported), Some(1_700));
}

#[test]
fn a_batch_folds_once() {
    let mut ledger = Ledger::default();
    let b = batch(vec![grant("ad-1", &["c"], 1_000, 30_000)]);
    ledger.fold(4, &b);
    ledger.fold(4, &b);
    ledger.fold(3, &b);
    assert_eq!(ledger.held("c"), 1_000);
    assert_eq!(ledger.folded_seq(), 4);
    ledger.fold(5, &b);
    assert_eq!(ledger.held("c"), 2_000, "a later batch is another grant");
}

#[test]
fn a_report_before_its_grant_waits_for_it() {
    let mut ledger = Ledger::default();
    let g = grant("ad-1", &["c"], 1_000, 30_000);
    ledger.report(Batch::lease_id(7, 0, &g), 250, 0);
    ledger.settle(i64::MAX);
    ledger.fold(7, &batch(vec![g]));
    assert_eq!(ledger.held("c"), 750);
}

#[test]
fn retired_after_expiry_plus_grace_once_caught_up() {
    let mut ledger = Ledger::default();
    ledger.fold(
        1,
        &batch(vec![
            grant("ad-1", &["c"], 1_000, 10_000),
            grant("ad-2", &["c"], 2_000, 20_000),
        ]),
    );
    let first = Batch::lease_id(1, 0, &grant("", &[], 0, 10_000));
    ledger.report(first, 100, 0);
    ledger.settle(i64::MAX);
    assert_eq!(ledger.retire(69_999, 60_000), Retired::default());
    assert_eq!(
        ledger.held_by("c"),
        Held {
            micros: 2_900,
            leases: 2
        }
    );
    assert_eq!(
        ledger.retire(70_000, 60_000),
        Retired {
            leases: 1,
            unused_micros: 900
        }
    );
    assert_eq!(ledger.held("c"), 2_000);
    assert_eq!(ledger.retire(i64::MAX, 60_000).leases, 1);
    assert_eq!(ledger.held_by("c"), Held::default());
    assert_eq!(ledger.live(), 0);
    // A report of a retired lease holds nothing and is not kept.
    ledger.report(first, 500, 0);
    ledger.settle(i64::MAX);
    assert_eq!(ledger.held("c"), 0);
    assert!(ledger.early.is_empty());
}

#[test]
fn a_report_frees_nothing_until_every_shard_has_caught_up_with_it() {
    let mut ledger = Ledger::default();
    let g = grant("ad-1", &["c"], 1_000, 60_000);
    ledger.fold(1, &batch(vec![g.clone()]));
    let id = Batch::lease_id(1, 0, &g);
    // Reported by a push complete as of 10 s: the limit's own spend may
    // still be on its way from another shard.
    ledger.report(id, 600, 10_000);
    ledger.settle(10_000 + REPORT_MARGIN_MS - 1);
    assert_eq!(ledger.held("c"), 1_000);
    ledger.settle(10_000 + REPORT_MARGIN_MS);
    assert_eq!(ledger.held("c"), 400);
}

#[test]
fn early_reports_are_forgotten_once_they_cannot_matter() {
    let mut ledger = Ledger::default();
    let g = grant("ad-1", &["c"], 1_000, 10_000);
    ledger.report(Batch::lease_id(9, 0, &g), 5, 0);
    ledger.settle(i64::MAX);
    assert_eq!(ledger.early.len(), 1);
    ledger.retire(70_000, 60_000);
    assert!(ledger.early.is_empty());
}
