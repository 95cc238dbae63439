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
