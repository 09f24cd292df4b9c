//! Readiness and liveness probes: `httpGet` (a status from 200 to 399 passes) and
//! `tcpSocket`, against the Pod's own address. Other probe kinds pass without running.

use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A probe as declared, with its timings.
#[derive(Debug, Clone)]
pub struct Probe {
    http_path: Option<String>,
    port: Option<u16>,
    /// `initialDelaySeconds`.
    pub initial_delay: Duration,
    /// `periodSeconds` (default 10).
    pub period: Duration,
    timeout: Duration,
    /// `failureThreshold` (default 3).
    pub failure_threshold: u32,
}

fn port(container: &Value, port: &Value) -> Option<u16> {
    if let Some(n) = port.as_u64() {
        return u16::try_from(n).ok();
    }
    let name = port.as_str()?;
    if let Ok(n) = name.parse() {
        return Some(n);
    }
    container["ports"]
        .as_array()?
        .iter()
        .find(|p| p["name"].as_str() == Some(name))
        .and_then(|p| p["containerPort"].as_u64())
        .and_then(|n| u16::try_from(n).ok())
}

impl Probe {
    /// The container's probe `field` (`readinessProbe`, `livenessProbe`), if declared.
    pub fn of(container: &Value, field: &str) -> Option<Self> {
        let probe = container.get(field)?;
        let seconds =
            |key: &str, default: u64| Duration::from_secs(probe[key].as_u64().unwrap_or(default));
        let (http_path, port) = if probe["httpGet"].is_object() {
            (
                Some(probe["httpGet"]["path"].as_str().unwrap_or("/").to_owned()),
                port(container, &probe["httpGet"]["port"]),
            )
        } else {
            (None, port(container, &probe["tcpSocket"]["port"]))
        };
        Some(Self {
            http_path,
            port,
            initial_delay: seconds("initialDelaySeconds", 0),
            period: seconds("periodSeconds", 10).max(Duration::from_secs(1)),
            timeout: seconds("timeoutSeconds", 1).max(Duration::from_secs(1)),
            failure_threshold: probe["failureThreshold"]
                .as_u64()
                .map_or(3, |n| n.max(1) as u32),
        })
    }

    /// Runs the probe once against `ip`.
    pub async fn check(&self, ip: &str) -> bool {
        let Some(port) = self.port else {
            return true;
        };
        let attempt = async {
            let mut stream = tokio::net::TcpStream::connect((ip, port)).await.ok()?;
            let Some(path) = &self.http_path else {
                return Some(true);
            };
            let request = format!(
                "GET {path} HTTP/1.1\r\nHost: {ip}:{port}\r\nUser-Agent: kube-probe/1.33\r\nConnection: close\r\n\r\n"
            );
            stream.write_all(request.as_bytes()).await.ok()?;
            let mut head = [0u8; 12];
            stream.read_exact(&mut head).await.ok()?;
            let code: u16 = std::str::from_utf8(&head[9..12]).ok()?.parse().ok()?;
            Some((200..400).contains(&code))
        };
        tokio::time::timeout(self.timeout, attempt)
            .await
            .ok()
            .flatten()
            .unwrap_or(false)
    }
}
