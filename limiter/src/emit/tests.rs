use super::*;
use adspend_wire::impression::parse_line;
use adspend_wire::lease::lease_of_key;
use proptest::prelude::*;

fn catalog() -> Catalog {
    Catalog::parse(
        "test",
        br#"{"limits":{"c":{"budget_micros":10,"period":"daily","time_zone":"Asia/Kolkata"},
                       "s":{"budget_micros":10,"period":"lifetime","parent":"c"}},
             "ads":{"ad-1":["s","c"]}}"#,
    )
    .unwrap()
}

#[test]
fn costs_above_the_ceiling_are_dead_lettered() {
    let payload =
        b"{\"id\":\"i1\",\"ad_id\":\"ad-1\",\"cost_micros\":18446744073709551615,\"ts\":1}\n\
                    {\"id\":\"i2\",\"ad_id\":\"ad-1\",\"cost_micros\":1000,\"ts\":1}\n\
                    {\"id\":\"i3\",\"ad_id\":\"ad-1\",\"cost_micros\":1001,\"ts\":1}\n";
    let input = Input {
        stream_seq: 3,
        payload,
    };
    let mut out = Output::new(4).with_max_cost(1000);
    out.add(&input, &catalog());
    assert_eq!(
        out.impressions, 1,
        "only the impression at the ceiling passes"
    );
    let reasons: Vec<_> = out
        .dead_letters
        .iter()
        .map(|d| (d.reason, d.line_no))
        .collect();
    assert_eq!(reasons, vec![("cost_too_large", 0), ("cost_too_large", 2)]);
    assert!(out.dead_letters[0]
        .detail
        .contains("ADSPEND_MAX_COST_MICROS"));
    assert_eq!(out.rejected, vec![(Reason::CostTooLarge, 2)]);
    // The default ceiling stops the largest integer the contract allows.
    let mut default = Output::new(4);
    default.add(&input, &catalog());
    assert_eq!(default.dead_letters.len(), 1);
    assert_eq!(default.impressions, 2);
}

#[test]
fn maps_good_lines_and_dead_letters_bad_ones() {
    let payload = b"{\"id\":\"i1\",\"ad_id\":\"ad-1\",\"cost_micros\":7,\"ts\":1700000000000}\n\
                    garbage\n\
                    \n\
                    {\"id\":\"i2\",\"ad_id\":\"nope\",\"cost_micros\":7,\"ts\":1}\n";
    let mut out = Output::new(4);
    out.add(
        &Input {
            stream_seq: 9,
            payload,
        },
        &catalog(),
    );
    assert_eq!(out.impressions, 1);
    assert_eq!(out.tuples(), 2);
    let reasons: Vec<_> = out
        .dead_letters
        .iter()
        .map(|d| (d.reason, d.line_no))
        .collect();
    assert_eq!(reasons, vec![("invalid_json", 1), ("unknown_ad", 3)]);
    assert_eq!(out.dead_letters[0].msg_id(), "9-1");
    let all: Vec<(&str, &SpendTuple)> = out
        .partitions
        .iter()
        .flat_map(|p| p.tuples.iter().map(move |t| (p.limit_of(t), t)))
        .collect();
    let (_, s) = all.iter().find(|(l, _)| *l == "s").unwrap();
    assert_eq!(s.bucket, adspend_wire::types::LIFETIME_BUCKET);
    assert_eq!(s.msg_id, MsgId::derive("s", "i1"));
    let (_, c) = all.iter().find(|(l, _)| *l == "c").unwrap();
    assert_eq!(
        adspend_wire::catalog::bucket_date(c.bucket)
            .unwrap()
            .to_string(),
        "2023-11-15"
    );
    // The same input maps to the same output: a re-emit carries the same ids.
    let mut again = Output::new(4);
    again.add(
        &Input {
            stream_seq: 9,
            payload,
        },
        &catalog(),
    );
    let encoded = |o: &Output| -> Vec<Vec<(Vec<u8>, usize)>> {
        o.partitions.iter().map(|p| p.encode(1, 5)).collect()
    };
    assert_eq!(encoded(&again), encoded(&out));
}
#[test]
fn one_message_of_many_bad_lines_gives_a_bounded_number_of_dead_letters() {
    // 5,100 lines: past what the NATS client lets await acknowledgement.
    let payload = "not json\n".repeat(5_100);
    let mut out = Output::new(4);
    out.add(
        &Input {
            stream_seq: 5,
            payload: payload.as_bytes(),
        },
        &catalog(),
    );
    let per_message = adspend_wire::dead_letter::PER_MESSAGE as usize;
    assert_eq!(out.dead_letters.len(), per_message + 1);
    let summary = out.dead_letters.last().unwrap();
    assert_eq!(summary.reason, adspend_wire::dead_letter::SUMMARY_REASON);
    assert!(
        summary.detail.contains("5000 more rejected lines"),
        "{}",
        summary.detail
    );
    assert_eq!(
        out.rejected,
        vec![(Reason::InvalidJson, 5_100)],
        "every line counted"
    );
}

