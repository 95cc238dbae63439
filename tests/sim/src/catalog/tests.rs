//! The generator's catalogs against what the pipeline relies on, the JSON
//! against the CONTRACT's document, and validation against broken ones.

use proptest::prelude::*;

use super::*;

/// What the pipeline and the tests rely on, checked without `validate()`.
fn assert_catalog_structure(catalog: &Catalog, spec: &CatalogSpec) {
    let count = |prefix: &str| {
        catalog
            .limits
            .keys()
            .filter(|id| id.starts_with(prefix))
            .count()
    };
    assert_eq!(count("account-"), spec.accounts as usize);
    assert_eq!(count("campaign-"), spec.campaigns as usize);
    assert_eq!(count("adset-"), spec.adsets as usize);
    assert_eq!(catalog.ads.len(), spec.ads as usize);
    for (id, limit) in &catalog.limits {
        assert!((1..=MAX_ID_BYTES).contains(&id.len()), "limit id {id:?}");
        assert!(limit.budget_micros > 0, "{id} has no budget");
        limit
            .time_zone
            .parse::<Tz>()
            .unwrap_or_else(|_| panic!("{id}: bad zone {:?}", limit.time_zone));
        // Parents exist, without cycles, and chains end at an account
        // within three steps.
        let chain = catalog
            .ancestry(id)
            .unwrap_or_else(|e| panic!("{id}: {e:#}"));
        assert!(chain.len() <= 3, "{id}: parent chain {chain:?}");
        assert!(chain.last().unwrap().starts_with("account-"), "{chain:?}");
    }
    for (ad, limits) in &catalog.ads {
        assert!((1..=MAX_ID_BYTES).contains(&ad.len()), "ad id {ad:?}");
        assert_eq!(limits.len(), 3, "{ad}: {limits:?}");
        for limit in limits {
            assert!(catalog.limits.contains_key(limit), "{ad}: {limit}");
        }
        let [adset, campaign, account] = &limits[..] else {
            unreachable!()
        };
        assert!(adset.starts_with("adset-"), "{ad}: {limits:?}");
        assert_eq!(catalog.limits[adset].parent.as_ref(), Some(campaign));
        assert_eq!(catalog.limits[campaign].parent.as_ref(), Some(account));
        assert_eq!(catalog.limits[account].parent, None);
    }
}

#[test]
fn default_catalog_is_valid_deterministic_and_mixed() {
    let spec = CatalogSpec::for_ads(1000);
    let catalog = generate_catalog(&spec, 42).unwrap();
    catalog.validate().unwrap();
    assert_catalog_structure(&catalog, &spec);
    assert_eq!(catalog, generate_catalog(&spec, 42).unwrap());
    assert_ne!(catalog, generate_catalog(&spec, 43).unwrap());

    let zones: HashSet<&str> = catalog
        .limits
        .values()
        .map(|l| l.time_zone.as_str())
        .collect();
    // Ten accounts take the zones in turn: every one is used.
    assert!(spec.accounts as usize >= ZONES.len(), "{spec:?}");
    for zone in ZONES {
        assert!(zones.contains(zone), "{zone} unused: {zones:?}");
    }
    let periods: HashSet<Period> = catalog.limits.values().map(|l| l.period).collect();
    assert_eq!(periods.len(), 2, "periods: {periods:?}");
    // Every ad set has ads: no limit of the generated catalog is unreachable.
    let used: HashSet<&String> = catalog.ads.values().flatten().collect();
    assert_eq!(used.len(), catalog.limits.len());
}

