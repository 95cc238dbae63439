use super::*;

fn name(s: &str) -> RegionName {
    RegionName::new(s).unwrap()
}

fn set(names: &[&str]) -> BTreeSet<RegionName> {
    names.iter().map(|n| name(n)).collect()
}

const DAY: i64 = 86_400_000;
const TODAY: i64 = 20_000 * DAY;

/// A ledger for limit "c1" at `me` among east, west, south.
fn ledger(me: &str, budget: Micros) -> LimitLedger {
    LimitLedger::new(
        "c1",
        name(me),
        set(&["east", "west", "south"]),
        budget,
        TODAY,
    )
    .unwrap()
}

/// `from`'s report of its ledger, with the given own figures.
fn report_of(
    from: &LimitLedger,
    seq: u64,
    spend: Micros,
    leased: Micros,
    want: Micros,
) -> RegionReport {
    RegionReport::new(
        from.region().clone(),
        seq,
        1_000 + seq as i64,
        vec![from.entry(spend, spend, leased, want)],
    )
}

fn deliver(to: &mut LimitLedger, report: &RegionReport) -> Merged {
    to.merge(report.origin(), &report.limits[0])
}

#[test]
fn initial_shares_add_up_to_the_budget_with_the_remainder_first() {
    let three = set(&["west", "east", "south"]);
    let share = |budget, r: &str| initial_share(budget, &three, &name(r));
    // Sorted: east, south, west.
    assert_eq!(
        [share(100, "east"), share(100, "south"), share(100, "west")],
        [34, 33, 33]
    );
    assert_eq!(
        [share(101, "east"), share(101, "south"), share(101, "west")],
        [34, 34, 33]
    );
    // Fewer micros than regions: the first ones get one each.
    assert_eq!(
        [share(2, "east"), share(2, "south"), share(2, "west")],
        [1, 1, 0]
    );
    assert_eq!(
        [share(0, "east"), share(0, "south"), share(0, "west")],
        [0, 0, 0]
    );
    let max: Vec<Micros> = three
        .iter()
        .map(|r| initial_share(u64::MAX, &three, r))
        .collect();
    assert_eq!(
        max.iter().map(|&m| u128::from(m)).sum::<u128>(),
        u128::from(u64::MAX)
    );
    assert_eq!(initial_share(7, &set(&["solo"]), &name("solo")), 7);
    assert_eq!(share(100, "north"), 0, "not in the set");
    assert_eq!(initial_share(100, &BTreeSet::new(), &name("east")), 0);
}

#[test]
fn a_ledger_counts_itself_in_and_refuses_too_many_regions() {
    let alone = LimitLedger::new("c1", name("solo"), [], 50, TODAY).unwrap();
    assert_eq!(alone.allotment(), 50, "one region holds the whole budget");
    assert_eq!(alone.room(20, 10), 20);

    let many = (0..MAX_REGIONS).map(|i| name(&format!("r{i}")));
    let err = LimitLedger::new("c1", name("extra"), many, 1, TODAY).unwrap_err();
    assert_eq!(err, RegionError::TooMany { count: 17, max: 16 });
}

#[test]
fn room_is_allotment_less_spend_and_leases_never_below_zero() {
    let east = ledger("east", 300);
    assert_eq!(east.allotment(), 100);
    assert_eq!(east.room(30, 20), 50);
    assert_eq!(east.room(80, 20), 0);
    assert_eq!(east.room(90, 20), 0);
    assert_eq!(east.room(u64::MAX, u64::MAX), 0);
}

#[test]
fn give_moves_room_and_never_what_is_spent_or_leased() {
    let mut east = ledger("east", 300);
    assert_eq!(east.give(&name("west"), 30, 40, 10), 30);
    assert_eq!(east.allotment(), 70);
    assert_eq!(east.given_to(&name("west")), 30);
    // Only the room (70 - 40 - 10) can go.
    assert_eq!(east.give(&name("west"), 1_000, 40, 10), 20);
    assert_eq!(east.allotment(), 50);
    assert_eq!(east.room(40, 10), 0);
    assert_eq!(east.give(&name("south"), 1, 40, 10), 0);
    assert_eq!(east.given_to(&name("west")), 50, "counters accumulate");
    assert_eq!(east.given_to(&name("south")), 0);

    let mut east = ledger("east", 300);
    assert_eq!(east.give(&name("east"), 10, 0, 0), 0, "not to itself");
    assert_eq!(
        east.give(&name("north"), 10, 0, 0),
        0,
        "not outside the set"
    );
    assert_eq!(east.give(&name("west"), 0, 0, 0), 0);
    assert_eq!(
        east,
        ledger("east", 300),
        "a gift of nothing leaves no trace"
    );
}

