//! The fair scheduler's decision for one round, as pure functions.
//!
//! Each round the limiter has room for `capacity` units of input (payload
//! bytes, one chunk) and a view of every source lane: how much waits, how old the
//! oldest is (its lag) and the source's share of the recent usage (see
//! `usage`). [`plan`] decides how many messages each lane gives.
//!
//! Intervention follows the usage/latency split: a source is a *victim*
//! when its oldest event has waited longer than the lag threshold while its
//! recent usage is below its fair share (`1/k` of the window among the `k`
//! competing sources); an *offender* when its usage is above
//! [`OFFENDER_FACTOR`] times that share. Only when some victim exists does
//! the round become deficit round robin (victims first, then fair users,
//! offenders last, each lane earning `capacity / k` per round); otherwise the
//! oldest events go first, which is what the single FIFO consumer did. Either
//! way the round is work-conserving: capacity left over goes to whoever
//! still has messages, so an offender drains at the spare capacity.
//!
//! The spare capacity is the aggregators', not only the limiter's: the
//! limiter keeps a window on what it has published that they have not
//! applied yet (`crate::downstream`). While sources compete, every source
//! with more waiting than its quantum of a round whose oldest message has
//! waited past the lag threshold (a backlog, not a trickle, nor a heavy
//! stream the pipeline keeps up with) shares what is left of that window
//! (`window`, in payload bytes) and no more; with none left it is *held*
//! and gets nothing. So the queue in `SPEND` ahead of the others' tuples
//! stays short, and the backlog goes on as fast as the aggregators apply
//! without the others' spend taking longer than the window's target (the
//! window follows their delay). Usage shares cannot decide this: a held
//! source's usage falls, and a trickle would soon look like the heavy user.

use std::cmp::Reverse;
use std::time::Duration;

/// Usage above this multiple of the fair share marks an offender.
pub(super) const OFFENDER_FACTOR: f64 = 1.5;

/// One lane as the scheduler sees it at the start of a round.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct LaneView {
    /// Units (payload bytes) waiting.
    pub(crate) pending: u64,
    /// Age of the oldest waiting message; zero when none waits.
    pub(crate) lag: Duration,
    /// The source's share of the usage in the sliding window, in `0..=1`.
    pub(crate) usage_share: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Class {
    /// Waiting too long while using less than its fair share: served first.
    Victim,
    Fair,
    /// Using more than [`OFFENDER_FACTOR`] times its fair share.
    Offender,
}

/// A round's decision: how many units to take from each lane, in the
/// order to take them, and whether the fair order was enforced.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Plan {
    /// `(lane index, units)`, lanes with nothing to give left out.
    pub(crate) takes: Vec<(usize, u64)>,
    pub(crate) intervening: bool,
    pub(crate) classes: Vec<Class>,
    /// The lanes with a backlog this round ([`backlogs`]), window or not.
    pub(crate) backlogs: Vec<bool>,
    /// Backlogs under the downstream window this round; given at most
    /// their part of it, perhaps nothing.
    pub(crate) held: Vec<bool>,
    /// Whether the window was less than the backlogs could have taken.
    pub(crate) limited: bool,
}

impl Plan {
    #[cfg(test)]
    pub(super) fn total(&self) -> u64 {
        self.takes.iter().map(|(_, n)| n).sum()
    }

    pub(super) fn take_of(&self, lane: usize) -> u64 {
        self.takes
            .iter()
            .filter(|(i, _)| *i == lane)
            .map(|(_, n)| n)
            .sum()
    }

    /// Lanes held back this round: given less than they had waiting,
    /// because of the downstream window or as offenders under intervention.
    pub(super) fn held_back(&self, lane: usize, view: &LaneView) -> bool {
        ((self.limited && self.held[lane])
            || (self.intervening && self.classes[lane] == Class::Offender))
            && self.take_of(lane) < view.pending
    }
}

