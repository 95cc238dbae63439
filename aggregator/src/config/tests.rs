use super::*;

fn validate(args: &[&str]) -> Result<Validated, Error> {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("--object-store-url=file://{}", dir.path().display());
    let mut all = vec!["aggregator", store.as_str()];
    all.extend_from_slice(args);
    Config::try_parse_from(all).unwrap().validate()
}

#[test]
fn ownership_is_parsed_once_into_the_validated_settings() {
    let fixed = validate(&["--owned-partitions=3, 1,3"]).unwrap();
    assert_eq!(fixed.ownership, Ownership::Fixed(vec![1, 3]));
    assert_eq!(fixed.ownership.shard(), "p1-3");
    assert_eq!(validate(&[]).unwrap().ownership.shard(), "all");
    let cluster = validate(&[
        "--owned-partitions=auto",
        "--etcd-endpoints=127.0.0.1:2379",
        "--aggregator-id=agg-1",
    ])
    .unwrap();
    assert_eq!(
        cluster.ownership,
        Ownership::Cluster {
            member_id: "agg-1".into()
        }
    );
}

#[test]
fn accepted_losses_name_a_shard_and_its_checkpoint() {
    let accepted = validate(&["--accept-loss=p3@17, all@2"]).unwrap();
    let accepted = accepted.config.shard_settings().accept_loss;
    assert!(accepted.covers("p3", 17) && accepted.covers("all", 2));
    assert!(!accepted.covers("p3", 18) && !accepted.covers("p4", 17));
    assert_eq!(
        validate(&[]).unwrap().config.shard_settings().accept_loss,
        AcceptLoss::default()
    );
    for bad in ["p3", "p3@", "@17", "P3@17", "p3@x", "all@-1"] {
        let error = validate(&[&format!("--accept-loss={bad}")]).unwrap_err();
        assert_eq!(
            error.exit_code(),
            adspend_common::error::EXIT_BAD_SETTING,
            "{bad}: {error}"
        );
        assert!(error.to_string().contains(ACCEPT_LOSS), "{error}");
    }
}

#[test]
fn writers_are_auto_or_a_count() {
    assert_eq!(parse_writers("auto"), Ok(Writers::Auto));
    assert_eq!(parse_writers(" 2 "), Ok(Writers::Count(2)));
    assert_eq!(parse_writers("1024"), Ok(Writers::Count(1024)));
    for bad in ["0", "1025", "-1", "two", ""] {
        let e = parse_writers(bad).unwrap_err();
        assert!(e.contains("auto") && e.contains("1 to 1024"), "{bad}: {e}");
    }
    assert_eq!(Writers::Auto.to_string(), "auto");
    assert_eq!(Writers::Count(3).to_string(), "3");
}

#[test]
fn bad_ownership_settings_are_config_errors() {
    for args in [
        &["--owned-partitions=16"][..],
        &["--owned-partitions=x"],
        &["--owned-partitions=auto"],
        &[
            "--owned-partitions=auto",
            "--etcd-endpoints=127.0.0.1:2379",
            "--aggregator-id=a/b",
        ],
    ] {
        let error = validate(args).unwrap_err();
        assert_eq!(
            error.exit_code(),
            adspend_common::error::EXIT_BAD_SETTING,
            "{args:?}: {error}"
        );
    }
}
