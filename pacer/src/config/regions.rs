//! The settings of one budget across regions (CONTRACT.md "Regions";
//! docs/REGIONS.md): which region this pacer serves, every region of the
//! deployment, and how often the pacers of the regions report to each
//! other. ADSPEND_REGION empty: one region, exactly as without them.

use std::collections::BTreeSet;
use std::time::Duration;

use adspend_common::Error;
use adspend_wire::regions::{RegionName, MAX_REGIONS};

use crate::regions::RegionSettings;

pub(crate) const REGION: &str = "ADSPEND_REGION";
pub(crate) const REGIONS: &str = "ADSPEND_REGIONS";
pub(crate) const REGION_REPORT_INTERVAL_MS: &str = "ADSPEND_REGION_REPORT_INTERVAL_MS";
pub(crate) const REGION_UNHEARD_MS: &str = "ADSPEND_REGION_UNHEARD_MS";

#[derive(clap::Args, Clone, Debug)]
pub(crate) struct RegionArgs {
    /// This pacer's region (1..=32 bytes of [a-z0-9-]). Empty: the
    /// deployment is one region and budgets are not split.
    #[arg(long, env = REGION, default_value = "")]
    pub(crate) region: String,
    /// Every region of the deployment, comma-separated, ADSPEND_REGION
    /// among them; the same list in every region (each region's initial
    /// share of a budget follows from it).
    #[arg(long, env = REGIONS, default_value = "")]
    pub(crate) regions: String,
    /// Milliseconds between this region's reports to the others (what it
    /// spent, leased, wants, and gave).
    #[arg(long, env = REGION_REPORT_INTERVAL_MS, default_value_t = 500,
          value_parser = clap::value_parser!(u64).range(50..=60_000))]
    pub(crate) region_report_interval_ms: u64,
    /// Milliseconds without a report after which a region counts as
    /// unheard (`adspend_pacer_region_heard` 0, alert AdspendRegionUnheard).
    #[arg(long, env = REGION_UNHEARD_MS, default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1_000..=86_400_000))]
    pub(crate) region_unheard_ms: u64,
}

impl RegionArgs {
    /// None when ADSPEND_REGION is empty (ADSPEND_REGIONS must be too).
    pub(crate) fn settings(&self) -> Result<Option<RegionSettings>, Error> {
        let fail = |name: &'static str, value: &str, reason: String| Error::Config {
            name,
            value: value.to_string(),
            reason,
        };
        let (own, all) = (self.region.trim(), self.regions.trim());
        if own.is_empty() {
            if !all.is_empty() {
                return Err(fail(REGIONS, all, format!("is set without {REGION}")));
            }
            return Ok(None);
        }
        let region = RegionName::new(own).map_err(|e| fail(REGION, own, e.to_string()))?;
        let mut regions = BTreeSet::new();
        for name in all.split(',').map(str::trim) {
            let name = RegionName::new(name).map_err(|e| fail(REGIONS, all, e.to_string()))?;
            if !regions.insert(name.clone()) {
                return Err(fail(REGIONS, all, format!("names {name} twice")));
            }
        }
        if !regions.contains(&region) {
            return Err(fail(
                REGIONS,
                all,
                format!("does not name this region ({REGION}={region})"),
            ));
        }
        if regions.len() > MAX_REGIONS {
            return Err(fail(
                REGIONS,
                all,
                format!("names {} regions; at most {MAX_REGIONS}", regions.len()),
            ));
        }
        Ok(Some(RegionSettings {
            region,
            regions,
            report_interval: Duration::from_millis(self.region_report_interval_ms),
            unheard_after: Duration::from_millis(self.region_unheard_ms),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Only {
        #[command(flatten)]
        args: RegionArgs,
    }

    fn settings(args: &[&str]) -> Result<Option<RegionSettings>, String> {
        let mut all = vec!["pacer"];
        all.extend_from_slice(args);
        let only = Only::try_parse_from(all).map_err(|e| e.to_string())?;
        only.args.settings().map_err(|e| e.to_string())
    }

    #[test]
    fn no_region_is_one_region() {
        assert_eq!(settings(&[]).unwrap(), None);
    }

    #[test]
    fn a_region_among_its_regions_with_the_documented_defaults() {
        let s = settings(&["--region=east", "--regions=west, east,south"])
            .unwrap()
            .unwrap();
        assert_eq!(s.region.as_str(), "east");
        let names: Vec<&str> = s.regions.iter().map(|r| r.as_str()).collect();
        assert_eq!(names, ["east", "south", "west"]);
        assert_eq!(s.report_interval, Duration::from_millis(500));
        assert_eq!(s.unheard_after, Duration::from_secs(10));
    }

    #[test]
    fn bad_values_are_refused_naming_the_setting_and_the_rule() {
        let many: Vec<String> = (0..17).map(|i| format!("r{i}")).collect();
        let many = format!("--regions={}", many.join(","));
        for (args, name, reason) in [
            (vec!["--regions=east"], REGIONS, "without ADSPEND_REGION"),
            (vec!["--region=East", "--regions=East"], REGION, "'E'"),
            (
                vec!["--region=east", "--regions=west"],
                REGIONS,
                "does not name",
            ),
            (vec!["--region=east"], REGIONS, "empty"),
            (
                vec!["--region=east", "--regions=east,,west"],
                REGIONS,
                "empty",
            ),
            (
                vec!["--region=east", "--regions=east,east"],
                REGIONS,
                "twice",
            ),
            (vec!["--region=r0", many.as_str()], REGIONS, "at most 16"),
        ] {
            let message = settings(&args).unwrap_err();
            assert!(
                message.contains(name) && message.contains(reason),
                "{args:?}: {message}"
            );
        }
        let message = settings(&["--region-report-interval-ms=10"]).unwrap_err();
        assert!(message.contains("region-report-interval-ms"), "{message}");
        let message = settings(&["--region-unheard-ms=5"]).unwrap_err();
        assert!(message.contains("region-unheard-ms"), "{message}");
    }
}