/// The chunk's `source_ms` for lines of the given `ts` values (as JSON
/// text), published at `published_ms`.
fn source_of(published_ms: i64, ts: &[&str]) -> (i64, Option<i64>) {
    let payload: String = ts
        .iter()
        .enumerate()
        .map(|(n, ts)| {
            format!("{{\"id\":\"i{n}\",\"ad_id\":\"ad-1\",\"cost_micros\":1,\"ts\":{ts}}}\n")
        })
        .collect();
    let mut out = Output::new(4);
    out.add(
        &Input {
            stream_seq: 1,
            payload: payload.as_bytes(),
        },
        &catalog(),
    );
    (
        chunk_source_ms(published_ms, out.oldest_ts_ms),
        out.oldest_ts_ms,
    )
}

#[test]
fn the_oldest_ts_of_a_chunk_is_its_source_time_when_older_than_the_publish() {
    // Served 10 s and 4 s before the stream took them: the older counts.
    let published = 1_700_000_010_000;
    assert_eq!(
        source_of(published, &["1700000006000", "1700000000000"]),
        (1_700_000_000_000, Some(1_700_000_000_000))
    );
    // A replayed backlog days old shows as days of lag.
    let days_old = published - 3 * 86_400_000;
    assert_eq!(source_of(published, &[&days_old.to_string()]).0, days_old);
}

#[test]
fn a_ts_ahead_of_the_publish_time_leaves_the_publish_time() {
    let published = 1_700_000_010_000;
    // An ad server's clock a little or far ahead: never later than the publish.
    for ahead in [1, 500, 3_600_000, 10 * 365 * 86_400_000i64] {
        let ts = (published + ahead).to_string();
        assert_eq!(
            source_of(published, &[&ts]).0,
            published,
            "ts {ahead} ms ahead"
        );
    }
    // One line ahead, one behind: the one behind counts.
    assert_eq!(
        source_of(published, &["1700000020000", "1700000009000"]).0,
        1_700_000_009_000
    );
}

#[test]
fn lines_without_a_valid_ts_do_not_move_the_source_time() {
    let published = 1_700_000_010_000;
    // Missing, negative, fractional, a string: dead-lettered, so only the
    // publish time (and the valid line, when there is one) counts.
    let mut out = Output::new(4);
    out.add(
        &Input {
            stream_seq: 1,
            payload: b"{\"id\":\"a\",\"ad_id\":\"ad-1\",\"cost_micros\":1}\n\
                       {\"id\":\"b\",\"ad_id\":\"ad-1\",\"cost_micros\":1,\"ts\":-5}\n\
                       {\"id\":\"c\",\"ad_id\":\"ad-1\",\"cost_micros\":1,\"ts\":1.5}\n\
                       {\"id\":\"d\",\"ad_id\":\"ad-1\",\"cost_micros\":1,\"ts\":\"1\"}\n",
        },
        &catalog(),
    );
    assert_eq!(out.impressions, 0);
    assert_eq!(out.dead_letters.len(), 4);
    assert_eq!(out.oldest_ts_ms, None);
    assert_eq!(chunk_source_ms(published, out.oldest_ts_ms), published);
    // An unknown ad's ts does not count either: it books no spend.
    out.add(
        &Input {
            stream_seq: 2,
            payload: b"{\"id\":\"e\",\"ad_id\":\"nope\",\"cost_micros\":1,\"ts\":5}\n\
                       {\"id\":\"f\",\"ad_id\":\"ad-1\",\"cost_micros\":1,\"ts\":1700000008000}\n",
        },
        &catalog(),
    );
    assert_eq!(out.oldest_ts_ms, Some(1_700_000_008_000));
    assert_eq!(
        chunk_source_ms(published, out.oldest_ts_ms),
        1_700_000_008_000
    );
}

/// A low ceiling, so that generated costs meet `cost_too_large` often.
const MAX_COST: u64 = 5_000_000;

