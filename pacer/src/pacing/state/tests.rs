use super::*;
use adspend_wire::types::SumEntry;
use proptest::prelude::*;

fn update(epoch: u64, seq: u64, push_seq: u64, lifetime: u64) -> SumsUpdate {
    SumsUpdate {
        shard: "all".into(),
        epoch,
        seq,
        push_seq,
        full: false,
        watermark_ms: seq as i64,
        source_ms: 0,
        entries: vec![SumEntry {
            limit: "a".into(),
            bucket: 10,
            bucket_micros: lifetime,
            lifetime_micros: lifetime,
            lifetime_events: lifetime / 10,
        }],
    }
}

#[test]
fn never_goes_backwards() {
    let mut state = SpendState::default();
    assert_eq!(state.apply(&update(1, 10, 1, 100), 1), Applied::Ok);
    // A new owner catching up from an older checkpoint: lower seq, ignored.
    assert_eq!(state.apply(&update(2, 5, 1, 60), 2), Applied::Ok);
    assert_eq!(state.limits["a"].lifetime_micros, 100);
    // The new owner passes the old position.
    assert_eq!(state.apply(&update(2, 12, 2, 130), 3), Applied::Ok);
    assert_eq!(state.limits["a"].lifetime_micros, 130);
    assert_eq!(state.limits["a"].buckets[&10], 130);
    // The fenced old owner keeps pushing: dropped.
    assert_eq!(state.apply(&update(1, 20, 2, 999), 4), Applied::Stale);
    assert_eq!(state.limits["a"].lifetime_micros, 130);
}

#[test]
fn lag_p99_is_kept_current_without_sorting_on_read() {
    let mut window = LagWindow::default();
    assert_eq!(window.p99(), 0);
    // 100 samples at one instant: 1..=100 ms; p99 is the 99th.
    for lag in 1..=100 {
        window.record(1_000, lag);
    }
    assert_eq!(window.p99(), 1, "recomputed at most once a second");
    window.record(2_000, 0);
    assert_eq!(window.p99(), 99);
    assert_eq!(window.max(), 100);
    // Samples older than five minutes leave the window.
    window.record(2_000 + LAG_WINDOW_MS + 1_000, 5);
    assert_eq!(window.p99(), 5);
    assert_eq!(window.max(), 5);
}

/// `update` as pushed at `now_ms` by an owner caught up at that moment.
fn caught_up(mut update: SumsUpdate, now_ms: i64) -> SumsUpdate {
    update.watermark_ms = now_ms;
    update
}

#[test]
fn a_shard_is_stale_after_a_silence_and_fresh_with_its_next_push() {
    let mut state = SpendState {
        stale_after_ms: 1_000,
        listening_since_ms: Some(0),
        ..SpendState::default()
    };
    // Nothing heard yet: not stale until the pacer has listened that long.
    assert!(!state.limit_stale(None, 1_000));
    assert!(state.limit_stale(None, 1_001));
    assert_eq!(
        state.apply(&caught_up(update(1, 1, 1, 10), 5_000), 5_000),
        Applied::Ok
    );
    let a = state.limits["a"].clone();
    assert!(!state.limit_stale(Some(&a), 6_000));
    assert_eq!(state.mark_stale_shards(6_000), 0);
    assert!(state.limit_stale(Some(&a), 6_001));
    assert_eq!(state.mark_stale_shards(6_001), 1);
    // A limit with no spend yet could be any shard's: stale as well.
    assert!(state.limit_stale(None, 6_001));
    // A heartbeat (no entries) of an owner caught up is progress.
    let mut heartbeat = caught_up(update(1, 1, 2, 10), 7_000);
    heartbeat.entries.clear();
    assert_eq!(state.apply(&heartbeat, 7_000), Applied::Ok);
    assert!(!state.limit_stale(Some(&a), 7_500));
    assert!(!state.limit_stale(None, 7_500));
    assert_eq!(state.mark_stale_shards(7_500), 0);
    // A fenced owner's pushes are not.
    assert_eq!(
        state.apply(&caught_up(update(2, 2, 1, 10), 7_600), 7_600),
        Applied::Ok
    );
    assert_eq!(
        state.apply(&caught_up(update(1, 3, 3, 10), 9_000), 9_000),
        Applied::Stale
    );
    assert!(state.limit_stale(Some(&a), 8_601));
}

