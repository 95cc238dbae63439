use super::*;
use proptest::prelude::*;

const EXAMPLE: &str = r#"{
  "limits": {
    "campaign-1": {"budget_micros": 100000000, "period": "daily", "time_zone": "America/New_York"},
    "adset-7":    {"budget_micros": 20000000,  "period": "lifetime", "parent": "campaign-1"}
  },
  "ads": {"ad-1": ["adset-7", "campaign-1"]}
}"#;

fn err_of(json: &str) -> String {
    Catalog::parse("test.json", json.as_bytes())
        .unwrap_err()
        .to_string()
}

#[test]
fn parses_the_contract_example() {
    let catalog = Catalog::parse("example", EXAMPLE.as_bytes()).unwrap();
    let ad = catalog.limits_of_ad("ad-1").unwrap();
    assert_eq!(ad.len(), 2);
    assert_eq!(&*ad[0].id, "adset-7");
    assert_eq!(ad[1].time_zone, chrono_tz::America::New_York);
    assert_eq!(catalog.limit("adset-7").unwrap().time_zone, Tz::UTC);
    assert_eq!(catalog.limits_above_ad("ad-1").unwrap().len(), 2);
}

#[test]
fn limits_after_an_id_come_in_id_order() {
    let catalog = Catalog::parse("example", EXAMPLE.as_bytes()).unwrap();
    let ids = |after: Option<&str>| -> Vec<&str> {
        catalog
            .limits_after(after)
            .iter()
            .map(|l| l.id.as_ref())
            .collect()
    };
    assert_eq!(ids(None), ["adset-7", "campaign-1"]);
    assert_eq!(ids(Some("adset-7")), ["campaign-1"]);
    assert_eq!(ids(Some("b")), ["campaign-1"]);
    assert_eq!(ids(Some("campaign-1")), Vec::<&str>::new());
    assert_eq!(ids(Some("")), ["adset-7", "campaign-1"]);
}