/// The example catalog: ads `ad-1` and `ad-2`, each with three limits of
/// both periods in two time zones.
fn example_catalog() -> Catalog {
    Catalog::parse(
        "example",
        include_bytes!("../../../deploy/catalog.example.json"),
    )
    .unwrap()
}

/// One line of a payload: mostly events (of the catalog's ads or an
/// unknown one, costs around the ceiling, ids that repeat), else blank,
/// `not json` or any bytes (which may hold line breaks of their own).
fn line() -> impl Strategy<Value = Vec<u8>> {
    let event = (
        prop_oneof!["i-[0-9]", "[a-zA-Z0-9-]{1,64}"],
        prop_oneof![4 => Just("ad-1"), 4 => Just("ad-2"), 1 => Just("ad-9")],
        prop_oneof![
            4 => 0..=MAX_COST,
            1 => MAX_COST..=MAX_COST + 2,
            1 => any::<u64>(),
        ],
        prop_oneof![
            4 => 1_600_000_000_000i64..1_900_000_000_000,
            1 => any::<i64>(),
        ],
        // No lease, a lease id of ours (a few, shared), or anything else.
        prop_oneof![
            4 => Just(serde_json::Value::Null),
            2 => (1u64..4).prop_map(|n| format!("lz1k.{n}.0").into()),
            1 => "[a-z.0-9]{0,70}".prop_map(serde_json::Value::from),
            1 => any::<i64>().prop_map(serde_json::Value::from),
        ],
    )
        .prop_map(|(id, ad, cost, ts, lease)| {
            serde_json::json!({"id": id, "ad_id": ad, "cost_micros": cost, "ts": ts, "lease_id": lease})
                .to_string()
                .into_bytes()
        });
    prop_oneof![
        8 => event,
        1 => "[ \t]{0,3}".prop_map(String::into_bytes),
        1 => Just(b"not json".to_vec()),
        1 => prop::collection::vec(any::<u8>(), 0..80),
    ]
}

/// An NDJSON payload: lines ended by `\n` or `\r\n` (the last one maybe
/// not ended), then sometimes enough bad lines to pass
/// [`adspend_wire::dead_letter::PER_MESSAGE`].
fn payload() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::collection::vec((line(), any::<bool>()), 0..40),
        any::<bool>(),
        prop_oneof![3 => Just(0usize), 1 => 90usize..130],
    )
        .prop_map(|(lines, ended, bad)| {
            let mut payload = Vec::new();
            for (line, crlf) in lines {
                payload.extend_from_slice(&line);
                payload.extend_from_slice(if crlf { b"\r\n" } else { b"\n" });
            }
            payload.extend(b"{\"id\":1}\n".repeat(bad));
            if !ended {
                payload.pop();
            }
            payload
        })
}

/// A spend tuple by its limit's id rather than its index.
type Named = (String, u32, u64, MsgId);

/// What `Output::add` must make of `payload`, worked out line by line from
/// the parser and the catalog: the non-blank lines, the impressions mapped
/// to spend, and their tuples (one per catalog limit of the ad, and one for
/// its lease's key when it names a lease id of ours).
fn expected(payload: &[u8], catalog: &Catalog) -> (u64, u64, Vec<Named>) {
    let (mut lines, mut accepted, mut tuples) = (0, 0, Vec::new());
    for raw in payload.split(|&b| b == b'\n') {
        let line = raw.strip_suffix(b"\r").unwrap_or(raw);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        lines += 1;
        let Ok(impression) = parse_line(line) else {
            continue;
        };
        let limits = catalog.limits_of_ad(&impression.ad_id);
        let (Some(limits), true) = (limits, impression.cost_micros <= MAX_COST) else {
            continue;
        };
        accepted += 1;
        for limit in limits {
            tuples.push((
                limit.id.to_string(),
                limit.bucket_of(impression.ts_ms),
                impression.cost_micros,
                MsgId::derive(&limit.id, &impression.id),
            ));
        }
        if let Some(key) = impression.lease_id.as_deref().and_then(lease_key) {
            tuples.push((
                key.clone(),
                adspend_wire::types::LIFETIME_BUCKET,
                impression.cost_micros,
                MsgId::derive(&key, &impression.id),
            ));
        }
    }
    (lines, accepted, tuples)
}