/// Sources competing for capacity: those with work waiting or with usage in
/// the window.
pub(super) fn competing(lanes: &[LaneView]) -> usize {
    lanes
        .iter()
        .filter(|l| l.pending > 0 || l.usage_share > 0.0)
        .count()
}

pub(super) fn classify(lanes: &[LaneView], lag_threshold: Duration) -> Vec<Class> {
    let k = competing(lanes).max(1);
    let fair_share = 1.0 / k as f64;
    lanes
        .iter()
        .map(|l| {
            if l.pending > 0 && l.usage_share > OFFENDER_FACTOR * fair_share {
                Class::Offender
            } else if l.pending > 0 && l.lag > lag_threshold && l.usage_share < fair_share {
                Class::Victim
            } else {
                Class::Fair
            }
        })
        .collect()
}

/// Deficit counters, one per lane, carried from round to round.
#[derive(Debug, Default, Clone)]
pub(super) struct Deficits(pub Vec<u64>);

/// Lanes the downstream window applies to: with two or more sources
/// competing, those with more than their quantum of a round
/// (`capacity / k`) waiting whose oldest message has waited past the lag
/// threshold. A single source is never limited, nor a heavy one the
/// pipeline keeps up with: holding it back would only turn its steady
/// stream into bursts the others then wait behind.
pub(super) fn backlogs(lanes: &[LaneView], capacity: u64, lag_threshold: Duration) -> Vec<bool> {
    let k = competing(lanes) as u64;
    let quantum = capacity / k.max(1);
    lanes
        .iter()
        .map(|l| k >= 2 && l.pending > quantum && l.lag > lag_threshold)
        .collect()
}