#[test]
fn rejects_bad_documents_with_a_reason() {
    assert!(err_of("{").contains("test.json"));
    assert!(
        err_of(r#"{"limits":{"a":{"budget_micros":-1,"period":"daily"}}}"#)
            .contains("invalid value")
    );
    assert!(
        err_of(r#"{"limits":{"a":{"budget_micros":1.5,"period":"daily"}}}"#)
            .contains("invalid type")
    );
    assert!(
        err_of(r#"{"limits":{"a":{"budget_micros":1,"period":"weekly"}}}"#)
            .contains("unknown variant")
    );
    assert!(err_of(
        r#"{"limits":{"a":{"budget_micros":1,"period":"daily","time_zone":"Mars/Base"}}}"#
    )
    .contains("unknown time zone"));
    assert!(
        err_of(r#"{"limits":{"a":{"budget_micros":1,"period":"daily","parent":"b"}}}"#)
            .contains("parent \"b\" is not a limit")
    );
    assert!(
        err_of(r#"{"limits":{"~lease/a":{"budget_micros":1,"period":"daily"}}}"#)
            .contains("kept for spend leases")
    );
    assert!(err_of(
        r#"{"limits":{"a":{"budget_micros":1,"period":"daily","parent":"b"},
                       "b":{"budget_micros":1,"period":"daily","parent":"a"}}}"#
    )
    .contains("cycle"));
    assert!(
        err_of(r#"{"limits":{"a":{"budget_micros":1,"period":"daily"}},"ads":{"x":["b"]}}"#)
            .contains("limit \"b\" is not in")
    );
    assert!(
        err_of(r#"{"limits":{"a":{"budget_micros":1,"period":"daily"}},"ads":{"x":[]}}"#)
            .contains("lists no limits")
    );
    let long = "l".repeat(65);
    assert!(err_of(&format!(
        r#"{{"limits":{{"{long}":{{"budget_micros":1,"period":"daily"}}}}}}"#
    ))
    .contains("1..=64 bytes"));
}

#[test]
fn daily_bucket_follows_the_time_zone() {
    let ny = chrono_tz::America::New_York;
    // 2026-03-08 06:30 UTC is 01:30 EST on 2026-03-08 in New York.
    let ts = Utc.with_ymd_and_hms(2026, 3, 8, 6, 30, 0).unwrap();
    let day = local_day(ny, ts.timestamp_millis());
    assert_eq!(bucket_date(day).unwrap().to_string(), "2026-03-08");
    // 04:30 UTC is still 2026-03-07 in New York.
    let ts = Utc.with_ymd_and_hms(2026, 3, 8, 4, 30, 0).unwrap();
    assert_eq!(
        bucket_date(local_day(ny, ts.timestamp_millis()))
            .unwrap()
            .to_string(),
        "2026-03-07"
    );
}

#[test]
fn dst_days_are_23_and_25_hours_long() {
    let ny = chrono_tz::America::New_York;
    let spring = local_day(
        ny,
        Utc.with_ymd_and_hms(2026, 3, 8, 12, 0, 0)
            .unwrap()
            .timestamp_millis(),
    );
    let autumn = local_day(
        ny,
        Utc.with_ymd_and_hms(2026, 11, 1, 12, 0, 0)
            .unwrap()
            .timestamp_millis(),
    );
    let hours = |b: u32| (day_start(ny, b + 1) - day_start(ny, b)).num_hours();
    assert_eq!(hours(spring), 23);
    assert_eq!(hours(autumn), 25);
    // Quarter-hour offset: Kathmandu (+05:45) days start at hh:15 UTC.
    let kathmandu = chrono_tz::Asia::Kathmandu;
    let b = local_day(
        kathmandu,
        Utc.with_ymd_and_hms(2026, 6, 1, 0, 0, 0)
            .unwrap()
            .timestamp_millis(),
    );
    assert_eq!(
        day_start(kathmandu, b + 1)
            .timestamp_millis()
            .rem_euclid(3_600_000),
        15 * 60_000
    );
}

/// Found by fuzzing (fuzz target catalog_parse): on a day a zone skipped
/// altogether, the previous day's end fell back to UTC midnight, so
/// events still in that day (local time) were outside its bounds. Also
/// a jump at midnight that is not a whole quarter hour started the day
/// late.
#[test]
fn skipped_days_and_odd_jumps_at_midnight() {
    let apia = chrono_tz::Pacific::Apia;
    let utc = |s: &str| s.parse::<DateTime<Utc>>().unwrap();
    // 2011-12-29 19:00 in Apia (-10:00); the zone then went to +14:00
    // and 2011-12-30 never happened there.
    let now = utc("2011-12-30T05:00:00Z");
    let limit = Limit {
        id: Arc::from("l"),
        budget_micros: 1,
        period: Period::Daily,
        time_zone: apia,
        parent: None,
        alerts: Box::default(),
    };
    let bounds = limit.period_at(now);
    assert_eq!(
        bucket_date(bounds.bucket).unwrap().to_string(),
        "2011-12-29"
    );
    assert_eq!(bounds.start.unwrap(), utc("2011-12-29T10:00:00Z"));
    assert_eq!(bounds.end.unwrap(), utc("2011-12-30T10:00:00Z"));
    assert!(bounds.start.unwrap() <= now && now < bounds.end.unwrap());
    // The skipped day starts and ends where 2011-12-31 starts.
    let skipped = bounds.bucket + 1;
    assert_eq!(day_start(apia, skipped), day_start(apia, skipped + 1));
    assert_eq!(
        local_day(apia, bounds.end.unwrap().timestamp_millis()),
        skipped + 1
    );

    // Africa/Monrovia went from -0:44:30 to +0:00 at midnight on
    // 1972-01-07: that day began at 00:44:30.
    let monrovia = chrono_tz::Africa::Monrovia;
    let jan7 = local_day(monrovia, utc("1972-01-07T12:00:00Z").timestamp_millis());
    assert_eq!(day_start(monrovia, jan7), utc("1972-01-07T00:44:30Z"));
    let last_of_jan6 = utc("1972-01-07T00:44:29.999Z").timestamp_millis();
    assert_eq!(local_day(monrovia, last_of_jan6), jan7 - 1);
}

/// Found by fuzzing (fuzz target catalog_parse): the doc said a local
/// date could not precede 1970; it can, and is booked to day 0.
#[test]
fn local_dates_before_1970_are_day_0() {
    let sao_paulo = chrono_tz::America::Sao_Paulo;
    assert_eq!(local_day(sao_paulo, 17), 0);
    assert_eq!(local_day(sao_paulo, 3 * 3_600_000 - 1), 0);
    assert_eq!(local_day(sao_paulo, 27 * 3_600_000), 1);
    assert_eq!(local_day(Tz::UTC, 0), 0);
}

/// (limits as (id, budget, daily?, parent pick), ads as limit picks).
type CatalogShape = (Vec<(String, u64, bool, Option<usize>)>, Vec<Vec<usize>>);

fn arb_catalog() -> impl Strategy<Value = CatalogShape> {
    let limits = prop::collection::vec(
        (
            "[a-z0-9-]{1,64}",
            any::<u64>(),
            any::<bool>(),
            any::<Option<usize>>(),
        ),
        1..20,
    );
    let ads = prop::collection::vec(prop::collection::vec(any::<usize>(), 1..4), 0..20);
    (limits, ads)
}

proptest! {
    /// Any catalog whose parents point strictly backwards is accepted, and
    /// every ad resolves to the limits it names.
    #[test]
    fn generated_catalogs_validate((limits, ads) in arb_catalog()) {
        // The expected catalog: id -> (budget, period, parent), in order.
        let mut expected: Vec<(String, u64, Period, Option<String>)> = Vec::new();
        // Parents above each expected limit: a pick past MAX_PARENT_DEPTH
        // goes without a parent (the depth bound has its own tests).
        let mut depths: Vec<usize> = Vec::new();
        let mut doc_limits = serde_json::Map::new();
        for (i, (id, budget, daily, parent)) in limits.iter().enumerate() {
            if expected.iter().any(|(e, ..)| e == id) { continue; }
            let period = if *daily { Period::Daily } else { Period::Lifetime };
            let mut spec = serde_json::json!({"budget_micros": budget, "period": period.as_str(), "time_zone": "Asia/Kolkata"});
            let pick = parent
                .filter(|_| i > 0 && !expected.is_empty())
                .map(|p| p % expected.len())
                .filter(|&p| depths[p] < MAX_PARENT_DEPTH);
            let parent = pick.map(|p| expected[p].0.clone());
            if let Some(parent) = &parent { spec["parent"] = serde_json::json!(parent); }
            doc_limits.insert(id.clone(), spec);
            expected.push((id.clone(), *budget, period, parent));
            depths.push(pick.map_or(0, |p| depths[p] + 1));
        }
        let mut doc_ads = serde_json::Map::new();
        let mut expected_ads: Vec<(String, Vec<String>)> = Vec::new();
        for (n, picks) in ads.iter().enumerate() {
            let mut chosen: Vec<String> = Vec::new();
            for p in picks {
                let id = &expected[p % expected.len()].0;
                if !chosen.contains(id) { chosen.push(id.clone()); }
            }
            doc_ads.insert(format!("ad-{n}"), serde_json::json!(chosen));
            expected_ads.push((format!("ad-{n}"), chosen));
        }
        let doc = serde_json::json!({"limits": doc_limits, "ads": doc_ads});
        let catalog = Catalog::parse("prop", doc.to_string().as_bytes()).unwrap();

        prop_assert_eq!(catalog.limits.len(), expected.len());
        let kolkata: Tz = "Asia/Kolkata".parse().unwrap();
        for (id, budget, period, parent) in &expected {
            let limit = catalog.limit(id).unwrap();
            prop_assert_eq!(limit.id.as_ref(), id.as_str());
            prop_assert_eq!(limit.budget_micros, *budget);
            prop_assert_eq!(limit.period, *period);
            prop_assert_eq!(limit.time_zone, kolkata);
            prop_assert_eq!(limit.parent.as_deref(), parent.as_deref());
            // The precomputed ancestors are the walk through `parent`.
            let mut walked: Vec<&str> = Vec::new();
            let mut cursor = parent.as_deref();
            while let Some(c) = cursor {
                walked.push(c);
                cursor = expected.iter().find(|(e, ..)| e == c).and_then(|(.., p)| p.as_deref());
            }
            let ancestors: Vec<&str> = catalog.ancestors(id).iter().map(|l| l.id.as_ref()).collect();
            prop_assert_eq!(ancestors, walked);
        }
        prop_assert_eq!(catalog.ads.len(), expected_ads.len());
        for (ad, chosen) in &expected_ads {
            let direct: Vec<&str> = catalog.limits_of_ad(ad).unwrap().iter().map(|l| l.id.as_ref()).collect();
            prop_assert_eq!(&direct, chosen);
            // Above the ad: its limits and every ancestor of them, once each.
            let mut want: Vec<&str> = Vec::new();
            for id in chosen {
                let mut cursor = Some(id.as_str());
                while let Some(c) = cursor {
                    if !want.contains(&c) { want.push(c); }
                    cursor = expected.iter().find(|(e, ..)| e == c).and_then(|(.., p)| p.as_deref());
                }
            }
            let mut above: Vec<&str> = Vec::new();
            let resolved = catalog.limits_above_ad(ad).unwrap();
            for l in &resolved { above.push(l.id.as_ref()); }
            prop_assert_eq!(above.len(), want.len(), "{:?} vs {:?}", above, want);
            above.sort_unstable();
            want.sort_unstable();
            prop_assert_eq!(above, want);
        }
        prop_assert!(catalog.limits_of_ad("ad-unknown").is_none());
    }

    /// Every instant falls in exactly the bucket whose bounds contain it.
    #[test]
    fn instant_is_inside_its_period(ts in 0i64..4_102_444_800_000, zone in 0usize..6) {
        let zones = [Tz::UTC, chrono_tz::America::New_York, chrono_tz::Asia::Kolkata,
                     chrono_tz::Asia::Kathmandu, chrono_tz::Australia::Lord_Howe, chrono_tz::America::Santiago];
        let limit = Limit { id: Arc::from("l"), budget_micros: 1, period: Period::Daily, time_zone: zones[zone], parent: None, alerts: Box::default() };
        let now = DateTime::<Utc>::from_timestamp_millis(ts).unwrap();
        let bounds = limit.period_at(now);
        prop_assert!(bounds.start.unwrap() <= now && now < bounds.end.unwrap());
        prop_assert_eq!(bounds.bucket, limit.bucket_of(ts));
    }
}

/// A document of `limits` given as (id, parent) pairs, each with a lifetime
/// budget, and `ads` as (ad, limits listed).
fn shaped(limits: &[(String, Option<String>)], ads: &[(String, Vec<String>)]) -> String {
    let limits: serde_json::Map<String, serde_json::Value> = limits
        .iter()
        .map(|(id, parent)| {
            let mut spec = serde_json::json!({"budget_micros": 1, "period": "lifetime"});
            if let Some(parent) = parent {
                spec["parent"] = serde_json::json!(parent);
            }
            (id.clone(), spec)
        })
        .collect();
    let ads: serde_json::Map<String, serde_json::Value> = ads
        .iter()
        .map(|(ad, listed)| (ad.clone(), serde_json::json!(listed)))
        .collect();
    serde_json::json!({"limits": limits, "ads": ads}).to_string()
}

/// `prefix-0` at the top, each `prefix-i` the parent of `prefix-(i+1)`:
/// `prefix-n` has `n` parents above it.
fn chain(prefix: &str, n: usize) -> Vec<(String, Option<String>)> {
    (0..=n)
        .map(|i| {
            (
                format!("{prefix}-{i}"),
                i.checked_sub(1).map(|p| format!("{prefix}-{p}")),
            )
        })
        .collect()
}

#[test]
fn a_chain_deeper_than_the_maximum_is_refused_by_name() {
    let at_max = shaped(
        &chain("l", MAX_PARENT_DEPTH),
        &[("ad".into(), vec![format!("l-{MAX_PARENT_DEPTH}")])],
    );
    let catalog = Catalog::parse("test.json", at_max.as_bytes()).unwrap();
    assert_eq!(
        catalog.limits_above_ad("ad").unwrap().len(),
        MAX_PARENT_DEPTH + 1
    );

    let deeper = shaped(&chain("l", MAX_PARENT_DEPTH + 1), &[]);
    let message = err_of(&deeper);
    assert!(
        message.contains(&format!(
            "limit \"l-{}\": {} parents above it, more than the {MAX_PARENT_DEPTH} allowed",
            MAX_PARENT_DEPTH + 1,
            MAX_PARENT_DEPTH + 1
        )),
        "{message}"
    );

    // The attack of issue 27: a 20,000-deep chain. Refused (naming the
    // first limit in id order past the maximum, here l-100), after one
    // climb rather than one per limit.
    let message = err_of(&shaped(&chain("l", 20_000), &[]));
    assert!(
        message.contains(&format!(
            "limit \"l-100\": 100 parents above it, more than the {MAX_PARENT_DEPTH} allowed"
        )),
        "{message}"
    );
}

#[test]
fn cycles_are_refused_whatever_their_length() {
    let own_parent = shaped(&[("a".into(), Some("a".into()))], &[]);
    assert!(
        err_of(&own_parent).contains("cycle"),
        "{}",
        err_of(&own_parent)
    );
    // Longer than MAX_PARENT_DEPTH: still named a cycle, not a deep chain.
    for length in [3, MAX_PARENT_DEPTH + 1, 100] {
        let mut limits = chain("c", length - 1);
        limits[0].1 = Some(format!("c-{}", length - 1));
        let message = err_of(&shaped(&limits, &[]));
        assert!(
            message.contains("parent chain has a cycle"),
            "{length}: {message}"
        );
    }
    // A cycle above a chain that ends in it.
    let mut limits = chain("c", 3);
    limits[0].1 = Some("c-2".into());
    limits.push(("below".into(), Some("c-3".into())));
    assert!(err_of(&shaped(&limits, &[])).contains("cycle"));
}

#[test]
fn an_ad_with_more_limits_above_it_than_the_maximum_is_refused() {
    // Listed directly.
    let many: Vec<(String, Option<String>)> = (0..=MAX_LIMITS_ABOVE_AD)
        .map(|i| (format!("l-{i}"), None))
        .collect();
    let listed: Vec<String> = many.iter().map(|(id, _)| id.clone()).collect();
    let message = err_of(&shaped(&many, &[("wide".into(), listed.clone())]));
    assert!(
        message.contains(&format!(
            "ad \"wide\" lists {} limits, more than the {MAX_LIMITS_ABOVE_AD} allowed",
            MAX_LIMITS_ABOVE_AD + 1
        )),
        "{message}"
    );
    let at_max = shaped(
        &many,
        &[("ok".into(), listed[..MAX_LIMITS_ABOVE_AD].to_vec())],
    );
    Catalog::parse("test.json", at_max.as_bytes()).unwrap();

    // Through parents: five limits listed, each 12 deep in its own chain,
    // 65 limits above the ad.
    let mut limits = Vec::new();
    let mut listed = Vec::new();
    for c in 0..5 {
        limits.extend(chain(&format!("c{c}"), 12));
        listed.push(format!("c{c}-12"));
    }
    let message = err_of(&shaped(&limits, &[("tall".into(), listed.clone())]));
    assert!(
        message.contains(&format!(
            "ad \"tall\": 65 limits above it (its own and their parents), more than the {MAX_LIMITS_ABOVE_AD} allowed"
        )),
        "{message}"
    );
    // Shared ancestors count once: the same five chains meeting at one root.
    for (id, parent) in limits.iter_mut() {
        if id.ends_with("-0") {
            *parent = Some("root".into());
        }
    }
    limits.push(("root".into(), None));
    for (id, parent) in limits.iter_mut() {
        if id.ends_with("-1") {
            *parent = Some("root".into());
        }
    }
    limits.retain(|(id, _)| !id.ends_with("-0"));
    let shared = shaped(&limits, &[("shared".into(), listed)]);
    let catalog = Catalog::parse("test.json", shared.as_bytes()).unwrap();
    assert_eq!(catalog.limits_above_ad("shared").unwrap().len(), 5 * 12 + 1);
}

#[test]
fn ancestors_are_worked_out_at_parse_time_parent_first() {
    let catalog = Catalog::parse("example", EXAMPLE.as_bytes()).unwrap();
    let ancestors = catalog.ancestors("adset-7");
    assert_eq!(ancestors.len(), 1);
    // The catalog's own limit, not a copy: nothing to look up per decision.
    assert!(Arc::ptr_eq(
        &ancestors[0],
        catalog.limit("campaign-1").unwrap()
    ));
    assert!(catalog.ancestors("campaign-1").is_empty());
    assert!(catalog.ancestors("no-such-limit").is_empty());

    let deep = shaped(
        &chain("l", MAX_PARENT_DEPTH),
        &[(
            "ad".into(),
            vec![format!("l-{MAX_PARENT_DEPTH}"), "l-3".into()],
        )],
    );
    let catalog = Catalog::parse("test.json", deep.as_bytes()).unwrap();
    let names: Vec<&str> = catalog
        .ancestors(&format!("l-{MAX_PARENT_DEPTH}"))
        .iter()
        .map(|l| l.id.as_ref())
        .collect();
    let expected: Vec<String> = (0..MAX_PARENT_DEPTH)
        .rev()
        .map(|i| format!("l-{i}"))
        .collect();
    assert_eq!(names, expected);
    for (i, limit) in catalog.ancestors("l-9").iter().enumerate() {
        assert_eq!(
            catalog.ancestors(&limit.id).len(),
            8 - i,
            "each ancestor's own chain is the rest of this one"
        );
    }
    // Above the ad: the deep chain once; l-3, listed too, already in it.
    let above: Vec<&str> = catalog
        .limits_above_ad("ad")
        .unwrap()
        .iter()
        .map(|l| l.id.as_ref())
        .collect();
    assert_eq!(above.len(), MAX_PARENT_DEPTH + 1);
    assert_eq!(above[0], format!("l-{MAX_PARENT_DEPTH}"));
}