#[test]
fn the_receiver_credits_what_it_heard_once() {
    let mut east = ledger("east", 300);
    let mut west = ledger("west", 300);
    east.give(&name("west"), 30, 0, 0);
    let first = report_of(&east, 1, 5, 0, 0);
    assert_eq!(deliver(&mut west, &first), Merged::Changed);
    assert_eq!(west.allotment(), 130);
    assert_eq!(west.received_from(&name("east")), 30);
    assert_eq!(deliver(&mut west, &first), Merged::Unchanged, "a duplicate");
    assert_eq!(west.allotment(), 130);

    east.give(&name("west"), 20, 0, 0);
    let second = report_of(&east, 2, 5, 0, 0);
    assert_eq!(deliver(&mut west, &second), Merged::Changed);
    let after_second = west.clone();
    assert_eq!(
        deliver(&mut west, &first),
        Merged::Unchanged,
        "an older report"
    );
    assert_eq!(west, after_second);
    assert_eq!(west.allotment(), 150);
    assert_eq!(
        east.allotment() + west.allotment() + ledger("south", 300).allotment(),
        300
    );
}

#[test]
fn gauges_follow_the_latest_seq_and_counters_the_maximum() {
    let mut west = ledger("west", 300);
    let east = ledger("east", 300);
    let newer = report_of(&east, 7, 50, 10, 4);
    let older = report_of(&east, 6, 40, 25, 9);
    deliver(&mut west, &newer);
    assert_eq!(deliver(&mut west, &older), Merged::Unchanged);
    let heard = west.heard(&name("east")).unwrap();
    assert_eq!(
        (
            heard.seq,
            heard.spend_micros,
            heard.leased_micros,
            heard.want_micros
        ),
        (7, 50, 10, 4)
    );
    assert_eq!(heard.as_of_ms, 1_007);

    // Reordered the other way round, the ledger ends the same.
    let mut other = ledger("west", 300);
    deliver(&mut other, &older);
    deliver(&mut other, &newer);
    assert_eq!(other, west);

    // A report of seq 0 is taken when nothing was heard yet.
    let mut fresh = ledger("west", 300);
    assert_eq!(
        deliver(&mut fresh, &report_of(&east, 0, 1, 2, 3)),
        Merged::Changed
    );
    assert_eq!(fresh.heard(&name("east")).unwrap().leased_micros, 2);
}

#[test]
fn global_spend_adds_the_last_heard_of_every_region() {
    let mut east = ledger("east", 300);
    assert_eq!(east.global_spend(12), 12);
    deliver(&mut east, &report_of(&ledger("west", 300), 1, 30, 0, 0));
    deliver(&mut east, &report_of(&ledger("south", 300), 1, 5, 0, 0));
    assert_eq!(east.global_spend(12), 47);
    assert_eq!(east.global_lifetime_spend(100), 135);
    assert_eq!(east.global_spend(u64::MAX), u64::MAX, "saturates");
}

#[test]
fn ignores_older_periods_unknown_regions_other_limits_and_follows_newer_periods() {
    let mut west = ledger("west", 300);
    west.give(&name("east"), 10, 0, 0);
    let mut east = ledger("east", 300);
    east.give(&name("west"), 40, 0, 0);
    deliver(&mut west, &report_of(&east, 1, 0, 0, 0));
    let before = west.clone();

    let mut yesterday = ledger("east", 300);
    yesterday.period_start_ms = TODAY - DAY;
    yesterday.give(&name("west"), 90, 0, 0);
    assert_eq!(
        deliver(&mut west, &report_of(&yesterday, 9, 0, 0, 0)),
        Merged::OlderPeriod
    );
    assert_eq!(west, before);

    let north = LimitLedger::new(
        "c1",
        name("north"),
        set(&["east", "west", "south"]),
        300,
        TODAY,
    );
    let mut north = north.unwrap();
    north.give(&name("west"), 50, 0, 0);
    assert_eq!(
        deliver(&mut west, &report_of(&north, 1, 0, 0, 0)),
        Merged::UnknownRegion
    );
    assert_eq!(west, before);

    let other_limit =
        LimitLedger::new("c2", name("east"), set(&["west", "south"]), 300, TODAY).unwrap();
    assert_eq!(
        deliver(&mut west, &report_of(&other_limit, 2, 0, 0, 0)),
        Merged::OtherLimit
    );
    assert_eq!(west, before);

    let mut tomorrow = ledger("east", 300);
    tomorrow.period_start_ms = TODAY + DAY;
    tomorrow.give(&name("west"), 5, 0, 0);
    assert_eq!(
        deliver(&mut west, &report_of(&tomorrow, 3, 7, 0, 0)),
        Merged::NewPeriod
    );
    assert_eq!(west.period_start_ms(), TODAY + DAY);
    assert_eq!(west.given_to(&name("east")), 0, "own counters restart");
    assert_eq!(west.allotment(), 105);
    assert_eq!(west.global_spend(0), 7);
    assert!(!west.roll_to(TODAY), "never back");
    assert!(west.roll_to(TODAY + 2 * DAY));
    assert_eq!((west.allotment(), west.global_spend(0)), (100, 0));
}

