//! The services' Prometheus text, fetched over the `data` network.

use anyhow::{ensure, Context};

use super::Cluster;

impl Cluster {
    /// The service's Prometheus text, fetched over the `data` network.
    pub async fn metrics(&self, service: &str, port: u16) -> anyhow::Result<String> {
        let state = self.state(service).await?;
        let ip = state
            .data_ip
            .with_context(|| format!("{service} has no address on the data network"))?;
        let url = format!("http://{ip}:{port}/metrics");
        let response = self
            .http
            .get(&url)
            .send()
            .await
            .with_context(|| url.clone())?;
        ensure!(
            response.status().is_success(),
            "{url}: {}",
            response.status()
        );
        Ok(response.text().await?)
    }
}

/// The sum of every series of `name` whatever its labels (`name 1`,
/// `name{side="take"} 2`); `None` when there is none.
pub fn metric_sum(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let value = match rest.as_bytes().first()? {
                b' ' => rest,
                b'{' => &rest[rest.find('}')? + 1..],
                _ => return None,
            };
            value.trim().parse::<f64>().ok()
        })
        .reduce(|a, b| a + b)
}

/// One value of a Prometheus text exposition, parsed as the single-machine
/// tests parse it.
pub use adspend_harness::pipeline::metric_value;

#[cfg(test)]
mod tests {
    use super::{metric_sum, metric_value};

    #[test]
    fn metric_values_by_series() {
        let body = "# TYPE x gauge\nadspend_aggregator_owned_partitions 5\n\
                    adspend_aggregator_owned_partitions_max 9\nh_sum{le=\"1\"} 0.25\n";
        assert_eq!(
            metric_value(body, "adspend_aggregator_owned_partitions"),
            Some(5.0)
        );
        assert_eq!(metric_value(body, "h_sum{le=\"1\"}"), Some(0.25));
        assert_eq!(metric_value(body, "missing"), None);
        let labelled = "h_count{side=\"take\"} 2\nh_count{side=\"release\"} 3\nh_count_x 9\n";
        assert_eq!(metric_sum(labelled, "h_count"), Some(5.0));
        assert_eq!(
            metric_sum(body, "adspend_aggregator_owned_partitions"),
            Some(5.0)
        );
        assert_eq!(metric_sum(labelled, "missing"), None);
    }
}