#[test]
fn spend_that_stopped_flowing_is_stale_though_heartbeats_arrive() {
    let mut state = SpendState {
        stale_after_ms: 1_000,
        ..SpendState::default()
    };
    assert_eq!(
        state.apply(&caught_up(update(1, 1, 1, 10), 5_000), 5_000),
        Applied::Ok
    );
    let a = state.limits["a"].clone();
    // The owner keeps sending heartbeats, but its watermark stopped at
    // 5,000: lag measured from now grows.
    for (push_seq, at) in [(2, 5_500), (3, 6_000), (4, 6_500)] {
        let mut heartbeat = update(1, 1, push_seq, 10);
        heartbeat.entries.clear();
        heartbeat.watermark_ms = 5_000;
        assert_eq!(state.apply(&heartbeat, at), Applied::Ok);
    }
    assert_eq!(state.staleness_ms(Some(&a), 6_000), 1_000);
    assert!(!state.limit_stale(Some(&a), 6_000));
    assert!(
        state.limit_stale(Some(&a), 6_001),
        "no progress for the threshold"
    );
    assert!(
        !state.shard_stale(&state.shards["all"], 6_500),
        "it does push"
    );
    // Caught up again, but the limiters' input waits: spend is not
    // reaching the aggregator, which looks caught up.
    let mut heartbeat = caught_up(update(1, 1, 5, 10), 7_000);
    heartbeat.entries.clear();
    assert_eq!(state.apply(&heartbeat, 7_000), Applied::Ok);
    assert!(!state.limit_stale(Some(&a), 7_000));
    state.set_input_lag(1_001);
    assert_eq!(state.staleness_ms(Some(&a), 7_000), 1_001);
    assert!(state.limit_stale(Some(&a), 7_000));
    assert!(state.limit_stale(None, 7_000));
    state.set_input_lag(10);
    assert!(!state.limit_stale(Some(&a), 7_000));
}

#[test]
fn the_windowed_rate_reads_bursts_as_their_average() {
    let mut state = SpendState::default();
    // 1_000 micros every 500 ms (2 micros/ms), pushed as a burst of
    // two events 50 ms apart every second.
    let mut lifetime = 0;
    for second in 0..30 {
        for at in [0, 50] {
            lifetime += 1_000;
            let mut u = update(1, lifetime, lifetime / 1_000, lifetime);
            u.entries[0].lifetime_events = lifetime / 1_000;
            state.apply(&u, 1_000 + second * 1_000 + at);
        }
    }
    let a = &state.limits["a"];
    let now = 1_000 + 29 * 1_000 + 50;
    let windowed = a.windowed_rate(now);
    assert!((1.5..=3.0).contains(&windowed), "{windowed}");
    // The peak of single pushes reads the burst: 20 micros/ms.
    assert!(a.peak_rate_per_ms > 10.0, "{}", a.peak_rate_per_ms);
    // Quiet for two windows: the rate decays.
    let later = a.windowed_rate(now + 2 * RATE_WINDOW_MS as i64);
    assert!(later < windowed / 5.0, "{later}");
}

#[test]
fn push_gap_is_reported() {
    let mut state = SpendState::default();
    assert_eq!(state.apply(&update(1, 1, 1, 1), 1), Applied::Ok);
    assert_eq!(state.apply(&update(1, 2, 3, 2), 2), Applied::Gap);
    assert_eq!(state.limits["a"].lifetime_micros, 2);
}

const NOW_MS: i64 = 1_767_225_600_000; // 2026-01-01

/// Mostly small values, so that pushes meet, overtake and repeat each
/// other; sometimes anything.
fn small_or_any() -> impl Strategy<Value = u64> {
    prop_oneof![7 => 0u64..=6, 1 => any::<u64>()]
}

/// Mostly around now; sometimes anything (negative too).
fn time() -> impl Strategy<Value = i64> {
    prop_oneof![7 => NOW_MS - 60_000..=NOW_MS + 60_000, 1 => any::<i64>()]
}

