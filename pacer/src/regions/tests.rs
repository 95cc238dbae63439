//! The book between the wire arithmetic and the pacer: readiness, grants
//! decided but not yet held, demand, and restoring its own counters.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use adspend_wire::catalog::Catalog;
use adspend_wire::regions::{RegionName, RegionReport};
use chrono::Utc;

use super::book::{Book, Own};

const BUDGET: u64 = 900_000;

fn name(s: &str) -> RegionName {
    RegionName::new(s).unwrap()
}

fn all() -> BTreeSet<RegionName> {
    ["east", "west", "south"].into_iter().map(name).collect()
}

fn catalog() -> Catalog {
    Catalog::parse(
        "t",
        format!(
            r#"{{"limits":{{"c":{{"budget_micros":{BUDGET},"period":"lifetime"}}}},"ads":{{"a":["c"]}}}}"#
        )
        .as_bytes(),
    )
    .unwrap()
}

fn book(region: &str) -> Book {
    let mut book = Book::new(name(region), all());
    book.follow_catalog(&catalog(), Utc::now());
    book
}

/// `book`'s next report, with `leased` held on `c`.
fn report(book: &mut Book, leased: u64) -> RegionReport {
    let own = HashMap::from([(
        Arc::<str>::from("c"),
        Own {
            leased,
            ..Own::default()
        },
    )]);
    let (seq, entries) = book.next_report(&catalog(), &own);
    book.end_interval();
    RegionReport::new(
        book.region().clone(),
        seq,
        adspend_common::now_ms(),
        entries,
    )
}

#[test]
fn no_room_until_ready_and_pending_grants_count_against_it() {
    let mut east = book("east");
    assert_eq!(east.room("c", 0, 0), 0, "not ready: nothing to grant");
    east.set_ready();
    assert_eq!(east.room("c", 0, 0), BUDGET / 3);
    assert_eq!(east.room("c", 100_000, 50_000), BUDGET / 3 - 150_000);
    east.add_pending([("c", 200_000)]);
    assert_eq!(east.room("c", 0, 50_000), BUDGET / 3 - 250_000);
    east.remove_pending([("c", 200_000)]);
    assert_eq!(east.room("c", 0, 50_000), BUDGET / 3 - 50_000);
    assert_eq!(east.room("unknown", 0, 0), 0);
}

#[test]
fn unused_shares_flow_to_the_region_that_wants_and_never_sum_past_the_budget() {
    let mut books: Vec<Book> = ["east", "west", "south"].into_iter().map(book).collect();
    for b in &mut books {
        b.set_ready();
    }
    let mut leased = 0;
    for _ in 0..20 {
        // East leases all its room and wants twice the budget more.
        let room = books[0].room("c", 0, leased);
        leased += room;
        books[0].add_want(&Arc::from("c"), 2 * BUDGET);
        let reports: Vec<RegionReport> = books
            .iter_mut()
            .enumerate()
            .map(|(i, b)| report(b, if i == 0 { leased } else { 0 }))
            .collect();
        for b in &mut books {
            for r in &reports {
                b.merge(r);
            }
        }
        let sum: u64 = books
            .iter()
            .map(|b| b.ledger("c").unwrap().allotment())
            .sum();
        assert!(sum <= BUDGET, "allotments {sum} > budget");
        assert!(leased <= books[0].ledger("c").unwrap().allotment());
    }
    let east = books[0].ledger("c").unwrap().allotment();
    assert!(east > BUDGET * 99 / 100, "east's allotment {east}");
    // West and south keep their reserve of what is left of theirs.
    for b in &books[1..] {
        assert!(b.ledger("c").unwrap().allotment() > 0);
    }
}

#[test]
fn its_own_last_report_restores_given_and_seq_after_a_restart() {
    let mut east = book("east");
    let mut west = book("west");
    east.set_ready();
    west.set_ready();
    east.add_want(&Arc::from("c"), BUDGET);
    let wants = report(&mut east, 0);
    west.merge(&wants);
    let gave = report(&mut west, 0);
    let given = west.ledger("c").unwrap().given_to(&name("east"));
    assert!(given > 0);
    let allotment = west.ledger("c").unwrap().allotment();
    // West restarts: a new book reads its own last report back.
    let mut again = book("west");
    assert_eq!(again.ledger("c").unwrap().given_to(&name("east")), 0);
    again.merge(&gave);
    assert_eq!(again.ledger("c").unwrap().given_to(&name("east")), given);
    assert_eq!(again.ledger("c").unwrap().allotment(), allotment);
    assert_eq!(again.seq(), gave.seq);
    again.set_ready();
    let next = report(&mut again, 0);
    assert!(
        next.seq > gave.seq,
        "seq went back: {} <= {}",
        next.seq,
        gave.seq
    );
}

#[test]
fn reports_of_regions_outside_the_deployment_are_ignored() {
    let mut east = book("east");
    let mut north = Book::new(name("north"), [name("north"), name("east")].into());
    north.follow_catalog(&catalog(), Utc::now());
    north.set_ready();
    let stranger = report(&mut north, 0);
    east.merge(&stranger);
    assert!(east.last_heard().get(&name("north")).is_none());
    assert!(east.ledger("c").unwrap().heard(&name("north")).is_none());
}

#[test]
fn unmet_demand_is_reported_for_two_intervals_then_forgotten() {
    let mut east = book("east");
    east.set_ready();
    east.add_want(&Arc::from("c"), 700);
    let wants: Vec<u64> = (0..3)
        .map(|_| report(&mut east, 0).limits[0].want_micros)
        .collect();
    assert_eq!(wants, [700, 700, 0]);
    // A reader (no report) forgets it just the same.
    east.add_want(&Arc::from("c"), 300);
    east.end_interval();
    east.end_interval();
    assert_eq!(report(&mut east, 0).limits[0].want_micros, 0);
}
