//! Prometheus metrics and the operator's small HTTP endpoint (`/metrics`, `/healthz`).

use std::sync::Arc;
use std::time::Instant;

use harvest_crds::HarvestJob;
use kube::runtime::reflector::Store;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::leader::{Election, Seen};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabel {
    error: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AccountLabel {
    account: String,
    window: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AccountLaneLabel {
    account: String,
    lane: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AccountName {
    account: String,
}

/// What the account gauges show, from an account's stored status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountUsage {
    /// Tokens today, this month and in total (holds included).
    pub tokens: [u64; 3],
    /// Running jobs in the small and large lanes.
    pub active: [u32; 2],
    /// Jobs waiting for admission.
    pub pending: u32,
}

/// The operator's metrics.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    reconciles: Counter,
    failures: Family<ErrorLabel, Counter>,
    duration: Histogram,
    admission_wait: Histogram,
    jobs: Family<PhaseLabel, Gauge>,
    account_tokens: Family<AccountLabel, Gauge>,
    account_active: Family<AccountLaneLabel, Gauge>,
    account_pending: Family<AccountName, Gauge>,
    leader: Gauge,
    election_errors: Counter,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("harvest_operator");
        let reconciles = Counter::default();
        let failures = Family::<ErrorLabel, Counter>::default();
        let duration = Histogram::new([0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]);
        let admission_wait = Histogram::new([1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 21600.0]);
        let jobs = Family::<PhaseLabel, Gauge>::default();
        registry.register("reconciles", "Reconciles run", reconciles.clone());
        registry.register(
            "reconcile_failures",
            "Reconciles that failed, by error",
            failures.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time per reconcile",
            duration.clone(),
        );
        registry.register(
            "admission_wait_seconds",
            "Time from creation to admission",
            admission_wait.clone(),
        );
        registry.register("jobs", "Jobs by phase", jobs.clone());
        let account_tokens = Family::<AccountLabel, Gauge>::default();
        let account_active = Family::<AccountLaneLabel, Gauge>::default();
        let account_pending = Family::<AccountName, Gauge>::default();
        registry.register(
            "account_tokens",
            "Tokens charged or held per account, by UTC window (today, month, total)",
            account_tokens.clone(),
        );
        registry.register(
            "account_active_jobs",
            "Running jobs per account and lane",
            account_active.clone(),
        );
        registry.register(
            "account_pending_jobs",
            "Jobs waiting for admission per account",
            account_pending.clone(),
        );
        let leader = Gauge::default();
        let election_errors = Counter::default();
        registry.register(
            "leader",
            "1 while this replica leads (or runs without election), 0 while it follows",
            leader.clone(),
        );
        registry.register(
            "election_errors",
            "Leader election rounds that failed to read or write the Lease",
            election_errors.clone(),
        );
        Self {
            registry: Arc::new(registry),
            leader,
            election_errors,
            reconciles,
            failures,
            duration,
            admission_wait,
            jobs,
            account_tokens,
            account_active,
            account_pending,
        }
    }
}

/// Observes a reconcile's duration when dropped.
#[derive(Debug)]
pub struct ReconcileTimer {
    start: Instant,
    duration: Histogram,
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        self.duration.observe(self.start.elapsed().as_secs_f64());
    }
}

impl Metrics {
    /// Counts a reconcile and times it.
    pub fn reconcile_started(&self) -> ReconcileTimer {
        self.reconciles.inc();
        ReconcileTimer {
            start: Instant::now(),
            duration: self.duration.clone(),
        }
    }

    /// Counts a failed reconcile.
    pub fn reconcile_failed(&self, error: &'static str) {
        self.failures.get_or_create(&ErrorLabel { error }).inc();
    }

    /// Records how long a job waited for admission.
    pub fn admitted(&self, waited_seconds: f64) {
        self.admission_wait.observe(waited_seconds.max(0.0));
    }