#[test]
fn catalog_json_is_the_contract_document() {
    let catalog = generate_catalog(&CatalogSpec::for_ads(20), 7).unwrap();
    let json = serde_json::to_value(&catalog).unwrap();
    let root = json.as_object().unwrap();
    assert_eq!(root.keys().collect::<Vec<_>>(), ["ads", "limits"]);
    for (id, limit) in json["limits"].as_object().unwrap() {
        let limit = limit.as_object().unwrap();
        assert!(limit["budget_micros"].is_u64(), "{id}");
        assert!(["daily", "lifetime"].contains(&limit["period"].as_str().unwrap()));
        assert!(limit["time_zone"].is_string(), "{id}");
        assert_eq!(limit.contains_key("parent"), !id.starts_with("account-"));
        for key in limit.keys() {
            assert!(
                ["budget_micros", "period", "time_zone", "parent"].contains(&key.as_str()),
                "{id}: unexpected field {key}"
            );
        }
    }
    for (ad, limits) in json["ads"].as_object().unwrap() {
        assert!(
            limits.as_array().unwrap().iter().all(|l| l.is_string()),
            "{ad}"
        );
    }
    // The contract's own example parses, with the zone defaulting to UTC.
    let example: Catalog = serde_json::from_str(
        r#"{"limits": {
              "campaign-1": {"budget_micros": 100000000, "period": "daily", "time_zone": "America/New_York"},
              "adset-7": {"budget_micros": 20000000, "period": "lifetime", "parent": "campaign-1"}},
            "ads": {"ad-1": ["adset-7", "campaign-1"]}}"#,
    )
    .unwrap();
    example.validate().unwrap();
    assert_eq!(example.limits["adset-7"].time_zone, "UTC");
    let back: Catalog = serde_json::from_value(json).unwrap();
    assert_eq!(back, catalog);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn generated_catalogs_are_valid(
        ads in 1u32..300,
        extra_adsets in 0u32..4,
        seed in any::<u64>(),
        custom in any::<bool>(),
    ) {
        let mut spec = CatalogSpec::for_ads(ads);
        if custom {
            // Levels that outnumber the level below leave childless parents.
            spec.adsets += extra_adsets;
            spec.campaigns += extra_adsets;
            spec.accounts += extra_adsets;
        }
        let catalog = generate_catalog(&spec, seed).unwrap();
        prop_assert!(catalog.validate().is_ok());
        assert_catalog_structure(&catalog, &spec);
    }
}

pub(crate) fn limit(budget_micros: u64, period: Period, zone: &str, parent: Option<&str>) -> Limit {
    Limit {
        budget_micros,
        period,
        time_zone: zone.to_owned(),
        parent: parent.map(str::to_owned),
    }
}

/// Turns the valid catalog of the test below into an invalid one.
type Breakage = fn(&mut Catalog);

#[test]
fn validate_rejects_broken_catalogs() {
    let good = || {
        let mut c = Catalog::default();
        c.limits
            .insert("a".into(), limit(1, Period::Daily, "UTC", None));
        c.limits
            .insert("b".into(), limit(1, Period::Lifetime, "UTC", Some("a")));
        c.ads.insert("ad".into(), vec!["b".into(), "a".into()]);
        c
    };
    good().validate().unwrap();
    let broken: [(&str, Breakage); 8] = [
        ("cycle", |c| {
            c.limits.get_mut("a").unwrap().parent = Some("b".into())
        }),
        ("unknown parent", |c| {
            c.limits.get_mut("a").unwrap().parent = Some("z".into())
        }),
        ("zero budget", |c| {
            c.limits.get_mut("a").unwrap().budget_micros = 0
        }),
        ("bad zone", |c| {
            c.limits.get_mut("a").unwrap().time_zone = "Mars/Olympus".into()
        }),
        ("unknown limit", |c| {
            c.ads.get_mut("ad").unwrap().push("z".into())
        }),
        ("limit twice", |c| {
            c.ads.get_mut("ad").unwrap().push("a".into())
        }),
        ("long ad id", |c| drop(c.ads.insert("x".repeat(65), vec![]))),
        ("empty limit id", |c| {
            drop(
                c.limits
                    .insert(String::new(), limit(1, Period::Daily, "UTC", None)),
            )
        }),
    ];
    for (what, breaks) in broken {
        let mut catalog = good();
        breaks(&mut catalog);
        assert!(catalog.validate().is_err(), "{what} accepted");
    }
}

#[test]
fn ancestry_walks_to_the_root_and_refuses_cycles_and_strangers() {
    let mut catalog = Catalog::default();
    catalog
        .limits
        .insert("account".into(), limit(1, Period::Daily, "UTC", None));
    catalog.limits.insert(
        "campaign".into(),
        limit(1, Period::Daily, "UTC", Some("account")),
    );
    catalog.limits.insert(
        "adset".into(),
        limit(1, Period::Lifetime, "UTC", Some("campaign")),
    );
    assert_eq!(
        catalog.ancestry("adset").unwrap(),
        ["adset", "campaign", "account"]
    );
    assert_eq!(catalog.ancestry("account").unwrap(), ["account"]);
    assert!(catalog.ancestry("nobody").is_err());

    catalog.limits.get_mut("campaign").unwrap().parent = Some("gone".into());
    let error = catalog.ancestry("adset").unwrap_err().to_string();
    assert!(error.contains("\"gone\""), "{error}");

    catalog.limits.get_mut("campaign").unwrap().parent = Some("adset".into());
    let error = catalog.ancestry("adset").unwrap_err().to_string();
    assert!(error.contains("cycle"), "{error}");
}