proptest! {
    /// Every non-blank line is counted once, as an impression or a
    /// rejection, and dead-lettered when rejected (one letter a line up to
    /// the cap, the rest in one summary); every tuple costs at most the
    /// ceiling and is one of a catalog limit of its line's ad; the SPEND
    /// messages of each partition decode to exactly its tuples.
    #[test]
    fn every_line_is_counted_and_every_tuple_belongs_to_its_ad(payload in payload()) {
        use adspend_wire::codec::decode_spend;
        use adspend_wire::types::SpendMessage;
        use adspend_wire::dead_letter::{LINE_BYTES, PER_MESSAGE};

        let catalog = example_catalog();
        let mut out = Output::new(4).with_max_cost(MAX_COST);
        out.add(&Input { stream_seq: 7, payload: &payload }, &catalog);
        let (lines, accepted, mut tuples) = expected(&payload, &catalog);

        let rejected: u64 = out.rejected.iter().map(|(_, n)| n).sum();
        prop_assert_eq!(out.impressions, accepted);
        prop_assert_eq!(out.impressions + rejected, lines, "every non-blank line counted once");
        let per_message = u64::from(PER_MESSAGE);
        let letters = rejected.min(per_message) + u64::from(rejected > per_message);
        prop_assert_eq!(out.dead_letters.len() as u64, letters, "dead letters");
        for letter in &out.dead_letters {
            let json = serde_json::to_vec(letter).unwrap();
            prop_assert!(json.len() < 40_000, "a dead letter of {} bytes", json.len());
            prop_assert!(letter.line.len() <= LINE_BYTES);
        }

        let mut emitted = Vec::new();
        for partition in out.partitions.iter().chain(&out.leases) {
            let mut own: Vec<Named> = Vec::new();
            for tuple in &partition.tuples {
                let limit = partition.limit_of(tuple);
                prop_assert!(tuple.cost_micros <= MAX_COST, "a tuple above the ceiling");
                prop_assert!(
                    catalog.limit(limit).is_some() || lease_of_key(limit).is_some(),
                    "a tuple for unknown limit {}",
                    limit
                );
                own.push((limit.to_string(), tuple.bucket, tuple.cost_micros, tuple.msg_id));
            }
            let mut decoded: Vec<Named> = Vec::new();
            for (message, count) in partition.encode(3, 1) {
                let SpendMessage::Batch(batch) = decode_spend(&message).unwrap() else {
                    panic!("a batch encoded as a marker");
                };
                prop_assert!(batch.tuples.len() <= 3);
                prop_assert_eq!(batch.tuples.len(), count);
                for t in &batch.tuples {
                    decoded.push((batch.limit_of(t).to_string(), t.bucket, t.cost_micros, t.msg_id));
                }
            }
            prop_assert_eq!(&decoded, &own, "SPEND round trip of the emitted tuples");
            emitted.extend(own);
        }
        emitted.sort();
        tuples.sort();
        prop_assert_eq!(emitted, tuples, "one tuple per catalog limit of each mapped line's ad");
    }
}

#[test]
fn an_impression_under_a_lease_is_booked_to_the_lease_too() {
    let payload = b"{\"id\":\"i1\",\"ad_id\":\"ad-1\",\"cost_micros\":7,\"ts\":1,\"lease_id\":\"lz1k.3.0\"}\n\
                    {\"id\":\"i2\",\"ad_id\":\"ad-1\",\"cost_micros\":5,\"ts\":1,\"lease_id\":\"lz1k.3.0\"}\n\
                    {\"id\":\"i3\",\"ad_id\":\"ad-1\",\"cost_micros\":2,\"ts\":1,\"lease_id\":\"not-ours\"}\n";
    let mut out = Output::new(4);
    out.add(
        &Input {
            stream_seq: 1,
            payload,
        },
        &catalog(),
    );
    assert_eq!(out.impressions, 3);
    // Two limits each, and the two under the lease once more.
    assert_eq!(out.tuples(), 8);
    assert!(
        out.partitions
            .iter()
            .all(|p| p.limits.iter().all(|l| !l.starts_with("~lease/"))),
        "lease spend is kept apart"
    );
    let leased: Vec<(u64, MsgId)> = out
        .leases
        .iter()
        .flat_map(|p| p.tuples.iter().map(move |t| (p.limit_of(t), t)))
        .filter(|(limit, _)| *limit == "~lease/lz1k.3.0")
        .map(|(_, t)| {
            assert_eq!(t.bucket, adspend_wire::types::LIFETIME_BUCKET);
            (t.cost_micros, t.msg_id)
        })
        .collect();
    assert_eq!(
        leased,
        vec![
            (7, MsgId::derive("~lease/lz1k.3.0", "i1")),
            (5, MsgId::derive("~lease/lz1k.3.0", "i2"))
        ]
    );
}
