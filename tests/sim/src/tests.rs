//! The command-line forms of the simulator's options and the checks of a
//! run's settings.

use super::*;

#[test]
fn option_parsers_accept_documented_forms_and_reject_others() {
    assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
    assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
    assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
    assert!(parse_duration("2 weeks").is_err());
    assert_eq!(
        "100..=5_000_000".parse(),
        Ok(CostDistribution::Uniform {
            min: 100,
            max: 5_000_000
        })
    );
    assert_eq!(
        "log-uniform:1..=9".parse(),
        Ok(CostDistribution::LogUniform { min: 1, max: 9 })
    );
    assert!("9..=1".parse::<CostDistribution>().is_err());
    assert!("log-uniform:0..=9".parse::<CostDistribution>().is_err());
    assert_eq!(
        "last:36h".parse(),
        Ok(EventTime::Last(Duration::from_secs(36 * 3600)))
    );
    assert_eq!(
        "range:2026-03-08T00:00:00Z..1772985600001".parse(),
        Ok(EventTime::Range {
            start_ms: 1_772_928_000_000,
            end_ms: 1_772_985_600_001
        })
    );
    assert!("range:5..5".parse::<EventTime>().is_err());
    for kind in BadKind::ALL {
        assert_eq!(kind.reason().parse(), Ok(kind));
    }
    assert!("garbage".parse::<BadKind>().is_err());

    let bad_configs = [
        SimConfig {
            subject: "other.subject".into(),
            ..Default::default()
        },
        SimConfig {
            subject: "impressions.>".into(),
            ..Default::default()
        },
        SimConfig {
            duplicate_rate: 1.5,
            ..Default::default()
        },
        SimConfig {
            batch: 0,
            ..Default::default()
        },
        SimConfig {
            run_id: Some("has space".into()),
            ..Default::default()
        },
        SimConfig {
            run_id: Some("r".repeat(41)),
            ..Default::default()
        },
    ];
    SimConfig::default().validate().unwrap();
    for config in bad_configs {
        assert!(config.validate().is_err(), "{config:?}");
    }
}

#[test]
fn serve_takes_the_lease_mode_and_its_settings() {
    use clap::Parser;

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        args: cli::ServeArgs,
    }
    let parse = |args: &[&str]| {
        Serve::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
            .map(|s| s.args.loop_config())
    };
    assert_eq!(parse(&[]).unwrap().mode, ServeMode::Decisions);
    let config = parse(&[
        "--mode",
        "leases",
        "--lease-ttl-ms",
        "10000",
        "--lease-margin-ms",
        "500",
        "--lease-ask-share",
        "0.25",
    ])
    .unwrap();
    assert_eq!(
        config.mode,
        ServeMode::Leases(LeaseMode {
            policy: LeasePolicy {
                ttl: Duration::from_secs(10),
                margin: Duration::from_millis(500),
                ask_share: 0.25,
                lead: LEAD,
            },
            release: true,
        })
    );
    config.validate().unwrap();
    assert_eq!(
        parse(&["--mode", "leases"]).unwrap().mode,
        ServeMode::Leases(LeaseMode::default())
    );
    assert!(parse(&["--mode", "leases", "--lease-ttl-ms", "999"]).is_err());
    assert!(parse(&["--mode", "bids"]).is_err());
    // A margin over half the ttl parses, and the run's check refuses it.
    let config = parse(&["--mode", "leases", "--lease-ttl-ms", "1000"]).unwrap();
    assert!(config
        .validate()
        .unwrap_err()
        .to_string()
        .contains("margin"));
}
