//! Keeping a client's endpoints to the etcd members that answer.
//!
//! etcd-client balances requests over every endpoint it was given, and a
//! member that is down is not skipped: its endpoint fails each request sent
//! to it ("dns error" once Docker forgets a killed container's name, a
//! timeout for a frozen one), so with one member of three down, about one
//! request in three fails while a quorum serves. A partition start makes
//! several etcd calls in a row; at one in three each, a restart after an
//! etcd leader kill could loop claim → fail → release for minutes. Here
//! every endpoint is probed on a client of its own each second (one
//! after another, each given 800 ms); one that
//! fails [`DOWN_AFTER`] probes in a row leaves the shared client's balance
//! list, and comes back at its first answer. The last endpoint is never
//! removed.

use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

const PROBE_EVERY: Duration = Duration::from_secs(1);
const PROBE_TIMEOUT: Duration = Duration::from_millis(800);
/// Failed probes in a row before an endpoint leaves the balance list.
const DOWN_AFTER: u32 = 2;

struct Endpoint {
    url: String,
    probe: Option<Client>,
    failures: u32,
    in_balance: bool,
}

/// Every endpoint of one shared client, as the probes see them.
pub(super) struct Endpoints {
    list: Vec<Endpoint>,
    options: ConnectOptions,
}

impl Endpoints {
    pub(super) fn new(urls: Vec<String>, options: ConnectOptions) -> Endpoints {
        let list = urls
            .into_iter()
            .map(|url| Endpoint {
                url,
                probe: None,
                failures: 0,
                in_balance: true,
            })
            .collect();
        Endpoints { list, options }
    }

    /// One probe of each endpoint at start-up: one that fails it leaves the
    /// balance before the service's first requests (unless none answered).
    pub(super) async fn first_round(&mut self, shared: &Client) {
        let _ = self.round(shared, 1).await;
    }

    /// Runs until its [`super::Background`] ends it (or the shared client's
    /// balance list can no longer be changed).
    pub(super) async fn keep_live(mut self, shared: Client) {
        let mut ticker = tokio::time::interval(PROBE_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            if self.round(&shared, DOWN_AFTER).await.is_err() {
                return;
            }
        }
    }

    /// Probes every endpoint once; takes out those that failed `down_after`
    /// probes in a row (while one answers) and puts back those that answer.
    async fn round(&mut self, shared: &Client, down_after: u32) -> Result<(), ()> {
        for endpoint in self.list.iter_mut() {
            let ok = probe(endpoint, &self.options).await;
            endpoint.failures = if ok { 0 } else { endpoint.failures + 1 };
        }
        let live = self.list.iter().filter(|e| e.failures == 0).count();
        for endpoint in &mut self.list {
            let change = if endpoint.in_balance && endpoint.failures >= down_after && live > 0 {
                shared.remove_endpoint(&endpoint.url).await.map(|()| false)
            } else if !endpoint.in_balance && endpoint.failures == 0 {
                shared.add_endpoint(&endpoint.url).await.map(|()| true)
            } else {
                continue;
            };
            match change {
                Ok(in_balance) => {
                    endpoint.in_balance = in_balance;
                    if in_balance {
                        tracing::info!(
                            endpoint = endpoint.url,
                            "etcd endpoint answers again; back in use"
                        );
                    } else {
                        tracing::warn!(
                            endpoint = endpoint.url,
                            failed_probes = endpoint.failures,
                            "etcd endpoint does not answer; requests go to the others"
                        );
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot change the etcd client's endpoints; no longer probing");
                    return Err(());
                }
            }
        }
        Ok(())
    }
}

/// One status request on the endpoint's own client (made on first use and
/// after a failure, so a member that comes back is dialled afresh).
async fn probe(endpoint: &mut Endpoint, options: &ConnectOptions) -> bool {
    let attempt = async {
        if endpoint.probe.is_none() {
            let client = Client::connect([endpoint.url.as_str()], Some(options.clone())).await?;
            endpoint.probe = Some(client);
        }
        match endpoint.probe.as_mut() {
            Some(client) => client.status().await.map(drop),
            None => Ok(()),
        }
    };
    let ok = matches!(
        tokio::time::timeout(PROBE_TIMEOUT, attempt).await,
        Ok(Ok(()))
    );
    if !ok {
        endpoint.probe = None;
    }
    ok
}