/// A push over 3 shards and 3 limits, epochs 0..=3, some of whose stamps
/// no aggregator sends (which `decode_push` refuses).
fn push() -> impl Strategy<Value = SumsUpdate> {
    let entry = (
        prop::sample::select(vec!["a", "b", "c"]),
        prop_oneof![1 => Just(LIFETIME_BUCKET), 3 => 20_000u32..=20_006],
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(limit, bucket, bucket_micros, lifetime_micros, lifetime_events)| SumEntry {
                limit: limit.to_string(),
                bucket,
                bucket_micros,
                lifetime_micros,
                lifetime_events,
            },
        );
    (
        prop::sample::select(vec!["all", "p0", "p1"]),
        0u64..=3,
        small_or_any(),
        small_or_any(),
        any::<bool>(),
        time(),
        time(),
        prop::collection::vec(entry, 0..=4),
    )
        .prop_map(
            |(shard, epoch, seq, push_seq, full, watermark_ms, source_ms, entries)| SumsUpdate {
                shard: shard.to_string(),
                epoch,
                seq,
                push_seq,
                full,
                watermark_ms,
                source_ms,
                entries,
            },
        )
}

/// `update` as the pacer receives it: encoded, then decoded by the ingest
/// loop's decoder; `None` when that refuses it.
fn received(update: &SumsUpdate) -> Option<SumsUpdate> {
    adspend_wire::codec::decode_push(&adspend_wire::codec::encode_sums(update)).ok()
}

/// Each limit's lifetime spend and held buckets.
type Sums = HashMap<String, (u64, BTreeMap<u32, u64>)>;

fn sums(state: &SpendState) -> Sums {
    state
        .limits
        .iter()
        .map(|(k, v)| (k.clone(), (v.lifetime_micros, v.buckets.clone())))
        .collect()
}

proptest! {
    /// Folded into an empty state, a push leaves each limit with the
    /// largest lifetime spend it carries for it.
    #[test]
    fn a_push_into_an_empty_state_holds_each_limits_largest_lifetime(update in push()) {
        let Some(update) = received(&update) else {
            return Ok(());
        };
        let mut state = SpendState::default();
        state.apply(&update, NOW_MS);
        let mut largest: HashMap<&str, u64> = HashMap::new();
        for e in &update.entries {
            let l = largest.entry(e.limit.as_str()).or_default();
            *l = (*l).max(e.lifetime_micros);
        }
        for (limit, micros) in largest {
            prop_assert_eq!(state.limits[limit].lifetime_micros, micros);
        }
    }

    /// Folding pushes in order (those the decoder lets through) never makes
    /// a shard's epoch or watermark, a limit's lifetime spend or a bucket it
    /// still holds go backwards, and folding the same push twice changes no
    /// sum.
    #[test]
    fn pushes_never_go_backwards_and_a_repeat_changes_nothing(
        pushes in prop::collection::vec((push(), 0i64..=5_000), 0..60),
    ) {
        let mut state = SpendState::default();
        let mut now = NOW_MS;
        for (update, later) in pushes {
            let Some(update) = received(&update) else {
                continue;
            };
            now += later;
            let before = sums(&state);
            let shards_before: HashMap<String, (u64, i64)> = state
                .shards
                .iter()
                .map(|(k, s)| (k.to_string(), (s.epoch, s.watermark_ms)))
                .collect();
            state.apply(&update, now);
            let after = sums(&state);
            for (limit, (lifetime, buckets)) in &before {
                let (lifetime_now, buckets_now) = &after[limit];
                prop_assert!(lifetime_now >= lifetime, "lifetime spend of {} went backwards", limit);
                for (bucket, micros) in buckets {
                    if let Some(now_micros) = buckets_now.get(bucket) {
                        prop_assert!(now_micros >= micros, "bucket {} of {} went backwards", bucket, limit);
                    }
                }
            }
            for (shard, (epoch, watermark)) in &shards_before {
                let s = &state.shards[shard.as_str()];
                prop_assert!(s.epoch >= *epoch, "epoch of {} went backwards", shard);
                prop_assert!(s.watermark_ms >= *watermark, "watermark of {} went backwards", shard);
            }
            state.apply(&update, now);
            prop_assert_eq!(sums(&state), after, "applying a push twice changed a sum");
        }
    }
}