    /// Records an account's books as they were just written.
    pub fn account(&self, account: &str, usage: AccountUsage) {
        for (window, tokens) in ["today", "month", "total"].into_iter().zip(usage.tokens) {
            let label = AccountLabel {
                account: account.to_owned(),
                window,
            };
            self.account_tokens
                .get_or_create(&label)
                .set(i64::try_from(tokens).unwrap_or(i64::MAX));
        }
        for (lane, active) in ["small", "large"].into_iter().zip(usage.active) {
            let label = AccountLaneLabel {
                account: account.to_owned(),
                lane,
            };
            self.account_active
                .get_or_create(&label)
                .set(i64::from(active));
        }
        let label = AccountName {
            account: account.to_owned(),
        };
        self.account_pending
            .get_or_create(&label)
            .set(i64::from(usage.pending));
    }

    /// The text exposition, with the jobs-by-phase gauge taken from the cache now and the
    /// election's figures from what it has `seen`.
    pub fn render(&self, jobs: &Store<HarvestJob>, seen: &Seen) -> String {
        self.leader.set(i64::from(seen.leading));
        self.election_errors
            .inc_by(seen.errors.saturating_sub(self.election_errors.get()));
        let phases = [
            "Pending",
            "Suspended",
            "Running",
            "Succeeded",
            "Failed",
            "Cancelled",
        ];
        let mut counts = [0i64; 6];
        for job in jobs.state() {
            let phase = job
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .map_or("Pending", |p| p.as_str());
            if let Some(i) = phases.iter().position(|p| *p == phase) {
                counts[i] += 1;
            }
        }
        for (phase, count) in phases.iter().zip(counts) {
            self.jobs.get_or_create(&PhaseLabel { phase }).set(count);
        }
        let mut text = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

/// Serves `GET /metrics`, `GET /healthz` (the election's [`crate::leader::health`]) and
/// `GET /readyz` (always: a follower is ready too) on `listener` until the task is dropped.
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    jobs: Store<HarvestJob>,
    election: Election,
) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            continue;
        };
        let metrics = metrics.clone();
        let jobs = jobs.clone();
        let election = election.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let n = stream.read(&mut buf).await.unwrap_or(0);
            let request = String::from_utf8_lossy(&buf[..n]);
            let path = request.split_whitespace().nth(1).unwrap_or("/");
            let (status, body) = match path {
                "/metrics" => ("200 OK", metrics.render(&jobs, &election.seen())),
                "/healthz" => match election.health() {
                    Ok(()) => ("200 OK", "ok\n".to_owned()),
                    Err(why) => ("503 Service Unavailable", format!("{why}\n")),
                },
                "/readyz" => ("200 OK", "ok\n".to_owned()),
                _ => (
                    "404 Not Found",
                    "not found: try /metrics or /healthz\n".to_owned(),
                ),
            };
            let response = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn metrics_are_served_over_http_with_the_account_gauges_and_a_lone_replica_leads() {
        let metrics = Metrics::default();
        metrics.account(
            "team-a",
            AccountUsage {
                tokens: [300, 900, 5_000],
                active: [2, 0],
                pending: 4,
            },
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (jobs, _writer) = kube::runtime::reflector::store::<HarvestJob>();
        let election = Election::alone();
        let server = tokio::spawn(serve(listener, metrics, jobs, election));
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        server.abort();
        assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
        for line in [
            "harvest_operator_account_tokens{account=\"team-a\",window=\"month\"} 900",
            "harvest_operator_account_active_jobs{account=\"team-a\",lane=\"small\"} 2",
            "harvest_operator_account_pending_jobs{account=\"team-a\"} 4",
            "harvest_operator_jobs{phase=\"Running\"} 0",
            "harvest_operator_leader 1",
            "harvest_operator_election_errors_total 0",
        ] {
            assert!(response.contains(line), "missing {line}:\n{response}");
        }
    }
}