#[test]
fn its_own_report_read_back_restores_what_it_gave() {
    let mut east = ledger("east", 300);
    east.give(&name("west"), 30, 0, 0);
    east.give(&name("south"), 10, 0, 0);
    let kept = report_of(&east, 4, 0, 0, 0);

    let mut restarted = ledger("east", 300);
    restarted.give(&name("west"), 35, 0, 0);
    assert_eq!(deliver(&mut restarted, &kept), Merged::Changed);
    assert_eq!(restarted.given_to(&name("west")), 35, "never lowered");
    assert_eq!(restarted.given_to(&name("south")), 10);
    assert_eq!(restarted.allotment(), 55);
    assert!(restarted.heard(&name("east")).is_none());
}

#[test]
fn the_entry_carries_what_was_given_and_credited() {
    let mut east = ledger("east", 300);
    let mut west = ledger("west", 300);
    west.give(&name("east"), 25, 0, 0);
    deliver(&mut east, &report_of(&west, 1, 0, 0, 0));
    east.give(&name("south"), 5, 0, 0);
    let entry = east.entry(11, 99, 3, 8);
    assert_eq!(entry.limit_id, "c1");
    assert_eq!(entry.period_start_ms, TODAY);
    assert_eq!(
        (
            entry.spend_micros,
            entry.lifetime_spend_micros,
            entry.leased_micros,
            entry.want_micros
        ),
        (11, 99, 3, 8)
    );
    assert_eq!(entry.given, BTreeMap::from([(name("south"), 5)]));
    assert_eq!(entry.received, BTreeMap::from([(name("west"), 25)]));

    // West learns that east credited it: nothing is in transit any more.
    assert_eq!(west.in_transit_to(&name("east")), 25);
    deliver(
        &mut west,
        &RegionReport::new(name("east"), 1, 0, vec![entry]),
    );
    assert_eq!(west.in_transit_to(&name("east")), 0);
    assert_eq!(west.allotment_of(&name("east")), 120);
    assert_eq!(west.allotment_of(&name("west")), 75);
    assert_eq!(west.allotment_of(&name("south")), 0, "never heard");
}

#[test]
fn plan_keeps_a_reserve_and_gives_what_others_want() {
    let mut east = ledger("east", 3_000);
    let mut west = ledger("west", 3_000);
    deliver(&mut east, &report_of(&west, 1, 1_000, 0, 300));
    // Allotment 1000, spent 100: room 900, reserve 10% = 100.
    assert_eq!(east.plan_gifts(100, 0, 0, 100), [(name("west"), 300)]);
    // Its own unmet demand comes first when larger than the reserve.
    assert_eq!(east.plan_gifts(100, 0, 700, 100), [(name("west"), 200)]);
    assert_eq!(east.plan_gifts(100, 0, 900, 100), []);
    assert_eq!(east.plan_gifts(100, 0, 0, 1000), [], "all reserved");
    assert_eq!(
        east.plan_gifts(100, 0, 0, u16::MAX),
        [],
        "above 1000 counts as 1000"
    );
    assert_eq!(east.plan_gifts(1_000, 0, 0, 0), [], "no room");

    // Once given, the same want is not answered again until west reports.
    for (to, micros) in east.plan_gifts(100, 0, 0, 100) {
        assert_eq!(east.give(&to, micros, 100, 0), micros);
    }
    assert_eq!(east.plan_gifts(100, 0, 0, 100), []);
    // West credits it, still wants 50 more, and says so.
    deliver(&mut west, &report_of(&east, 1, 100, 0, 0));
    deliver(&mut east, &report_of(&west, 2, 1_000, 0, 50));
    assert_eq!(east.plan_gifts(100, 0, 0, 100), [(name("west"), 50)]);
}

