//! HarvestAccount books on the fake cluster with the real harvester: budgets make jobs wait
//! whatever their source, jobs created for the REST API and jobs applied directly share one
//! account queue, and a controller that fails between its two writes (hold, then job status;
//! job status, then settlement) neither loses nor repeats a charge.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{ACCOUNT, API_NAMESPACE, Cluster};
use harvest_crds::conditions::{self, ADMITTED, FINISHED};
use harvest_crds::{ACCOUNT_LABEL, HarvestJob, HarvestJobSpec, KEY_LABEL};
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::PostParams;

fn admitted_reason(job: &HarvestJob) -> Option<String> {
    conditions::get(&job.status.as_ref()?.conditions, ADMITTED).map(|c| c.reason.clone())
}

fn finished_reason(job: &HarvestJob) -> Option<String> {
    conditions::get(&job.status.as_ref()?.conditions, FINISHED).map(|c| c.reason.clone())
}

fn charged(job: &HarvestJob) -> u64 {
    job.status
        .as_ref()
        .and_then(|s| s.tokens)
        .and_then(|t| t.charged)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_daily_budget_holds_a_job_back_until_the_running_one_settles() {
    let cluster = Cluster::start(2).await;
    cluster
        .set_account(|spec| spec.daily_tokens = Some(150_000))
        .await;
    let prompts = cluster.prompts("budget", 24, 8);
    cluster.submit("spender", prompts.clone(), |_| {}).await;
    cluster.running_pod("spender").await;
    cluster.submit("held", prompts, |_| {}).await;
    let held = cluster
        .wait("held", "held back by the daily budget", |j| {
            admitted_reason(j).as_deref() == Some("DailyBudgetExhausted")
        })
        .await;
    let message = conditions::get(&held.status.unwrap().conditions, ADMITTED)
        .unwrap()
        .message
        .clone();
    assert!(
        message.contains(ACCOUNT) && message.contains("150000"),
        "the reason names the account and the budget: {message}"
    );
    // The account controller counts it among the pending jobs.
    cluster.account_until(|s| s.pending_jobs == 1).await;
    // The spender is charged what it ran, far below its hold, so the held job then fits.
    let spender = cluster.finished("spender").await;
    let held = cluster.finished("held").await;
    assert_eq!(finished_reason(&held).as_deref(), Some("Succeeded"));
    let books = cluster.account_until(|s| s.holds.is_empty()).await;
    assert_eq!(books.tokens_today, charged(&spender) + charged(&held));
    assert_eq!(books.pending_jobs, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_between_the_two_writes_neither_lose_nor_repeat_a_charge() {
    let cluster = Cluster::start(2).await;
    // The job's status write after its hold is taken fails once, as a crash there would.
    cluster
        .server
        .store
        .fail_next("PUT", "/namespaces/default/harvestjobs/crash/status", 1);
    let prompts = cluster.prompts("crash", 24, 8);
    cluster.submit("crash", prompts, |_| {}).await;
    cluster.running_pod("crash").await;
    // Settlement fails twice after the job ends.
    cluster
        .server
        .store
        .fail_next("PUT", &format!("/harvestaccounts/{ACCOUNT}/status"), 2);
    let job = cluster.finished("crash").await;
    assert_eq!(finished_reason(&job).as_deref(), Some("Succeeded"));
    assert_eq!(job.status.as_ref().unwrap().attempts, 1);
    assert_eq!(
        cluster.server.started_pods().get(&format!(
            "default/{}",
            harvest_operator::pod::pod_name("crash", job.metadata.uid.as_deref(), 1)
        )),
        Some(&1)
    );
    let books = cluster.account_until(|s| s.holds.is_empty()).await;
    assert_eq!(
        cluster.server.store.faults_pending(),
        0,
        "both injected failures hit"
    );
    assert_eq!(books.tokens_total, charged(&job), "charged exactly once");
    assert_eq!(
        books.jobs_by_key.get("namespace:default"),
        Some(&1),
        "admitted once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directly_applied_job_queues_behind_an_api_job_in_the_same_account_lane() {
    let cluster = Cluster::start(4).await;
    cluster.set_account(|spec| spec.lanes.small = 1).await;
    let namespace = Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some(API_NAMESPACE.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(cluster.client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap();
    common::create_worker_account(&cluster.client, API_NAMESPACE).await;
    let prompts = cluster.prompts("shared", 48, 8);
    let mut rest = HarvestJob::new(
        "rest",
        HarvestJobSpec::new(
            "smollm2-135m",
            prompts.clone(),
            cluster.output("rest").display().to_string(),
            100_000,
        ),
    );
    rest.metadata.labels = Some(
        [
            (ACCOUNT_LABEL.to_owned(), ACCOUNT.to_owned()),
            (KEY_LABEL.to_owned(), "k1".to_owned()),
        ]
        .into(),
    );
    let api_jobs: Api<HarvestJob> = Api::namespaced(cluster.client.clone(), API_NAMESPACE);
    api_jobs
        .create(&PostParams::default(), &rest)
        .await
        .unwrap();
    let admitted = |j: &HarvestJob| {
        j.status
            .as_ref()
            .is_some_and(|s| conditions::is_true(&s.conditions, ADMITTED))
    };
    harvest_testkit::eventually(
        "the API job's admission",
        harvest_testkit::SETTLE_WITHIN,
        || async {
            match api_jobs.get("rest").await {
                Ok(job) if admitted(&job) => Ok(()),
                other => Err(format!("{:?}", other.map(|j| j.status))),
            }
        },
    )
    .await;
    cluster.submit("gitops", prompts, |_| {}).await;
    let rest_running = api_jobs.get("rest").await.unwrap();
    assert!(
        finished_reason(&rest_running).is_none(),
        "the API job (48 long prompts) still runs when the applied one arrives"
    );
    cluster
        .wait("gitops", "queued behind the API job", |j| {
            admitted_reason(j).as_deref() == Some("WaitingForAccountLane")
        })
        .await;
    let gitops = cluster.finished("gitops").await;
    let rest = api_jobs.get("rest").await.unwrap();
    assert_eq!(finished_reason(&rest).as_deref(), Some("Succeeded"));
    assert_eq!(finished_reason(&gitops).as_deref(), Some("Succeeded"));
    let rest_done = rest.status.unwrap().completion_time.unwrap();
    let gitops_started = gitops.status.as_ref().unwrap().start_time.clone().unwrap();
    assert!(
        gitops_started.0 >= rest_done.0,
        "the account's one slot was used in turn"
    );
    let books = cluster.account_until(|s| s.holds.is_empty()).await;
    assert_eq!(books.jobs_by_key.get("key:k1"), Some(&1));
    assert_eq!(books.jobs_by_key.get("namespace:default"), Some(&1));
    assert_eq!(books.jobs_this_month, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_replicas_only_the_leader_acts_and_the_follower_finishes_a_job_charged_once() {
    let mut cluster = Cluster::start(2).await;
    cluster.kill_operator().await;
    let first = cluster.spawn_replica("replica-a");
    harvest_testkit::eventually("a leader", harvest_testkit::SETTLE_WITHIN, || async {
        cluster.leader().ok_or_else(|| "none yet".to_owned())
    })
    .await;
    let second = cluster.spawn_replica("replica-b");
    assert_eq!(cluster.leader().as_deref(), Some("replica-a"));
    let prompts = cluster.prompts("leader", 48, 8);
    cluster.submit("handover", prompts, |_| {}).await;
    cluster.running_pod("handover").await;
    first.abort();
    let _ = first.await;
    let job = cluster.finished("handover").await;
    assert_eq!(
        cluster.leader().as_deref(),
        Some("replica-b"),
        "the follower took the Lease once it expired"
    );
    assert_eq!(finished_reason(&job).as_deref(), Some("Succeeded"));
    assert_eq!(
        cluster.server.started_pods().get(&format!(
            "default/{}",
            harvest_operator::pod::pod_name("handover", job.metadata.uid.as_deref(), 1)
        )),
        Some(&1),
        "the harvest ran once"
    );
    let books = cluster.account_until(|s| s.holds.is_empty()).await;
    assert_eq!(
        books.tokens_total,
        charged(&job),
        "charged once across the handover"
    );
    assert_eq!(books.jobs_by_key.get("namespace:default"), Some(&1));
    second.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_stops_cleanly_gives_up_its_lease_at_once() {
    let mut cluster = Cluster::start(2).await;
    cluster.kill_operator().await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let replica = cluster.spawn_replica_until("replica-a", async {
        let _ = stopped.await;
    });
    harvest_testkit::eventually("a leader", harvest_testkit::SETTLE_WITHIN, || async {
        cluster.leader().ok_or_else(|| "none yet".to_owned())
    })
    .await;
    assert_eq!(cluster.leader().as_deref(), Some("replica-a"));
    let _ = stop.send(());
    tokio::time::timeout(harvest_testkit::SETTLE_WITHIN, replica)
        .await
        .expect("the replica stops within the deadline")
        .unwrap()
        .unwrap();
    assert_eq!(
        cluster.leader(),
        None,
        "the Lease is free once the leader has stopped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_waiting_for_the_lease_is_ready_all_the_same() {
    let mut cluster = Cluster::start(2).await;
    cluster.kill_operator().await;
    let _leader = cluster.spawn_replica("replica-a");
    harvest_testkit::eventually("a leader", harvest_testkit::SETTLE_WITHIN, || async {
        cluster.leader().ok_or_else(|| "none yet".to_owned())
    })
    .await;
    let port = harvest_testkit::free_port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let _follower = cluster.spawn_replica_serving("replica-b", Some(addr), std::future::pending());
    harvest_testkit::eventually(
        "the follower's readyz",
        harvest_testkit::SETTLE_WITHIN,
        || async {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut stream = tokio::net::TcpStream::connect(addr)
                .await
                .map_err(|e| e.to_string())?;
            let request = b"GET /readyz HTTP/1.1\r\nHost: operator\r\nConnection: close\r\n\r\n";
            stream.write_all(request).await.map_err(|e| e.to_string())?;
            let mut answer = String::new();
            stream
                .read_to_string(&mut answer)
                .await
                .map_err(|e| e.to_string())?;
            if answer.starts_with("HTTP/1.1 200") {
                Ok(())
            } else {
                Err(answer)
            }
        },
    )
    .await;
    assert_eq!(
        cluster.leader().as_deref(),
        Some("replica-a"),
        "still a follower"
    );
}

/// The answer to `GET path` on the operator's metrics address, status line included.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: operator\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .await
        .map_err(|e| e.to_string())?;
    Ok(answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_rides_out_lease_errors_counts_them_and_then_leads_healthy() {
    let mut cluster = Cluster::start(2).await;
    cluster.kill_operator().await;
    // Its first rounds fail as through an apiserver blip; it used to exit on the first one.
    cluster
        .server
        .store
        .fail_next("GET", "/leases/harvest-operator", 3);
    let port = harvest_testkit::free_port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let replica = cluster.spawn_replica_serving("replica-a", Some(addr), std::future::pending());
    harvest_testkit::eventually("replica-a leading", Duration::from_secs(60), || async {
        assert!(
            !replica.is_finished(),
            "the replica exited on a transient error"
        );
        (cluster.leader().as_deref() == Some("replica-a"))
            .then_some(())
            .ok_or(format!("{:?}", cluster.leader()))
    })
    .await;
    let metrics =
        harvest_testkit::eventually("the leader gauge at 1", Duration::from_secs(30), || async {
            let answer = http_get(addr, "/metrics").await?;
            answer
                .contains("harvest_operator_leader 1")
                .then_some(answer.clone())
                .ok_or(answer)
        })
        .await;
    assert!(
        metrics.contains("harvest_operator_election_errors_total 3"),
        "{metrics}"
    );
    let health = http_get(addr, "/healthz").await.unwrap();
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    replica.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_keeps_its_lease_through_renew_errors_shorter_than_its_renew_deadline() {
    let mut cluster = Cluster::start(4).await;
    cluster.kill_operator().await;
    let replica = cluster.spawn_replica("replica-a");
    harvest_testkit::eventually("replica-a leading", Duration::from_secs(30), || async {
        (cluster.leader().as_deref() == Some("replica-a"))
            .then_some(())
            .ok_or(format!("{:?}", cluster.leader()))
    })
    .await;
    // Renewals every 2/3 s and retries every 2/15 s: three failures in a row fit well inside
    // the 4/3 s renew deadline of the 2 s Lease.
    cluster
        .server
        .store
        .fail_next("GET", "/leases/harvest-operator", 3);
    harvest_testkit::eventually(
        "the injected failures used",
        Duration::from_secs(30),
        || async {
            let left = cluster.server.store.faults_pending();
            (left == 0).then_some(()).ok_or(left.to_string())
        },
    )
    .await;
    let renew_time = || {
        cluster
            .server
            .get(
                "/apis/coordination.k8s.io/v1",
                "leases",
                "default",
                "harvest-operator",
            )
            .map(|l| l["spec"]["renewTime"].clone())
    };
    let after_failures = renew_time();
    harvest_testkit::eventually(
        "a renewal after the failures",
        Duration::from_secs(30),
        || async {
            let now = renew_time();
            (now != after_failures)
                .then_some(())
                .ok_or(format!("{now:?}"))
        },
    )
    .await;
    assert_eq!(cluster.leader().as_deref(), Some("replica-a"));
    assert!(
        !replica.is_finished(),
        "the leader exited on a transient error"
    );
}
