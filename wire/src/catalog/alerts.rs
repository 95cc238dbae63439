//! Budget alert thresholds of a limit (`"alerts": [50, 75, 90, 100]`).
//!
//! Each is a whole percent of the limit's budget for its period, in
//! 1..=[`MAX_THRESHOLD_PERCENT`] (an alert past the budget is meaningful:
//! overspend), listed in ascending order, each once. A limit with alerts
//! names the NATS subject its alerts go to (`adspend.alerts.<limit id>`),
//! so its id must be usable there: no whitespace, no wildcard (`*`, `>`),
//! no empty token (a leading, trailing or doubled `.`).

/// Highest threshold accepted, percent of the budget.
pub(super) const MAX_THRESHOLD_PERCENT: u32 = 1000;

/// The validated thresholds of limit `id` (empty when it lists none), or
/// why they are refused.
pub(super) fn thresholds(id: &str, listed: Option<&[u32]>) -> Result<Box<[u16]>, String> {
    let Some(listed) = listed.filter(|l| !l.is_empty()) else {
        return Ok(Box::default());
    };
    for (i, &percent) in listed.iter().enumerate() {
        if !(1..=MAX_THRESHOLD_PERCENT).contains(&percent) {
            return Err(format!(
                "limit {id:?}: alert threshold {percent} must be 1..={MAX_THRESHOLD_PERCENT} \
                 (percent of the budget)"
            ));
        }
        if let Some(&before) = i.checked_sub(1).map(|b| &listed[b]) {
            if before == percent {
                return Err(format!(
                    "limit {id:?}: alert threshold {percent} is listed twice"
                ));
            }
            if before > percent {
                return Err(format!(
                    "limit {id:?}: alert thresholds must be ascending ({before} before {percent})"
                ));
            }
        }
    }
    check_subject_token(id)?;
    // In range, so each fits a u16.
    Ok(listed.iter().map(|&p| p as u16).collect())
}

/// `id` is a valid tail of a NATS subject.
fn check_subject_token(id: &str) -> Result<(), String> {
    let bad_char = id
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || matches!(c, '*' | '>'));
    if let Some(c) = bad_char {
        return Err(format!(
            "limit {id:?}: has alerts, so its id names a NATS subject \
             (adspend.alerts.<limit id>) and may not hold {c:?}"
        ));
    }
    if id.split('.').any(str::is_empty) {
        return Err(format!(
            "limit {id:?}: has alerts, so its id names a NATS subject \
             (adspend.alerts.<limit id>) and may not start or end with '.' or hold '..'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::Catalog;

    fn with_alerts(id: &str, alerts: &str) -> Result<Catalog, String> {
        let json = format!(
            r#"{{"limits": {{{id:?}: {{"budget_micros": 1000, "period": "daily", "alerts": {alerts}}}}},
                "ads": {{"ad": [{id:?}]}}}}"#
        );
        Catalog::parse("alerts.json", json.as_bytes()).map_err(|e| e.to_string())
    }

    #[test]
    fn valid_thresholds_are_kept_in_order() {
        let catalog = with_alerts("c", "[50, 75, 90, 100, 1000]").unwrap();
        assert_eq!(
            &*catalog.limit("c").unwrap().alerts,
            &[50, 75, 90, 100, 1000]
        );
        assert_eq!(catalog.alerting().len(), 1);
        for none in ["[]", "null"] {
            let catalog = with_alerts("c", none).unwrap();
            assert!(catalog.limit("c").unwrap().alerts.is_empty());
            assert!(catalog.alerting().is_empty());
        }
        // Dots are fine: they make a longer subject, still one limit's.
        assert!(with_alerts("acme.campaign-1", "[1]").is_ok());
    }

    #[test]
    fn absent_alerts_mean_none() {
        let json = br#"{"limits": {"c": {"budget_micros": 1, "period": "lifetime"}}, "ads": {}}"#;
        let catalog = Catalog::parse("t", json).unwrap();
        assert!(catalog.limit("c").unwrap().alerts.is_empty());
        assert!(catalog.alerting().is_empty());
    }

    #[test]
    fn bad_thresholds_are_refused_with_the_limit_and_the_reason() {
        for (alerts, expected) in [
            ("[0]", "alert threshold 0 must be 1..=1000"),
            ("[50, 1001]", "alert threshold 1001 must be 1..=1000"),
            ("[50, 50]", "alert threshold 50 is listed twice"),
            ("[90, 50]", "must be ascending (90 before 50)"),
            ("[-5]", "invalid value"),
            ("[50.5]", "invalid type"),
            ("\"50\"", "invalid type"),
        ] {
            let message = with_alerts("camp", alerts).unwrap_err();
            assert!(message.contains("alerts.json"), "{alerts}: {message}");
            assert!(message.contains(expected), "{alerts}: {message}");
            if !expected.starts_with("invalid") {
                assert!(message.contains("limit \"camp\""), "{alerts}: {message}");
            }
        }
    }

    #[test]
    fn a_limit_with_alerts_needs_an_id_that_names_a_subject() {
        for id in ["a b", "a*", "a>", ".a", "a.", "a..b", "tab\there"] {
            let message = with_alerts(id, "[50]").unwrap_err();
            assert!(message.contains("NATS subject"), "{id:?}: {message}");
        }
        // Without alerts the id is fine as it is.
        assert!(with_alerts("a b", "[]").is_ok());
    }
}