#[test]
fn plan_splits_a_short_spare_in_proportion_greatest_need_first() {
    let mut east = ledger("east", 3_000);
    deliver(&mut east, &report_of(&ledger("west", 3_000), 1, 0, 0, 200));
    deliver(&mut east, &report_of(&ledger("south", 3_000), 1, 0, 0, 100));
    // Room 1000 - 990 = 10 for needs 200 and 100: 6.67 and 3.33.
    let plan = east.plan_gifts(990, 0, 0, 0);
    assert_eq!(plan, [(name("south"), 3), (name("west"), 7)]);
    // Equal needs, odd spare: the leftover micro goes by name.
    let mut east = ledger("east", 3_000);
    deliver(&mut east, &report_of(&ledger("west", 3_000), 1, 0, 0, 100));
    deliver(&mut east, &report_of(&ledger("south", 3_000), 1, 0, 0, 100));
    assert_eq!(
        east.plan_gifts(995, 0, 0, 0),
        [(name("south"), 3), (name("west"), 2)]
    );
    // A spare of 1 for two needs: one gets it, no zero gifts.
    assert_eq!(east.plan_gifts(999, 0, 0, 0), [(name("south"), 1)]);
    // The whole spare goes, no more.
    let total: Micros = east.plan_gifts(900, 0, 0, 0).iter().map(|g| g.1).sum();
    assert_eq!(total, 100);
}

#[test]
fn a_lower_budget_leaves_no_room_and_no_panic() {
    let mut east = ledger("east", 300);
    east.give(&name("west"), 60, 20, 0);
    assert_eq!(east.allotment(), 40);
    east.set_budget(30);
    assert_eq!(east.allotment_exact(), 10 - 60);
    assert_eq!(east.allotment(), 0);
    assert_eq!(east.room(20, 0), 0);
    assert_eq!(east.give(&name("west"), 1, 20, 0), 0);
    assert_eq!(east.plan_gifts(20, 0, 0, 0), []);
    east.set_budget(3_000);
    assert_eq!(east.allotment(), 940);
    assert_eq!(east.room(20, 0), 920);
}

#[test]
fn figures_near_u64_max_clamp_instead_of_wrapping() {
    let mut east = ledger("east", u64::MAX);
    let third = u64::MAX / 3;
    assert_eq!(east.allotment(), third);
    assert_eq!(east.give(&name("west"), u64::MAX, 0, 0), third);
    assert_eq!(east.allotment(), 0);
    assert_eq!(east.give(&name("west"), u64::MAX, 0, 0), 0);

    // Reports no deployment sends: gifts past the budget, from both others.
    let mut bogus = ledger("west", u64::MAX);
    bogus.given.insert(name("east"), u64::MAX);
    let mut bogus2 = ledger("south", u64::MAX);
    bogus2.given.insert(name("east"), u64::MAX);
    let mut east = ledger("east", u64::MAX);
    deliver(
        &mut east,
        &report_of(&bogus, 1, u64::MAX, u64::MAX, u64::MAX),
    );
    deliver(&mut east, &report_of(&bogus2, 1, u64::MAX, 0, u64::MAX));
    assert_eq!(east.allotment(), u64::MAX);
    assert_eq!(east.room(0, 0), u64::MAX);
    assert_eq!(east.global_spend(1), u64::MAX);
    assert_eq!(east.allotment_of(&name("west")), 0);
    let plan = east.plan_gifts(0, 0, 0, 0);
    assert_eq!(
        plan.iter().map(|g| u128::from(g.1)).sum::<u128>(),
        u128::from(u64::MAX)
    );
    for (to, micros) in plan {
        assert_eq!(east.give(&to, micros, 0, 0), micros);
    }
    // Its exact allotment is still past u64::MAX: clamped, not wrapped.
    let third = i128::from(third);
    assert_eq!(
        east.allotment_exact(),
        third + 2 * i128::from(u64::MAX) - i128::from(u64::MAX)
    );
    assert_eq!(east.allotment(), u64::MAX);
    // A counter at u64::MAX takes nothing more.
    let mut full = ledger("east", 300);
    full.given.insert(name("west"), u64::MAX);
    deliver(&mut full, &report_of(&bogus, 2, 0, 0, 0));
    deliver(&mut full, &report_of(&bogus2, 2, 0, 0, 0));
    assert_eq!(
        full.allotment_exact(),
        100 + 2 * i128::from(u64::MAX) - i128::from(u64::MAX)
    );
    assert_eq!(full.give(&name("west"), 5, 0, 0), 0);
    assert_eq!(full.give(&name("south"), 5, 0, 0), 5);
}

#[test]
fn a_decoded_report_from_an_unknown_region_is_ignored() {
    let json = br#"{"version":1,"region":"north","seq":1,"as_of_ms":5,"limits":[
        {"limit_id":"c1","period_start_ms":1728000000000,"spend_micros":9,
         "lifetime_spend_micros":9,"leased_micros":0,"want_micros":0,"given":{"east":70}}]}"#;
    let report = RegionReport::decode(json).unwrap();
    let mut east = ledger("east", 300);
    assert_eq!(
        east.merge(report.origin(), &report.limits[0]),
        Merged::UnknownRegion
    );
    assert_eq!((east.allotment(), east.global_spend(0)), (100, 0));
}