/// Decide one round. `window`: payload bytes the backlogs may take
/// together this round, what is left of the downstream window (`None`: no
/// window, the aggregators have not reported or it is turned off).
/// `deficits` is resized to the lanes and updated.
pub(super) fn plan(
    lanes: &[LaneView],
    capacity: u64,
    lag_threshold: Duration,
    window: Option<u64>,
    deficits: &mut Deficits,
) -> Plan {
    deficits.0.resize(lanes.len(), 0);
    let classes = classify(lanes, lag_threshold);
    let backlogs = backlogs(lanes, capacity, lag_threshold);
    let held = match window {
        Some(_) => backlogs.clone(),
        None => vec![false; lanes.len()],
    };
    let mut window_left = window.unwrap_or(u64::MAX);
    let mut given = vec![0u64; lanes.len()];
    let mut left = capacity;
    // What lane `i` may be given now: the round's room, and for a backlog
    // the window's.
    let room = |i: usize, left: u64, window_left: u64| {
        if held[i] {
            left.min(window_left)
        } else {
            left
        }
    };
    let victims = classes.contains(&Class::Victim);
    // The window binds when it is less than the backlogs could take.
    let backlog: u64 = (0..lanes.len())
        .filter(|&i| held[i])
        .map(|i| lanes[i].pending)
        .sum();
    let limited = backlog > 0 && window_left < backlog.min(capacity);
    let intervening = victims || limited;
    // Oldest waiting first; ties by lane index so a plan is deterministic.
    let mut order: Vec<usize> = (0..lanes.len()).filter(|&i| lanes[i].pending > 0).collect();
    if intervening {
        order.sort_by_key(|&i| (classes[i], Reverse(lanes[i].lag), i));
        let k = competing(lanes).max(1) as u64;
        let quantum = (capacity / k).max(1);
        for &i in &order {
            // A lane's credit never exceeds one chunk: an idle lane cannot
            // bank capacity for a later burst.
            deficits.0[i] = (deficits.0[i] + quantum).min(capacity);
            let n = deficits.0[i]
                .min(lanes[i].pending)
                .min(room(i, left, window_left));
            given[i] += n;
            deficits.0[i] -= n;
            left -= n;
            if held[i] {
                window_left -= n;
            }
        }
    } else {
        order.sort_by_key(|&i| (Reverse(lanes[i].lag), i));
    }
    // Work-conserving: what is left goes to whoever still has messages and
    // room in the window.
    for &i in &order {
        let n = (lanes[i].pending - given[i]).min(room(i, left, window_left));
        given[i] += n;
        left -= n;
        if held[i] {
            window_left -= n;
        }
    }
    for (i, lane) in lanes.iter().enumerate() {
        if lane.pending == given[i] {
            deficits.0[i] = 0;
        }
    }
    let takes = order
        .iter()
        .filter(|&&i| given[i] > 0)
        .map(|&i| (i, given[i]))
        .collect();
    Plan {
        takes,
        intervening,
        classes,
        backlogs,
        held,
        limited,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LAG: Duration = Duration::from_millis(200);

    fn lane(pending: u64, lag_ms: u64, usage_share: f64) -> LaneView {
        LaneView {
            pending,
            lag: Duration::from_millis(lag_ms),
            usage_share,
        }
    }

    #[test]
    fn a_flooding_source_is_an_offender_and_a_waiting_trickle_a_victim() {
        let lanes = [
            lane(50_000, 3_000, 0.9),
            lane(3, 900, 0.025),
            lane(2, 50, 0.025),
            lane(0, 0, 0.05),
        ];
        assert_eq!(
            classify(&lanes, LAG),
            vec![Class::Offender, Class::Victim, Class::Fair, Class::Fair]
        );
    }

    #[test]
    fn victims_are_served_before_the_offender_which_gets_the_rest() {
        let lanes = [
            lane(50_000, 3_000, 0.9),
            lane(3, 900, 0.02),
            lane(7, 400, 0.02),
        ];
        let plan = plan(&lanes, 1_000, LAG, None, &mut Deficits::default());
        assert!(plan.intervening);
        assert_eq!(plan.takes, vec![(1, 3), (2, 7), (0, 990)]);
        assert!(plan.held_back(0, &lanes[0]));
        assert!(!plan.held_back(1, &lanes[1]));
    }

    #[test]
    fn without_victims_the_oldest_go_first_as_in_fifo() {
        // The hot source is far ahead in usage, but nobody waits too long.
        let lanes = [
            lane(5_000, 150, 0.9),
            lane(3, 100, 0.02),
            lane(4, 180, 0.02),
        ];
        let plan = plan(&lanes, 1_000, LAG, None, &mut Deficits::default());
        assert!(!plan.intervening);
        assert_eq!(plan.takes, vec![(2, 4), (0, 996)]);
    }

    #[test]
    fn two_floods_share_the_capacity_by_quantum() {
        // Two equal backlogs, both victims of a third offender: each earns
        // capacity / 3 before the offender gets anything.
        let lanes = [
            lane(10_000, 2_000, 0.1),
            lane(10_000, 2_500, 0.1),
            lane(10_000, 100, 0.8),
        ];
        let mut deficits = Deficits::default();
        let plan = plan(&lanes, 900, LAG, None, &mut deficits);
        assert!(plan.intervening);
        assert_eq!(plan.takes, vec![(1, 300), (0, 300), (2, 300)]);
    }

    #[test]
    fn while_the_aggregators_are_behind_a_backlog_is_held_and_trickles_go_on() {
        // A replays a backlog; nobody has waited past the threshold yet,
        // so without congestion it is plain oldest-first and A takes all.
        let lanes = [
            lane(50_000, 800, 0.7),
            lane(3, 20, 0.1),
            lane(7, 10, 0.1),
            lane(0, 0, 0.1),
        ];
        let free = plan(&lanes, 1_000, LAG, None, &mut Deficits::default());
        assert!(!free.intervening);
        assert_eq!(free.takes, vec![(0, 1_000)]);
        let held = plan(&lanes, 1_000, LAG, Some(0), &mut Deficits::default());
        assert!(held.intervening);
        assert_eq!(held.held, vec![true, false, false, false]);
        assert_eq!(held.takes, vec![(1, 3), (2, 7)]);
        assert!(held.held_back(0, &lanes[0]));
        assert!(!held.held_back(1, &lanes[1]));
    }

    #[test]
    fn a_backlog_takes_what_is_left_of_the_window() {
        let lanes = [lane(50_000, 800, 0.7), lane(3, 20, 0.1), lane(7, 10, 0.1)];
        // A window larger than the round limits nothing: oldest first.
        let wide = plan(&lanes, 1_000, LAG, Some(5_000), &mut Deficits::default());
        assert!(!wide.intervening);
        assert_eq!(wide.takes, vec![(0, 1_000)]);
        assert!(!wide.held_back(0, &lanes[0]));
        // 400 bytes left: A gets them, the trickles all they have.
        let narrow = plan(&lanes, 1_000, LAG, Some(400), &mut Deficits::default());
        assert!(narrow.intervening);
        assert_eq!(narrow.take_of(0), 400);
        assert_eq!((narrow.take_of(1), narrow.take_of(2)), (3, 7));
        assert!(narrow.held_back(0, &lanes[0]));
    }

    #[test]
    fn congestion_holds_no_single_source_and_no_trickle() {
        // One source: nobody to be fair to, it goes on.
        let one = [lane(50_000, 500, 1.0)];
        let plan1 = plan(&one, 1_000, LAG, Some(0), &mut Deficits::default());
        assert_eq!(plan1.takes, vec![(0, 1_000)]);
        // Trickles within their quantum (500 each) go on, whatever their
        // usage: the held backlog's usage falls and theirs rises.
        let trickles = [lane(400, 50, 0.9), lane(500, 60, 0.1)];
        let plan2 = plan(&trickles, 1_000, LAG, Some(0), &mut Deficits::default());
        assert_eq!(plan2.total(), 900);
        assert!(!plan2.intervening);
        // A heavy stream the pipeline keeps up with (more than its quantum
        // waiting, but none of it past the lag threshold) is not a
        // backlog: holding it would only turn it into bursts.
        let heavy = [lane(5_000, 150, 0.7), lane(30, 20, 0.1)];
        let plan3 = plan(&heavy, 1_000, LAG, Some(0), &mut Deficits::default());
        assert_eq!(plan3.held, vec![false, false]);
        assert_eq!(
            plan3.total(),
            1_000,
            "oldest first, as the window were not there"
        );
        // Once its oldest has waited past the threshold, it is held.
        let behind = [lane(5_000, 250, 0.7), lane(30, 20, 0.1)];
        let plan4 = plan(&behind, 1_000, LAG, Some(0), &mut Deficits::default());
        assert_eq!(plan4.held, vec![true, false]);
        assert_eq!(plan4.takes, vec![(1, 30)]);
    }

    fn lanes_strategy() -> impl Strategy<Value = Vec<LaneView>> {
        prop::collection::vec(
            (0u64..5_000, 0u64..5_000, 0u32..=1_000).prop_map(|(pending, lag, share)| {
                lane(
                    pending,
                    if pending == 0 { 0 } else { lag },
                    f64::from(share) / 1_000.0,
                )
            }),
            0..12,
        )
    }

    proptest! {
        /// Nothing taken twice or beyond what waits; the round is
        /// work-conserving (a lane left waiting means the capacity is used).
        #[test]
        fn plans_are_bounded_and_work_conserving(
            lanes in lanes_strategy(),
            capacity in 1u64..3_000,
            rounds in 1usize..5,
        ) {
            let mut deficits = Deficits::default();
            for _ in 0..rounds {
                let plan = plan(&lanes, capacity, LAG, None, &mut deficits);
                let mut seen = std::collections::BTreeSet::new();
                for &(i, n) in &plan.takes {
                    prop_assert!(seen.insert(i), "lane {} listed twice", i);
                    prop_assert!(n > 0 && n <= lanes[i].pending);
                }
                let waiting: u64 = lanes.iter().map(|l| l.pending).sum();
                prop_assert_eq!(plan.total(), waiting.min(capacity));
                prop_assert!(deficits.0.iter().all(|&d| d <= capacity));
            }
        }

        /// Congested, a held lane gets nothing, the others are served as
        /// work-conservingly as before among themselves, and only lanes
        /// with more than their quantum waiting are held, never a lone one.
        #[test]
        fn congested_plans_hold_exactly_the_backlogs(
            lanes in lanes_strategy(),
            capacity in 1u64..3_000,
        ) {
            let plan = plan(&lanes, capacity, LAG, Some(0), &mut Deficits::default());
            let k = competing(&lanes) as u64;
            let mut free = 0;
            for (i, l) in lanes.iter().enumerate() {
                prop_assert_eq!(plan.held[i], k >= 2 && l.pending > capacity / k && l.lag > LAG);
                if plan.held[i] {
                    prop_assert_eq!(plan.take_of(i), 0);
                    prop_assert!(plan.held_back(i, l));
                } else {
                    free += l.pending;
                }
            }
            prop_assert_eq!(plan.total(), free.min(capacity));
        }

        /// Whatever the window, the backlogs together stay within it, and
        /// the round is work-conserving within it.
        #[test]
        fn windowed_plans_keep_backlogs_within_the_window(
            lanes in lanes_strategy(),
            capacity in 1u64..3_000,
            window in 0u64..6_000,
        ) {
            let plan = plan(&lanes, capacity, LAG, Some(window), &mut Deficits::default());
            let backlog: u64 = (0..lanes.len()).filter(|&i| plan.held[i]).map(|i| plan.take_of(i)).sum();
            prop_assert!(backlog <= window);
            let free: u64 = (0..lanes.len()).filter(|&i| !plan.held[i]).map(|i| lanes[i].pending).sum();
            let limited: u64 = (0..lanes.len()).filter(|&i| plan.held[i]).map(|i| lanes[i].pending).sum();
            prop_assert_eq!(plan.total(), (free + limited.min(window)).min(capacity));
            for &(i, n) in &plan.takes {
                prop_assert!(n > 0 && n <= lanes[i].pending);
            }
        }

        /// Under intervention every victim gets at least its quantum (or all
        /// it has) before any offender gets a message.
        #[test]
        fn victims_get_their_quantum_before_offenders(
            lanes in lanes_strategy(),
            capacity in 1u64..3_000,
        ) {
            let plan = plan(&lanes, capacity, LAG, None, &mut Deficits::default());
            let k = competing(&lanes).max(1) as u64;
            let quantum = (capacity / k).max(1);
            let victims: Vec<usize> = (0..lanes.len()).filter(|&i| plan.classes[i] == Class::Victim).collect();
            prop_assert_eq!(plan.intervening, !victims.is_empty());
            let demand: u64 = victims.iter().map(|&i| lanes[i].pending.min(quantum)).sum();
            if demand <= capacity {
                for &i in &victims {
                    prop_assert!(plan.take_of(i) >= lanes[i].pending.min(quantum));
                }
            }
            if let Some(first_offender) = plan.takes.iter().position(|&(i, _)| plan.classes[i] == Class::Offender) {
                prop_assert!(plan.takes[first_offender..].iter().all(|&(i, _)| plan.classes[i] != Class::Victim));
            }
        }

        /// Victims and offenders are what they claim: a victim waits past
        /// the threshold below its fair share, an offender is above 1.5x.
        #[test]
        fn classes_match_their_definitions(lanes in lanes_strategy()) {
            let k = competing(&lanes).max(1) as f64;
            for (l, class) in lanes.iter().zip(classify(&lanes, LAG)) {
                match class {
                    Class::Victim => prop_assert!(l.lag > LAG && l.usage_share < 1.0 / k && l.pending > 0),
                    Class::Offender => prop_assert!(l.usage_share > OFFENDER_FACTOR / k && l.pending > 0),
                    Class::Fair => prop_assert!(
                        l.pending == 0 || (l.usage_share <= OFFENDER_FACTOR / k && !(l.lag > LAG && l.usage_share < 1.0 / k))
                    ),
                }
            }
        }
    }
}
